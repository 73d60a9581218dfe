"""The causal depthwise convolution of a Gated DeltaNet layer, followed by SiLU: the plain-torch twins of the forward
and the backward (the specification, what CPU runs) and the Triton kernels (fla-core's `causal_conv1d` is the
reference for the math), as an op pair `causal_conv1d_silu_op` (Triton on CUDA per `qtrain.kernels.dispatch`, the
twins elsewhere) that keeps x, not the output, and recomputes the pre-activation in backward.

For channel c, kernel width K, weight w (D, K), input x (B, T, D), with x[t] = 0 for t < 0::

    y[t, c] = silu( sum_{j=0..K-1} w[c, j] x[t - K + 1 + j, c] )

in fp32, rounded once to x's dtype (transformers' `causal_conv1d_fn` runs F.conv1d in the weight's dtype and casts
back: the same values in fp32). Each output reads the K - 1 tokens before it, so a sequence's first tokens see zeros.

Documents (`resets` (B, T) bool, True at a document's first token: --document-masking): the tokens before a
document's first one read as zeros for its outputs too, x[t - s] counting only where no reset lies in (t - s, t],
so each document is convolved as if alone (the convolution's state restarts at each boundary).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from qtrain.kernels.dispatch import jit, tl, triton, use_triton

__all__ = ["causal_conv1d_silu_backward_triton", "causal_conv1d_silu_backward_twin", "causal_conv1d_silu_op",
           "causal_conv1d_silu_triton", "causal_conv1d_silu_twin"]


def _check(x: torch.Tensor, w: torch.Tensor, resets: torch.Tensor | None) -> None:
    if x.dim() != 3 or w.dim() != 2 or w.shape[0] != x.shape[-1]:
        raise ValueError(f"causal_conv1d: expected x (B, T, D) and w (D, K), got {tuple(x.shape)}, {tuple(w.shape)}")
    if resets is not None and (resets.shape != x.shape[:2] or resets.dtype != torch.bool):
        raise ValueError(f"causal_conv1d: resets must be (B, T) bool, got {tuple(resets.shape)} {resets.dtype}")


def _seen(resets: torch.Tensor | None, K: int, T: int) -> dict[int, torch.Tensor]:
    """Shift s -> (B, T, 1) bool: no reset in (t - s, t] (documents); empty without resets."""
    seen: dict[int, torch.Tensor] = {}
    if resets is not None:
        for s in range(1, K):
            r = ~F.pad(resets, (s - 1, 0))[:, :T, None]  # no reset at t - s + 1
            seen[s] = r if s == 1 else seen[s - 1] & r
    return seen


def causal_conv1d_silu_twin(x: torch.Tensor, w: torch.Tensor, resets: torch.Tensor | None = None) -> torch.Tensor:
    """x (B, T, D), w (D, K) -> silu(causal depthwise conv) (B, T, D) in x's dtype; `resets` (B, T) bool: documents
    (module docstring)."""
    _check(x, w, resets)
    K, T = w.shape[1], x.shape[1]
    acc = torch.promote_types(x.dtype, torch.float32)  # fp32 (fp64 inputs stay fp64, for tests)
    xf = F.pad(x.to(acc), (0, 0, K - 1, 0))  # (B, K - 1 + T, D): zeros before the first token
    wf = w.to(acc)
    seen = _seen(resets, K, T)
    y = 0
    for j in range(K):  # the oldest tap first, as the plain sum runs
        term = wf[:, j] * xf[:, j:j + T]
        s = K - 1 - j
        y = y + (term * seen[s] if s in seen else term)
    return F.silu(y).to(x.dtype)


# ------------------------------------------------------------------------------------------ backward twin
def causal_conv1d_silu_backward_twin(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor,
                                     resets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The specification of the backward: (dx in x's dtype, dw (D, K) in w's dtype) for the output gradient dy, in
    fp32 (fp64 for fp64 inputs), the pre-activation recomputed::

        u = the convolution at t, dpre = dy silu'(u) = dy s (1 + u (1 - s)), s = sigmoid(u)
        dx[t - s'] += w[:, K - 1 - s'] dpre[t] seen_s'(t),  dw[:, K - 1 - s'] = sum_t x[t - s'] dpre[t] seen_s'(t)"""
    _check(x, w, resets)
    K, T = w.shape[1], x.shape[1]
    acc = torch.promote_types(x.dtype, torch.float32)
    xf, wf, seen = F.pad(x.to(acc), (0, 0, K - 1, 0)), w.to(acc), _seen(resets, K, T)
    u = 0
    for j in range(K):
        term = wf[:, j] * xf[:, j:j + T]
        u = u + (term * seen[K - 1 - j] if K - 1 - j in seen else term)
    sig = torch.sigmoid(u)
    dpre = dy.to(acc) * sig * (1 + u * (1 - sig))
    dx = torch.zeros_like(xf)
    dw = torch.zeros(w.shape, dtype=acc, device=w.device)
    for j in range(K):
        s = K - 1 - j
        g = dpre * seen[s] if s in seen else dpre  # (B, T, D): the outputs that read their input s tokens back
        dw[:, j] = (g * xf[:, j:j + T]).sum((0, 1))
        dx[:, j:j + T] += wf[:, j] * g
    return dx[:, K - 1:].to(x.dtype), dw.to(w.dtype)


