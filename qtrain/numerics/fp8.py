"""FP8 matmuls for the four block linears (QKV, attn-out, MLP up, MLP down).

The recipe is llm.q's (reference/llmq.md §3.2): per-tensor current scaling from the abs-max, e4m3 for
activations and weights, e4m3 or e5m2 for the output gradient dY, bf16 output, fp32 accumulation. Two
llm.q quirks are fixed here: e5m2 is scaled to its real max 57344 (not 448), and the bias gradient is
the fp32 sum of the unquantized dY (llm.q sums the quantized dY and rescales it by an extra activation
scale factor).

Contents, small parts first:
- `quantize_fp8`: per-tensor quantization (kernels/fp8_quant.py holds the kernel and its twin).
- `check_scaled_mm_args` / `scaled_mm`: the one FP8 GEMM entry point. On CUDA it is torch._scaled_mm;
  elsewhere an fp32 emulation. Both first check the rules the CUDA op enforces on an H100/H200 (sm90),
  so a layout mistake fails in CPU CI rather than on the GPU machine.
- `Fp8WeightCache`: quantized weights reused across the micro-steps of one optimizer step.
- `fp8_linear`: y = x @ W^T + b as a torch.autograd.Function with FP8 forward and both backward GEMMs.
- `fp8_swiglu_mlp`: down(swiglu(up(x))) as one Function, so the SwiGLU output is produced directly in FP8
  (kernels/swiglu_fp8.py) and the up projection's output gradient is quantized with the abs-max that the
  SwiGLU backward kernel reduced (kernels/swiglu.py): same numbers as the three-call composition, fewer
  passes over the two largest activations of the block. With `onepass` (--fp8-swiglu-onepass) both go to FP8
  in one pass each with power-of-two scales predicted per layer (kernels/swiglu_fp8_onepass.py).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from qtrain.kernels.fp8_quant import (FP8_DTYPES, FP8_MAX, fp8_quantize, fp8_quantize_rmsnorm_transposed,
                                      fp8_quantize_transposed)
from qtrain.kernels.swiglu import swiglu_backward_amax
from qtrain.kernels.swiglu_fp8 import swiglu_fp8
from qtrain.kernels.swiglu_fp8_onepass import new_scale_hint, swiglu_backward_fp8_onepass, swiglu_fp8_onepass

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2

__all__ = ["E4M3", "E5M2", "FP8_MAX", "quantize_fp8", "quantize_fp8_transposed", "check_scaled_mm_args", "scaled_mm",
           "Fp8WeightCache", "fp8_linear", "fp8_swiglu_mlp"]


def quantize_fp8(x: Tensor, dtype: torch.dtype = E4M3, amax: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Per-tensor current scaling: scale = FMAX / max(amax, floor), saturating round-to-nearest cast.

    Returns (x_fp8, inv_scale): x_fp8 contiguous with x's shape, inv_scale a 0-dim fp32 tensor on x's
    device such that x ~= x_fp8.float() * inv_scale. Pass `amax` when the producer already computed it
    (fused into rmsnorm/swiglu, or the optimizer's abs-max of the updated weight); values beyond it saturate.
    """
    q, _, inv_scale = fp8_quantize(x, dtype, amax)
    return q, inv_scale


def quantize_fp8_transposed(x: Tensor, dtype: torch.dtype = E4M3) -> tuple[Tensor, Tensor]:
    """(q^T contiguous, inv_scale) of a 2-D x with its own abs-max: the operand an FP8 GEMM needs where x's
    reduction dimension is its first (cuBLASLt takes FP8 only row-major x column-major). One abs-max and one
    quantize launch; the kernel writes q as well (not returned)."""
    _, qt, inv_scale = fp8_quantize(x, dtype, transpose=True)
    return qt, inv_scale


Prenorm = tuple[Tensor, Tensor, Tensor]  # an RMSNorm's (input x, rstd, gain w) whose output a linear quantizes


