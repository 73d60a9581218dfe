"""Per-tensor FP8 quantization: abs-max, scale, saturating cast, and optionally a transposed copy.

Math (llm.q `src/kernels/quant.cu`, reference/llmq.md §3.2), all in fp32:

    amax      = max |x|                        (or given: fused into the producing kernel upstream)
    scale     = FMAX / max(amax, AMAX_FLOOR)   FMAX = 448 (e4m3fn) or 57344 (e5m2)
    q         = cast_rn(clamp(x * scale, -FMAX, FMAX))
    inv_scale = 1 / scale                      (what torch._scaled_mm / cuBLASLt take as scale_a/scale_b)

llm.q scales e5m2 to 448 as well, leaving 7 of its binades unused [quirk]; we use e5m2's real max.
The clamp makes the cast saturating: a value above the given amax (stale or estimated) becomes +-FMAX,
never NaN (e4m3fn has no inf) or inf (e5m2).

`fp8_quantize_rmsnorm_transposed` quantizes an RMSNorm's output h = w * round(x * rstd) without h existing in
memory: it reads the norm's input x, the rows' rstd and the gain w instead, so the compiled block's norm kernel writes
only what it must keep (the residual stream and rstd) and reduces h's abs-max in registers: one bf16 write of h fewer
per norm feeding an FP8 linear.

The transposed copy exists because cuBLASLt FP8 only multiplies row-major x column-major (TN): the
weight-gradient GEMM needs dY^T and X^T as contiguous row-major FP8 matrices. Writing them from the
same tile that produces q saves a full re-read of the FP8 tensor.

This is FP8 quantization's one home. Layout (STYLE.md "Kernels and their twins"): Triton kernels, host launcher, torch
twin (the specification; the CPU path), `fp8_quantize`, which asks `qtrain.kernels.dispatch` which to run, the custom
ops a compiled graph calls, and the entries the rest of qtrain calls: `quantize_fp8` (q and its inverse scale; the
FP8 linears and the persistent e4m3 weight shards), `quantize_fp8_transposed` (q^T), `quantize_for_gemms` (a GEMM
operand with its transposed copy, through the opaque op inside torch.compile'd graphs), `quantize_fp8_rowwise` (one
scale per row: the FP8 expert GEMMs).
"""
from __future__ import annotations

import torch
from torch import Tensor

from qtrain.kernels.dispatch import HAS_TRITON, INTERPRET, jit, tl, triton, use_triton
from qtrain.kernels.stochastic_rounding import KINDS, load_f32, round_f32

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_DTYPES = (E4M3, E5M2)
# Largest finite value of each format (torch.finfo(dtype).max).
FP8_MAX: dict[torch.dtype, float] = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# Lower bound on amax. Any floor keeps an all-zero tensor finite; this one is small enough that tiny
# gradients (no loss scaling, and AdamW is scale-invariant) still use the full FP8 range, and large
# enough that FMAX / AMAX_FLOOR (<= 5.7e34) and its inverse (>= 1.7e-35) stay normal fp32 numbers.
# llm.q uses 1e-10, which flushes every tensor with amax < ~1e-12 to zero.
AMAX_FLOOR = 1e-30
# The quantize kernels' tile and warps (`fp8_quantize_triton` takes others as parameters). H200, the 3B up
# projection's output gradient (32768 x 22016 bf16 -> e4m3 + transpose): 64 x 256 with 8 warps 0.761 ms, 64 x 64
# with 4 warps 0.824 ms, a bf16 copy of the same bytes 0.677 ms.
QUANT_BLOCK_M, QUANT_BLOCK_N, QUANT_WARPS = 64, 256, 8

QuantResult = tuple[Tensor, Tensor | None, Tensor]  # (q, q^T contiguous or None, inv_scale fp32 0-dim)


