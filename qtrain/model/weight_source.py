"""What a block receives and what it gives back: the weight source and gradient sink protocols between the model
and `parallel/`, and the extra entries of a block's weight dict (FP8 copies, scale hints).

The per-block loop (`transformer.Transformer`) asks a `WeightSource` for each block's weights and hands each
block's weight gradients to a `GradientSink` (a gradient manager) as soon as its backward is done; the block
function (the family's) reads its tensors by short name, plus the entries named here when present.
"""
from __future__ import annotations

from typing import Protocol

import torch


class WeightSource(Protocol):
    """Where the model gets its weights. `block(l)` / `non_block()` return tensors; the model differentiates with
    respect to exactly those that require grad (a frozen tensor does not), and `block(l)` may add, for a block
    matrix `name`, an FP8 copy as the two entries `FP8_WEIGHT.format(name)` / `FP8_INV_SCALE.format(name)` (no
    grad), and its transpose as `FP8_WEIGHT_T.format(name)`, which the block hands to its linear.
    `release_block(l)` says block l is no longer needed in this pass (a sharded source may free or reuse its
    buffer); `invalidate()` says the weights changed (an update, a load): drop anything derived from them."""

    def block(self, layer: int) -> dict[str, torch.Tensor]: ...
    def non_block(self) -> dict[str, torch.Tensor]: ...
    def release_block(self, layer: int) -> None: ...
    def invalidate(self) -> None: ...


class GradientSink(Protocol):
    """Receives weight gradients of one micro-step as soon as they exist. Tensors handed over are fresh
    (owned by the sink); names are the short block names or 'embed' / 'norm' / 'lm_head'."""

    def accumulate_block(self, layer: int, grads: dict[str, torch.Tensor]) -> None: ...
    def accumulate_non_block(self, grads: dict[str, torch.Tensor]) -> None: ...


FP8_WEIGHT = "{}.fp8"  # an e4m3 copy of block matrix {} (N, K), contiguous
FP8_INV_SCALE = "{}.fp8_inv"  # its inverse scale, a 0-dim fp32 tensor
FP8_WEIGHT_T = "{}.fp8_t"  # optional: the e4m3 copy transposed, (K, N) contiguous (the input gradient's operand)
# with --fp8-swiglu-onepass: the layer's int32 (2,) scale hints of h and du (kernels/swiglu/hints.py), which
# the Transformer adds to the block's weights for the fused FP8 MLP (no grad; run state: `Transformer.scale_hints`)
SCALE_HINT = "mlp.fp8_scale_hint"
# a routed (MoE) layer's share of the router losses, which the Transformer adds to the block's weights in training
# (model/moe_router.RouterLosses; no grad): the block writes its statistics into ROUTER_STATS in forward (tokens per
# expert, probability sums, sum of logsumexp^2: (2E + 1,) fp32), and its backward reads the losses' gradients with
# respect to its probability sums and z-sum from ROUTER_AUX_GRAD (E,) and ROUTER_Z_GRAD (1,), which the Transformer
# fills between the forward and the backward (they depend on every layer's statistics). ROUTER_Z_GRAD is there only
# with a router z-loss.
ROUTER_STATS = "router.stats"
ROUTER_AUX_GRAD = "router.aux_grad"
ROUTER_Z_GRAD = "router.z_grad"


def quantized_weight(w: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, ...] | None:
    """(weight_fp8, inv_scale[, weight_fp8_t]) of block matrix `name` when the weight source provided them, else
    None; the transpose only when the source made it too."""
    q = w.get(FP8_WEIGHT.format(name))
    if q is None:
        return None
    pair, qt = (q, w[FP8_INV_SCALE.format(name)]), w.get(FP8_WEIGHT_T.format(name))
    return pair if qt is None else (*pair, qt)
