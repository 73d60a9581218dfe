"""RoPE backward kernel (qtrain/kernels/rope.py): twin against float64 autograd, Triton against the twin bit
for bit (interpreter on CPU, and the GPU), and `qkv_rope`'s "kernel" mode, the autograd Function the compiled
block uses.

Tolerances: the twin computes in fp32 from the stored gradients and rounds once, so against a float64
reference it is within fp32 rounding in fp32 (rel 1e-6, with an absolute floor for sums that cancel) and
within one bf16 rounding (2^-8 relative, plus a floor) in bf16. The kernel does the same multiplications and
one addition in the same order without FMA contraction, so it equals the twin exactly.
"""
from __future__ import annotations

import pytest
import torch

from tests.triton_interp import compile_for_hopper, interp_only, interpreter_subprocess_test, needs_cuda
from qtrain.kernels import dispatch, rope
from qtrain.kernels.rope import (apply_rope, qkv_rope, rope_qkv_backward, rope_qkv_backward_triton,
                                 rope_qkv_backward_twin, rope_tables)
from qtrain.model.config import ModelConfig
from qtrain.model.layers import rms_norm
from qtrain.model.llama import LlamaConfig

test_interpreter_subprocess = interpreter_subprocess_test(__file__)


def _cfg(hs: int) -> ModelConfig:
    return LlamaConfig(vocab_size=64, hidden_size=4 * hs, intermediate_size=8 * hs, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=hs)


def _inputs(B, T, nh, nkv, hs, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(B, T, h, hs, generator=g).to(dtype).to(device)  # noqa: E731
    cos, sin = rope_tables(_cfg(hs), T, "cpu", torch.float32)
    return mk(nh), mk(nkv), mk(nkv), cos.to(dtype).to(device), sin.to(dtype).to(device)


def _reference(dq, dk, dv, cos, sin):
    """float64 autograd through `apply_rope` on q and k of a fused (B, T, q + 2 kv) tensor."""
    B, T, nh, hs = dq.shape
    nkv = dk.shape[2]
    qkv = torch.zeros(B, T, (nh + 2 * nkv) * hs, dtype=torch.float64, requires_grad=True)
    q, k, v = qkv.split([nh * hs, nkv * hs, nkv * hs], -1)
    c, s = cos.double()[:, None], sin.double()[:, None]
    outs = (apply_rope(q.view(B, T, nh, hs), c, s), apply_rope(k.view(B, T, nkv, hs), c, s), v.view(B, T, nkv, hs))
    torch.autograd.backward(outs, (dq.double(), dk.double(), dv.double()))
    return qkv.grad


@pytest.mark.parametrize("dtype,rtol,atol", [(torch.float32, 1e-6, 1e-6), (torch.bfloat16, 2.0**-8, 2e-2)])
def test_twin_matches_float64_autograd(dtype, rtol, atol):
    dq, dk, dv, cos, sin = _inputs(2, 7, 4, 2, 16, dtype)
    got = rope_qkv_backward_twin(dq, dk, dv, cos, sin)
    assert got.dtype == dtype and got.shape == (2, 7, 8 * 16)
    torch.testing.assert_close(got.double(), _reference(dq, dk, dv, cos, sin), rtol=rtol, atol=atol)


def test_fused_function_forward_is_the_plain_rope_and_backward_the_op():
    """Forward: `apply_rope` on the split views bit for bit, v a copy; backward: the op (twin on CPU),
    against autograd through the plain ops (fp32: rounding differences only)."""
    B, T, nh, nkv, hs = 2, 5, 4, 2, 8
    cos, sin = rope_tables(_cfg(hs), T, "cpu", torch.float32)
    qkv = torch.randn(B, T, (nh + 2 * nkv) * hs, generator=torch.Generator().manual_seed(3))
    a, b = qkv.clone().requires_grad_(True), qkv.clone().requires_grad_(True)
    qa, ka, va = qkv_rope(a, cos, sin, nh, nkv, hs, mode="kernel")
    q, k, v = b.split([nh * hs, nkv * hs, nkv * hs], -1)
    c, s = cos[:, None], sin[:, None]
    qb, kb, vb = apply_rope(q.view(B, T, nh, hs), c, s), apply_rope(k.view(B, T, nkv, hs), c, s), v.view(B, T, nkv, hs)
    assert torch.equal(qa, qb) and torch.equal(ka, kb) and torch.equal(va, vb)
    assert va.is_contiguous() and va.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
    g = torch.Generator().manual_seed(4)
    grads = [torch.randn(t.shape, generator=g) for t in (qa, ka, va)]
    torch.autograd.backward((qa, ka, va), grads)
    torch.autograd.backward((qb, kb, vb), grads)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6)


