"""SwiGLU forward straight to FP8: h = up * silu(gate) quantized per tensor, with its transposed copy.

In an FP8 MLP the SwiGLU output h (M, F) is only ever the input of the down projection, which needs it as
e4m3 twice: h_q (M, F) for the forward GEMM and h_q^T (F, M) for the weight-gradient GEMM (cuBLASLt FP8
multiplies only row-major x column-major). Per-tensor current scaling needs max |h| before any element can
be scaled, so this is two passes:

    pass 1: h = swiglu(u) in u's dtype, and one partial max |h| per program   (reads u, writes h)
    pass 2: `fp8_quantize` of h with that amax, transposed copy included       (reads h, writes 2 x M*F bytes)

h is rounded where torch rounds it (silu(gate) first, then the product), so it is the h that
`activation.swiglu` computes, up to Triton's exp and division differing from torch's by an ulp of fp32 (which
can flip a bf16 rounding). Measured on the H200 at Qwen2.5-1.5B shapes, inductor ran this work as an
abs-max reduction plus two fused pointwise kernels in 0.73 ms per call (41 ms per training step); a version
that recomputed h in pass 2 instead of storing it was compute-bound (exp and division twice) at 0.67 ms.

The plain-torch twin (`swiglu_fp8_twin`: `swiglu` then `fp8_quantize_torch`) is the specification; the op
`qtrain::swiglu_fp8` makes a torch.compile'd block call the kernels as one opaque step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from qtrain.kernels.dispatch import jit, tl, triton, use_triton
from qtrain.kernels.fp8_quant import FP8_DTYPES, fp8_quantize_torch, fp8_quantize_triton
from qtrain.kernels.stochastic_rounding import KINDS, load_f32, round_f32, store_f32

__all__ = ["check_swiglu_fp8_args", "swiglu_fp8", "swiglu_fp8_triton", "swiglu_fp8_twin",
           "swiglu_forward_amax_triton"]

BLOCK_M, BLOCK_F, NUM_WARPS = 16, 256, 4  # a streaming tile, as the SwiGLU backward kernel's (a launch parameter)


def check_swiglu_fp8_args(u: torch.Tensor, dtype: torch.dtype, who: str = "swiglu_fp8") -> None:
    """u (M, 2F) in a dtype the kernels read, an FP8 output dtype (also fp8_onepass.py's check)."""
    if u.dim() != 2 or u.shape[1] % 2:
        raise ValueError(f"{who}: u must be (M, 2F), got shape {tuple(u.shape)}")
    if u.dtype not in KINDS:
        raise TypeError(f"{who}: u must be one of {list(KINDS)}, got {u.dtype}")
    if dtype not in FP8_DTYPES:
        raise TypeError(f"{who}: dtype must be float8_e4m3fn or float8_e5m2, got {dtype}")


# ---------------------------------------------------------------------------------------------- twin
def swiglu_fp8_twin(u: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The specification: (h_q (M, F), h_q^T (F, M), inv_scale) for h = up * silu(gate) in u's dtype
    (`activation.swiglu`'s formula and rounding)."""
    check_swiglu_fp8_args(u, dtype)
    up, gate = u.chunk(2, dim=-1)
    q, qt, inv_scale = fp8_quantize_torch(F.silu(gate) * up, dtype, transpose=True)
    return q, qt, inv_scale


# -------------------------------------------------------------------------------------------- triton
@jit
def _swiglu_fwd_amax_kernel(u_ptr, h_ptr, partial_ptr, M, F, KIND: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_F: tl.constexpr):
    """h = round(round(silu(gate)) * up) for the tile; partial_ptr[program] = max |h| of the tile (one small
    reduction finishes it: 36k programs doing an atomic max on one address serialize)."""
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]
    rf = (tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)).to(tl.int64)[None, :]
    mask = (rm < M) & (rf < F)
    off = rm * (2 * F) + rf
    up = load_f32(u_ptr + off, mask, KIND)
    gate = load_f32(u_ptr + off + F, mask, KIND)
    silu = round_f32(gate / (1.0 + tl.exp(-gate)), KIND)
    h = silu * up  # masked lanes: silu(0) * 0 = 0
    store_f32(h_ptr + rm * F + rf, h, mask, KIND)
    # rounding is monotone and odd: max |round(h)| = round(max |h|)
    tl.store(partial_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1),
             round_f32(tl.max(tl.max(tl.abs(h), axis=1), axis=0), KIND))


def swiglu_forward_amax_triton(u: torch.Tensor, *, block_m: int = BLOCK_M, block_f: int = BLOCK_F,
                               num_warps: int = NUM_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass 1: (h (M, F) in u's dtype, max |h| as a 0-dim fp32 tensor). The tile changes no bit."""
    u = u.contiguous()
    M, F = u.shape[0], u.shape[1] // 2
    h = torch.empty((M, F), dtype=u.dtype, device=u.device)
    if not u.numel():
        return h, torch.zeros((), dtype=torch.float32, device=u.device)
    grid = (triton.cdiv(M, block_m), triton.cdiv(F, block_f))
    partial = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=u.device)
    bits = (lambda t: t.view(torch.int16)) if u.dtype == torch.bfloat16 else (lambda t: t)
    _swiglu_fwd_amax_kernel[grid](bits(u), bits(h), partial, M, F, KIND=KINDS[u.dtype], BLOCK_M=block_m,
                                  BLOCK_F=block_f, num_warps=num_warps)
    return h, partial.amax()


def swiglu_fp8_triton(u: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Host launcher (pass 1 here, pass 2 the quantize kernel); same contract as the twin."""
    check_swiglu_fp8_args(u, dtype)
    h, amax = swiglu_forward_amax_triton(u)
    q, qt, inv_scale = fp8_quantize_triton(h, dtype, amax, transpose=True)
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
    check_swiglu_fp8_args(u, dtype)
    M, F = u.shape[0], u.shape[1] // 2
    return u.new_empty((M, F), dtype=dtype), u.new_empty((F, M), dtype=dtype), u.new_empty((), dtype=torch.float32)
