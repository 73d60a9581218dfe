"""The sparse MoE MLP, functional and family-independent: route, permute, grouped expert GEMMs, SwiGLU, combine.

One layer, for N tokens of width C, E experts of intermediate size F, top-k routing::

    1) routing (moe_router.route)       logits = x W_r^T (N, E); softmax, top-k, renormalise: in fp32
    2) permutation (moe_permute)         xs = the k copies of each token in expert order (N*k, C)
    3) up/gate GEMM (grouped_gemm)      h = xs_g W_ug[g]^T per expert g (N*k, 2F), rows [up; gate]
    4) SwiGLU (layers.swiglu_fused)     a = up * silu(gate) (N*k, F)
    5) down GEMM (grouped_gemm)         ys = a_g W_d[g]^T (N*k, C)
    6) combine (moe_permute)            out[t] = sum_j w[t, j] ys[row of (t, j)] (N, C), fp32 sum

Dropless: every token reaches all k of its experts, whatever the imbalance; nothing is padded to a capacity, so
the result equals transformers' per-expert loop. An expert that gets no token owns no rows: the grouped GEMMs
leave its weight gradient exactly zero (never a NaN from an empty mean or an uninitialised buffer).

Weights, per MoE layer (what the family seam stores; the HF names are in the families' mappings):
  router_weight   (E, C)       <- mlp.gate.weight (Mixtral: block_sparse_moe.gate.weight)
  experts_up_gate (E, 2F, C)   rows [up; gate] of each expert, qtrain's dense MLP order (model/weights.py)
                               <- experts.{e}.up_proj / gate_proj (Mixtral: w3 / w1); transformers' own fused
                               `experts.gate_up_proj` is [gate; up], so its halves swap
  experts_down    (E, C, F)    <- experts.{e}.down_proj (Mixtral: w2)

Memory kept for backward besides the dense MLP's kinds of tensors: xs (N*k, C), h (N*k, 2F), a (N*k, F) and ys
(N*k, C) in the activation dtype (with `fp8`, the GEMMs keep e4m3 copies of xs and a plus an fp32 scale per row
instead), the routing (N, E) fp32 probabilities, and the permutation indices
(2 x N*k int64). Imbalance changes none of these sizes: dropless routing fixes the row count at N*k.
With expert parallelism (`exchange`) xs, h and a are the rows this rank's experts received (M of them, plus the
exchange's two int64 row orders), which imbalance does change: at most `max_received_rows`, ep*N*min(k, E/ep), when
every token of the token group picks experts of one rank (balanced routing: M = N*k); ys and the indices stay
this rank's own N*k rows (the combine's).

LoRA on the experts (`adapter`, model/lora/adapter.py `LoraAdapter.expert_term`): steps 3 and 5 add the adapter
term of their stack for the rows they multiply, h += s B_e A_e xs_g, inside the same step (a recomputed 'up' step
reruns its adapter too).

Inside a block, steps 2-3 and step 4 run through the block's `step(name, fn, *args)` as its 'up' and 'swiglu' steps
(model/recompute.py), so --recompute-ffn / --recompute-swiglu drop what they keep as they do for a dense MLP.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Protocol

import torch

from qtrain.kernels.grouped_gemm import expert_linear
from qtrain.kernels.grouped_gemm_fp8 import fp8_expert_linear
from qtrain.kernels.moe_permute import ExpertOrder, permute_tokens, sort_by_expert, unpermute_tokens
from qtrain.model.layers import swiglu_fused
from qtrain.model.moe_router import RouterStats, route, router_stats
from qtrain.model.recompute import run_step

__all__ = ["EXPERTS_DOWN", "EXPERTS_UP_GATE", "ExpertAdapter", "ExpertExchange", "MoEOutput", "max_received_rows",
           "moe_forward", "permuted_up"]

EXPERTS_UP_GATE, EXPERTS_DOWN = "experts_up_gate", "experts_down"  # the expert stacks' names (module docstring)
# (stack name, its input rows grouped by expert, the int32 row ends) -> the adapter's term (rows, out), or None
ExpertAdapter = Callable[[str, torch.Tensor, torch.Tensor], Optional[torch.Tensor]]


def _expert_gemm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, name: str,
                 adapter: ExpertAdapter | None, fp8: bool = False) -> torch.Tensor:
    """x's rows through their experts' stack `name` (`w`), with its adapter's term when there is one; `fp8`: the
    GEMMs in e4m3 with row-wise scales (kernels/grouped_gemm_fp8.py), else in x's dtype."""
    y = (fp8_expert_linear if fp8 else expert_linear)(x, w, offsets)
    delta = adapter(name, x, offsets) if adapter is not None else None
    return y if delta is None else y + delta