def quantize_for_gemms(x: Tensor, dtype: torch.dtype, transpose: bool, *, opaque: bool = True,
                       prenorm: Prenorm | None = None) -> tuple[Tensor, Tensor | None, Tensor]:
    """(q, q^T or None, inv_scale) of a 2-D GEMM operand: `fp8_quantize`, except with a transposed copy inside a
    graph torch.compile traces with `opaque`: there the abs-max is a traced reduction and the quantization one
    opaque op running the Triton kernel (`fp8_quantize_transposed`, ~4.8 TB/s counting both writes on the H200),
    where inductor's own code for the transposed write ran at 1-2 TB/s (in a Qwen2.5-3B e4m3 step's profile). An
    opaque op cannot be rebuilt by the partitioner, so a forward's q^T is kept for backward (1 byte per element,
    as eager keeps it) instead of re-made in backward: `--fp8-keep-transposes`. The same quantization either way
    (on the CPU the same bits; on the GPU the kernel and inductor's code may round an element differently).

    The traced abs-max is written row by row, then over the rows (`_abs_max_by_rows`): the same value (max is
    exact), but inductor's one-shot reduction of a whole 65,536 x 2048 operand (Qwen2.5-1.5B's d(qkv) after the
    RoPE backward) split it into 528 chunks that do not divide it, with a modulo per element: 0.21 ms for 268 MB
    (1.3 TB/s) on the H200, where the other abs-max reductions of the step ran at ~3 TB/s.

    `prenorm`: x is the RMSNorm output of `prenorm` = (input, rstd, gain) (`model.layers.rms_norm_and_rstd`). Inside the compiled graph the op
    then quantizes it from the norm's input, rstd and gain (`fp8_quantize_rmsnorm_transposed`, the same values) and
    x's only other reader is its traced abs-max, which inductor reduces in the norm's own kernel: x is never written
    (one bf16 write fewer per norm, ~0.05 ms at Qwen2.5-1.5B's 65,536 x 1536)."""
    if transpose and opaque and torch.compiler.is_compiling():
        if prenorm is not None:
            x_in, rstd, w = prenorm
            return fp8_quantize_rmsnorm_transposed(x_in.reshape(-1, x_in.shape[-1]), rstd.reshape(-1), w,
                                                   _abs_max_by_rows(x), dtype)
        return fp8_quantize_transposed(x, _abs_max_by_rows(x), dtype)
    return fp8_quantize(x, dtype, transpose=transpose)


def _abs_max_by_rows(x: Tensor) -> Tensor:
    """max |x| of a 2-D x as a reduction over each row, then over the rows' maxima (exactly vector_norm(x, inf))."""
    if not x.numel():
        return x.new_zeros(())
    return torch.linalg.vector_norm(x, float("inf"), dim=-1).amax()


# ----------------------------------------------------------------------------------------------------
# scaled_mm: the FP8 GEMM entry point
# ----------------------------------------------------------------------------------------------------
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _is_row_major(t: Tensor) -> bool:
    """Rows contiguous, possibly padded (leading dimension >= columns): cuBLAS 'T' for our operands."""
    return t.stride(1) == 1 and t.stride(0) >= max(1, t.size(1))


def _is_col_major(t: Tensor) -> bool:
    """Columns contiguous, possibly padded: what `some_row_major_matrix.t()` looks like."""
    return t.stride(0) == 1 and t.stride(1) >= max(1, t.size(0))


