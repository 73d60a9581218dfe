"""FP8 linears for the block: y = x W^T + b with the forward and both backward GEMMs in FP8, and the e4m3 weight
copies reused across the micro-steps of one optimizer step.

The recipe is llm.q's (reference/llmq.md §3.2): per-tensor current scaling from the abs-max, e4m3 for
activations and weights, e4m3 or e5m2 for the output gradient dY, bf16 output, fp32 accumulation. Two
llm.q quirks are fixed here: e5m2 is scaled to its real max 57344 (not 448), and the bias gradient is
the fp32 sum of the unquantized dY (llm.q sums the quantized dY and rescales it by an extra activation
scale factor).

Built on two kernel-level homes: FP8 quantization (`kernels/fp8_quant.py`: `quantize_fp8`, `quantize_for_gemms`)
and the FP8 GEMM with the operand rules of a linear (`kernels/scaled_mm.py`). The MLP's up -> SwiGLU -> down as one
FP8 function is the SwiGLU op's (`kernels/swiglu/mlp.py`).

Contents:
- `Fp8WeightCache`: quantized weights reused across the micro-steps of one optimizer step.
- `fp8_linear`: y = x @ W^T + b as a torch.autograd.Function with FP8 forward and both backward GEMMs.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from qtrain.kernels.fp8_quant import E4M3, FP8_DTYPES, Prenorm, fp8_quantize, quantize_for_gemms, quantize_fp8
from qtrain.kernels.scaled_mm import (WeightFp8, check_linear_shapes, checked_weight_fp8, fp8_input_grad,
                                      gemm_out_dtype, scaled_mm)

__all__ = ["Fp8WeightCache", "fp8_linear"]


# ----------------------------------------------------------------------------------------------------
# Weight cache
# ----------------------------------------------------------------------------------------------------
@dataclass
class _CacheEntry:
    ref: weakref.ref  # the weight itself: a new tensor object at a recycled address is a miss
    version: int  # weight._version when quantized; in-place updates bump it
    data_ptr: int
    shape: torch.Size
    w_fp8: Tensor
    inv_scale: Tensor
    w_fp8_t: Tensor | None = None  # (K, N) contiguous: the input-gradient GEMM's operand, made on request


class Fp8WeightCache:
    """e4m3 copies of weights, reused across the micro-steps of one optimizer step.

    A weight only changes at the optimizer update, so with gradient accumulation over G micro-steps the
    per-tensor abs-max + quantize runs once instead of G times. An entry is valid while the weight is the
    same tensor object at the same address with the same version counter: every in-place op through
    autograd-visible paths (optimizer steps under no_grad, `copy_`, custom ops declaring `mutates_args`)
    bumps `weight._version`. Writes that bypass the counter -- through `weight.data`, a raw Triton launch,
    or a collective filling a reused gather buffer -- are invisible: whoever does them must call
    `invalidate()` (or `clear()`).

    The model holds one cache; `fp8_linear(..., weight_fp8=cache.get(w))`. Entries die with their weight.
    """

    def __init__(self) -> None:
        self._entries: dict[int, _CacheEntry] = {}
        self.hits = 0
        self.misses = 0

    def get(self, weight: Tensor) -> tuple[Tensor, Tensor]:
        """(w_fp8, inv_scale) for `weight`, quantizing to e4m3 on a miss."""
        e = self._valid_entry(weight)
        if e is not None:
            self.hits += 1
            return e.w_fp8, e.inv_scale
        e = self._quantize(weight, transpose=False)
        return e.w_fp8, e.inv_scale

    def _quantize(self, weight: Tensor, *, transpose: bool) -> _CacheEntry:
        """A miss: the entry for `weight`, with its transposed copy when asked (one pass of the kernel)."""
        self.misses += 1
        key = id(weight)
        with torch.no_grad():
            w_fp8, w_fp8_t, inv_scale = fp8_quantize(weight.detach(), E4M3, transpose=transpose)
        entries = self._entries
        e = self._entries[key] = _CacheEntry(weakref.ref(weight, lambda _: entries.pop(key, None)), weight._version,
                                             weight.data_ptr(), weight.shape, w_fp8, inv_scale, w_fp8_t)
        return e

    def get_with_transpose(self, weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(w_fp8, inv_scale, w_fp8^T): `get` and `transposed` as one ask (one hit or one miss), both copies made
        by one pass of the kernel on a miss."""
        e = self._valid_entry(weight)
        if e is None:
            e = self._quantize(weight, transpose=True)
        else:
            self.hits += 1
        return e.w_fp8, e.inv_scale, self.transposed(weight)

    def transposed(self, weight: Tensor) -> Tensor:
        """The e4m3 copy of `weight` in the other major order, (K, N) contiguous, made once per entry: the input
        gradient's GEMM needs it (cuBLASLt multiplies only row-major by column-major), and without the cache
        every backward makes it again (1 byte read and written per parameter per micro-step).

        Made by the quantize kernel's transposed store, with the copy itself on a miss (ask for this first): an
        e4m3 `.t().contiguous()` is aten's generic strided copy, ~0.34 TB/s on the H200 (16.4 ms per Qwen2.5-3B
        step in its profile), the kernel ~4.8 TB/s. The abs-max is exact, so the same bits as q.t()."""
        e = self._valid_entry(weight)
        if e is None:  # not asked for its copy yet (a miss, counted as one)
            self._quantize(weight, transpose=True)
            e = self._entries[id(weight)]
        if e.w_fp8_t is None:
            with torch.no_grad():
                e.w_fp8_t = fp8_quantize(weight.detach(), E4M3, transpose=True)[1]
        return e.w_fp8_t

    def _valid_entry(self, weight: Tensor) -> _CacheEntry | None:
        e = self._entries.get(id(weight))
        if (e is not None and e.ref() is weight and e.version == weight._version
                and e.data_ptr == weight.data_ptr() and e.shape == weight.shape):
            return e
        return None

    def invalidate(self, weight: Tensor) -> None:
        """Forget `weight`'s entry; the next `get` re-quantizes."""
        self._entries.pop(id(weight), None)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


