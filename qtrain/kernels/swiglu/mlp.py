"""The SwiGLU MLP with FP8 GEMMs as one function: down(swiglu(up(x))), the SwiGLU output existing only in FP8.

What compiled e4m3 blocks run for up -> SwiGLU -> down (`model/matmul.block_mlp` binds the run's settings): the four
GEMMs of `numerics.fp8.fp8_linear` per projection (the FP8 GEMM and the operand rules are `kernels/scaled_mm.py`'s),
with the SwiGLU in between made straight to FP8: h by the two-pass kernels (`fp8.py`) or, with the layer's scale hints
(`hints.py`), by the one-pass ones (`fp8_onepass.py`), and du = d(up projection output) quantized with the abs-max the
SwiGLU backward kernel reduces (`activation.swiglu_backward_amax`) or in one pass. Number for number the composition
fp8_linear -> swiglu -> fp8_linear (tests/kernels/test_swiglu_fp8.py), with fewer passes over the two largest
activations of the block.
"""
from __future__ import annotations

import torch
from torch import Tensor

from qtrain.kernels.fp8_quant import (E4M3, FP8_DTYPES, Prenorm, fp8_quantize_transposed, quantize_for_gemms,
                                      quantize_fp8)
from qtrain.kernels.scaled_mm import (WeightFp8, check_linear_shapes, checked_weight_fp8, fp8_input_grad,
                                      gemm_out_dtype, scaled_mm)
from qtrain.kernels.swiglu.activation import swiglu_backward_amax
from qtrain.kernels.swiglu.fp8 import swiglu_fp8
from qtrain.kernels.swiglu.fp8_onepass import new_scale_hint, swiglu_backward_fp8_onepass, swiglu_fp8_onepass

__all__ = ["fp8_swiglu_mlp"]


class _Fp8SwiGLUMLP(torch.autograd.Function):
    """y = (swiglu(x @ W_up^T)) @ W_down^T with the four GEMMs of `fp8_linear` per projection.

    Equal, number for number, to fp8_linear(swiglu(fp8_linear(x, W_up)), W_down): the SwiGLU output h exists only
    as e4m3 (h_q, h_q^T from `swiglu_fp8`), and du = d(up-projection output) is quantized with the abs-max reduced
    by the SwiGLU backward kernel (`swiglu_backward_amax`) and transposed by one Triton op. Saved for backward: x_q^T,
    u (the up projection's output, which the SwiGLU backward needs, as in the composition), h_q^T, the two e4m3
    weights and the inverse scales (and the weights' e4m3 transposes when the weight source made them).

    With `hint` (int32 (2,), the layer's scale hints; fp8_onepass.py) h and du are instead made
    in one pass each with power-of-two scales (`swiglu_fp8_onepass`, `swiglu_backward_fp8_onepass`): the same
    SwiGLU values, quantized with 2^e in place of the exact scale.
    """

    @staticmethod
    def forward(ctx, x: Tensor, w_up: Tensor, w_down: Tensor, grad_dtype: torch.dtype, need_dw: bool,
                wu_q: Tensor | None, wu_inv: Tensor | None, wu_qt: Tensor | None,
                wd_q: Tensor | None, wd_inv: Tensor | None, wd_qt: Tensor | None, keep_t: bool,
                hint: Tensor | None, pre_x: Tensor | None, pre_rstd: Tensor | None, pre_w: Tensor | None) -> Tensor:
        C = x.shape[-1]
        x2 = x.reshape(-1, C)
        prenorm = None if pre_x is None else (pre_x, pre_rstd, pre_w)
        x_q, x_qt, x_inv = quantize_for_gemms(x2, E4M3, need_dw, opaque=keep_t, prenorm=prenorm)
        if wu_q is None:
            wu_q, wu_inv = quantize_fp8(w_up.detach(), E4M3)
        u = scaled_mm(x_q, wu_q.t(), x_inv, wu_inv, out_dtype=torch.bfloat16, use_fast_accum=True).to(x.dtype)
        h_q, h_qt, h_inv = swiglu_fp8(u, E4M3) if hint is None else swiglu_fp8_onepass(u, E4M3, hint, 0)
        if wd_q is None:
            wd_q, wd_inv = quantize_fp8(w_down.detach(), E4M3)
        y = scaled_mm(h_q, wd_q.t(), h_inv, wd_inv, out_dtype=torch.bfloat16, use_fast_accum=True)
        ctx.save_for_backward(x_qt, x_inv, wu_q, wu_inv, wu_qt, u, h_qt, h_inv, wd_q, wd_inv, wd_qt, hint)
        ctx.grad_dtype, ctx.x_shape, ctx.x_dtype = grad_dtype, x.shape, x.dtype
        ctx.w_dtypes = (w_up.dtype, w_down.dtype)
        return y.view(*x.shape[:-1], w_down.shape[0])

    @staticmethod
    def backward(ctx, dy: Tensor):
        x_qt, x_inv, wu_q, wu_inv, wu_qt, u, h_qt, h_inv, wd_q, wd_inv, wd_qt, hint = ctx.saved_tensors
        need_dx, need_dwu, need_dwd = ctx.needs_input_grad[:3]
        gd, x_dtype = ctx.grad_dtype, ctx.x_dtype
        dy2 = dy.reshape(-1, wd_q.shape[0])  # (M, C)
        dx = dwu = dwd = None
        dy_q, dy_qt, dy_inv = quantize_for_gemms(dy2, gd, need_dwd)
        if need_dwd:
            dwd = scaled_mm(dy_qt, h_qt.t(), dy_inv, h_inv, out_dtype=gemm_out_dtype(ctx.w_dtypes[1]))
            dwd = dwd.to(ctx.w_dtypes[1])
        if need_dx or need_dwu:
            dh = fp8_input_grad(dy_q, wd_q, dy_inv, wd_inv, wd_qt, gemm_out_dtype(x_dtype))
            if hint is None:
                du, du_amax = swiglu_backward_amax(dh.to(x_dtype), u)
                du_q, du_qt, du_inv = fp8_quantize_transposed(du, du_amax, gd)
            else:
                du_q, du_qt, du_inv = swiglu_backward_fp8_onepass(dh.to(x_dtype), u, gd, hint, 1)
            if need_dx:
                dx = fp8_input_grad(du_q, wu_q, du_inv, wu_inv, wu_qt, gemm_out_dtype(x_dtype))
                dx = dx.view(ctx.x_shape).to(x_dtype)
            if need_dwu:
                dwu = scaled_mm(du_qt, x_qt.t(), du_inv, x_inv, out_dtype=gemm_out_dtype(ctx.w_dtypes[0]))
                dwu = dwu.to(ctx.w_dtypes[0])
        return dx, dwu, dwd, None, None, None, None, None, None, None, None, None, None, None, None, None


