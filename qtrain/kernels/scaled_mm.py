"""The FP8 GEMM: torch._scaled_mm on CUDA, an fp32 emulation (its twin) elsewhere, with CUDA's rules checked on every
device; and the operand rules of an FP8 linear that its callers share (`numerics.fp8.fp8_linear`, the SwiGLU op's FP8
MLP in `kernels/swiglu/mlp.py`, the cross-entropy op's FP8 head).

Contents, small parts first:
- `check_scaled_mm_args` / `scaled_mm`: the one FP8 GEMM entry point. Both paths first check the rules the CUDA op
  enforces on an H100/H200 (sm90), so a layout mistake fails in CPU CI rather than on the GPU machine.
- `check_linear_shapes`, `checked_weight_fp8`, `transposed_weight`, `gemm_out_dtype`: y = x W^T as FP8 GEMMs needs
  K and N (and M for the weight gradient) in multiples of 16, a cached e4m3 weight copy of the weight's shape, the
  weight in the other major order for the input gradient, and an output dtype cuBLASLt writes.
- `fp8_input_grad`: the input gradient's GEMM with that transposition inside one opaque op (why: above it).
"""
from __future__ import annotations

import torch
from torch import Tensor

from qtrain.kernels.fp8_quant import E4M3, E5M2, FP8_DTYPES
from qtrain.kernels.fp8_transpose import transpose_fp8

__all__ = ["WeightFp8", "check_linear_shapes", "check_scaled_mm_args", "checked_weight_fp8", "fp8_input_grad",
           "gemm_out_dtype", "scaled_mm", "transposed_weight"]

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
# the operands of an FP8 linear
# ----------------------------------------------------------------------------------------------------
WeightFp8 = tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]  # (W_q (N, K), inv_scale[, W_q^T (K, N)])


def check_linear_shapes(x: Tensor, weight: Tensor, bias: Tensor | None, need_dw: bool) -> None:
    """The shapes an FP8 linear takes (messages name `fp8_linear`, whose rules they are): K and N multiples of 16, and
    the token count M when the weight gets a gradient (its GEMM's inner dimension)."""
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


def checked_weight_fp8(weight: Tensor, weight_fp8: WeightFp8 | None, arg: str
                       ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """(W_q, inv_scale, W_q^T or None) of a cached copy (`weight_fp8`, as `fp8_linear` takes it), checked against
    `weight`; (None, None, None) without one. `arg` names the argument in the messages."""
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


def transposed_weight(w_fp8: Tensor, w_fp8_t: Tensor | None) -> Tensor:
    """W_q^T (K, N) contiguous: the cached one when the weight source made it, else a copy made here."""
    return transpose_fp8(w_fp8) if w_fp8_t is None else w_fp8_t


# The input gradient as one opaque op, the weight's transposed copy made inside it: traced by torch.compile, the
# copy needs only the weight, so the partitioner may move it into the forward and keep it until the backward instead
# of the weight (it does where the weight is quantized inside the forward: the same bytes there, measured on the
# CPU). Where the weight source holds the codes (a frozen e4m3 base, --persistent-quants) that would be a second byte
# a parameter; kernels/grouped_gemm_fp8.py's `_after` keeps its re-quantization in the backward for the same reason.
# (On an H100 a Qwen2.5-7B LoRA block over an e4m3 base did keep a copy of every block matrix's codes, session 37;
# whether this was the cause is not yet measured.)
@torch.library.custom_op("qtrain::fp8_input_grad", mutates_args=())
def fp8_input_grad(dy_fp8: Tensor, w_fp8: Tensor, dy_inv_scale: Tensor, w_inv_scale: Tensor,
                   w_fp8_t: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    """dX (M, K) = dY_q (M, N) @ W_q (N, K) in `out_dtype`: `scaled_mm` with W_q in the other major order
    (`w_fp8_t`, or the copy `transposed_weight` makes)."""
    return scaled_mm(dy_fp8, transposed_weight(w_fp8, w_fp8_t).t(), dy_inv_scale, w_inv_scale, out_dtype=out_dtype)


@fp8_input_grad.register_fake
def _(dy_fp8: Tensor, w_fp8: Tensor, dy_inv_scale: Tensor, w_inv_scale: Tensor, w_fp8_t: Tensor | None,
      out_dtype: torch.dtype) -> Tensor:
    return dy_fp8.new_empty((dy_fp8.shape[0], w_fp8.shape[1]), dtype=out_dtype)


def gemm_out_dtype(dtype: torch.dtype) -> torch.dtype:
    """The GEMM writes the caller's dtype directly when cuBLASLt can (bf16/fp16/fp32), else bf16."""
    return dtype if dtype in _OUT_DTYPES else torch.bfloat16
