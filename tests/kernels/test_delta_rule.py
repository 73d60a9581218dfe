"""The delta-rule ops' plain-torch forms against each other and against transformers' references: the chunked form
equals the recurrent specification (values, final state and gradients; fp64, so only the algorithm can differ), and
both equal transformers' `torch_recurrent_gated_delta_rule`; the causal convolution twin equals F.conv1d's causal
depthwise convolution as transformers runs it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qtrain.kernels.delta_rule import causal_conv1d_silu, gated_delta_rule_chunked, gated_delta_rule_recurrent


def _inputs(B=2, T=70, Hk=2, H=4, dk=16, dv=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    return (r(B, T, Hk, dk), r(B, T, Hk, dk), r(B, T, H, dv), -torch.rand(B, T, H, generator=g, dtype=dtype),
            torch.rand(B, T, H, generator=g, dtype=dtype))


@pytest.mark.parametrize("T,chunk", [(70, 64), (64, 16), (5, 64)])
def test_chunked_equals_recurrent_values_state_and_gradients(T, chunk):
    args = [t.requires_grad_(True) for t in _inputs(T=T)]
    s0 = torch.randn(2, 4, 16, 8, dtype=torch.float64)
    o1, s1 = gated_delta_rule_recurrent(*args, initial_state=s0)
    g1 = torch.autograd.grad((o1 * o1).sum() + s1.sum(), args)
    o2, s2 = gated_delta_rule_chunked(*args, initial_state=s0, chunk=chunk)
    g2 = torch.autograd.grad((o2 * o2).sum() + s2.sum(), args)
    assert torch.allclose(o1, o2, rtol=0, atol=1e-10) and torch.allclose(s1, s2, rtol=0, atol=1e-10)
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-9)


def test_fp32_and_bf16_inputs_run_in_fp32():
    q, k, v, g, beta = _inputs(dtype=torch.float32)
    o32, s32 = gated_delta_rule_chunked(q, k, v, g, beta)
    o16, s16 = gated_delta_rule_chunked(*(t.bfloat16() for t in (q, k, v, g, beta)))
    assert o16.dtype == torch.bfloat16 and s16.dtype == torch.float32 and s32.dtype == torch.float32
    assert ((o16.float() - o32).norm() / o32.norm()).item() < 2e-2  # bf16 inputs, fp32 state


def test_recurrent_equals_transformers_reference():
    ref = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    q, k, v, g, beta = _inputs(dtype=torch.float32)
    o, s = gated_delta_rule_recurrent(q, k, v, g, beta)
    o_hf, s_hf = ref.torch_recurrent_gated_delta_rule(q, k, v, g, beta, output_final_state=True,
                                                      use_qk_l2norm_in_kernel=True)
    assert torch.allclose(o, o_hf, rtol=0, atol=1e-6) and torch.allclose(s, s_hf, rtol=0, atol=1e-6)


@pytest.mark.parametrize("K", [2, 4])
def test_causal_conv_equals_conv1d(K):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 9, 12, generator=g, dtype=torch.float64), torch.randn(12, K, generator=g, dtype=torch.float64)
    ref = F.silu(F.conv1d(x.transpose(1, 2), w.unsqueeze(1), padding=K - 1, groups=12)[..., :9]).transpose(1, 2)
    assert torch.allclose(causal_conv1d_silu(x, w), ref, rtol=0, atol=1e-12)
    # causal: a change at token t moves no output before t
    x2 = x.clone()
    x2[:, 5] += 1
    assert torch.equal(causal_conv1d_silu(x2, w)[:, :5], causal_conv1d_silu(x, w)[:, :5])


def _resets(B, T, starts):
    r = torch.zeros(B, T, dtype=torch.bool)
    r[:, 0] = True
    for b, ts in enumerate(starts):
        r[b, list(ts)] = True
    return r


# document starts per row: inside a chunk, on a chunk boundary (16), two in one chunk, several chunks long
STARTS = [(5, 16, 20, 21, 45), (33,)]


def test_resets_equal_documents_run_alone():
    """With resets (documents' first tokens) the recurrent form computes, for every document, its output alone
    from a zero state, and the final state is the last document's (fp64)."""
    q, k, v, g, beta = _inputs(T=50)
    resets = _resets(2, 50, STARTS)
    o, S = gated_delta_rule_recurrent(q, k, v, g, beta, resets=resets)
    for b in range(2):
        bounds = [0, *STARTS[b], 50]
        for s, e in zip(bounds[:-1], bounds[1:]):
            o1, s1 = gated_delta_rule_recurrent(*(t[b:b + 1, s:e] for t in (q, k, v, g, beta)))
            assert torch.allclose(o[b:b + 1, s:e], o1, rtol=0, atol=1e-12)
        assert torch.allclose(S[b:b + 1], s1, rtol=0, atol=1e-12)


@pytest.mark.parametrize("chunk", [16, 64, 8])
def test_chunked_with_resets_equals_recurrent(chunk):
    """The chunked form's document masks (a start inside a chunk, at its first token, two in one chunk, the last
    chunk padded) against the recurrent form: values, final state and every gradient (fp64)."""
    args = [t.requires_grad_(True) for t in _inputs(T=50)]
    resets = _resets(2, 50, STARTS)
    s0 = torch.randn(2, 4, 16, 8, dtype=torch.float64)
    o1, s1 = gated_delta_rule_recurrent(*args, initial_state=s0, resets=resets)
    g1 = torch.autograd.grad((o1 * o1).sum() + s1.sum(), args)
    o2, s2 = gated_delta_rule_chunked(*args, initial_state=s0, chunk=chunk, resets=resets)
    g2 = torch.autograd.grad((o2 * o2).sum() + s2.sum(), args)
    assert torch.allclose(o1, o2, rtol=0, atol=1e-10) and torch.allclose(s1, s2, rtol=0, atol=1e-10)
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("K", [2, 4])
def test_causal_conv_with_resets_convolves_each_document_alone(K):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 50, 6, generator=g, dtype=torch.float64), torch.randn(6, K, generator=g, dtype=torch.float64)
    y = causal_conv1d_silu(x, w, _resets(2, 50, STARTS))
    for b in range(2):
        bounds = [0, *STARTS[b], 50]
        for s, e in zip(bounds[:-1], bounds[1:]):
            assert torch.allclose(y[b:b + 1, s:e], causal_conv1d_silu(x[b:b + 1, s:e], w), rtol=0, atol=1e-14)
    assert torch.equal(causal_conv1d_silu(x, w, torch.zeros(2, 50, dtype=torch.bool)), causal_conv1d_silu(x, w))


@pytest.mark.parametrize("kind,slices", [("masked", 1), ("masked", 2), ("varlen", 1), ("varlen", 2)])
def test_document_resets_read_either_mask(kind, slices):
    from qtrain.kernels.delta_rule import document_resets
    from qtrain.kernels.document_attention import document_mask
    resets = _resets(3, 50, STARTS + [(1, 2, 49)])
    positions = torch.zeros(3, 50, dtype=torch.int64)
    for b in range(3):
        for t in range(1, 50):
            positions[b, t] = 0 if resets[b, t] else positions[b, t - 1] + 1
    docs = document_mask(positions, kind=kind, slices=slices)
    assert torch.equal(document_resets(docs, 3, 50), resets)