# ----------------------------------------------------------------------------------------------------
# fp8_linear
# ----------------------------------------------------------------------------------------------------
class _Fp8Linear(torch.autograd.Function):
    """y = x @ W^T + b with all three GEMMs in FP8 (forward, dX, dW).

    GEMM layouts (cuBLASLt needs row-major x column-major; every transposed copy is explicit):
      forward  y  (M, N) = x_q (M, K)            @ W_q.t()                       W_q (N, K) as stored
      dgrad    dX (M, K) = dY_q (M, N)           @ W_q^T.t()  (W_q^T = explicit (K, N) copy)
      wgrad    dW (N, K) = dY_q^T (N, M)         @ x_q^T.t()  (both explicit copies, made by the quantizer)
    Saved for backward: x_q^T (fp8) and its inverse scale, W_q and its inverse scale -- not the bf16 x -- and
    W_q^T when the weight source made it (`Fp8WeightCache.transposed`), else the backward makes it.
    The forward uses fast accumulation, the backward GEMMs do not (torchao's default split: gradients
    see the larger K = M in wgrad and are the more sensitive).
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, grad_dtype: torch.dtype,
                w_fp8: Tensor | None, w_inv_scale: Tensor | None, w_fp8_t: Tensor | None, need_dw: bool,
                keep_t: bool, pre_x: Tensor | None, pre_rstd: Tensor | None, pre_w: Tensor | None) -> Tensor:
        N, K = weight.shape
        x2 = x.reshape(-1, K)  # (M, K); a view when x is contiguous, and the quantizer reads any strides
        prenorm = None if pre_x is None else (pre_x, pre_rstd, pre_w)
        x_fp8, x_fp8_t, x_inv = quantize_for_gemms(x2, E4M3, need_dw, opaque=keep_t, prenorm=prenorm)
        if w_fp8 is None:
            w_fp8, w_inv_scale = quantize_fp8(weight.detach(), E4M3)
        b = None if bias is None else bias.detach().to(torch.bfloat16)  # cuBLASLt epilogue wants bf16
        y = scaled_mm(x_fp8, w_fp8.t(), x_inv, w_inv_scale, out_dtype=torch.bfloat16, bias=b,
                      use_fast_accum=True)
        ctx.save_for_backward(x_fp8_t, x_inv, w_fp8, w_inv_scale, w_fp8_t)
        ctx.grad_dtype = grad_dtype
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.view(*x.shape[:-1], N)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x_fp8_t, x_inv, w_fp8, w_inv, w_fp8_t = ctx.saved_tensors
        N, K = w_fp8.shape
        need_dx, need_dw, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        dy2 = dy.reshape(-1, N)  # (M, N)
        dx = dw = db = None
        if need_dx or need_dw:
            dy_fp8, dy_fp8_t, dy_inv = quantize_for_gemms(dy2, ctx.grad_dtype, need_dw)
        if need_dx:
            dx = fp8_input_grad(dy_fp8, w_fp8, dy_inv, w_inv, w_fp8_t, gemm_out_dtype(ctx.x_dtype))
            dx = dx.view(ctx.x_shape).to(ctx.x_dtype)
        if need_dw:
            dw = scaled_mm(dy_fp8_t, x_fp8_t.t(), dy_inv, x_inv, out_dtype=gemm_out_dtype(ctx.w_dtype))
            dw = dw.to(ctx.w_dtype)
        if need_db:
            # From the unquantized dY, summed in fp32: exact up to fp32 summation order (llm.q [quirk]).
            db = dy2.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return dx, dw, db, None, None, None, None, None, None, None, None, None


def fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, grad_dtype: torch.dtype = E4M3,
               weight_fp8: WeightFp8 | None = None, keep_transposes: bool = False,
               prenorm: Prenorm | None = None) -> Tensor:
    """y = x @ weight^T + bias with FP8 GEMMs; y is bf16 with shape (..., N).

    x (..., K); weight (N, K) (the bf16 master; receives the gradient); bias (N,) or None.
    grad_dtype: format of the quantized output gradient dY (e4m3 default as in llm.q, or e5m2).
    weight_fp8: a cached (W_fp8 (N, K) e4m3, inv_scale) for this weight, e.g. `Fp8WeightCache.get(weight)`,
    optionally with its (K, N) contiguous transpose as a third entry (`Fp8WeightCache.transposed`); None
    quantizes the weight here. K and N must be multiples of 16, and so must the token count
    M = x.numel() / K when the weight needs a gradient (checked here, before any work).
    keep_transposes: in a torch.compile'd graph, quantize x with the Triton op, which keeps x_q^T for backward
    (`quantize_for_gemms`); no effect elsewhere.
    prenorm: x is the RMSNorm output of (input, rstd, gain) = prenorm (`model.layers.rms_norm_and_rstd`); with
    keep_transposes in a compiled graph x is then quantized from the norm's input (`quantize_for_gemms`); no effect
    elsewhere.
    """
    if grad_dtype not in FP8_DTYPES:
        raise ValueError(f"fp8_linear: grad_dtype must be float8_e4m3fn or float8_e5m2, got {grad_dtype}")
    need_dw = weight.requires_grad and torch.is_grad_enabled()
    check_linear_shapes(x, weight, bias, need_dw)
    w_fp8, w_inv, w_fp8_t = checked_weight_fp8(weight, weight_fp8, "fp8_linear: weight_fp8")
    return _Fp8Linear.apply(x, weight, bias, grad_dtype, w_fp8, w_inv, w_fp8_t, need_dw, keep_transposes,
                            *(prenorm or (None, None, None)))