def _check_args(x: Tensor, dtype: torch.dtype, transpose: bool) -> None:
    if dtype not in FP8_DTYPES:
        raise TypeError(f"fp8_quantize: dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    if not x.is_floating_point() or x.dtype in FP8_DTYPES:
        raise TypeError(f"fp8_quantize: x must be a bf16/fp16/fp32 tensor, got {x.dtype}")
    if transpose and x.dim() != 2:
        raise ValueError(f"fp8_quantize: transpose=True needs a 2-D tensor, got shape {tuple(x.shape)}")


# ----------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------
@jit
def _abs_max_kernel(x_ptr, amax_ptr, n_elements, BLOCK: tl.constexpr):
    """amax_ptr[0] = max(amax_ptr[0], max |x[block]|); amax_ptr must start at 0. Exact (no arithmetic
    beyond abs and max), so it equals the twin bit for bit on finite inputs."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n_elements, other=0.0).to(tl.float32)
    tl.atomic_max(amax_ptr, tl.max(tl.abs(x), axis=0))


@jit
def fp8_scale(amax_ptr, FMAX: tl.constexpr, AMAX_FLOOR: tl.constexpr):
    """scale = FMAX / max(amax, AMAX_FLOOR) from the one fp32 amax. `div_rn` (IEEE round-to-nearest)
    instead of `/`, which Triton lowers to the approximate div.full.f32: the twin's torch division is
    correctly rounded, and bit-exact equality with the twin is what the GPU tests check."""
    amax = tl.maximum(tl.load(amax_ptr).to(tl.float32), AMAX_FLOOR)
    return tl.math.div_rn(tl.full((), FMAX, tl.float32), amax)


@jit
def store_fp8_tile(q_ptr, qt_ptr, inv_scale_ptr, x, scale, rm, rn, M, N, mask, FMAX: tl.constexpr,
                   TRANSPOSE: tl.constexpr):
    """q[m, n] = cast_rn(clamp(x[m, n] * scale, +-FMAX)) for the tile (rm, rn) of an (M, N) q, and, if
    TRANSPOSE, qt[n, m] = q[m, n]; the first program also writes inv_scale = 1 / scale. The output
    pointer's element type (e4m3fn or e5m2) picks the cast."""
    y = x * scale
    y = tl.minimum(tl.maximum(y, -FMAX), FMAX)
    q = y.to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + rm[:, None] * N + rn[None, :], q, mask=mask)
    if TRANSPOSE:
        # tl.trans lets the compiler stage the tile through shared memory so both stores coalesce.
        tl.store(qt_ptr + rn[:, None] * M + rm[None, :], tl.trans(q), mask=tl.trans(mask))
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(inv_scale_ptr, tl.math.div_rn(tl.full((), 1.0, tl.float32), scale))


