"""Bytes in the other major order: q^T (K, N) contiguous from q (N, K), for an FP8 GEMM operand (cuBLASLt multiplies
only row-major by column-major): the input gradient's weight where no transposed copy is cached (a frozen e4m3
base's codes), and the FP8 head backward's d(logits) codes (kernels/cross_entropy/fp8.py).

`transpose_fp8_torch` is the specification (`q.t().contiguous()`: aten's generic strided copy, ~0.34 TB/s for
one-byte elements on the H200, numerics/fp8.py `Fp8WeightCache.transposed`); `transpose_u8_kernel` moves square
tiles of bytes through the registers (a uint8 view: the bits move, never converted); `transpose_fp8` picks one by
`qtrain.kernels.dispatch.use_triton`.
"""
from __future__ import annotations

import torch
from torch import Tensor

from qtrain.kernels.dispatch import jit, tl, triton, use_triton

__all__ = ["T_BLOCK", "T_WARPS", "transpose_fp8", "transpose_fp8_torch", "transpose_fp8_triton", "transpose_u8_kernel"]

# the square tile and warps: on the H200 a 128 tile beat 64 (+5%) and 32 (+13%) inside the FP8 head backward's three
# launches (kernels/cross_entropy/fp8.py, 16384 x 151936); not measured alone
T_BLOCK, T_WARPS = 128, 4


def _check(q: Tensor) -> None:
    if q.dim() != 2 or q.element_size() != 1 or not q.is_contiguous():
        raise ValueError(f"transpose_fp8: expected a contiguous 2-D tensor of one-byte elements, got {q.dtype} "
                         f"{tuple(q.shape)} strides {q.stride()}")


def transpose_fp8_torch(q: Tensor) -> Tensor:
    """The specification: q^T, contiguous."""
    _check(q)
    return q.t().contiguous()


@jit
def transpose_u8_kernel(src_ptr, dst_ptr, R, C, stride_src, stride_dst, BLOCK_R: tl.constexpr,
                        BLOCK_C: tl.constexpr):
    """dst[c, r] = src[r, c] for bytes (rows of either at their own stride)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = (r[:, None] < R) & (c[None, :] < C)
    t = tl.load(src_ptr + r[:, None].to(tl.int64) * stride_src + c[None, :], mask=m)
    tl.store(dst_ptr + c[:, None].to(tl.int64) * stride_dst + r[None, :], tl.trans(t), mask=tl.trans(m))


def transpose_fp8_triton(q: Tensor) -> Tensor:
    """q^T, contiguous, by `transpose_u8_kernel` (the same bits as the twin)."""
    _check(q)
    N, K = q.shape
    qt = torch.empty((K, N), dtype=q.dtype, device=q.device)
    if q.numel():
        src, dst = q.view(torch.uint8), qt.view(torch.uint8)
        transpose_u8_kernel[(triton.cdiv(N, T_BLOCK), triton.cdiv(K, T_BLOCK))](
            src, dst, N, K, src.stride(0), dst.stride(0), BLOCK_R=T_BLOCK, BLOCK_C=T_BLOCK, num_warps=T_WARPS)
    return qt


def transpose_fp8(q: Tensor) -> Tensor:
    """Triton or the twin, as `dispatch.use_triton` decides; the same contract."""
    return transpose_fp8_triton(q) if use_triton(q) else transpose_fp8_torch(q)