def check_scaled_mm_args(mat1: Tensor, mat2: Tensor, scale_a: Tensor, scale_b: Tensor, *,
                         out_dtype: torch.dtype = torch.bfloat16, bias: Tensor | None = None) -> None:
    """Raise what torch._scaled_mm raises on an sm90 GPU (torch 2.11, tensor-wise scaling) for these args.

    Rules (aten/src/ATen/native/cuda/ScaledBlas.cpp `_scaled_mm_out_cuda` / `_scaled_gemm`, and
    cuBlasCommonArgs.h for how strides turn into cuBLAS transposes). The error *type* matches CUDA's:
    TORCH_CHECK -> RuntimeError, TORCH_CHECK_VALUE -> ValueError.
      1. mat1 (M, K), mat2 (K, N) are 2-D with matching K.
      2. Tensor-wise scales: mat1/mat2 float8, scale_a/scale_b fp32 with exactly one element.
      3. bias, if any, has N elements.
      4. K and N are multiples of 16 (mat1.size(1), mat2.size(0), mat2.size(1)); M is free.
      5. mat1, mat2 are float8_e4m3fn or float8_e5m2, not both e5m2 (ValueError; cuBLASLt has no e5m2 x e5m2).
      6. bias: not with an fp32 output; bf16 or fp16; bf16 for a bf16 output, fp16 for an fp16 output.
      7. All tensors, scales included, on one device.
      8. sm90 cuBLASLt multiplies only row-major mat1 by column-major mat2 ("TN"): mat1 must be
         contiguous (rows may be padded), mat2 must be the transpose of a row-major (N, K) matrix.
    Stricter than CUDA on purpose (qtrain rules, same RuntimeError):
      - out_dtype must be bf16, fp16 or fp32 (CUDA also allows FP8 outputs, which we never use);
      - a mat1 with arbitrary strides is rejected: CUDA would silently copy it (STYLE.md: no silent copies);
      - leading dimensions and data pointers 16-byte aligned, which cuBLASLt requires for FP8 and
        otherwise reports only as an opaque CUBLAS_STATUS_NOT_SUPPORTED at run time.
    Reads no tensor values, so it never synchronizes with the GPU.
    """
    def fail(msg: str) -> RuntimeError:
        return RuntimeError(f"scaled_mm: {msg}")

    if mat1.dim() != 2 or mat2.dim() != 2:
        raise fail(f"mat1 and mat2 must be matrices, got {mat1.dim()}-D and {mat2.dim()}-D "
                   "(flatten (B, T, C) activations to (B*T, C) first)")
    M, K = mat1.shape
    K2, N = mat2.shape
    if K != K2:
        raise fail(f"mat1 and mat2 shapes cannot be multiplied ({M}x{K} and {K2}x{N})")
    for name, s in (("scale_a", scale_a), ("scale_b", scale_b)):
        if s.dtype != torch.float32 or s.numel() != 1:
            raise fail(f"Invalid scaling configuration: tensor-wise scaling needs {name} to be an fp32 tensor "
                       f"with one element (the inverse scale), got dtype {s.dtype} and shape {tuple(s.shape)}")
    if bias is not None and bias.numel() != N:
        raise fail(f"Bias must be size {N} but got {bias.numel()}")
    if K % 16 or N % 16:
        raise fail(f"K and N must be multiples of 16 for FP8 cuBLASLt, got mat1 {M}x{K} and mat2 {K2}x{N} "
                   "(K = mat1.size(1) = mat2.size(0), N = mat2.size(1); M may be anything)")
    if out_dtype not in _OUT_DTYPES:
        raise fail(f"out_dtype must be one of {_OUT_DTYPES}, got {out_dtype}")
    for name, m in (("mat1", mat1), ("mat2", mat2)):
        if m.dtype not in FP8_DTYPES:
            raise fail(f"Expected {name} to be float8_e4m3fn or float8_e5m2, got {m.dtype}")
    if mat1.dtype == E5M2 and mat2.dtype == E5M2:
        raise ValueError("scaled_mm: Multiplication of two Float8_e5m2 matrices is not supported "
                         "(cuBLASLt); quantize one operand (the weight or activation) to e4m3")
    if bias is not None:
        if out_dtype == torch.float32:
            raise fail("Bias is not supported when out_dtype is set to Float32")
        if bias.dtype not in (torch.bfloat16, torch.float16):
            raise fail(f"Bias must be BFloat16 or Half, but got {bias.dtype}")
        if bias.dtype != out_dtype:
            raise fail(f"Bias must be {out_dtype} to compute {out_dtype} output, but got {bias.dtype}")
    tensors = {"mat1": mat1, "mat2": mat2, "scale_a": scale_a, "scale_b": scale_b}
    if bias is not None:
        tensors["bias"] = bias
    devices = {n: t.device for n, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise fail(f"Expected all tensors to be on the same device, got {devices} "
                   "(inverse scales must live on the GPU too)")
    if not (mat1.is_contiguous() or _is_row_major(mat1)):
        raise fail(f"Only multiplication of row-major and column-major matrices is supported by cuBLASLt: "
                   f"mat1 must be row-major (contiguous), got strides {mat1.stride()} for shape {tuple(mat1.shape)}")
    if not (_is_col_major(mat2) and not mat2.is_contiguous()):
        raise fail(f"Only multiplication of row-major and column-major matrices is supported by cuBLASLt: "
                   f"mat2 must be column-major, i.e. some_row_major_NxK.t(), got strides {mat2.stride()} for "
                   f"shape {tuple(mat2.shape)}; make the transposed copy explicitly (x.t().contiguous().t())")
    if mat1.stride(0) % 16 or mat2.stride(1) % 16:
        raise fail(f"leading dimensions must be multiples of 16 elements (16 bytes), got mat1.stride(0)="
                   f"{mat1.stride(0)}, mat2.stride(1)={mat2.stride(1)}")
    if not torch.compiler.is_compiling():  # fake tensors under torch.compile have no data pointer
        for name, m in (("mat1", mat1), ("mat2", mat2)):
            if m.numel() and m.data_ptr() % 16:
                raise fail(f"{name} data pointer must be 16-byte aligned, got offset {m.data_ptr() % 16} "
                           f"(a slice starting at storage_offset {m.storage_offset()}?)")


def _scaled_mm_emulated(mat1: Tensor, mat2: Tensor, scale_a: Tensor, scale_b: Tensor,
                        out_dtype: torch.dtype, bias: Tensor | None) -> Tensor:
    """What cuBLASLt computes, in fp32: D = cast(scale_a * scale_b * (A @ B) + bias).

    FP8 x FP8 products are exact in fp32 (4 x 4 significant bits), so the only rounding is the fp32
    accumulation (its order differs from cuBLAS, hence "exact-ish") and the final cast. The scales are
    applied to the accumulator, as cuBLASLt does, not to the operands.
    """
    acc = mat1.float() @ mat2.float()
    out = acc * (scale_a.reshape(()).float() * scale_b.reshape(()).float())
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def scaled_mm(a_fp8: Tensor, b_fp8: Tensor, a_inv_scale: Tensor, b_inv_scale: Tensor, *,
              out_dtype: torch.dtype = torch.bfloat16, bias: Tensor | None = None,
              use_fast_accum: bool = False, out: Tensor | None = None) -> Tensor:
    """out (M, N) = (a_fp8 * a_inv_scale) @ (b_fp8 * b_inv_scale) + bias, in out_dtype.

    a_fp8 (M, K) row-major, b_fp8 (K, N) column-major (b_fp8 = w_fp8.t() for a row-major w_fp8 (N, K)).
    The arguments are checked against CUDA's rules on every device (`check_scaled_mm_args`); on CUDA the
    GEMM is torch._scaled_mm, elsewhere `_scaled_mm_emulated`. `use_fast_accum` trades accuracy for
    speed on Hopper (no periodic promotion of the tensor-core accumulator to fp32); the emulation always
    accumulates in fp32 and ignores it. `out`: a contiguous (M, N) tensor of out_dtype to write instead of a new one.
    """
    check_scaled_mm_args(a_fp8, b_fp8, a_inv_scale, b_inv_scale, out_dtype=out_dtype, bias=bias)
    if out is not None and (out.shape != (a_fp8.shape[0], b_fp8.shape[1]) or out.dtype != out_dtype
                            or not out.is_contiguous()):
        raise RuntimeError(f"scaled_mm: out must be a contiguous {(a_fp8.shape[0], b_fp8.shape[1])} {out_dtype} "
                           f"tensor, got {tuple(out.shape)} {out.dtype} strides {out.stride()}")
    if a_fp8.is_cuda:
        kwargs = {"out": out} if out is not None else {}
        return torch._scaled_mm(a_fp8, b_fp8, scale_a=a_inv_scale, scale_b=b_inv_scale, bias=bias,
                                out_dtype=out_dtype, use_fast_accum=use_fast_accum, **kwargs)
    result = _scaled_mm_emulated(a_fp8, b_fp8, a_inv_scale, b_inv_scale, out_dtype, bias)
    return result if out is None else out.copy_(result)


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
def _check_linear_shapes(x: Tensor, weight: Tensor, bias: Tensor | None, need_dw: bool) -> None:
    if weight.dim() != 2:
        raise ValueError(f"fp8_linear: weight must be (N, K), got shape {tuple(weight.shape)}")
    N, K = weight.shape
    if x.shape[-1] != K:
        raise ValueError(f"fp8_linear: x has {x.shape[-1]} input features but weight is ({N}, {K})")
    if K % 16 or N % 16:
        raise ValueError(f"fp8_linear: in_features K={K} and out_features N={N} must be multiples of 16 "
                         "(FP8 cuBLASLt); qtrain does not pad")
    M = x.numel() // K if K else 0
    if need_dw and M % 16:
        raise ValueError(f"fp8_linear: the number of tokens M={M} (= x.numel() / K, e.g. B*T) must be a "
                         "multiple of 16 when the weight needs a gradient: it is the inner dimension of "
                         "dW = dY^T @ X")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"fp8_linear: bias must have shape ({N},), got {tuple(bias.shape)}")


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
            w_fp8_t = _transposed(w_fp8, w_fp8_t)  # (K, N): the weight in the other major order
            dx = scaled_mm(dy_fp8, w_fp8_t.t(), dy_inv, w_inv, out_dtype=_gemm_out_dtype(ctx.x_dtype))
            dx = dx.view(ctx.x_shape).to(ctx.x_dtype)
        if need_dw:
            dw = scaled_mm(dy_fp8_t, x_fp8_t.t(), dy_inv, x_inv, out_dtype=_gemm_out_dtype(ctx.w_dtype))
            dw = dw.to(ctx.w_dtype)
        if need_db:
            # From the unquantized dY, summed in fp32: exact up to fp32 summation order (llm.q [quirk]).
            db = dy2.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return dx, dw, db, None, None, None, None, None, None, None, None, None