@jit
def _quantize_kernel(x_ptr, q_ptr, qt_ptr, amax_ptr, inv_scale_ptr, M, N, stride_xm, stride_xn,
                     FMAX: tl.constexpr, AMAX_FLOOR: tl.constexpr, TRANSPOSE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Quantize the (BLOCK_M, BLOCK_N) tile of x at (program 0, program 1) (`store_fp8_tile`)."""
    scale = fp8_scale(amax_ptr, FMAX, AMAX_FLOOR)
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    x = tl.load(x_ptr + rm[:, None] * stride_xm + rn[None, :] * stride_xn, mask=mask, other=0.0)
    store_fp8_tile(q_ptr, qt_ptr, inv_scale_ptr, x.to(tl.float32), scale, rm, rn, M, N, mask, FMAX, TRANSPOSE)


@jit
def _quantize_rmsnorm_kernel(x_ptr, rstd_ptr, w_ptr, q_ptr, qt_ptr, amax_ptr, inv_scale_ptr, M, N, stride_xm,
                             KIND: tl.constexpr, LOAD_KIND: tl.constexpr, NATIVE: tl.constexpr, FMAX: tl.constexpr,
                             AMAX_FLOOR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """`_quantize_kernel` of h = round(w * round(x * rstd)) for the tile: the RMSNorm's output made from its input
    (`fp8_quantize_rmsnorm_torch` says how it rounds). LOAD_KIND: how x and w are read (`load_f32`; 0 natively);
    NATIVE: `round_f32`'s."""
    scale = fp8_scale(amax_ptr, FMAX, AMAX_FLOOR)
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    x = load_f32(x_ptr + rm[:, None] * stride_xm + rn[None, :], mask, LOAD_KIND)
    rstd = tl.load(rstd_ptr + rm, mask=rm < M, other=0.0)
    w = load_f32(w_ptr + rn, rn < N, LOAD_KIND)
    h = round_f32(w[None, :] * round_f32(x * rstd[:, None], KIND, NATIVE), KIND, NATIVE)
    store_fp8_tile(q_ptr, qt_ptr, inv_scale_ptr, h, scale, rm, rn, M, N, mask, FMAX, True)


def fp8_quantize_triton(x: Tensor, dtype: torch.dtype = torch.float8_e4m3fn, amax: Tensor | None = None,
                        *, transpose: bool = False, block_m: int = QUANT_BLOCK_M, block_n: int = QUANT_BLOCK_N,
                        num_warps: int = QUANT_WARPS) -> QuantResult:
    """Host launcher; same contract as `fp8_quantize_torch`. The quantize tile (`block_m` x `block_n`, `num_warps`)
    changes no code.

    Abs-max and quantization are two launches (plus a memset) unless amax is given: a grid-wide max
    must finish before any element can be scaled, so "fused" means fused into the producer upstream.
    Measured on an H200: the abs-max kernel reads 3.97 TB/s at 16384x18944 bf16 (156 us; vector_norm(inf)
    180 us, abs().amax() 480 us), quantize+transpose ~4.8 TB/s counting both writes. Each Triton
    launch costs ~25 us of host time there, which matters for small layers run eagerly.
    """
    if not HAS_TRITON:
        raise RuntimeError("fp8_quantize_triton: triton is not installed")
    _check_args(x, dtype, transpose)
    x2 = x if x.dim() == 2 else x.reshape(1, -1) if x.dim() < 2 else x.reshape(-1, x.shape[-1])
    M, N = x2.shape
    if amax is None and not x2.is_contiguous():
        amax = torch.linalg.vector_norm(x2, float("inf"))  # strided read, still no copy of x
    if amax is None:
        amax_buf = torch.zeros((), dtype=torch.float32, device=x.device)
        if x2.numel() > 0:
            BLOCK = 8192
            _abs_max_kernel[(triton.cdiv(x2.numel(), BLOCK),)](x2, amax_buf, x2.numel(), BLOCK=BLOCK)
    else:  # any float dtype: the kernel converts on load, sparing a launch for .float()
        amax_buf = amax.reshape(()) if amax.device == x.device else amax.to(x.device).reshape(())
    q = torch.empty((M, N), dtype=dtype, device=x.device)
    qt = torch.empty((N, M), dtype=dtype, device=x.device) if transpose else q  # dummy ptr when unused
    inv_scale = torch.empty((), dtype=torch.float32, device=x.device)
    grid = (max(triton.cdiv(M, block_m), 1), max(triton.cdiv(N, block_n), 1))
    _quantize_kernel[grid](x2, q, qt, amax_buf, inv_scale, M, N, x2.stride(0), x2.stride(1),
                           FMAX=FP8_MAX[dtype], AMAX_FLOOR=AMAX_FLOOR, TRANSPOSE=transpose,
                           BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
    return q.view(x.shape), (qt if transpose else None), inv_scale


# ----------------------------------------------------------------------------------------------------
# Torch twin: the specification
# ----------------------------------------------------------------------------------------------------
def fp8_quantize_torch(x: Tensor, dtype: torch.dtype = torch.float8_e4m3fn, amax: Tensor | None = None,
                       *, transpose: bool = False) -> QuantResult:
    """Quantize x with one per-tensor scale. Returns (q, q^T or None, inv_scale).

    q has x's shape and is contiguous whatever x's strides; q^T (only for 2-D x and transpose=True) is
    q.t() made contiguous. inv_scale is a 0-dim fp32 tensor on x's device: x ~= q.float() * inv_scale.
    """
    _check_args(x, dtype, transpose)
    fmax = FP8_MAX[dtype]
    if amax is None:
        # vector_norm(inf) reads x once without materialising |x|; max is exact in any dtype.
        amax = torch.linalg.vector_norm(x, float("inf")) if x.numel() else x.new_zeros(())
    amax32 = amax.to(device=x.device, dtype=torch.float32).reshape(())
    scale = torch.full((), fmax, dtype=torch.float32, device=x.device) / amax32.clamp_min(AMAX_FLOOR)
    q = (x.float() * scale).clamp_(-fmax, fmax).to(dtype).contiguous()
    qt = q.t().clone(memory_format=torch.contiguous_format) if transpose else None  # a copy even for one row
    return q, qt, scale.reciprocal()


def fp8_quantize(x: Tensor, dtype: torch.dtype = torch.float8_e4m3fn, amax: Tensor | None = None,
                 *, transpose: bool = False) -> QuantResult:
    """Triton or the torch twin, as `qtrain.kernels.dispatch.use_triton` decides. Same contract as the twin."""
    if use_triton(x):
        return fp8_quantize_triton(x, dtype, amax, transpose=transpose)
    return fp8_quantize_torch(x, dtype, amax, transpose=transpose)




def _check_rmsnorm_args(x: Tensor, rstd: Tensor, weight: Tensor, dtype: torch.dtype) -> None:
    _check_args(x, dtype, True)
    M, N = x.shape
    if x.dtype not in KINDS or x.stride(1) != 1:
        raise ValueError(f"fp8_quantize_rmsnorm: x must be fp32/bf16/fp16 with contiguous rows, got {x.dtype} "
                         f"strides {x.stride()}")
    if rstd.dtype != torch.float32 or rstd.numel() != M:
        raise ValueError(f"fp8_quantize_rmsnorm: rstd must be {M} fp32 values (one per row of x), got "
                         f"{rstd.dtype} {tuple(rstd.shape)}")
    if weight.shape != (N,) or weight.dtype != x.dtype:
        raise ValueError(f"fp8_quantize_rmsnorm: weight must be ({N},) in x's dtype {x.dtype}, got "
                         f"{weight.dtype} {tuple(weight.shape)}")


def fp8_quantize_rmsnorm_torch(x: Tensor, rstd: Tensor, weight: Tensor, amax: Tensor, dtype: torch.dtype
                               ) -> tuple[Tensor, Tensor, Tensor]:
    """The specification: (q, q^T, inv_scale) of h = weight * (x * rstd rounded to x's dtype), rounded to x's
    dtype (`model.layers.rms_norm`'s operations, given its rstd), quantized with `amax` (`fp8_quantize_torch`).
    x (M, N), rstd M fp32 values, weight (N,)."""
    _check_rmsnorm_args(x, rstd, weight, dtype)
    h = weight * (x.float() * rstd.reshape(-1, 1)).to(x.dtype)
    q, qt, inv_scale = fp8_quantize_torch(h, dtype, amax, transpose=True)
    return q, qt, inv_scale


def fp8_quantize_rmsnorm_triton(x: Tensor, rstd: Tensor, weight: Tensor, amax: Tensor, dtype: torch.dtype
                                ) -> tuple[Tensor, Tensor, Tensor]:
    """Host launcher of `_quantize_rmsnorm_kernel`; the twin's contract. On the GPU x and w are read natively and
    rounded by the hardware conversion; under the interpreter (whose bf16 conversions are not the GPU's) through
    their bits, as `swiglu_fp8_onepass` does."""
    _check_rmsnorm_args(x, rstd, weight, dtype)
    M, N = x.shape
    kind = KINDS[x.dtype]
    native = not INTERPRET
    bits = (lambda t: t) if native or kind != 1 else (lambda t: t.view(torch.int16))
    amax_buf = amax.reshape(()) if amax.device == x.device else amax.to(x.device).reshape(())
    q = torch.empty((M, N), dtype=dtype, device=x.device)
    qt = torch.empty((N, M), dtype=dtype, device=x.device)
    inv_scale = torch.empty((), dtype=torch.float32, device=x.device)
    grid = (max(triton.cdiv(M, QUANT_BLOCK_M), 1), max(triton.cdiv(N, QUANT_BLOCK_N), 1))
    _quantize_rmsnorm_kernel[grid](bits(x), rstd.reshape(-1).contiguous(), bits(weight.contiguous()), q, qt, amax_buf,
                                   inv_scale, M, N, x.stride(0), KIND=kind, LOAD_KIND=0 if native else kind,
                                   NATIVE=native, FMAX=FP8_MAX[dtype], AMAX_FLOOR=AMAX_FLOOR, BLOCK_M=QUANT_BLOCK_M,
                                   BLOCK_N=QUANT_BLOCK_N, num_warps=QUANT_WARPS)
    return q, qt, inv_scale


# ----------------------------------------------------------------------------------------------------
# Custom op: the Triton kernels inside torch.compile'd code
# ----------------------------------------------------------------------------------------------------
@torch.library.custom_op("qtrain::fp8_quantize_transposed", mutates_args=())
def fp8_quantize_transposed(x: Tensor, amax: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """(q, q^T, inv_scale) of a 2-D x with a known amax, as one opaque op: a compiled graph runs the Triton
    kernel (~4.8 TB/s at 16384 x 17920) instead of inductor's transposed-write kernel, which ran the same
    work at ~2 TB/s on the H200. Used where the producer already reduced the amax (SwiGLU backward)."""
    q, qt, inv_scale = fp8_quantize(x, dtype, amax, transpose=True)
    return q, qt, inv_scale


@fp8_quantize_transposed.register_fake
def _(x: Tensor, amax: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    _check_args(x, dtype, True)
    M, N = x.shape
    return (x.new_empty((M, N), dtype=dtype), x.new_empty((N, M), dtype=dtype),
            x.new_empty((), dtype=torch.float32))


@torch.library.custom_op("qtrain::fp8_quantize_rmsnorm_transposed", mutates_args=())
def fp8_quantize_rmsnorm_transposed(x: Tensor, rstd: Tensor, weight: Tensor, amax: Tensor, dtype: torch.dtype
                                    ) -> tuple[Tensor, Tensor, Tensor]:
    """(q, q^T, inv_scale) of the RMSNorm output h = weight * round(x * rstd) with a known amax (h's), as one opaque
    op that reads x, rstd and weight instead of h (module docstring): Triton or the twin. The kernel is validated
    on the GPU for bf16 x (what FP8 training runs); other dtypes take the twin there."""
    if use_triton(x) and (x.dtype == torch.bfloat16 or INTERPRET):
        return fp8_quantize_rmsnorm_triton(x, rstd, weight, amax, dtype)
    return fp8_quantize_rmsnorm_torch(x, rstd, weight, amax, dtype)


@fp8_quantize_rmsnorm_transposed.register_fake
def _(x: Tensor, rstd: Tensor, weight: Tensor, amax: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    _check_rmsnorm_args(x, rstd, weight, dtype)
    M, N = x.shape
    return (x.new_empty((M, N), dtype=dtype), x.new_empty((N, M), dtype=dtype),
            x.new_empty((), dtype=torch.float32))


# ----------------------------------------------------------------------------------------------------
# The entries
# ----------------------------------------------------------------------------------------------------
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


def quantize_fp8_rowwise(x: Tensor, dtype: torch.dtype = E4M3, *, amax: Tensor | None = None
                         ) -> tuple[Tensor, Tensor]:
    """Row-wise current scaling: `fp8_quantize_torch`'s math (FMAX / max(amax, AMAX_FLOOR), saturating round-to-nearest
    cast) with one scale per row of the last dimension, for GEMMs whose contraction runs along it (the FP8 expert GEMMs,
    `kernels/grouped_gemm_fp8.py`, where one token or one expert's column must not set the scale of the others).

    x (..., K) with any strides; returns (q, inv_scale): q contiguous e4m3/e5m2 of x's shape, inv_scale fp32 of shape
    x.shape[:-1], x ~= q.float() * inv_scale[..., None]. `amax` (x.shape[:-1]): the rows' abs-max when known.
    Plain torch ops: inductor fuses them into the block's kernels when compiled; eager, the fp32 product is a
    transient of 4 bytes per element."""
    if dtype not in FP8_DTYPES:
        raise ValueError(f"quantize_fp8_rowwise: dtype must be float8_e4m3fn or float8_e5m2, got {dtype}")
    if x.dim() < 1 or not x.is_floating_point():
        raise ValueError(f"quantize_fp8_rowwise: x must be a floating tensor of >= 1 dims, got {x.dtype} "
                         f"{tuple(x.shape)}")
    fmax = FP8_MAX[dtype]
    if amax is None:  # max is exact in any dtype; an empty row (K = 0) has none
        amax = (torch.linalg.vector_norm(x, float("inf"), dim=-1) if x.shape[-1]
                else x.new_zeros(x.shape[:-1]))
    amax32 = amax.to(torch.float32).clamp_min(AMAX_FLOOR)
    scale = torch.full_like(amax32, fmax) / amax32  # a division, as the twin's (`fmax / t` is fmax * (1 / t))
    q = (x * scale.unsqueeze(-1)).clamp_(-fmax, fmax).to(dtype, memory_format=torch.contiguous_format)
    return q, scale.reciprocal()


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

    `prenorm`: x is the RMSNorm output of `prenorm` = (input, rstd, gain) (`model.layers.rms_norm_and_rstd`). Inside
    the compiled graph the op then quantizes it from the norm's input, rstd and gain
    (`fp8_quantize_rmsnorm_transposed`, the same values) and x's only other reader is its traced abs-max, which
    inductor reduces in the norm's own kernel: x is never written (one bf16 write fewer per norm, ~0.05 ms at
    Qwen2.5-1.5B's 65,536 x 1536)."""
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
