"""Attention inside documents (kernels/document_attention.py): the varlen op's twin and the masked SDPA path against
each document run through plain causal SDPA on its own, the DocumentMask made from position ids (slices, lengths,
refusals), RoPE's fused op with per-token tables, and on the GPU flash's varlen kernel against the twin.

Tolerances: on the CPU in float64 inputs the twin computes in fp32, so it differs from float64 SDPA by fp32
rounding of O(1) values (< 1e-5, as tests/kernels/test_attention.py); the masked path runs SDPA itself in float64
(1e-10). On the GPU both sides are bf16 kernels with fp32 accumulation, compared as test_attention.py does
(outputs within a few bf16 ulps, gradients within 2e-2 of their largest element).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from qtrain.kernels.document_attention import (DocumentMask, document_attention, document_mask, positions_error,
                                               resolve_document_attention, varlen_attention)
from qtrain.kernels.rope import qkv_rope, rope_tables
from qtrain.model.llama import LlamaConfig

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
LENGTHS = [(7, 1, 12, 4), (3, 21)]  # documents per row (T = 24); a document of one token included


def positions_of(rows: list[tuple[int, ...]]) -> torch.Tensor:
    return torch.tensor([[p for n in row for p in range(n)] for row in rows])


def per_document_reference(x: torch.Tensor, nh: int, nkv: int, rows, dout: torch.Tensor):
    """(out (B, T, nh, hs), d x) with each document through causal SDPA alone."""
    x = x.detach().requires_grad_()
    outs = []
    for b, row in enumerate(rows):
        s, parts = 0, []
        for n in row:
            q, k, v = x[b:b + 1, s:s + n].split([nh, nkv, nkv], dim=2)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True, enable_gqa=nh != nkv)
            parts.append(o.transpose(1, 2))
            s += n
        outs.append(torch.cat(parts, 1))
    out = torch.cat(outs)
    out.backward(dout)
    return out.detach(), x.grad


@pytest.mark.parametrize("kind,atol", [("varlen", 1e-5), ("masked", 1e-10)])
@pytest.mark.parametrize("slices", [1, 2])
@pytest.mark.parametrize("nh,nkv", [(4, 2), (2, 2)])
def test_document_attention_is_each_document_alone(kind, atol, slices, nh, nkv):
    B, T, hs = len(LENGTHS), sum(LENGTHS[0]), 8
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, nh + 2 * nkv, hs, dtype=torch.float64, generator=g)
    dout = torch.randn(B, T, nh, hs, dtype=torch.float64, generator=g)
    ref_out, ref_dx = per_document_reference(x, nh, nkv, LENGTHS, dout)
    x.requires_grad_()
    q, k, v = x.split([nh, nkv, nkv], dim=2)
    docs = document_mask(positions_of(LENGTHS), kind=kind, slices=slices)
    assert docs.slices == slices
    out = document_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), docs)
    assert out.shape == (B, T, nh, hs) and out.dtype == x.dtype
    out.backward(dout)
    torch.testing.assert_close(out.detach(), ref_out, rtol=0, atol=atol)
    torch.testing.assert_close(x.grad, ref_dx, rtol=0, atol=atol)


def test_document_mask_forms():
    pos = positions_of(LENGTHS)
    one = document_mask(pos, kind="varlen")
    assert one.cu_seqlens[0].tolist() == [0, 7, 8, 20, 24, 27, 48] and one.cu_seqlens[0].dtype == torch.int32
    assert one.max_seqlen[0].item() == 21 and one.max_seqlen[0].device.type == "cpu" and not one.masks
    two = document_mask(pos, kind="varlen", slices=2)  # a slice's documents, counted from its own first token
    assert [c.tolist() for c in two.cu_seqlens] == [[0, 7, 8, 20, 24], [0, 3, 24]]
    assert [m.item() for m in two.max_seqlen] == [12, 21]
    masked = document_mask(pos, kind="masked", slices=2)
    assert [m.shape for m in masked.masks] == [(1, 1, 24, 24)] * 2 and not masked.cu_seqlens
    m = masked.masks[1][0, 0]
    assert m[5, 3] and m[2, 0] and not m[5, 2] and not m[5, 6]  # the same document (3 | 21 tokens), causal
    assert resolve_document_attention("auto", torch.device("cpu"), torch.bfloat16) == "masked"
    assert resolve_document_attention("varlen", torch.device("cpu"), torch.float32) == "varlen"


@pytest.mark.parametrize("bad", [[[1, 2, 3]], [[0, 1, 1]], [[0, 2, 3]], [[0, -1, 0]]])
def test_malformed_positions_are_refused(bad):
    assert positions_error(np.array(bad))
    with pytest.raises(ValueError, match="document_mask"):
        document_mask(torch.tensor(bad), kind="varlen")


def test_rope_kernel_mode_takes_per_token_tables():
    """`qkv_rope(mode="kernel")` (the compiled blocks' op: twin on the CPU) with (B, T, hs) tables computes what
    autograd through the plain rotation does, and each row's tables are the (T, hs) rows at its positions."""
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16)
    cos, sin = rope_tables(cfg, 24, "cpu", torch.float32)
    pos = positions_of(LENGTHS)
    c, s = cos[pos], sin[pos]
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 24, 8 * 16, generator=g)
    douts = [torch.randn(2, 24, h, 16, generator=g) for h in (4, 2, 2)]
    grads = []
    for mode in ("autograd", "kernel"):
        x = qkv.clone().requires_grad_()
        outs = qkv_rope(x, c, s, 4, 2, 16, mode=mode)
        torch.autograd.backward(outs, douts)
        grads.append((outs, x.grad))
    for a, b in zip(grads[0][0], grads[1][0]):
        assert torch.equal(a, b)
    torch.testing.assert_close(grads[1][1], grads[0][1], rtol=1e-6, atol=1e-6)
    # the second row's second document starts at token 3: its rotation is that of a sequence starting at 0
    alone = qkv_rope(qkv[1:, 3:], cos[:21], sin[:21], 4, 2, 16)
    torch.testing.assert_close(grads[0][0][0][1:, 3:], alone[0], rtol=0, atol=0)