# -------------------------------------------------------------------------------------------- triton
BT, BD, NUM_WARPS = 32, 64, 4  # a program: 32 tokens x 64 channels


@jit
def _conv_pre(x_ptr, w_ptr, r_ptr, row, col, rmask, cmask, t, SX, K: tl.constexpr, HAS_RESETS: tl.constexpr,
              BT: tl.constexpr, BD: tl.constexpr):
    """The convolution before SiLU at rows `row` [BT, 1] (flattened b T + t; x's rows SX elements apart), channels
    `col` [1, BD], fp32, the oldest tap first (the twin's order); a tap reads zero across a sequence's start or a
    document's (`resets`)."""
    acc = tl.zeros([BT, BD], tl.float32)
    for j in tl.static_range(K):
        s = K - 1 - j  # the tap's shift
        ok = rmask & (t >= s)
        if HAS_RESETS:
            for q in tl.static_range(K - 1):  # no document starts at t, t - 1, ..., t - s + 1 (q < s)
                r = tl.load(r_ptr + row - q, mask=ok & (q < s), other=0)
                ok = ok & (r == 0)
        xv = tl.load(x_ptr + (row - s).to(tl.int64) * SX + col, mask=ok & cmask, other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + col * K + j, mask=cmask, other=0.0).to(tl.float32)
        acc = acc + wv * xv
    return acc


@jit
def _conv_fwd_kernel(x_ptr, SX, w_ptr, r_ptr, y_ptr, rows, T, D, K: tl.constexpr, HAS_RESETS: tl.constexpr,
                     BT: tl.constexpr, BD: tl.constexpr):
    """y = silu(conv) for a [BT, BD] tile."""
    row = tl.program_id(0) * BT + tl.arange(0, BT)[:, None]
    col = tl.program_id(1) * BD + tl.arange(0, BD)[None, :]
    rmask, cmask = row < rows, col < D
    u = _conv_pre(x_ptr, w_ptr, r_ptr, row, col, rmask, cmask, row % T, SX, K, HAS_RESETS, BT, BD)
    tl.store(y_ptr + row.to(tl.int64) * D + col, u * tl.sigmoid(u), mask=rmask & cmask)


