"""The e4m3 weight in the other major order: q^T (K, N) contiguous from q (N, K), for an FP8 input-gradient GEMM
(cuBLASLt multiplies only row-major by column-major) over codes that have no cached transpose (a frozen e4m3 base).

`transpose_fp8_torch` is the specification (`q.t().contiguous()`: aten's generic strided copy, ~0.34 TB/s for one-byte
elements on the H200, numerics/fp8.py `Fp8WeightCache.transposed`); `transpose_fp8_triton` moves tiles of bytes
through the kernel's registers (a uint8 view: the bits are moved, never converted). `transpose_fp8` picks one by
`qtrain.kernels.dispatch.use_triton`.
"""
from __future__ import annotations

import torch
from torch import Tensor

from qtrain.kernels.dispatch import jit, tl, triton, use_triton

__all__ = ["transpose_fp8", "transpose_fp8_torch", "transpose_fp8_triton"]

BLOCK = 64  # a 64 x 64 byte tile a program


def _check(q: Tensor) -> None:
    if q.dim() != 2 or q.element_size() != 1 or not q.is_contiguous():
        raise ValueError(f"transpose_fp8: expected a contiguous 2-D tensor of one-byte elements, got {q.dtype} "
                         f"{tuple(q.shape)} strides {q.stride()}")


def transpose_fp8_torch(q: Tensor) -> Tensor:
    """The specification: q^T, contiguous."""
    _check(q)
    return q.t().contiguous()


@jit
def _transpose_kernel(q_ptr, qt_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rn[:, None] < N) & (rk[None, :] < K)
    tile = tl.load(q_ptr + rn[:, None].to(tl.int64) * K + rk[None, :], mask=mask)
    tl.store(qt_ptr + rk[:, None].to(tl.int64) * N + rn[None, :], tl.trans(tile), mask=tl.trans(mask))


def transpose_fp8_triton(q: Tensor) -> Tensor:
    """q^T, contiguous, by the Triton kernel (the same bits as the twin)."""
    _check(q)
    N, K = q.shape
    qt = torch.empty((K, N), dtype=q.dtype, device=q.device)
    if q.numel():
        grid = (triton.cdiv(N, BLOCK), triton.cdiv(K, BLOCK))
        _transpose_kernel[grid](q.view(torch.uint8), qt.view(torch.uint8), N, K, BLOCK_N=BLOCK, BLOCK_K=BLOCK)
    return qt


def transpose_fp8(q: Tensor) -> Tensor:
    """Triton or the twin, as `dispatch.use_triton` decides; the same contract."""
    return transpose_fp8_triton(q) if use_triton(q) else transpose_fp8_torch(q)
