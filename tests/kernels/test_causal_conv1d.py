"""The causal depthwise convolution + SiLU (kernels/delta_rule/causal_conv1d.py): the backward twin is the gradient of
the forward twin (fp64, with and without document resets), the op pair differentiates as the twin does, and the
Triton kernels (forward; backward: dpre, then dx and dw) equal the twins. The Triton tests run under Triton's
interpreter in a child pytest (TRITON_INTERPRET=1, fp32: tests/triton_interp.py) and on a GPU (bf16, marked gpu).

Tolerances: the kernels accumulate in fp32 in the twins' order without FMA contraction, so the convolution before SiLU
agrees bit for bit; SiLU's sigmoid and the dw reduction (per tile, then summed) round differently: fp32 results
within 1e-6 relative (observed ~1e-7); bf16 outputs within one bf16 ulp of the twin's (2^-8 relative).
"""
from __future__ import annotations

import pytest
import torch

from qtrain.kernels.delta_rule.causal_conv1d import (causal_conv1d_silu_backward_triton,
                                                     causal_conv1d_silu_backward_twin, causal_conv1d_silu_op,
                                                     causal_conv1d_silu_triton, causal_conv1d_silu_twin, rows_of)
from tests.triton_interp import compile_for_hopper, interp_only, interpreter_subprocess_test, needs_cuda

test_interpreter_subprocess = interpreter_subprocess_test(__file__)