def test_modes_share_the_forward_and_a_qk_norm_takes_autograds_backward():
    """`qkv_rope`'s modes give the same q, k, v; with a qk-norm between the split and the rotation (Qwen3) the kernel,
    which starts from the split's outputs, cannot apply: the "kernel" mode's gradients are then autograd's, bit for
    bit. An unknown mode is refused."""
    B, T, nh, nkv, hs = 2, 5, 4, 2, 8
    cos, sin = rope_tables(_cfg(hs), T, "cpu", torch.float32)
    g = torch.Generator().manual_seed(6)
    qkv = torch.randn(B, T, (nh + 2 * nkv) * hs, generator=g)
    wq, wk = 1 + 0.1 * torch.randn(hs, generator=g), 1 + 0.1 * torch.randn(hs, generator=g)
    grads = [torch.randn(B, T, n, hs, generator=g) for n in (nh, nkv, nkv)]
    for norm in (None, lambda q, k: (rms_norm(q, wq, 1e-6), rms_norm(k, wk, 1e-6))):
        outs, dx = [], []
        for mode in ("autograd", "kernel"):
            x = qkv.clone().requires_grad_(True)
            out = qkv_rope(x, cos, sin, nh, nkv, hs, mode=mode, qk_norm=norm)
            torch.autograd.backward(out, grads)
            outs.append(out)
            dx.append(x.grad)
        assert all(torch.equal(a, b) for a, b in zip(*outs))
        if norm is None:  # the kernel: rounded once from fp32, autograd per operation
            torch.testing.assert_close(dx[1], dx[0], rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(dx[1], dx[0])
    with pytest.raises(ValueError, match="mode must be one of"):
        qkv_rope(qkv, cos, sin, nh, nkv, hs, mode="fused")


def test_fused_function_compiles_with_the_op_opaque():
    """Under torch.compile (CPU) the backward reaches the custom op through its fake: same gradient as eager."""
    B, T, nh, nkv, hs = 2, 6, 4, 2, 8
    cos, sin = rope_tables(_cfg(hs), T, "cpu", torch.float32)
    qkv = torch.randn(B, T, (nh + 2 * nkv) * hs, generator=torch.Generator().manual_seed(5))

    def f(x):
        q, k, v = qkv_rope(x, cos, sin, nh, nkv, hs, mode="kernel")
        return (q * 1.5).sum() + (k * k).sum() + (v * 0.5).sum()

    a, b = qkv.clone().requires_grad_(True), qkv.clone().requires_grad_(True)
    torch._dynamo.reset()
    torch.compile(f, backend="aot_eager")(a).backward()
    f(b).backward()
    assert torch.equal(a.grad, b.grad)


def test_bad_shapes_and_dtypes_are_refused():
    dq, dk, dv, cos, sin = _inputs(1, 4, 4, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="hs"):
        rope_qkv_backward_twin(dq, dk[..., :4], dv, cos, sin)
    with pytest.raises(ValueError, match="cos"):
        rope_qkv_backward_twin(dq, dk, dv, cos[:3], sin[:3])
    with pytest.raises(TypeError, match="dtype"):
        rope_qkv_backward_twin(dq, dk.double(), dv, cos, sin)


# (B, T, nh, nkv, hs): GQA, MHA, tokens not a multiple of the kernel's ROWS, a half head not a power of two, a
# head of 2 columns, and tiles that divide the shape (the unmasked path)
INTERP_SHAPES = [(2, 5, 4, 2, 16), (1, 3, 2, 2, 8), (3, 7, 6, 1, 10), (1, 2, 1, 1, 2), (2, 16, 4, 2, 16)]


@interp_only
@pytest.mark.parametrize("shape", INTERP_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interp_triton_equals_twin(shape, dtype):
    dq, dk, dv, cos, sin = _inputs(*shape, dtype, seed=sum(shape))
    assert torch.equal(rope_qkv_backward_triton(dq, dk, dv, cos, sin), rope_qkv_backward_twin(dq, dk, dv, cos, sin))


@interp_only
def test_interp_fp32_gradients_with_bf16_tables():
    """An fp32 run under autocast-like mixes: the tables' own dtype is read as such (TAB_KIND)."""
    dq, dk, dv, cos, sin = _inputs(2, 4, 4, 2, 8, torch.float32, seed=9)
    cos, sin = cos.bfloat16(), sin.bfloat16()
    assert torch.equal(rope_qkv_backward_triton(dq, dk, dv, cos, sin), rope_qkv_backward_twin(dq, dk, dv, cos, sin))


@interp_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interp_per_token_tables_equal_twin(dtype):
    """--document-masking's (B, T, hs) tables (each row's at its tokens' positions in their documents): the kernel
    reads them as B * T table rows."""
    dq, dk, dv, cos, sin = _inputs(3, 7, 4, 2, 16, dtype, seed=4)
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 3, 4, 5, 6], [0, 0, 1, 2, 0, 1, 2]])
    got = rope_qkv_backward_triton(dq, dk, dv, cos[pos], sin[pos])
    assert torch.equal(got, rope_qkv_backward_twin(dq, dk, dv, cos[pos], sin[pos]))
    assert torch.equal(got[1], rope_qkv_backward_twin(dq[1:2], dk[1:2], dv[1:2], cos, sin)[0])