def fp8_swiglu_mlp(x: Tensor, w_up: Tensor, w_down: Tensor, *, grad_dtype: torch.dtype = E4M3,
                   up_fp8: WeightFp8 | None = None, down_fp8: WeightFp8 | None = None,
                   keep_transposes: bool = False, onepass: bool = False, scale_hint: Tensor | None = None,
                   prenorm: Prenorm | None = None) -> Tensor:
    """The SwiGLU MLP with FP8 GEMMs: x (..., C), w_up (2F, C) with rows [up; gate], w_down (C, F) -> (..., C)
    in x's dtype. up_fp8 / down_fp8: cached (e4m3 copy, inv_scale[, its transpose]) of the weights, as
    `fp8_linear`'s weight_fp8; keep_transposes as `fp8_linear`'s. onepass: the SwiGLU output and its gradient in
    one pass each, with power-of-two scales predicted by `scale_hint` (the layer's int32 (2,) hints, kept by the
    caller across calls and updated here; without one a fresh hint: the second pass and the tensors' own
    exponents, `fp8_onepass.scale_exponent`). prenorm as `fp8_linear`'s. Shapes
    are checked as `fp8_linear` checks them (multiples of 16), before any work."""
    if grad_dtype not in FP8_DTYPES:
        raise ValueError(f"fp8_swiglu_mlp: grad_dtype must be float8_e4m3fn or float8_e5m2, got {grad_dtype}")
    if w_up.dim() != 2 or w_down.dim() != 2 or w_up.shape[0] != 2 * w_down.shape[1]:
        raise ValueError(f"fp8_swiglu_mlp: w_up must be (2F, C) and w_down (C, F), got {tuple(w_up.shape)} and "
                         f"{tuple(w_down.shape)}")
    need_dw = (w_up.requires_grad or w_down.requires_grad) and torch.is_grad_enabled()
    check_linear_shapes(x, w_up, None, need_dw)
    check_linear_shapes(x.new_empty(0, w_down.shape[1]), w_down, None, False)
    wu = checked_weight_fp8(w_up, up_fp8, "fp8_swiglu_mlp: up_fp8")
    wd = checked_weight_fp8(w_down, down_fp8, "fp8_swiglu_mlp: down_fp8")
    if onepass and scale_hint is None:
        scale_hint = new_scale_hint(x.device)
    hint = scale_hint if onepass else None
    return _Fp8SwiGLUMLP.apply(x, w_up, w_down, grad_dtype, need_dw, *wu, *wd, keep_transposes, hint,
                               *(prenorm or (None, None, None))).to(x.dtype)
