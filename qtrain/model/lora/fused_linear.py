"""A frozen base linear and its adapters as one autograd function, so the input gradient's two terms are summed by
the GEMM that makes the second, not by a kernel of their own.

    out = x W^T (+ b) + s (x A^T) Bbd^T          (Bbd: the targets' B, block-diagonal: adapter.block_diagonal)
    dx  = addmm(dout W, s (dout Bbd), A)          one GEMM reads the base's d(x) as its C and writes the sum

Through autograd, `F.linear(x, W)` followed by the adapter term (`LoraAdapter.__call__`) gives d(x) as two GEMM
outputs that a third pass adds: inductor folds that add into a norm's backward where one reads d(x) (the q/k/v and
up/gate inputs), but the o-projection's and the down-projection's inputs feed the attention's and SwiGLU's backward
ops, so there the add is a kernel of its own: a read of two (tokens, in) tensors and a write of one, per layer and
micro-step (at Qwen2.5-7B, 8,192 tokens: 2 x 59 MB for o and 2 x 310 MB for down, ~0.7 GB of traffic a layer). Here
cuBLAS's epilogue reads the base's d(x) as C instead (beta 1): two passes fewer.

What it keeps for backward is what the unfused path keeps (x for dA, h = x A^T for dB; W, A and Bbd are weights).
Without dropout only: with it each target's A sees its own dropped copy of x (`LoraAdapter._drop`), whose gradient
is not x's. The frozen W and b get no gradient unless they require one (then dW = dout^T x, db = sum dout).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class _AdaptedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, a: torch.Tensor, bd: torch.Tensor,
                scaling: float) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        h = x2 @ a.t()  # (tokens, targets r)
        y = F.linear(x2, w, b)
        out = torch.addmm(y, h, bd.t(), alpha=scaling)
        ctx.save_for_backward(x2, w, a, bd, h)
        ctx.scaling, ctx.has_bias, ctx.x_shape = scaling, b is not None, x.shape
        return out.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        x2, w, a, bd, h = ctx.saved_tensors
        d2 = dout.reshape(-1, dout.shape[-1])
        need_x, need_w, need_b, need_a, need_bd = ctx.needs_input_grad[:5]
        dh = (d2 @ bd) * ctx.scaling if (need_x or need_a) else None  # (tokens, targets r)
        dx = torch.addmm(d2 @ w, dh, a).view(ctx.x_shape) if need_x else None
        dw = d2.t() @ x2 if need_w else None
        db = d2.sum(0) if (need_b and ctx.has_bias) else None
        da = dh.t() @ x2 if need_a else None
        dbd = (d2.t() @ h) * ctx.scaling if need_bd else None
        return dx, dw, db, da, dbd, None


def adapted_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, a: torch.Tensor, bd: torch.Tensor,
                   scaling: float) -> torch.Tensor:
    """x W^T (+ b) + scaling (x A^T) Bbd^T, with its input gradient summed in one GEMM (module docstring)."""
    return _AdaptedLinear.apply(x, w, b, a, bd, scaling)


def adapted_linear_twin(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, a: torch.Tensor, bd: torch.Tensor,
                        scaling: float) -> torch.Tensor:
    """The specification: the same terms through autograd (the unfused path's arithmetic)."""
    y = F.linear(x, w, b)
    return y + scaling * F.linear(F.linear(x, a), bd)