# --------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("nh,nkv,hs", [(14, 2, 64), (28, 4, 128), (16, 16, 128)])
def test_gpu_flash_varlen_equals_twin(nh, nkv, hs):
    """torch's flash varlen kernel (bf16) against the twin: documents from 1 to 2,000 tokens in rows of 4096."""
    rows = [(1, 2000, 96, 1000, 999), (4096,), (17, 33, 4046)]
    pos = positions_of(rows).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    B, T = len(rows), 4096
    x = torch.randn(B * T, nh + 2 * nkv, hs, device="cuda", generator=g).bfloat16()
    dout = torch.randn(B * T, nh, hs, device="cuda", generator=g).bfloat16()
    docs = document_mask(pos.cpu(), kind="varlen", device="cuda")
    got, want = [], []
    for impl in ("cuda", "twin"):
        xi = x.clone().requires_grad_()
        q, k, v = (t.contiguous() for t in xi.split([nh, nkv, nkv], dim=1))
        cu, mx = docs.cu_seqlens[0], docs.max_seqlen[0]
        if impl == "twin":
            q, k, v, cu = q.cpu().float(), k.cpu().float(), v.cpu().float(), cu.cpu()
        out = varlen_attention(q, k, v, cu, mx)
        out.backward(dout.to(out.device, out.dtype))
        (got if impl == "cuda" else want).append((out.float().cpu(), xi.grad.float().cpu()))
    (out, dx), (ref_out, ref_dx) = got[0], want[0]
    torch.testing.assert_close(out, ref_out, rtol=2e-2, atol=2e-2)
    err = (dx - ref_dx).abs().max() / ref_dx.abs().max()
    assert err < 2e-2, f"gradient error {err:.2e} of the largest element"


@pytest.mark.gpu
@needs_cuda
def test_gpu_masked_and_varlen_agree_in_bf16():
    """The fallback (masked SDPA, GQA expanded) and flash varlen compute the same attention on the GPU."""
    rows = [(100, 300, 624), (1024,)]
    pos = positions_of(rows)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(2, 1024, 14 + 4, 64, device="cuda", generator=g).bfloat16()
    q, k, v = (t.transpose(1, 2) for t in x.split([14, 2, 2], dim=2))
    outs = [document_attention(q, k, v, document_mask(pos, kind=kind, device="cuda")).float()
            for kind in ("varlen", "masked")]
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2)


def test_document_mask_is_a_named_tuple_of_tensors():
    """What torch.compile sees at the block's fifth argument: a tuple of tensors (no object it would guard by id)."""
    docs = document_mask(positions_of(LENGTHS), kind="varlen")
    assert isinstance(docs, tuple) and isinstance(docs, DocumentMask)
    assert all(isinstance(t, torch.Tensor) for field in docs for t in field)
