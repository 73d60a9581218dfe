"""The MLP op pair with the SwiGLU in its GEMMs' epilogues (kernels/gated_mlp.py): its twin is the specification
(checked here against autograd of linear -> SwiGLU -> linear, the block's three-step path), its registration is what
torch.compile needs (torch.library.opcheck), and on a Hopper GPU with quack-kernels the quack path equals the twin
to bf16 rounding (the GPU test).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qtrain.kernels import dispatch
from qtrain.kernels.gated_mlp import (deinterleave_rows, gated_mlp, gated_mlp_bwd, gated_mlp_bwd_twin, gated_mlp_fwd,
                                      gated_mlp_fwd_twin, interleave_rows, quack_runs)
from qtrain.kernels.hopper import hopper_device, quack, quack_missing
from qtrain.kernels.swiglu import swiglu


def _inputs(M: int, C: int, Fi: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(M, C, generator=g, device=device).to(dtype)
    w_up = (torch.randn(2 * Fi, C, generator=g, device=device) * C ** -0.5).to(dtype)
    w_down = (torch.randn(C, Fi, generator=g, device=device) * Fi ** -0.5).to(dtype)
    return h, w_up, w_down


def _three_steps(h, w_up, w_down, dy):
    """The block's path (fp32 autograd): (y, dh, dW_up, dW_down)."""
    h, w_up, w_down = (t.detach().float().requires_grad_() for t in (h, w_up, w_down))
    y = F.linear(swiglu(F.linear(h, w_up)), w_down)
    return (y, *torch.autograd.grad(y, (h, w_up, w_down), dy.float()))


def test_interleave_is_a_row_permutation_and_deinterleave_its_inverse():
    w = torch.arange(6 * 2).reshape(6, 2)  # rows up_0..up_2, gate_0..gate_2
    il = interleave_rows(w)
    assert il[:, 0].tolist() == [6, 0, 8, 2, 10, 4]  # gate_0, up_0, gate_1, up_1, ...
    assert torch.equal(deinterleave_rows(il), w)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_twin_equals_the_three_step_path(dtype, tol):
    """fp32: reduction order only (1e-5 relative); bf16: the twin rounds the SwiGLU output once from the fp32 GEMM
    result where the three steps round the GEMM output first, a few bf16 units (2^-8) in norm."""
    h, w_up, w_down = _inputs(37, 24, 40, dtype)
    dy = torch.randn(37, 24).to(dtype)
    y, pre = gated_mlp_fwd_twin(h, w_up, w_down)
    assert pre.shape == (37, 80) and pre.dtype == dtype
    want = _three_steps(h, w_up, w_down, dy)
    got = (y, *gated_mlp_bwd_twin(dy, h, pre, w_up, w_down))
    for name, a, b in zip(("y", "dh", "dW_up", "dW_down"), got, want):
        assert a.dtype == dtype and a.shape == b.shape, name
        assert (a.float() - b).norm() <= tol * b.norm(), name
    # the pre-activations are the up/gate GEMM's output, interleaved
    assert torch.allclose(deinterleave_rows(pre.T).T.float(), F.linear(h.float(), w_up.float()), rtol=tol, atol=tol)


def test_autograd_through_the_op_equals_the_three_steps():
    h, w_up, w_down = (t.requires_grad_() for t in _inputs(16, 8, 12, torch.float32))
    x = h.view(2, 8, 8)
    y = gated_mlp(x, w_up, w_down)
    assert y.shape == (2, 8, 8)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (h, w_up, w_down), dy)
    want = _three_steps(h, w_up, w_down, dy.reshape(16, 8))[1:]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_opcheck_the_registration_torch_compile_reads():
    """Schema, fake (meta) shapes and the autograd registration, as torch.compile uses them."""
    h, w_up, w_down = _inputs(16, 8, 12, torch.float32)
    torch.library.opcheck(gated_mlp_fwd, (h.requires_grad_(), w_up.requires_grad_(), w_down.requires_grad_()))
    y, pre = gated_mlp_fwd(h, w_up, w_down)
    torch.library.opcheck(gated_mlp_bwd, (torch.randn_like(y), h.detach(), pre.detach(), w_up.detach(),
                                          w_down.detach()))


def test_bad_shapes_are_one_line():
    h, w_up, w_down = _inputs(4, 8, 12, torch.float32)
    with pytest.raises(ValueError, match=r"gated_mlp: need h \(M, C\), w_up \(2F, C\), w_down \(C, F\)"):
        gated_mlp_fwd_twin(h, w_up, w_down.T)


def test_cpu_tensors_run_the_twin():
    assert not quack_runs(torch.zeros(1, dtype=torch.bfloat16))


needs_quack = pytest.mark.skipif(not (hopper_device() and quack() is not None),
                                 reason=f"needs a Hopper GPU and quack-kernels ({quack_missing() or 'no sm90 GPU'})")


@pytest.mark.gpu
@needs_quack
@pytest.mark.parametrize("M,C,Fi", [(4096, 896, 4864), (1000, 256, 512)])
def test_gpu_quack_path_equals_the_twin(M, C, Fi):
    """bf16 on the GPU: quack's epilogues compute from their fp32 accumulators as the twin computes from fp32 GEMM
    results; the GEMMs' reduction orders differ, so each output agrees to bf16 rounding: relative error in norm under
    1e-2 (2^-8 per rounding, one or two roundings each side). M = 1000: no multiple of a tile."""
    h, w_up, w_down = _inputs(M, C, Fi, torch.bfloat16, "cuda")
    dy = torch.randn(M, C, device="cuda").bfloat16()
    assert quack_runs(h)
    y, pre = gated_mlp_fwd(h, w_up, w_down)
    got = (y, pre, *gated_mlp_bwd(dy, h, pre, w_up, w_down))
    old = dispatch.BACKEND
    dispatch.BACKEND = "twin"
    try:
        y_t, pre_t = gated_mlp_fwd(h, w_up, w_down)
        want = (y_t, pre_t, *gated_mlp_bwd(dy, h, pre_t, w_up, w_down))
    finally:
        dispatch.BACKEND = old
    for name, a, b in zip(("y", "preact", "dh", "dW_up", "dW_down"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.isfinite(a).all(), name
        err = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert err < 1e-2, (name, err)