# ------------------------------------------------------------------------- sm_90 build, on the CPU
@pytest.mark.skipif(not dispatch.HAS_TRITON, reason="no triton")
def test_kernel_builds_for_hopper_without_fma():
    """The kernel compiles for sm_90 as launched (bf16 natively, Qwen2.5-1.5B's head layout, even tiles) and, as the
    launcher asks, without FMA contraction: a fused multiply-add rounds once where the twin rounds twice, so with one
    the kernel would not equal the twin bit for bit (the default contraction does emit them here)."""
    sig = {n: "*bf16" for n in ("dq_ptr", "dk_ptr", "dv_ptr", "cos_ptr", "sin_ptr", "out_ptr")} | {"rows": "i32"}
    const = dict(T=1024, NH=12, NKV=2, HS=128, KIND=0, TAB_KIND=0, ROWS=rope.ROWS, BLOCK_H=64, EVEN=True)
    ptx = compile_for_hopper(rope._rope_qkv_bwd_kernel, sig, const, num_warps=rope.NUM_WARPS, enable_fp_fusion=False)
    assert "fma.rn" not in ptx and ptx.count("st.global") > 0
    assert "fma.rn" in compile_for_hopper(rope._rope_qkv_bwd_kernel, sig, const, num_warps=rope.NUM_WARPS)


# --------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", [(64, 1024, 14, 2, 64), (8, 1024, 12, 2, 128), (2, 1024, 28, 4, 128)])
def test_gpu_triton_equals_twin_at_qwen_shapes(shape):
    """Qwen2.5-0.5B (64 x 1024, as in the profile), 1.5B and 7B head layouts, bf16: bit for bit."""
    dq, dk, dv, cos, sin = _inputs(*shape, torch.bfloat16, device="cuda", seed=1)
    with dispatch.backend("triton"):
        got = rope_qkv_backward(dq, dk, dv, cos, sin)
    assert torch.equal(got, rope_qkv_backward_twin(dq, dk, dv, cos, sin))
