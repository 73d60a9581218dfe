"""Linears over a frozen weight held only as e4m3 codes and their inverse scale (LoRA's `--lora-base-dtype e4m3`):
y = x (q s)^T + b, where q (N, K) float8_e4m3fn and s the 0-dim fp32 inverse scale, no gradient for the weight.

Two ways, the same value up to the GEMM's rounding:
- FP8 GEMMs (`fp8_gemms`: CUDA, bf16 activations, K and N multiples of 16): qtrain's `fp8_linear` with the codes as
  its cached weight copy (forward and input-gradient GEMMs in FP8; no weight gradient is asked for).
- Elsewhere (the CPU, fp32 activations, other shapes): `_DequantLinear`, which dequantizes the codes to the
  activation's dtype inside its forward and again inside its backward and saves only the codes and the scale, so no
  copy of the weight in a wider dtype outlives one GEMM (autograd keeps the codes, 1 byte per element); the two
  products are opaque ops (`dequant_linear`, `dequant_linear_input_grad`), so a compiled block cannot keep the
  dequantized weight from forward to backward either.

`dequantize(q, s, dtype)` = (q.float() * s).to(dtype): the one definition of the weight these codes stand for (the
tests build their reference base from it).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from qtrain.kernels.fp8_quant import E4M3
from qtrain.numerics.fp8 import fp8_linear

__all__ = ["dequantize", "frozen_e4m3_linear"]


def dequantize(codes: Tensor, inv_scale: Tensor, dtype: torch.dtype) -> Tensor:
    """The weight the e4m3 `codes` stand for, in `dtype` (rounded once, from the fp32 product)."""
    return (codes.float() * inv_scale).to(dtype)


# The two products as opaque ops, the weight dequantized inside each: traced by torch.compile as one op each, a
# compiled block's partitioner cannot keep the dequantized weight from forward to backward (inductor's did: a
# model-dtype copy of every block matrix alive until the backward, 2 bytes a parameter, measured on the CPU)
@torch.library.custom_op("qtrain::dequant_linear", mutates_args=())
def dequant_linear(x: Tensor, codes: Tensor, inv: Tensor, bias: Tensor | None) -> Tensor:
    """x W^T + bias, W = dequantize(codes, inv, x.dtype)."""
    return F.linear(x, dequantize(codes, inv, x.dtype), bias)


@dequant_linear.register_fake
def _(x: Tensor, codes: Tensor, inv: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty(*x.shape[:-1], codes.shape[0])


@torch.library.custom_op("qtrain::dequant_linear_input_grad", mutates_args=())
def dequant_linear_input_grad(dy: Tensor, codes: Tensor, inv: Tensor) -> Tensor:
    """dy W, W = dequantize(codes, inv, dy.dtype): the input's gradient."""
    return dy @ dequantize(codes, inv, dy.dtype)


@dequant_linear_input_grad.register_fake
def _(dy: Tensor, codes: Tensor, inv: Tensor) -> Tensor:
    return dy.new_empty(*dy.shape[:-1], codes.shape[1])


class _DequantLinear(torch.autograd.Function):
    """y = x W^T + b with W = dequantize(codes, inv) made in forward and again in backward, each inside its op
    (module docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor, codes: Tensor, inv: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(codes, inv)
        ctx.has_bias = bias is not None
        return dequant_linear(x, codes, inv, bias)

    @staticmethod
    def backward(ctx, dy: Tensor):
        codes, inv = ctx.saved_tensors
        dx = dequant_linear_input_grad(dy, codes, inv) if ctx.needs_input_grad[0] else None
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return dx, None, None, db


def fp8_gemms(x: Tensor, codes: Tensor) -> bool:
    """Whether the FP8 GEMM path serves this linear: CUDA with FP8 tensor cores (compute capability 8.9+), bf16
    activations, K and N multiples of 16 (cuBLASLt)."""
    if not x.is_cuda or x.dtype != torch.bfloat16 or codes.shape[0] % 16 or codes.shape[1] % 16:
        return False
    return torch.cuda.get_device_capability(x.device) >= (8, 9)


def frozen_e4m3_linear(matmul_dtype: str = "", grad_dtype: torch.dtype = E4M3):
    """The block linear over e4m3 codes: the block calls it as `linear(x, w, b, (codes, inv))` (w is the codes too:
    the weight source hands them under the matrix's name and as its FP8 copy). With `matmul_dtype` 'e4m3' the
    GEMMs run in FP8 where `fp8_gemms` allows, otherwise on a dequantized copy made inside the op."""

    def linear(x: Tensor, w: Tensor, b: Tensor | None, w_fp8: tuple[Tensor, ...] | None = None, **_) -> Tensor:
        if w_fp8 is None or w.dtype != E4M3:
            raise ValueError(f"frozen e4m3 linear: expected the e4m3 codes and their scale, got a {w.dtype} weight")
        codes, inv = w_fp8[0], w_fp8[1]
        if matmul_dtype == "e4m3" and fp8_gemms(x, codes):
            # `weight` (shape and dtype only: no gradient) a view, not the codes again: one tensor given twice made
            # torch.compile break its graph at every base linear ("duplicate tensor input"), the block in pieces
            return fp8_linear(x, codes.view(codes.shape), b, grad_dtype=grad_dtype,
                              weight_fp8=(codes, inv)).to(x.dtype)
        return _DequantLinear.apply(x, codes, inv, b)

    return linear