def _inputs(B=2, T=45, D=70, K=4, dtype=torch.float64, device="cpu", resets=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    w = torch.randn(D, K, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    dy = torch.randn(B, T, D, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    r = None
    if resets:  # document starts: at a row's start, inside, adjacent ones, and one in the last tile
        r = torch.zeros(B, T, dtype=torch.bool)
        r[:, 0] = True
        r[0, [5, 6, 33]] = True
        r[1, [2, 40, 44]] = True
        r = r.to(device)
    return x, w, dy, r


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("K", [2, 3, 4])
@pytest.mark.parametrize("resets", [False, True])
def test_backward_twin_is_the_gradient_of_the_forward_twin(K, resets):
    x, w, dy, r = _inputs(K=K, resets=resets)
    x.requires_grad_(True), w.requires_grad_(True)
    dx, dw = torch.autograd.grad(causal_conv1d_silu_twin(x, w, r), (x, w), dy)
    tx, tw = causal_conv1d_silu_backward_twin(x.detach(), w.detach(), dy, r)
    assert torch.allclose(tx, dx, rtol=0, atol=1e-12) and torch.allclose(tw, dw, rtol=0, atol=1e-11)


def test_op_pair_differentiates_as_the_twin():
    """On the CPU the op pair runs the twins: the same values, and the gradients of the backward twin."""
    x, w, dy, r = _inputs()
    x.requires_grad_(True), w.requires_grad_(True)
    y1 = causal_conv1d_silu_twin(x, w, r)
    g1 = torch.autograd.grad(y1, (x, w), dy)
    y2 = causal_conv1d_silu_op(x, w, r)
    g2 = torch.autograd.grad(y2, (x, w), dy)
    assert torch.equal(y1, y2)
    assert all(torch.allclose(a, b, rtol=0, atol=1e-11) for a, b in zip(g1, g2))


@interp_only
@pytest.mark.parametrize("K", [2, 4])
@pytest.mark.parametrize("resets", [False, True])
def test_interp_triton_forward_and_backward_match_the_twins_fp32(K, resets):
    x, w, dy, r = _inputs(K=K, dtype=torch.float32, resets=resets)
    y = causal_conv1d_silu_triton(x, w, r)
    assert y.dtype == torch.float32 and _rel(y, causal_conv1d_silu_twin(x, w, r)) <= 1e-6
    dx, dw = causal_conv1d_silu_backward_triton(x, w, dy, r)
    tx, tw = causal_conv1d_silu_backward_twin(x.float(), w.float(), dy.float(), r)
    assert dx.dtype == dw.dtype == torch.float32 and dw.shape == w.shape
    assert _rel(dx, tx) <= 1e-6 and _rel(dw, tw) <= 1e-6
    # the gradient managers add gradients in place and take contiguous ones only (a transposed dw failed eager bf16
    # Qwen3.5 training on the H100 in sr_add_)
    assert dx.is_contiguous() and dw.is_contiguous() and tw.is_contiguous()


def test_a_column_slice_is_read_in_place():
    """The layer's convolution input is a column slice of its input projection: the kernels read it with its row
    stride (no copy); a layout rows cannot describe (transposed, overlapping rows) is copied."""
    wide = torch.randn(2, 5, 12)
    x = wide[..., 3:10]
    got, stride = rows_of(x)
    assert got.data_ptr() == x.data_ptr() and stride == 12
    for odd in (torch.randn(2, 7, 5).transpose(1, 2), torch.randn(5, 2, 7).transpose(0, 1),
                torch.randn(1, 7).expand(2, 5, 7)):
        got, stride = rows_of(odd)
        assert got.is_contiguous() and stride == 7
    one = torch.randn(3, 8, 1).transpose(1, 2)  # (3, 1, 8), strides (8, 1, 1): "contiguous", T's stride meaningless
    got, stride = rows_of(one)
    assert got.data_ptr() == one.data_ptr() and stride == 8


@interp_only
@pytest.mark.parametrize("resets", [False, True])
def test_interp_kernels_read_a_column_slice_as_its_copy(resets):
    """Forward and backward on a column slice of a wider tensor equal those on its contiguous copy, bit for bit."""
    x, w, dy, r = _inputs(K=4, dtype=torch.float32, resets=resets)
    wide = torch.cat([torch.randn(*x.shape[:2], 9), x, torch.randn(*x.shape[:2], 3)], dim=-1)
    xs = wide[..., 9:9 + x.shape[-1]]
    assert not xs.is_contiguous() and torch.equal(xs, x)
    assert torch.equal(causal_conv1d_silu_triton(xs, w, r), causal_conv1d_silu_triton(x, w, r))
    for a, b in zip(causal_conv1d_silu_backward_triton(xs, w, dy, r), causal_conv1d_silu_backward_triton(x, w, dy, r)):
        assert torch.equal(a, b)


@interp_only
def test_interp_resets_keep_documents_apart():
    """A document's outputs and input gradients through the kernels do not depend on the tokens before it."""
    x, w, dy, r = _inputs(K=4, dtype=torch.float32)
    x2 = x.clone()
    x2[0, :33] += 1.0  # every token before row 0's last document (starts at 33)
    y, y2 = causal_conv1d_silu_triton(x, w, r), causal_conv1d_silu_triton(x2, w, r)
    assert torch.equal(y[0, 33:], y2[0, 33:]) and not torch.equal(y[0, 30:33], y2[0, 30:33])
    dx = causal_conv1d_silu_backward_triton(x, w, dy, r)[0]
    dy2 = dy.clone()
    dy2[0, 33:] += 1.0
    assert torch.equal(dx[0, :33], causal_conv1d_silu_backward_triton(x, w, dy2, r)[0][0, :33])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("resets", [False, True])
def test_gpu_bf16_matches_the_twins(resets):
    x, w, dy, r = _inputs(B=4, T=1000, D=1000, K=4, dtype=torch.bfloat16, device="cuda", resets=resets)
    y = causal_conv1d_silu_triton(x, w, r)
    # against the twin in fp32 on the same bf16 inputs: the kernel sums in fp32 and rounds once to bf16 (half an ulp,
    # 2^-9 relative; 2^-8 leaves room for the sums' order). The bf16 twin itself rounds its sums and is off from
    # the fp32 twin by as much as the kernel at most (0.031 absolute on the H100, both), so it is no reference.
    ref = causal_conv1d_silu_twin(x.float(), w.float(), r)
    assert y.dtype == torch.bfloat16 and ((y.float() - ref).abs() <= 2 ** -8 * ref.abs() + 1e-6).all()
    dx, dw = causal_conv1d_silu_backward_triton(x, w, dy, r)
    tx, tw = causal_conv1d_silu_backward_twin(x.float(), w.float(), dy.float(), r)
    assert _rel(dx, tx) <= 2 ** -8 and _rel(dw, tw) <= 2 ** -8
    assert dx.is_contiguous() and dw.is_contiguous()  # what the gradient managers take (the CPU test's note)
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    torch.autograd.grad(causal_conv1d_silu_op(xg, wg, r), (xg, wg), dy)  # the op pair runs Triton on CUDA


@pytest.mark.parametrize("resets", [False, True])
def test_kernels_build_for_hopper(resets):
    """The interpreter never compiles: build the three kernels for sm_90 with Triton's own ptxas (bf16 in and out)."""
    from qtrain.kernels.delta_rule import causal_conv1d as m
    c = dict(K=4, HAS_RESETS=resets, BT=m.BT, BD=m.BD)
    ptrs = {"x_ptr": "*bf16", "w_ptr": "*bf16", "r_ptr": "*u8"}
    dims = {"SX": "i32", "rows": "i32", "T": "i32", "D": "i32"}
    assert ".entry" in compile_for_hopper(m._conv_fwd_kernel, {**ptrs, "y_ptr": "*bf16", **dims}, c)
    assert ".entry" in compile_for_hopper(m._conv_dpre_kernel, {**ptrs, "dy_ptr": "*bf16", "dpre_ptr": "*fp32",
                                                                **dims}, c)
    assert ".entry" in compile_for_hopper(m._conv_bwd_kernel, {**ptrs, "dpre_ptr": "*fp32", "dx_ptr": "*bf16",
                                                               "dw_ptr": "*fp32", **dims}, c)
