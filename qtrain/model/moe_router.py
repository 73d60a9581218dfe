"""MoE routing and the router's auxiliary losses: top-k softmax routing in fp32, the Switch-Transformer
load-balancing loss exactly as transformers computes it, and ST-MoE's router z-loss.

Routing follows transformers' `Qwen3MoeTopKRouter` / `OlmoeTopKRouter` / `MixtralTopKRouter` (5.x): the router
logits are a linear of the hidden states in the activation dtype; the softmax over all experts, the top-k and
the optional renormalisation of the k kept probabilities (`norm_topk_prob`; Mixtral always renormalises) run in
fp32. transformers then casts the weights back to the activation dtype for Qwen3-MoE and OLMoE (not for
Mixtral); here they stay fp32 for every family and the combine (`kernels.moe_permute.unpermute`) accumulates in
fp32, so in fp32 the results agree to rounding and in bf16 qtrain rounds less. Why fp32: with 128 experts the
top-8 probabilities are small and close together, and bf16 (8 bits of mantissa) would tie or reorder them.

Load-balancing loss (transformers' `load_balancing_loss_func`, identical in the three model files): over the
router logits of every MoE layer, concatenated (R rows in all, each layer's N tokens),

    f_e = (number of top-k picks of expert e) / R       (sums to k over e; no gradient)
    P_e = (sum of softmax probabilities of expert e) / R
    loss = E * sum_e f_e * P_e

with the model's `num_experts_per_tok` as k and `num_experts` as E; an attention mask drops padding rows from
the counts, the sums and R. The model adds `router_aux_loss_coef * loss`. Because f is a constant, the
gradient with respect to each layer's per-expert probability sum is the same vector coef * E * f_e / R for
every layer: a block-by-block backward (qtrain's) can inject it from small per-layer statistics
(`RouterStats`) instead of keeping every layer's (N, E) logits until the end.

Router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): mean over rows of logsumexp(logits)^2, here over the rows of
every layer (the mean of the per-layer losses; ST-MoE adds one per router, L times this), so the coefficient
does not depend on depth, as the load-balancing loss does not.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["Routing", "RouterStats", "aux_loss_grads", "load_balancing_loss", "load_balancing_loss_from_stats",
           "route", "router_stats", "router_z_loss", "router_z_loss_from_stats"]


class Routing(NamedTuple):
    logits: torch.Tensor   # (N, E) in the activation dtype, differentiable
    probs: torch.Tensor    # (N, E) fp32 softmax of the logits, differentiable
    weights: torch.Tensor  # (N, k) fp32 combine weights (renormalised when norm_topk_prob), differentiable
    ids: torch.Tensor      # (N, k) int64 expert ids, in decreasing probability


def route(x: torch.Tensor, router_weight: torch.Tensor, *, top_k: int, norm_topk_prob: bool) -> Routing:
    """x (N, C), router_weight (E, C) -> Routing (module docstring for the order and the dtypes)."""
    logits = F.linear(x, router_weight)  # (N, E), activation dtype
    probs = torch.softmax(logits.float(), dim=-1)  # (N, E) fp32
    weights, ids = torch.topk(probs, top_k, dim=-1)  # (N, k)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(logits, probs, weights.contiguous(), ids)


class RouterStats(NamedTuple):
    """One MoE layer's share of the auxiliary losses, from its N rows."""
    tokens_per_expert: torch.Tensor  # (E,) fp32: top-k picks of each expert (no gradient)
    prob_sum: torch.Tensor           # (E,) fp32: sum over rows of the softmax probabilities (differentiable)
    z_sum: torch.Tensor              # () fp32: sum over rows of logsumexp(logits)^2 (differentiable)
    rows: int


def router_stats(routing: Routing, num_experts: int, tokens_per_expert: torch.Tensor | None = None) -> RouterStats:
    """The per-layer statistics the auxiliary losses are made of (module docstring). `tokens_per_expert`: the
    top-k picks per expert if the caller has them already (the permutation's counts), else counted here."""
    if tokens_per_expert is None:
        tokens_per_expert = torch.zeros(num_experts, dtype=torch.float32, device=routing.ids.device)
        tokens_per_expert.index_add_(0, routing.ids.reshape(-1),
                                     torch.ones(routing.ids.numel(), device=routing.ids.device))
    z = torch.logsumexp(routing.logits.float(), dim=-1)
    return RouterStats(tokens_per_expert.float(), routing.probs.sum(dim=0), (z * z).sum(), routing.ids.shape[0])


def load_balancing_loss_from_stats(stats: Sequence[RouterStats]) -> torch.Tensor:
    """E * sum_e f_e * P_e over all the layers' rows (module docstring), fp32 0-dim, differentiable through each
    layer's `prob_sum`."""
    rows = sum(s.rows for s in stats)
    f = torch.stack([s.tokens_per_expert for s in stats]).sum(0) / rows
    p = torch.stack([s.prob_sum for s in stats]).sum(0) / rows
    return f.numel() * (f * p).sum()


def router_z_loss_from_stats(stats: Sequence[RouterStats]) -> torch.Tensor:
    """Mean over all the layers' rows of logsumexp(logits)^2, fp32 0-dim."""
    return torch.stack([s.z_sum for s in stats]).sum() / sum(s.rows for s in stats)


def aux_loss_grads(stats: Sequence[RouterStats], *, aux_coef: float, z_coef: float = 0.0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of aux_coef * load_balancing_loss + z_coef * router_z_loss with respect to each layer's
    `prob_sum` (E,) and `z_sum` (): the same for every layer (module docstring), so one pair serves all.
    A block-by-block backward passes them with the block's output gradient."""
    rows = sum(s.rows for s in stats)
    f = torch.stack([s.tokens_per_expert for s in stats]).sum(0) / rows
    d_prob_sum = aux_coef * f.numel() * f / rows
    d_z_sum = torch.full((), z_coef / rows, dtype=torch.float32, device=f.device)
    return d_prob_sum, d_z_sum


# ------------------------------------------------------------------- the same from concatenated logits
def load_balancing_loss(router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int,
                        attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' `load_balancing_loss_func` (module docstring) from each layer's (N, E) logits, with the
    softmax in fp32. attention_mask (B, T) with B*T = N: rows where it is 0 do not count."""
    device = router_logits[0].device
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        _, ids = torch.topk(probs, top_k, dim=-1)
        m = torch.ones(probs.shape[0], device=device) if mask is None else mask
        counts = counts.index_add(0, ids.reshape(-1), m.repeat_interleave(top_k))
        prob_sum = prob_sum + (probs * m[:, None]).sum(dim=0)
        rows = rows + m.sum()
    return num_experts * ((counts / rows) * (prob_sum / rows)).sum()


def router_z_loss(router_logits: Sequence[torch.Tensor]) -> torch.Tensor:
    """ST-MoE's z-loss, mean over every layer's rows of logsumexp(logits)^2 (fp32 0-dim)."""
    z = torch.cat([torch.logsumexp(t.float(), dim=-1) for t in router_logits])
    return (z * z).mean()
