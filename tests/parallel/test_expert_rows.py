"""The worst case of expert parallelism's token exchange (parallel/experts.py `TokenExchange`) on 2 gloo ranks: routing
forced maximally unbalanced (every token's top experts on rank 0) makes rank 0's experts receive exactly
`moe.max_received_rows` rows, ep N min(k, E/ep), for k below and above E/ep; random routings stay within it on both
ranks; and what rank 0's MoE block then keeps for backward is the plan's statement (`MoeBlock.saved_by_moe` with
`expert_parallel`; Qwen3.5-MoE's `memory.moe_terms`, its shared expert besides) within 16 bytes, for the MLP's
recompute switches (the other rank keeps less)."""
from __future__ import annotations

import torch

from qtrain.model.activations import activation_terms
from qtrain.model.moe import max_received_rows
from qtrain.model.qwen3_5 import Qwen35Config
from qtrain.model.qwen3_moe import Qwen3MoeConfig
from qtrain.model.recompute import resolve_flags
from tests.dist_utils import run_distributed
from tests.model.family_fixtures import qwen35_cfg

EP, B, T = 2, 2, 16
BASE = dict(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, rope_theta=1e4, intermediate_size=48, moe_intermediate_size=40, norm_topk_prob=True)
CONFIGS = {"k 2 of E/ep 4": Qwen3MoeConfig(**BASE, num_experts=8, num_experts_per_tok=2),
           "k 3 over E/ep 2": Qwen3MoeConfig(**BASE, num_experts=4, num_experts_per_tok=3),
           "qwen3_5 k 2 of E/ep 4": qwen35_cfg(moe=True, num_hidden_layers=1, layer_types=("full_attention",),
                                               num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40)}
FLAGS = [(), ("ffn",), ("swiglu",)]


def _weights(cfg, rank: int, *, forced: bool, seed: int) -> dict[str, torch.Tensor]:
    """A routed block's weights holding rank's E/ep experts. `forced`: the attention adds nothing (o = 0), RMSNorm-2
    keeps the positive input positive (gain 1) and the router ranks experts 0, 1, ... first for every positive
    input (small weights: the softmax of far-apart logits would underflow and tie), so with k <= E/ep every token's
    experts are rank 0's, and with k > E/ep its E/ep first are."""
    from qtrain.model.weights import block_shapes
    g = torch.Generator().manual_seed(seed)
    w = {n: (0.1 * torch.randn(s, generator=g)).to(torch.bfloat16) for n, s in block_shapes(cfg, 0).items()}
    n = cfg.num_experts // EP
    for name in ("experts_up_gate", "experts_down"):
        w[name] = w[name][rank * n:(rank + 1) * n].clone()
    if forced:
        w["o"].zero_()
        w["ln2"].fill_(0.0 if isinstance(cfg, Qwen35Config) else 1.0)  # Qwen3.5's RMSNorm scales by 1 + w
        E, k = cfg.num_experts, cfg.num_experts_per_tok
        w["router"] = torch.tensor([0.01 * (k - e) if e < k else -0.01 for e in range(E)]).to(torch.bfloat16)[:, None] \
            .expand(E, cfg.hidden_size).contiguous()
    return {name: t.requires_grad_() for name, t in w.items()}


def _worker(rank: int, world: int) -> dict:
    from qtrain.kernels.rope import rope_tables
    from qtrain.model.moe_router import RouterLosses
    from qtrain.model.recompute import block_steps, count_saved_bytes
    from qtrain.model.transformer import make_block_fn
    from qtrain.parallel.experts import make_expert_parallel
    exchange = make_expert_parallel(EP, rank=rank, world=world, device=torch.device("cpu")).exchange
    received: list[int] = []
    dispatch = exchange.dispatch

    def counting(xs, counts):
        routed = dispatch(xs, counts)
        assert routed.rows.shape[0] == sum(routed.recv)
        received.append(routed.rows.shape[0])
        return routed

    exchange.dispatch = counting
    out: dict = {}
    for name, cfg in CONFIGS.items():
        cos, sin = rope_tables(cfg, T, "cpu", torch.bfloat16)
        for forced, seed, flags in [(True, 0, f) for f in FLAGS] + [(False, s, ()) for s in range(3)]:
            fn = make_block_fn(cfg, recompute=block_steps(flags), experts=exchange)
            w = _weights(cfg, rank, forced=forced, seed=seed)
            w.update(RouterLosses(cfg.router, B * T, torch.device("cpu"), z_loss=True).slot(0))
            g = torch.Generator().manual_seed(100 + 10 * seed + rank)
            x = torch.rand(B, T, cfg.hidden_size, generator=g) + 0.5  # positive: the forced routing's premise
            if not forced:
                x = torch.randn(B, T, cfg.hidden_size, generator=g)
            x = x.to(torch.bfloat16).requires_grad_()
            with count_saved_bytes(exclude=[x, cos, sin, *w.values()]) as c:
                fn(x, w, cos, sin)
            out[(name, forced, seed, flags)] = (received.pop(), c.bytes)
    return out


def _planned(cfg, flags) -> int:
    terms = activation_terms(cfg, layer=0, model_dtype="bf16", recompute=resolve_flags(flags), expert_parallel=EP)
    return sum(t.nbytes(B * T) for t in terms if t.kept and t.name != "input")


def test_a_maximally_unbalanced_routing_reaches_the_bound_and_the_plan_keeps_it():
    res = run_distributed(_worker, EP)
    for name, cfg in CONFIGS.items():
        N, k, E = B * T, cfg.num_experts_per_tok, cfg.num_experts
        bound = max_received_rows(N, top_k=k, num_experts=E, ep=EP)
        assert bound == EP * N * min(k, E // EP) > N * k  # above the balanced case
        for flags in FLAGS:
            (rows0, kept0), (rows1, kept1) = (res[r][(name, True, 0, flags)] for r in range(EP))
            assert rows0 == bound and rows1 == EP * N * k - bound, (name, flags)  # every row lands somewhere
            assert abs(kept0 - _planned(cfg, flags)) <= 16, (name, flags, kept0, _planned(cfg, flags))
            assert kept1 < kept0, (name, flags)
        for seed in range(3):
            rows = [res[r][(name, False, seed, ())][0] for r in range(EP)]
            assert max(rows) <= bound and sum(rows) == EP * N * k, (name, seed, rows)
