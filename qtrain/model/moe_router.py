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

In a block-by-block backward (`transformer.Transformer`): `RouterLosses` holds one micro-step's per-layer statistics
(each MoE block writes its row in forward, `record_router_stats`) and, once the whole forward has run, the gradients
the losses give every layer's probability sums and z-sum (`RouterLosses.set_grads`); `with_router_grads` puts an
autograd node into each block that hands them to the block's backward (Megatron's MoEAuxLossAutoScaler, whose
gradient is known in forward; here it is read when the backward runs). The model's parameters get exactly the
gradient of coef * load_balancing_loss (+ z_coef * router_z_loss) over the micro-batch, times the caller's scale.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from qtrain.model.config import RouterSpec
from qtrain.model.weight_source import ROUTER_AUX_GRAD, ROUTER_STATS, ROUTER_Z_GRAD

__all__ = ["RouterLosses", "Routing", "RouterStats", "aux_loss_grads", "load_balancing_loss",
           "load_balancing_loss_from_stats", "record_router_stats", "route", "router_stats", "router_z_loss",
           "router_z_loss_from_stats", "with_router_grads"]


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


class _ZSum(torch.autograd.Function):
    """sum over rows of logsumexp(logits)^2 (fp32 0-dim). Its gradient, 2 lse softmax(logits), comes from the routing's
    softmax probabilities, which the softmax keeps anyway: it keeps lse alone (4 bytes per row), so the statistic costs
    next to nothing whether a z-loss is on or not."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        lse = torch.logsumexp(logits.float(), dim=-1)  # (N,)
        ctx.save_for_backward(lse, probs)
        ctx.dtype = logits.dtype
        return (lse * lse).sum()

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        lse, probs = ctx.saved_tensors
        return ((2 * g) * lse[:, None] * probs).to(ctx.dtype), None


def router_stats(routing: Routing, num_experts: int, tokens_per_expert: torch.Tensor | None = None) -> RouterStats:
    """The per-layer statistics the auxiliary losses are made of (module docstring). `tokens_per_expert`: the
    top-k picks per expert if the caller has them already (the permutation's counts), else counted here."""
    if tokens_per_expert is None:
        tokens_per_expert = torch.zeros(num_experts, dtype=torch.float32, device=routing.ids.device)
        tokens_per_expert.index_add_(0, routing.ids.reshape(-1),
                                     torch.ones(routing.ids.numel(), device=routing.ids.device))
    z_sum = _ZSum.apply(routing.logits, routing.probs)
    return RouterStats(tokens_per_expert.float(), routing.probs.sum(dim=0), z_sum, routing.ids.shape[0])


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


# ------------------------------------------------------------------- in a block-by-block backward
class _WithRouterGrads(torch.autograd.Function):
    """x unchanged; its backward gives `prob_sum` and `z_sum` the gradients in `aux_grad` / `z_grad` as they are when
    the backward runs (filled after the forward: `RouterLosses.set_grads`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, prob_sum: torch.Tensor, z_sum: torch.Tensor, aux_grad: torch.Tensor,
                z_grad: torch.Tensor | None) -> torch.Tensor:
        ctx.grads = (aux_grad, z_grad)  # read, not saved: the Transformer writes them after this forward
        return x

    @staticmethod
    def backward(ctx, dx: torch.Tensor):
        aux_grad, z_grad = ctx.grads
        return dx, aux_grad.clone(), (None if z_grad is None else z_grad.view(()).clone()), None, None


@torch._disable_dynamo  # torch.compiler.disable, made at the first call: importing torch._dynamo costs ~1.5 s
def with_router_grads(x: torch.Tensor, stats: RouterStats, w: dict[str, torch.Tensor]) -> torch.Tensor:
    """x, through a node whose backward adds the router losses' gradients to this layer's statistics (`stats`),
    from the block's weight dict `w` (`RouterLosses.slot`); x itself where `w` has no such entries (evaluation).
    Outside torch.compile (a graph break in a compiled block): a compiled backward would read the gradients as they
    were when the forward ran (zeros), not as the Transformer fills them after it (measured on the CPU)."""
    aux = w.get(ROUTER_AUX_GRAD)
    if aux is None or not torch.is_grad_enabled():
        return x
    z = w.get(ROUTER_Z_GRAD)
    return _WithRouterGrads.apply(x, stats.prob_sum, stats.z_sum if z is not None else None, aux, z)


def record_router_stats(stats: RouterStats, w: dict[str, torch.Tensor]) -> None:
    """Write this layer's statistics into its row of `RouterLosses` (the block's weight dict `w`), if it has one."""
    slot = w.get(ROUTER_STATS)
    if slot is not None:
        with torch.no_grad():
            E = stats.prob_sum.numel()
            slot[:E].copy_(stats.tokens_per_expert)
            slot[E:2 * E].copy_(stats.prob_sum)
            slot[2 * E].copy_(stats.z_sum)


class RouterLosses:
    """One micro-step's router statistics of every MoE layer (`RouterSpec.layers`), rows of `rows` tokens each, and
    the gradients the router losses give each layer (module docstring). Device tensors, no host sync:
      stats     (layers, 2E + 1) fp32: tokens per expert, probability sums, sum of logsumexp(logits)^2 (ROUTER_STATS)
      aux_grad  (E,) fp32: d(scale * aux_coef * load_balancing_loss) / d(prob_sum), the same for every layer
      z_grad    (1,) fp32: d(scale * z_coef * router_z_loss) / d(z_sum); only with a z-loss (`z_loss`)"""

    def __init__(self, router: RouterSpec, rows: int, device: torch.device, *, z_loss: bool):
        E = router.experts
        self.router, self.rows = router, rows
        # one tensor per layer, not views of one: a compiled block then sees the same kind of input in every layer
        self._stats = {layer: torch.zeros(2 * E + 1, dtype=torch.float32, device=device) for layer in router.layers}
        self.aux_grad = torch.zeros(E, dtype=torch.float32, device=device)
        self.z_grad = torch.zeros(1, dtype=torch.float32, device=device) if z_loss else None

    def slot(self, layer: int) -> dict[str, torch.Tensor]:
        """The entries block `layer` gets beside its weights (none for a dense layer)."""
        if layer not in self._stats:
            return {}
        out = {ROUTER_STATS: self._stats[layer], ROUTER_AUX_GRAD: self.aux_grad}
        if self.z_grad is not None:
            out[ROUTER_Z_GRAD] = self.z_grad
        return out

    @property
    def stats(self) -> torch.Tensor:
        """(layers, 2E + 1) fp32: the MoE layers' rows, in layer order."""
        return torch.stack([self._stats[layer] for layer in self.router.layers])

    @property
    def total_rows(self) -> int:
        return self.rows * len(self.router.layers)

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        """(layers, E) fp32: top-k picks of each expert in each MoE layer."""
        return self.stats[:, :self.router.experts]

    def set_grads(self, *, aux_coef: float, z_coef: float = 0.0) -> None:
        """After the forward: the gradients of aux_coef * load_balancing_loss + z_coef * router_z_loss over every
        layer's rows (`aux_loss_grads`' formulas from the recorded statistics)."""
        R = self.total_rows
        f = sum(t[:self.router.experts] for t in self._stats.values()) / R
        torch.mul(f, aux_coef * self.router.experts / R, out=self.aux_grad)
        if self.z_grad is not None:
            self.z_grad.fill_(z_coef / R)

    def aux_loss(self) -> torch.Tensor:
        """The load-balancing loss of the micro-step (without its coefficient), fp32 0-dim."""
        E, R = self.router.experts, self.total_rows
        f = self.tokens_per_expert.sum(0) / R
        p = self.stats[:, E:2 * E].sum(0) / R
        return E * (f * p).sum()

    def z_loss(self) -> torch.Tensor:
        """The router z-loss of the micro-step (mean over every layer's rows of logsumexp^2), fp32 0-dim."""
        return self.stats[:, 2 * self.router.experts].sum() / self.total_rows


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
