"""The block's matmul precision: the four block linears (QKV, attention output, MLP up and down) and the MLP
as one function, in the model dtype or in FP8 (`--matmul-dtype e4m3`, `numerics.fp8`).

A model setting (`RunOptions.matmul_dtype`), not a trainer concern: the block function is built with what
these return. With FP8, a weight is quantized in the call (per-tensor current scaling) unless the weight
source passes its FP8 copy, made once per optimizer step (`--persistent-quants`): `QuantizedWeights` for
replicated weights (the copy and its transpose), `ShardedWeights` for sharded ones (which then gathers only
that copy of the matrices; the backward transposes it).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from qtrain.kernels.fp8_quant import E4M3, E5M2, Prenorm
from qtrain.kernels.gated_mlp import gated_mlp
from qtrain.kernels.swiglu import fp8_swiglu_mlp
from qtrain.numerics.fp8 import fp8_linear

FP8_GRAD_DTYPES = {"e4m3": E4M3, "e5m2": E5M2}


def block_linear(matmul_dtype: str = "", grad_dtype: str = "e4m3", keep_transposes: bool = False):
    """The function the four block linears run through: F.linear, or FP8 with matmul_dtype "e4m3" (e4m3
    forward; output gradients in `grad_dtype`, e4m3 or e5m2; `keep_transposes`: a compiled block keeps each input's
    e4m3 transpose for backward instead of rebuilding it, `kernels.fp8_quant.quantize_for_gemms`; the FP8 function takes
    `prenorm`, the RMSNorm its input comes from, as `fp8_linear` does)."""
    if matmul_dtype != "e4m3":
        return F.linear
    gd = FP8_GRAD_DTYPES[grad_dtype or "e4m3"]

    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
               w_fp8: tuple[torch.Tensor, ...] | None = None, prenorm: Prenorm | None = None) -> torch.Tensor:
        return fp8_linear(x, w, b, grad_dtype=gd, weight_fp8=w_fp8, keep_transposes=keep_transposes,
                          prenorm=prenorm).to(x.dtype)

    return linear


def block_mlp(matmul_dtype: str = "", grad_dtype: str = "e4m3", keep_transposes: bool = False,
              onepass: bool = False, epilogue: bool = False):
    """The MLP as one function with matmul_dtype "e4m3" (the SwiGLU op's `fp8_swiglu_mlp`: the SwiGLU output exists
    only in FP8, its gradient is quantized with an abs-max fused into the SwiGLU backward); in the model dtype with
    `epilogue` (--swiglu-epilogue: kernels/gated_mlp.py, the SwiGLU in the GEMMs' epilogues); else None (the block
    runs linear -> SwiGLU -> linear). Compiled blocks use it (as they do the fused SwiGLU backward).
    `keep_transposes` as `block_linear`'s; `onepass` (--fp8-swiglu-onepass): h and du in one pass each with
    power-of-two scales, predicted by the hint the block passes (the layer's, kept by the Transformer)."""
    if matmul_dtype != "e4m3":
        return _epilogue_mlp if epilogue else None
    gd = FP8_GRAD_DTYPES[grad_dtype or "e4m3"]

    def mlp(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, up_fp8=None, down_fp8=None,
            scale_hint: torch.Tensor | None = None, prenorm: Prenorm | None = None) -> torch.Tensor:
        return fp8_swiglu_mlp(x, w_up, w_down, grad_dtype=gd, up_fp8=up_fp8, down_fp8=down_fp8,
                              keep_transposes=keep_transposes, onepass=onepass, scale_hint=scale_hint,
                              prenorm=prenorm)

    return mlp


def _epilogue_mlp(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, up_fp8=None, down_fp8=None,
                  scale_hint: torch.Tensor | None = None, prenorm: Prenorm | None = None) -> torch.Tensor:
    """The `Mlp` of --swiglu-epilogue (model-dtype weights: no FP8 copies, hints or prenorm reach it)."""
    return gated_mlp(x, w_up, w_down)
