"""Weight-gradient GEMMs split along their token reduction.

dW (N, K) = dY^T (N, M) @ X (M, K) reduces over M, the micro-batch's tokens (32,768-65,536), into only N x K
outputs. Where N x K is a few dozen of cuBLAS's output tiles (Qwen2.5-1.5B's attention output projection,
1536 x 1536, is 72 tiles of 128 x 256 for the H200's 132 SMs; 0.5B's 896 x 896 is 28) one GEMM leaves SMs idle
through some of the longest GEMMs of the step. Split into s slices of the reduction, the s partial products
are s times as many tiles; each is computed in fp32 and they are summed and rounded once to the gradient's dtype,
which is what one GEMM's fp32 accumulator does, in another summation order (the difference is fp32 rounding).

`wgrad_splits` is the rule (measured: `python -m bench.run gemm-ceiling --only 'wgrad-*'`, BENCHMARKS.md);
`split_wgrad_linear` a linear whose backward splits its bf16 wgrad (`model.matmul.block_linear`); the FP8 form
is `numerics.fp8.wgrad_scaled_mm`, which the FP8 linears call with their transposed operands.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["wgrad_splits", "split_bounds", "split_wgrad_linear"]

SPLIT_BELOW_TILES = 132
"""Split a wgrad whose output has fewer 128 x 256 tiles than this (one wave on the H200)..."""
MAX_SPLITS = 4
MIN_SLICE = 8192
"""... into at most MAX_SPLITS slices of at least MIN_SLICE tokens each."""


def wgrad_splits(n: int, k: int, m: int, device: torch.device | str) -> int:
    """How many slices of the reduction over m tokens the wgrad GEMM of an (n, k) weight runs in: 1 off CUDA and
    for outputs of one wave or more, else the most (<= MAX_SPLITS) that keep the slices >= MIN_SLICE tokens and
    the partial products within about one wave."""
    if torch.device(device).type != "cuda":
        return 1
    tiles = -(-n // 128) * -(-k // 256)
    s = 1
    while (s < MAX_SPLITS and tiles * s < SPLIT_BELOW_TILES and m // (2 * s) >= MIN_SLICE):
        s *= 2
    return s


def split_bounds(m: int, s: int) -> list[int]:
    """s + 1 slice bounds over m rows, each inner bound a multiple of 16 (FP8 GEMMs want 16-byte aligned
    leading offsets and reduction lengths that are multiples of 16)."""
    inner = [(m * i // s) // 16 * 16 for i in range(1, s)]
    return [0, *inner, m]


def _wgrad_split_mm(dy: Tensor, x: Tensor, s: int) -> Tensor:
    """dY^T X (N, K) from dy (M, N), x (M, K) in s slices of M, fp32 partials summed, rounded once."""
    M = dy.shape[0]
    if M % s:
        raise ValueError(f"wgrad split: {M} tokens do not divide into {s} slices")
    a = dy.reshape(s, M // s, -1).transpose(1, 2)
    b = x.reshape(s, M // s, -1)
    if dy.is_cuda:
        parts = torch.bmm(a, b, out_dtype=torch.float32)
    else:  # the CPU has no mixed-dtype bmm: the same fp32 products from fp32 copies
        parts = torch.bmm(a.float(), b.float())
    return parts.sum(0).to(dy.dtype)


class _SplitWgradLinear(torch.autograd.Function):
    """F.linear whose weight gradient is `_wgrad_split_mm` in `s` slices; the input and bias gradients as
    autograd's."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, b: Tensor | None, s: int) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.s, ctx.has_bias = s, b is not None
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w = ctx.saved_tensors
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = dy @ w
        if ctx.needs_input_grad[1]:
            dw = _wgrad_split_mm(dy2, x2, ctx.s)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db, None


def split_wgrad_linear(x: Tensor, w: Tensor, b: Tensor | None = None, splits: int | None = None) -> Tensor:
    """F.linear, with its weight gradient split along the tokens where `wgrad_splits` says so (else F.linear
    itself, so autograd's own backward runs)."""
    m = x.numel() // x.shape[-1]
    s = wgrad_splits(*w.shape, m, x.device) if splits is None else splits
    if s == 1 or not (w.requires_grad and torch.is_grad_enabled()):
        return F.linear(x, w, b)
    return _SplitWgradLinear.apply(x, w, b, s)