def _transposed(w_fp8: Tensor, w_fp8_t: Tensor | None) -> Tensor:
    """W_q^T (K, N) contiguous: the cached one when the weight source made it, else a copy made here."""
    return w_fp8.t().contiguous() if w_fp8_t is None else w_fp8_t


def _gemm_out_dtype(dtype: torch.dtype) -> torch.dtype:
    """The GEMM writes the caller's dtype directly when cuBLASLt can (bf16/fp16/fp32), else bf16."""
    return dtype if dtype in _OUT_DTYPES else torch.bfloat16


WeightFp8 = tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]  # (W_q (N, K), inv_scale[, W_q^T (K, N)])


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
    prenorm: x is the RMSNorm output of (input, rstd, gain) = prenorm (`model.layers.rms_norm_and_rstd`); with keep_transposes in a compiled graph x is then
    quantized from the norm's input (`quantize_for_gemms`); no effect elsewhere.
    """
    if grad_dtype not in FP8_DTYPES:
        raise ValueError(f"fp8_linear: grad_dtype must be float8_e4m3fn or float8_e5m2, got {grad_dtype}")
    need_dw = weight.requires_grad and torch.is_grad_enabled()
    _check_linear_shapes(x, weight, bias, need_dw)
    w_fp8, w_inv, w_fp8_t = _checked_weight_fp8(weight, weight_fp8, "fp8_linear: weight_fp8")
    return _Fp8Linear.apply(x, weight, bias, grad_dtype, w_fp8, w_inv, w_fp8_t, need_dw, keep_transposes,
                            *(prenorm or (None, None, None)))


def _checked_weight_fp8(weight: Tensor, weight_fp8: WeightFp8 | None, arg: str
                        ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    if weight_fp8 is None:
        return None, None, None
    w_fp8, w_inv, w_fp8_t = (*weight_fp8, None) if len(weight_fp8) == 2 else weight_fp8
    if w_fp8.dtype != E4M3 or w_fp8.shape != weight.shape or not w_fp8.is_contiguous():
        raise ValueError(f"{arg} must be a contiguous e4m3 copy of shape {tuple(weight.shape)}, "
                         f"got {w_fp8.dtype} {tuple(w_fp8.shape)}")
    if w_fp8_t is not None and (w_fp8_t.dtype != E4M3 or w_fp8_t.shape != weight.shape[::-1]
                                or not w_fp8_t.is_contiguous()):
        raise ValueError(f"{arg}'s third entry must be the contiguous e4m3 transpose, shape "
                         f"{tuple(weight.shape[::-1])}, got {w_fp8_t.dtype} {tuple(w_fp8_t.shape)} "
                         f"(contiguous: {w_fp8_t.is_contiguous()})")
    return w_fp8, w_inv, w_fp8_t


# ----------------------------------------------------------------------------------------------------
# fp8_swiglu_mlp
# ----------------------------------------------------------------------------------------------------
class _Fp8SwiGLUMLP(torch.autograd.Function):
    """y = (swiglu(x @ W_up^T)) @ W_down^T with the four GEMMs of `_Fp8Linear` per projection.

    Equal, number for number, to fp8_linear(swiglu(fp8_linear(x, W_up)), W_down) (tests/test_fp8.py): the
    SwiGLU output h exists only as e4m3 (h_q, h_q^T from `swiglu_fp8`), and du = d(up-projection output)
    is quantized with the abs-max reduced by the SwiGLU backward kernel (`swiglu_backward_amax`) and
    transposed by one Triton op. Saved for backward: x_q^T, u (the up projection's output, which the
    SwiGLU backward needs, as in the composition), h_q^T, the two e4m3 weights and the inverse scales (and the
    weights' e4m3 transposes when the weight source made them).

    With `hint` (int32 (2,), the layer's scale hints; kernels/swiglu_fp8_onepass.py) h and du are instead made
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
            dwd = scaled_mm(dy_qt, h_qt.t(), dy_inv, h_inv, out_dtype=_gemm_out_dtype(ctx.w_dtypes[1]))
            dwd = dwd.to(ctx.w_dtypes[1])
        if need_dx or need_dwu:
            dh = scaled_mm(dy_q, _transposed(wd_q, wd_qt).t(), dy_inv, wd_inv, out_dtype=_gemm_out_dtype(x_dtype))
            if hint is None:
                du, du_amax = swiglu_backward_amax(dh.to(x_dtype), u)
                du_q, du_qt, du_inv = fp8_quantize_transposed(du, du_amax, gd)
            else:
                du_q, du_qt, du_inv = swiglu_backward_fp8_onepass(dh.to(x_dtype), u, gd, hint, 1)
            if need_dx:
                dx = scaled_mm(du_q, _transposed(wu_q, wu_qt).t(), du_inv, wu_inv, out_dtype=_gemm_out_dtype(x_dtype))
                dx = dx.view(ctx.x_shape).to(x_dtype)
            if need_dwu:
                dwu = scaled_mm(du_qt, x_qt.t(), du_inv, x_inv, out_dtype=_gemm_out_dtype(ctx.w_dtypes[0]))
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
    exponents, `swiglu_fp8_onepass.scale_exponent`). prenorm as `fp8_linear`'s. Shapes
    are checked as `fp8_linear` checks them (multiples of 16), before any work."""
    if grad_dtype not in FP8_DTYPES:
        raise ValueError(f"fp8_swiglu_mlp: grad_dtype must be float8_e4m3fn or float8_e5m2, got {grad_dtype}")
    if w_up.dim() != 2 or w_down.dim() != 2 or w_up.shape[0] != 2 * w_down.shape[1]:
        raise ValueError(f"fp8_swiglu_mlp: w_up must be (2F, C) and w_down (C, F), got {tuple(w_up.shape)} and "
                         f"{tuple(w_down.shape)}")
    need_dw = (w_up.requires_grad or w_down.requires_grad) and torch.is_grad_enabled()
    _check_linear_shapes(x, w_up, None, need_dw)
    _check_linear_shapes(x.new_empty(0, w_down.shape[1]), w_down, None, False)
    wu = _checked_weight_fp8(w_up, up_fp8, "fp8_swiglu_mlp: up_fp8")
    wd = _checked_weight_fp8(w_down, down_fp8, "fp8_swiglu_mlp: down_fp8")
    if onepass and scale_hint is None:
        scale_hint = new_scale_hint(x.device)
    hint = scale_hint if onepass else None
    return _Fp8SwiGLUMLP.apply(x, w_up, w_down, grad_dtype, need_dw, *wu, *wd, keep_transposes, hint,
                               *(prenorm or (None, None, None))).to(x.dtype)