def max_received_rows(tokens: int, *, top_k: int, num_experts: int, ep: int) -> int:
    """The most rows one rank's experts can receive in a layer when each of the ep ranks of its token group routes
    `tokens` tokens: a token's k experts are distinct, so at most min(k, E/ep) of them live on one rank, and dropless
    routing sends every such row (no capacity cuts it). ep 1: N*k whatever the imbalance; balanced routing gives N*k
    under any ep (the memory plan's worst and balanced cases)."""
    return ep * tokens * min(top_k, num_experts // ep)


class MoEOutput(NamedTuple):
    out: torch.Tensor            # x's shape and dtype
    router_logits: torch.Tensor  # (N, E) in x's dtype: what transformers returns as `router_logits`
    stats: RouterStats           # this layer's share of the auxiliary losses (moe_router)
    plan: ExpertOrder            # the permutation; plan.counts = tokens per expert (observability)


def _check(x: torch.Tensor, router_weight: torch.Tensor, experts_up_gate: torch.Tensor,
           experts_down: torch.Tensor, top_k: int, ep: int = 1) -> None:
    E, C = router_weight.shape
    El = E // ep  # the experts this rank holds (expert parallelism: E / ep)
    F2 = experts_up_gate.shape[1] if experts_up_gate.dim() == 3 else -1
    if x.shape[-1] != C or experts_up_gate.shape != (El, F2, C) or F2 % 2 or \
            experts_down.shape != (El, C, F2 // 2) or E % ep:
        raise ValueError(f"moe_forward: expected x (..., C), router (E, C), experts_up_gate (E, 2F, C), "
                         f"experts_down (E, C, F) (the stacks: E/{ep} experts with expert parallelism {ep}); got "
                         f"{tuple(x.shape)}, {tuple(router_weight.shape)}, {tuple(experts_up_gate.shape)}, "
                         f"{tuple(experts_down.shape)}")
    if not 1 <= top_k <= E:
        raise ValueError(f"moe_forward: top_k must be in [1, {E}] (the number of experts), got {top_k}")


def permuted_up(x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, offsets: torch.Tensor,
                experts_up_gate: torch.Tensor, top_k: int, adapter: ExpertAdapter | None = None,
                fp8: bool = False) -> torch.Tensor:
    """Steps 2-3: the tokens x (N, C) in expert order, through their experts' up/gate GEMM -> (N*k, 2F)."""
    plan = ExpertOrder(order, inverse, offsets, offsets, top_k)  # counts are not read here
    xs = permute_tokens(x, plan)  # (N*k, C) in expert order
    return _expert_gemm(xs, experts_up_gate, offsets, EXPERTS_UP_GATE, adapter, fp8)  # (N*k, 2F): [up | gate]


class ExpertExchange(Protocol):
    """Expert parallelism's token exchange (parallel/experts.TokenExchange): this rank holds E/ep of the experts;
    `dispatch` sends rows in global expert order to their experts' ranks (returning the local experts' rows,
    expert-major, with `.rows`, `.offsets`), `combine` sends the local experts' outputs back."""
    ep: int

    def local_experts(self, num_experts: int) -> tuple[int, int]: ...

    def dispatch(self, xs: torch.Tensor, counts: torch.Tensor) -> Any: ...

    def combine(self, ys: torch.Tensor, routed: Any) -> torch.Tensor: ...


def _local_experts(xs: torch.Tensor, experts_up_gate: torch.Tensor, experts_down: torch.Tensor,
                   offsets: torch.Tensor, step, adapter: ExpertAdapter | None, fp8: bool) -> torch.Tensor:
    """Steps 3-5 on rows grouped by expert."""
    h = step("up", _expert_gemm, xs, experts_up_gate, offsets, EXPERTS_UP_GATE, adapter, fp8)  # (M, 2F)
    a = step("swiglu", swiglu_fused, h)  # (M, F)
    return _expert_gemm(a, experts_down, offsets, EXPERTS_DOWN, adapter, fp8)  # (M, C)


def moe_forward(x: torch.Tensor, router_weight: torch.Tensor, experts_up_gate: torch.Tensor,
                experts_down: torch.Tensor, *, top_k: int, norm_topk_prob: bool, step=run_step,
                exchange: ExpertExchange | None = None, adapter: ExpertAdapter | None = None,
                fp8: bool = False) -> MoEOutput:
    """The MoE MLP of one layer (module docstring) on x (..., C): weights as listed there, all differentiable.
    `norm_topk_prob`: renormalise the k kept probabilities to sum to 1 (Qwen3-MoE per config, OLMoE False,
    Mixtral True). `step`: the block's step policy ('up', 'swiglu'). `exchange`: expert parallelism (the expert
    stacks hold this rank's E/ep experts; the permuted rows travel to their experts' ranks between steps 2 and 3
    and back between 5 and 6; the 'up' step is then the local up/gate GEMM alone). `adapter`: LoRA's term of the
    expert GEMMs (module docstring). `fp8`: steps 3 and 5 in e4m3 with row-wise scales (--fp8-experts,
    kernels/grouped_gemm_fp8.py; K and N multiples of 16). Returns the output and what the auxiliary losses and the
    logs need."""
    _check(x, router_weight, experts_up_gate, experts_down, top_k, 1 if exchange is None else exchange.ep)
    shape, E = x.shape, router_weight.shape[0]
    x2 = x.reshape(-1, shape[-1])  # (N, C)
    r = route(x2, router_weight, top_k=top_k, norm_topk_prob=norm_topk_prob)
    plan = sort_by_expert(r.ids, E)
    if exchange is None:
        h = step("up", permuted_up, x2, plan.order, plan.inverse, plan.offsets, experts_up_gate, top_k,
                 adapter, fp8)  # (N k, 2F)
        a = step("swiglu", swiglu_fused, h)  # (N*k, F)
        ys = _expert_gemm(a, experts_down, plan.offsets, EXPERTS_DOWN, adapter, fp8)  # (N*k, C)
    else:
        routed = exchange.dispatch(permute_tokens(x2, plan), plan.counts)
        ys = exchange.combine(_local_experts(routed.rows, experts_up_gate, experts_down, routed.offsets, step,
                                             adapter, fp8), routed)
    out = unpermute_tokens(ys, r.weights, plan)  # (N, C)
    return MoEOutput(out.view(shape), r.logits, router_stats(r, E, plan.counts), plan)
