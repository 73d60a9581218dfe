"""SwiGLU forward straight to FP8: h = up * silu(gate) quantized per tensor, with its transposed copy.

In an FP8 MLP the SwiGLU output h (M, F) is only ever the input of the down projection, which needs it as
e4m3 twice: h_q (M, F) for the forward GEMM and h_q^T (F, M) for the weight-gradient GEMM (cuBLASLt FP8
multiplies only row-major x column-major). Per-tensor current scaling needs max |h| before any element can
be scaled, so this takes two passes over u = [up | gate] (M, 2F) and never writes h in bf16:

    pass 1: h = swiglu(u) tile by tile, atomic max of |h|            (reads u)
    pass 2: recompute h, scale, saturating cast, store h_q and h_q^T  (reads u, writes 2 x M*F bytes)

Both passes compute h with the same code, so pass 2 sees exactly the values pass 1 reduced. h is rounded
to u's dtype where torch rounds it (silu(gate) first, then the product), so it is the bf16 h that
`layers.swiglu` computes, up to Triton's exp differing from torch's by an ulp of fp32 (which can flip a
bf16 rounding of silu). Measured at Qwen2.5-1.5B shapes, inductor ran the same work as an abs-max
reduction plus two fused pointwise kernels, 0.73 ms per call (41 ms per training step).

The plain-torch twin (`swiglu_fp8_twin`: `swiglu` then `fp8_quantize_torch`) is the specification; the op
`qtrain::swiglu_fp8` makes a torch.compile'd block call the kernels as one opaque step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from qtrain.kernels.dispatch import jit, tl, triton, use_triton
from qtrain.kernels.fp8_quant import AMAX_FLOOR, FP8_DTYPES, FP8_MAX, fp8_quantize_torch, fp8_scale, store_fp8_tile
from qtrain.kernels.stochastic_rounding import load_f32, round_f32

__all__ = ["swiglu_fp8", "swiglu_fp8_triton", "swiglu_fp8_twin"]

_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Tiles (rows, columns of h, warps). Pass 1 only reads, so streaming rows x 256; pass 2 stores a transposed
# tile too, so square-ish tiles (the transpose goes through shared memory). Chosen on the H200 with
# bench/bench_swiglu_fp8.py at Qwen2.5-1.5B shapes.
AMAX_TILE = (16, 256, 4)
QUANT_TILE = (64, 64, 4)


def _check(u: torch.Tensor, dtype: torch.dtype) -> None:
    if u.dim() != 2 or u.shape[1] % 2:
        raise ValueError(f"swiglu_fp8: u must be (M, 2F), got shape {tuple(u.shape)}")
    if u.dtype not in _KINDS:
        raise TypeError(f"swiglu_fp8: u must be one of {list(_KINDS)}, got {u.dtype}")
    if dtype not in FP8_DTYPES:
        raise TypeError(f"swiglu_fp8: dtype must be float8_e4m3fn or float8_e5m2, got {dtype}")


# ---------------------------------------------------------------------------------------------- twin
def swiglu_fp8_twin(u: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The specification: (h_q (M, F), h_q^T (F, M), inv_scale) for h = up * silu(gate) in u's dtype
    (`qtrain.model.layers.swiglu`'s formula and rounding)."""
    _check(u, dtype)
    up, gate = u.chunk(2, dim=-1)
    q, qt, inv_scale = fp8_quantize_torch(F.silu(gate) * up, dtype, transpose=True)
    return q, qt, inv_scale


# -------------------------------------------------------------------------------------------- triton
@jit
def _swiglu_tile(u_ptr, rm, rf, F, mask, KIND: tl.constexpr):
    """h for the (rm, rf) tile in fp32, rounded as torch rounds it in u's dtype."""
    off = rm[:, None] * (2 * F) + rf[None, :]
    up = load_f32(u_ptr + off, mask, KIND)
    gate = load_f32(u_ptr + off + F, mask, KIND)
    silu = round_f32(tl.math.div_rn(gate, 1.0 + tl.exp(-gate)), KIND)
    return round_f32(silu * up, KIND)