@jit
def _conv_dpre_kernel(x_ptr, SX, w_ptr, r_ptr, dy_ptr, dpre_ptr, rows, T, D, K: tl.constexpr,
                      HAS_RESETS: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """dpre = dy silu'(u) (fp32) for a [BT, BD] tile, u recomputed."""
    row = tl.program_id(0) * BT + tl.arange(0, BT)[:, None]
    col = tl.program_id(1) * BD + tl.arange(0, BD)[None, :]
    rmask, cmask = row < rows, col < D
    u = _conv_pre(x_ptr, w_ptr, r_ptr, row, col, rmask, cmask, row % T, SX, K, HAS_RESETS, BT, BD)
    at = row.to(tl.int64) * D + col
    dy = tl.load(dy_ptr + at, mask=rmask & cmask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(u)
    tl.store(dpre_ptr + at, dy * sig * (1 + u * (1 - sig)), mask=rmask & cmask)


@jit
def _conv_bwd_kernel(x_ptr, SX, w_ptr, r_ptr, dpre_ptr, dx_ptr, dw_ptr, rows, T, D, K: tl.constexpr,
                     HAS_RESETS: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """For a [BT, BD] tile of inputs: dx = sum over taps of w dpre at the outputs reading it, and this tile's share
    of dw (K, BD) into its row of the (row blocks, K, D) fp32 partial sums (summed after: deterministic)."""
    pid = tl.program_id(0)
    row = pid * BT + tl.arange(0, BT)[:, None]
    col = tl.program_id(1) * BD + tl.arange(0, BD)[None, :]
    rmask, cmask = row < rows, col < D
    t = row % T
    xv = tl.load(x_ptr + row.to(tl.int64) * SX + col, mask=rmask & cmask, other=0.0).to(tl.float32)
    dx = tl.zeros([BT, BD], tl.float32)
    for j in tl.static_range(K):
        s = K - 1 - j  # the tap's shift
        ok = rmask & (t + s < T)  # the output s tokens later, in this sequence
        if HAS_RESETS:
            for q in tl.static_range(K - 1):  # it sees this token: no document starts at row + s, ..., row + 1
                r = tl.load(r_ptr + row + s - q, mask=ok & (q < s), other=0)
                ok = ok & (r == 0)
        g = tl.load(dpre_ptr + (row + s).to(tl.int64) * D + col, mask=ok & cmask, other=0.0)
        wv = tl.load(w_ptr + col * K + j, mask=cmask, other=0.0).to(tl.float32)
        dx = dx + wv * g
        tl.store(dw_ptr + (pid * K + j) * D + col, tl.sum(xv * g, axis=0)[None, :], mask=cmask)
    tl.store(dx_ptr + row.to(tl.int64) * D + col, dx, mask=rmask & cmask)


def rows_of(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x (B, T, D) as the kernels read it, with the distance between its rows: a column slice of a wider tensor
    (the layer's input projection split into the convolution's part and the rest) is read in place, any other
    layout copied."""
    B, T, D = x.shape
    # the distance between consecutive flattened rows b T + t: along T, or along B where T is 1 (a size-1
    # dimension's stride means nothing: a tensor torch calls contiguous may carry any there)
    step = x.stride(1) if T > 1 else x.stride(0) if B > 1 else D
    if x.stride(2) != 1 or (B > 1 and x.stride(0) != T * step) or step < D:
        x = x.contiguous()
        step = D
    return x, step


def _launch_args(x: torch.Tensor, w: torch.Tensor, resets: torch.Tensor | None):
    B, T, D = x.shape
    r = resets.contiguous().view(torch.uint8) if resets is not None else x.new_zeros(1, dtype=torch.uint8)
    grid = (triton.cdiv(B * T, BT), triton.cdiv(D, BD))
    return (*rows_of(x), w.contiguous(), r), B * T, T, D, grid


def causal_conv1d_silu_triton(x: torch.Tensor, w: torch.Tensor, resets: torch.Tensor | None = None) -> torch.Tensor:
    """Triton forward; the twin's contract (fp32 accumulation, the output rounded once to x's dtype)."""
    _check(x, w, resets)
    ins, rows, T, D, grid = _launch_args(x, w, resets)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if y.numel():
        _conv_fwd_kernel[grid](*ins, y, rows, T, D, K=w.shape[1], HAS_RESETS=resets is not None, BT=BT, BD=BD,
                               num_warps=NUM_WARPS, enable_fp_fusion=False)
    return y


def causal_conv1d_silu_backward_triton(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor,
                                       resets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton backward; the backward twin's contract. Two launches: dpre (fp32, B T D: the recomputed SiLU's
    gradient), then dx and the per-tile dw partial sums, reduced by torch."""
    _check(x, w, resets)
    ins, rows, T, D, grid = _launch_args(x, w, resets)
    K, has = w.shape[1], resets is not None
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    partial = torch.zeros(grid[0], K, D, dtype=torch.float32, device=x.device)
    if dx.numel():
        dpre = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        _conv_dpre_kernel[grid](*ins, dy.contiguous(), dpre, rows, T, D, K=K, HAS_RESETS=has, BT=BT, BD=BD,
                                num_warps=NUM_WARPS, enable_fp_fusion=False)
        _conv_bwd_kernel[grid](*ins, dpre, dx, partial, rows, T, D, K=K, HAS_RESETS=has, BT=BT, BD=BD,
                               num_warps=NUM_WARPS, enable_fp_fusion=False)
    # w's layout: the gradient managers take contiguous gradients only (the fake kernel promises empty_like(w))
    return dx, partial.sum(0).t().to(w.dtype).contiguous()


# ---------------------------------------------------------------------------------------------- ops
@torch.library.custom_op("qtrain::causal_conv1d_silu_fwd", mutates_args=())
def _conv_fwd(x: torch.Tensor, w: torch.Tensor, resets: torch.Tensor | None) -> torch.Tensor:
    if use_triton(x):
        return causal_conv1d_silu_triton(x, w, resets)
    return causal_conv1d_silu_twin(x, w, resets)


@_conv_fwd.register_fake
def _(x, w, resets):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("qtrain::causal_conv1d_silu_bwd", mutates_args=())
def _conv_bwd(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, resets: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        return causal_conv1d_silu_backward_triton(x, w, dy, resets)
    return causal_conv1d_silu_backward_twin(x, w, dy, resets)


@_conv_bwd.register_fake
def _(x, w, dy, resets):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(w)


def _setup_context(ctx, inputs, output):
    x, w, resets = inputs
    ctx.save_for_backward(x, w, resets)  # the input, not the output: the backward recomputes the pre-activation


def _backward(ctx, dy):
    x, w, resets = ctx.saved_tensors
    dx, dw = _conv_bwd(x, w, dy, resets)
    return dx, dw, None


_conv_fwd.register_autograd(_backward, setup_context=_setup_context)


def causal_conv1d_silu_op(x: torch.Tensor, w: torch.Tensor, resets: torch.Tensor | None = None) -> torch.Tensor:
    """The op pair (forward, backward: Triton on CUDA, the twins elsewhere), differentiable; it keeps x, w and the
    resets for backward, not the output."""
    return _conv_fwd(x, w, resets)
