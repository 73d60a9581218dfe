"""MoE token permutation: tokens gathered into expert order, and the experts' outputs combined back per token.

Routing gives each of N tokens k expert ids and k weights. Slot s = t*k + j is token t's j-th choice. Sorting the
N*k slots by expert id (stable, so within an expert the slots stay in token order) gives `order` (row i of the
expert-ordered batch is slot order[i]), its inverse `inverse` (slot s sits at row inverse[s]) and the cumulative
row ends per expert `offsets` that the grouped GEMMs take. Why a sort and not one mask per expert (what the
transformers reference loops over): one pass over N*k ids whatever the number of experts, no host sync, and
rows of an expert contiguous, which is what a grouped GEMM needs. Dropless: every slot gets a row, so an expert
may get anything from 0 to N rows; nothing is padded to a capacity.

Three ops, each a row gather written once per destination row (no atomics, so deterministic), fp32 inside::

    permute               xs[i]  = x[order[i] // k]                               (N*k, C)
    unpermute             out[t] = sum_j w[t, j] * ys[inverse[t*k + j]]           (N, C); w None: a plain sum
    unpermute_backward    dys[i] = w[s] * dout[s // k],  dw[s] = <dout[s // k], ys[i]>,  s = order[i]

`permute`'s backward is `unpermute` without weights (each token sums the gradients of its k copies);
`unpermute`'s backward is `unpermute_backward`, a permute of d(out) scaled by the routing weights plus the
weights' gradients as dot products (fp32), in one pass over the expert-ordered rows. The k-sum of `unpermute`
runs in fp32 over j = 0..k-1 in order and rounds once to the output dtype (transformers' loop adds each
expert's contribution into a tensor of the activation dtype, expert by expert).

Each plain-torch twin (`*_twin`) is the specification; the public ops are custom ops (`qtrain::moe_permute`,
`qtrain::moe_unpermute`, `qtrain::moe_unpermute_backward`) that run Triton on CUDA and the twin elsewhere
(`qtrain.kernels.dispatch`). `permute_tokens` / `unpermute_tokens` are the autograd entries the MoE layer calls.

Memory: `unpermute_tokens` saves ys (N*k, C, activation dtype) for the weights' gradient; `sort_by_expert`'s
indices are 2 x N*k int64 plus E int32.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from qtrain.kernels.dispatch import jit, tl, use_triton
from qtrain.kernels.stochastic_rounding import KINDS, load_f32, store_f32

__all__ = ["ExpertOrder", "permute", "permute_tokens", "permute_triton", "permute_twin", "sort_by_expert",
           "unpermute", "unpermute_backward", "unpermute_backward_triton", "unpermute_backward_twin",
           "unpermute_tokens", "unpermute_triton", "unpermute_twin"]

# One program per destination row, walking the row in BLOCK_C columns (a memory-bound gather: C = 2048 is two
# tiles). The launchers take others as parameters; no choice changes a bit.
BLOCK_C, NUM_WARPS = 1024, 4


class ExpertOrder(NamedTuple):
    """Where each (token, choice) slot goes in the expert-ordered batch (module docstring)."""
    order: torch.Tensor    # (N*k,) int64: row i holds slot order[i]
    inverse: torch.Tensor  # (N*k,) int64: slot s sits at row inverse[s]
    offsets: torch.Tensor  # (E,) int32: cumulative row ends per expert (torch._grouped_mm's `offs`)
    counts: torch.Tensor   # (E,) int64: rows per expert (0 for an expert that got no token)
    topk: int


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> ExpertOrder:
    """The expert order of the slots of `topk_ids` (N, k) (values in [0, num_experts)). A stable sort; the
    counts come from a binary search of the sorted ids, so nothing waits for the device (bincount would)."""
    if topk_ids.dim() != 2:
        raise ValueError(f"sort_by_expert: topk_ids must be (N, k), got {tuple(topk_ids.shape)}")
    flat = topk_ids.reshape(-1)
    sorted_ids, order = torch.sort(flat, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    bounds = torch.arange(num_experts, device=flat.device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, bounds, right=True, out_int32=True)
    counts = torch.diff(offsets.long(), prepend=offsets.new_zeros(1, dtype=torch.long))
    return ExpertOrder(order, inverse, offsets, counts, topk_ids.shape[1])


def _check_rows(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2 or t.dtype not in KINDS:
        raise TypeError(f"{name}: expected a 2-D tensor of dtype {list(KINDS)}, got {tuple(t.shape)} {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (rows of C), got strides {t.stride()}")


def _check_index(name: str, idx: torch.Tensor, rows: int) -> None:
    if idx.dim() != 1 or idx.dtype != torch.int64 or idx.numel() != rows:
        raise ValueError(f"{name}: expected an int64 index of {rows} entries, got {tuple(idx.shape)} {idx.dtype}")


def _check_weights(name: str, w: torch.Tensor, n: int, topk: int) -> None:
    if w.shape != (n, topk) or w.dtype != torch.float32 or not w.is_contiguous():
        raise ValueError(f"{name}: routing weights must be contiguous fp32 ({n}, {topk}), got {tuple(w.shape)} "
                         f"{w.dtype}")


def _check_permute(x: torch.Tensor, order: torch.Tensor, topk: int) -> None:
    _check_rows("permute: x", x)
    _check_index("permute: order", order, x.shape[0] * topk)


def _check_unpermute(ys: torch.Tensor, inverse: torch.Tensor, topk: int, weights: torch.Tensor | None) -> None:
    _check_rows("unpermute: ys", ys)
    if topk < 1 or ys.shape[0] % topk:
        raise ValueError(f"unpermute: ys has {ys.shape[0]} rows, not a multiple of topk={topk}")
    _check_index("unpermute: inverse", inverse, ys.shape[0])
    if weights is not None:
        _check_weights("unpermute", weights, ys.shape[0] // topk, topk)


def _check_unpermute_backward(dout: torch.Tensor, ys: torch.Tensor, order: torch.Tensor,
                              weights: torch.Tensor) -> None:
    _check_rows("unpermute_backward: dout", dout)
    _check_rows("unpermute_backward: ys", ys)
    n, topk = weights.shape if weights.dim() == 2 else (-1, -1)
    if dout.dtype != ys.dtype or dout.shape[1] != ys.shape[1] or dout.shape[0] != n or ys.shape[0] != n * topk:
        raise ValueError(f"unpermute_backward: dout (N, C) and ys (N*k, C) of one dtype with weights (N, k), got "
                         f"{tuple(dout.shape)} {dout.dtype}, {tuple(ys.shape)} {ys.dtype}, {tuple(weights.shape)}")
    _check_weights("unpermute_backward", weights, n, topk)
    _check_index("unpermute_backward: order", order, ys.shape[0])


# ---------------------------------------------------------------------------------------------- twins
def permute_twin(x: torch.Tensor, order: torch.Tensor, topk: int) -> torch.Tensor:
    """The specification: xs[i] = x[order[i] // topk], (N*k, C) in x's dtype."""
    _check_permute(x, order, topk)
    return x.index_select(0, order // topk)


def unpermute_twin(ys: torch.Tensor, inverse: torch.Tensor, topk: int,
                   weights: torch.Tensor | None = None) -> torch.Tensor:
    """The specification: out[t] = sum_j w[t, j] * ys[inverse[t*k + j]] in fp32, j in order, rounded once to
    ys's dtype (w = 1 without weights), (N, C)."""
    _check_unpermute(ys, inverse, topk, weights)
    g = ys.index_select(0, inverse).view(-1, topk, ys.shape[1])  # (N, k, C) in slot order
    acc = torch.zeros(g.shape[0], g.shape[2], dtype=torch.float32, device=ys.device)
    for j in range(topk):
        v = g[:, j].float()
        acc = acc + (v * weights[:, j:j + 1] if weights is not None else v)
    return acc.to(ys.dtype)


def unpermute_backward_twin(dout: torch.Tensor, ys: torch.Tensor, order: torch.Tensor,
                            weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The specification: (dys, dweights). With s = order[i]: dys[i] = w[s] * dout[s // k] (fp32, rounded once
    to ys's dtype); dweights[s] = <dout[s // k], ys[i]> in fp32, (N, k)."""
    _check_unpermute_backward(dout, ys, order, weights)
    topk = weights.shape[1]
    g = dout.index_select(0, order // topk).float()  # (N*k, C): d(out) of each row's token
    dys = (g * weights.reshape(-1).index_select(0, order)[:, None]).to(ys.dtype)
    dw = torch.empty(order.numel(), dtype=torch.float32, device=ys.device)
    dw[order] = (g * ys.float()).sum(dim=1)
    return dys, dw.view_as(weights)


# --------------------------------------------------------------------------------------------- triton
@jit
def _permute_kernel(src_ptr, order_ptr, dst_ptr, w_ptr, ys_ptr, dw_ptr, C, TOPK: tl.constexpr, KIND: tl.constexpr,
                    BACKWARD: tl.constexpr, BLOCK_C: tl.constexpr):
    """Row i of the expert-ordered batch: dst[i] = src[t] with t = order[i] // TOPK. BACKWARD (unpermute's
    backward, src = d(out)): dst[i] = w[s] * src[t] and dw[s] = sum_c src[t, c] * ys[i, c], s = order[i]; all
    products and the dot in fp32, each output rounded once."""
    i = tl.program_id(0).to(tl.int64)
    s = tl.load(order_ptr + i)
    t = s // TOPK
    if BACKWARD:
        scale = tl.load(w_ptr + s)
    dot = tl.zeros([BLOCK_C], dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = cols < C
        v = load_f32(src_ptr + t * C + cols, mask, KIND)
        if BACKWARD:
            dot += v * load_f32(ys_ptr + i * C + cols, mask, KIND)
            v = v * scale
        store_f32(dst_ptr + i * C + cols, v, mask, KIND)
    if BACKWARD:
        tl.store(dw_ptr + s, tl.sum(dot, axis=0))


@jit
def _unpermute_kernel(src_ptr, inv_ptr, w_ptr, dst_ptr, C, TOPK: tl.constexpr, KIND: tl.constexpr,
                      WEIGHTED: tl.constexpr, BLOCK_C: tl.constexpr):
    """Token t: dst[t] = sum_{j < TOPK} w[t, j] * src[inv[t*TOPK + j]] (w = 1 unless WEIGHTED), accumulated in
    fp32 over j in order and rounded once."""
    t = tl.program_id(0).to(tl.int64)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = cols < C
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(TOPK):
            row = tl.load(inv_ptr + t * TOPK + j)
            v = load_f32(src_ptr + row * C + cols, mask, KIND)
            if WEIGHTED:
                v = v * tl.load(w_ptr + t * TOPK + j)
            acc += v
        store_f32(dst_ptr + t * C + cols, acc, mask, KIND)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def permute_triton(x: torch.Tensor, order: torch.Tensor, topk: int, *, block_c: int = BLOCK_C,
                   num_warps: int = NUM_WARPS) -> torch.Tensor:
    """Triton launcher; same contract as `permute_twin`."""
    _check_permute(x, order, topk)
    out = torch.empty(order.numel(), x.shape[1], dtype=x.dtype, device=x.device)
    if out.numel():
        unused = order  # the BACKWARD-only pointers
        _permute_kernel[(order.numel(),)](_bits(x), order, _bits(out), unused, unused, unused, x.shape[1], TOPK=topk,
                                          KIND=KINDS[x.dtype], BACKWARD=False, BLOCK_C=block_c,
                                          num_warps=num_warps)
    return out


def unpermute_triton(ys: torch.Tensor, inverse: torch.Tensor, topk: int, weights: torch.Tensor | None = None, *,
                     block_c: int = BLOCK_C, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """Triton launcher; same contract as `unpermute_twin`."""
    _check_unpermute(ys, inverse, topk, weights)
    n = ys.shape[0] // topk
    out = torch.empty(n, ys.shape[1], dtype=ys.dtype, device=ys.device)
    if out.numel():
        w = weights if weights is not None else inverse  # not read unless WEIGHTED
        _unpermute_kernel[(n,)](_bits(ys), inverse, w, _bits(out), ys.shape[1],
                                TOPK=topk, KIND=KINDS[ys.dtype], WEIGHTED=weights is not None, BLOCK_C=block_c,
                                num_warps=num_warps)
    return out


def unpermute_backward_triton(dout: torch.Tensor, ys: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, *,
                              block_c: int = BLOCK_C, num_warps: int = NUM_WARPS
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher; same contract as `unpermute_backward_twin`."""
    _check_unpermute_backward(dout, ys, order, weights)
    dys = torch.empty_like(ys)
    dw = torch.zeros_like(weights)
    if ys.numel():
        _permute_kernel[(ys.shape[0],)](_bits(dout), order, _bits(dys), weights, _bits(ys), dw, ys.shape[1],
                                        TOPK=weights.shape[1], KIND=KINDS[ys.dtype], BACKWARD=True,
                                        BLOCK_C=block_c, num_warps=num_warps)
    return dys, dw


# --------------------------------------------------------------------------------------------- public ops
@torch.library.custom_op("qtrain::moe_permute", mutates_args=())
def permute(x: torch.Tensor, order: torch.Tensor, topk: int) -> torch.Tensor:
    """xs (N*k, C): the tokens in expert order (module docstring); Triton or twin per dispatch."""
    return permute_triton(x, order, topk) if use_triton(x) else permute_twin(x, order, topk)


@permute.register_fake
def _(x: torch.Tensor, order: torch.Tensor, topk: int) -> torch.Tensor:
    _check_permute(x, order, topk)
    return x.new_empty(order.numel(), x.shape[1])


@torch.library.custom_op("qtrain::moe_unpermute", mutates_args=())
def unpermute(ys: torch.Tensor, inverse: torch.Tensor, topk: int, weights: torch.Tensor | None = None
              ) -> torch.Tensor:
    """out (N, C): each token's k rows of ys summed, weighted by `weights` (N, k) fp32 when given."""
    if use_triton(ys):
        return unpermute_triton(ys, inverse, topk, weights)
    return unpermute_twin(ys, inverse, topk, weights)


@unpermute.register_fake
def _(ys: torch.Tensor, inverse: torch.Tensor, topk: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    _check_unpermute(ys, inverse, topk, weights)
    return ys.new_empty(ys.shape[0] // topk, ys.shape[1])


@torch.library.custom_op("qtrain::moe_unpermute_backward", mutates_args=())
def unpermute_backward(dout: torch.Tensor, ys: torch.Tensor, order: torch.Tensor, weights: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dys, dweights) of the weighted `unpermute` (module docstring)."""
    if use_triton(ys):
        return unpermute_backward_triton(dout, ys, order, weights)
    return unpermute_backward_twin(dout, ys, order, weights)


@unpermute_backward.register_fake
def _(dout: torch.Tensor, ys: torch.Tensor, order: torch.Tensor, weights: torch.Tensor
      ) -> tuple[torch.Tensor, torch.Tensor]:
    _check_unpermute_backward(dout, ys, order, weights)
    return torch.empty_like(ys), torch.empty_like(weights)


# ------------------------------------------------------------------------------------------- autograd
class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, topk: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.topk = topk
        return permute(x, order, topk)

    @staticmethod
    def backward(ctx, dxs: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return unpermute(dxs.contiguous(), inverse, ctx.topk), None, None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ys: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor
                ) -> torch.Tensor:
        ctx.save_for_backward(ys, weights, order)
        return unpermute(ys, inverse, weights.shape[1], weights)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        ys, weights, order = ctx.saved_tensors
        dys, dw = unpermute_backward(dout.contiguous(), ys, order, weights)
        return dys, (dw if ctx.needs_input_grad[1] else None), None, None


def permute_tokens(x: torch.Tensor, plan: ExpertOrder) -> torch.Tensor:
    """x (N, C) -> (N*k, C) in expert order, differentiable (the backward sums each token's k row gradients)."""
    return _Permute.apply(x, plan.order, plan.inverse, plan.topk)


def unpermute_tokens(ys: torch.Tensor, weights: torch.Tensor, plan: ExpertOrder) -> torch.Tensor:
    """ys (N*k, C) in expert order -> (N, C), each token's rows weighted by `weights` (N, k) fp32 and summed;
    differentiable in ys and weights."""
    return _Unpermute.apply(ys, weights, plan.order, plan.inverse)