@jit
def _swiglu_amax_kernel(u_ptr, partial_ptr, M, F, KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr):
    """partial_ptr[program] = max |h| over the program's tile (one small reduction finishes it: 36k programs
    doing an atomic max on one address serialize)."""
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rf = (tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)).to(tl.int64)
    mask = (rm[:, None] < M) & (rf[None, :] < F)
    h = _swiglu_tile(u_ptr, rm, rf, F, mask, KIND)  # masked lanes: silu(0) * 0 = 0
    tl.store(partial_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1),
             tl.max(tl.max(tl.abs(h), axis=1), axis=0))


@jit
def _swiglu_quant_kernel(u_ptr, q_ptr, qt_ptr, amax_ptr, inv_scale_ptr, M, F, KIND: tl.constexpr,
                         FMAX: tl.constexpr, AMAX_FLOOR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr):
    scale = fp8_scale(amax_ptr, FMAX, AMAX_FLOOR)
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rf = (tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)).to(tl.int64)
    mask = (rm[:, None] < M) & (rf[None, :] < F)
    h = _swiglu_tile(u_ptr, rm, rf, F, mask, KIND)
    store_fp8_tile(q_ptr, qt_ptr, inv_scale_ptr, h, scale, rm, rf, M, F, mask, FMAX, True)


def swiglu_fp8_triton(u: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, *,
                      amax_tile: tuple[int, int, int] = AMAX_TILE, quant_tile: tuple[int, int, int] = QUANT_TILE
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Host launcher (two kernels, see the module docstring); same contract as the twin. The tiles are
    (rows, columns, warps) per program, for benchmarking other shapes."""
    _check(u, dtype)
    u = u.contiguous()
    M, F = u.shape[0], u.shape[1] // 2
    bits = u.view(torch.int16) if u.dtype == torch.bfloat16 else u
    kind = _KINDS[u.dtype]
    q = torch.empty((M, F), dtype=dtype, device=u.device)
    qt = torch.empty((F, M), dtype=dtype, device=u.device)
    inv_scale = torch.empty((), dtype=torch.float32, device=u.device)
    if u.numel():
        bm, bf, warps = amax_tile
        grid = (triton.cdiv(M, bm), triton.cdiv(F, bf))
        partial = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=u.device)
        _swiglu_amax_kernel[grid](bits, partial, M, F, KIND=kind, BLOCK_M=bm, BLOCK_F=bf, num_warps=warps)
        amax = partial.amax()
    else:
        amax = torch.zeros((), dtype=torch.float32, device=u.device)
    bm, bf, warps = quant_tile
    grid = (max(triton.cdiv(M, bm), 1), max(triton.cdiv(F, bf), 1))
    _swiglu_quant_kernel[grid](bits, q, qt, amax, inv_scale, M, F, KIND=kind, FMAX=FP8_MAX[dtype],
                               AMAX_FLOOR=AMAX_FLOOR, BLOCK_M=bm, BLOCK_F=bf, num_warps=warps)
    return q, qt, inv_scale


# ---------------------------------------------------------------------------------------------- public
@torch.library.custom_op("qtrain::swiglu_fp8", mutates_args=())
def swiglu_fp8(u: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h_q, h_q^T, inv_scale) for h = swiglu(u) (module docstring); Triton or twin per dispatch."""
    if use_triton(u):
        return swiglu_fp8_triton(u, dtype)
    return swiglu_fp8_twin(u, dtype)


@swiglu_fp8.register_fake
def _(u: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check(u, dtype)
    M, F = u.shape[0], u.shape[1] // 2
    return u.new_empty((M, F), dtype=dtype), u.new_empty((F, M), dtype=dtype), u.new_empty((), dtype=torch.float32)
