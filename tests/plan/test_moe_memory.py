"""The memory plan of an MoE model (a routed and a dense layer) against a real Trainer and a real micro-step, as
tests/plan/test_components.py and test_memory.py check the dense families: the expert stacks' weights, gradients
and Adam state come from the layout's groups (the experts' group included) byte for byte, for the gradient kinds
and the optimizer-state offload an MoE run can use; the activation row is what forward_backward holds when the LM
head starts (the blocks' saved bytes, measured exactly per block in tests/model/test_moe_activations.py), within
1% (measured: 400 bytes of 0.75 MB; the dense tests allow 10%), and the micro-step's peak stays below
activations + workspace. With --expert-parallel the activations hold the worst case of the token exchange, derived here
(what a maximally unbalanced routing makes a rank keep: tests/parallel/test_expert_rows.py)."""
from __future__ import annotations

import pytest
import torch

from qtrain.model.qwen3_moe import Qwen3MoeConfig
from qtrain.model.recompute import resolve_flags
from qtrain.options import Options
from qtrain.parallel.dist import DistContext
from qtrain.plan.resolution import plan_for_trainer, plan_memory
from qtrain.train.trainer import Trainer
from tests.dist_utils import random_batch, write_model_dir
from tests.plan.test_components import component_parts, measure, plan_parts, planned, total
from tests.plan.test_memory import measure_micro_step

CFG = Qwen3MoeConfig(vocab_size=101, hidden_size=64, intermediate_size=48, moe_intermediate_size=32,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     max_position_embeddings=128, rope_theta=10000.0, num_experts=8, num_experts_per_tok=2,
                     norm_topk_prob=True, mlp_only_layers=(1,))
VARIANTS = {"default": {}, "reduce-scatter": dict(shard_gradients=True),
            "offload m v, all-to-all": dict(shard_gradients=True, all_to_all_reduce=True, offload_opt_m=True,
                                            offload_opt_v=True),
            "bf16 m v": dict(opt_m_dtype="bf16", opt_v_dtype="bf16")}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_trainer_state_equals_the_plan(tmp_path, variant):
    tr = Trainer(Options(model=write_model_dir(tmp_path, CFG), from_scratch=True, device="cpu", compile="off",
                         batch_size=2, seq_len=16, grad_accumulation=1, **VARIANTS[variant]),
                 DistContext(rank=0, world=1, local_rank=0, device=torch.device("cpu")))
    tr.micro_step(*random_batch(CFG.vocab_size, 2, 16, 0, 0, 0))
    plan = plan_for_trainer(tr)
    got = {k: total(v) for k, v in measure(tr.weights, tr.grads, tr.optimizer).items()}
    assert got == {k: d + h for k, (d, h) in planned(plan).items()}, variant
    assert component_parts(tr) == plan_parts(plan), variant
    experts = tr.layout.by_key["block.0.experts"].padded_numel
    assert got["weights"] >= 2 * experts and got["adam v"] >= 2 * experts  # the experts are in them (bf16 or more)


@pytest.mark.parametrize("dtype,flags", [("bf16", ()), ("fp32", ()), ("bf16", ("block",)), ("bf16", ("ffn",))])
def test_activations_match_a_real_micro_step(dtype, flags):
    B, T = 2, 64
    at_head, peak = measure_micro_step(CFG, dtype, flags=flags, B=B, T=T)
    plan = plan_memory(CFG, Options(model_dtype=dtype, batch_size=B, seq_len=T, recompute_block="block" in flags,
                                    recompute_ffn="ffn" in flags),
                       device="cpu", compiled=False, recompute=resolve_flags(flags))
    act = plan.item("activations")
    assert act.device == pytest.approx(at_head, rel=0.01)
    assert at_head <= peak <= act.device + plan.item("workspace").device <= 1.6 * peak


def test_expert_parallel_plans_each_ranks_share_of_the_experts():
    """--expert-parallel 2 on 2 ranks: the weights and gradients rows hold half of every expert stack (the dense
    groups whole), the Adam rows a rank's experts unsharded plus half of the rest (ZeRO-1 over the world either way:
    the same bytes)."""
    from qtrain.options import Options
    from qtrain.parallel.layout import FlatLayout
    from tests.parallel.test_moe_layout import CFG as LAYERED
    experts = sum(g.padded_numel for g in FlatLayout(LAYERED, 2).groups if g.experts)
    rows = {}
    for ep in (1, 2):
        opts = Options(model="x", from_scratch=True, batch_size=1, seq_len=16, expert_parallel=ep)
        rows[ep] = {i.name.split(" (")[0]: i.device for i in plan_memory(LAYERED, opts, world=2, device="cpu").items}
    for row in ("weights", "gradients"):
        assert rows[1][row] - rows[2][row] == experts // 2 * 2  # bf16: half the experts' elements, 2 bytes each
    assert rows[1]["adam m"] == rows[2]["adam m"] and rows[1]["adam v"] == rows[2]["adam v"]


def _moe_bytes(cfg, N: int, ep: int) -> int:
    """What a routed layer's MoE MLP keeps (bf16, nothing recomputed), derived here: the routing (fp32 probabilities,
    int64 ids, fp32 combine weights with their renormalisation, logsumexp), the permutation (2 int64) and the
    experts' outputs over the rank's own N k rows; the permuted input, up/gate and SwiGLU outputs (and with expert
    parallelism the exchange's two int64 row orders) over the rows its experts receive, at the worst case every
    token of the ep ranks routed to them: ep N min(k, E/ep); the offsets of its E/ep experts (int32)."""
    C, F, E, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok
    rows = ep * N * min(k, E // ep)
    routing = N * (4 * E + 8 * k + (8 * k + 4) + 4) + 4 * (E // ep)
    return (routing + 16 * N * k + 2 * N * k * C + rows * 2 * (C + 2 * F + F)
            + (16 * rows if ep > 1 else 0))


@pytest.mark.parametrize("k", [2, 3])  # E/ep at EP 4 is 2: k = 3 lies above it
def test_expert_parallel_plans_the_worst_case_of_the_exchange(k):
    """The activations row under --expert-parallel 2 and 4 is EP 1's plus what the worst-case rows add to each routed
    layer (`_moe_bytes`); EP 1's MoE terms are the same formula with N k rows (dropless routing: its worst case is the
    balanced one). The row says so and states balanced routing's bytes beside it; the block backward's gradients
    grow with the received rows too."""
    from dataclasses import replace
    cfg = replace(CFG, num_experts_per_tok=k)
    B, T, L = 2, 16, CFG.num_hidden_layers
    N, routed = B * T, L - len(CFG.mlp_only_layers)
    plans = {ep: plan_memory(cfg, Options(model="x", from_scratch=True, batch_size=B, seq_len=T, expert_parallel=ep),
                             world=4, device="cpu") for ep in (1, 2, 4)}
    act = {ep: p.item("activations") for ep, p in plans.items()}
    moe = {ep: sum(t["bytes"] for t in p.activation_breakdown if t["name"].startswith("moe_"))
           for ep, p in plans.items()}
    assert moe[1] == _moe_bytes(cfg, N, 1) and "balanced_routing" not in act[1].parts and "worst" not in act[1].detail
    for ep in (2, 4):
        assert moe[ep] == _moe_bytes(cfg, N, ep)
        assert act[ep].device - act[1].device == routed * (_moe_bytes(cfg, N, ep) - _moe_bytes(cfg, N, 1))
        balanced = act[1].device + routed * (16 * N * k - 4 * (cfg.num_experts - cfg.num_experts // ep))
        assert act[ep].parts["balanced_routing"] == balanced  # the received rows N k: the exchange's orders, offsets
        rows = ep * N * min(k, cfg.num_experts // ep)
        assert f"worst case of the token exchange, {rows} rows" in act[ep].detail
        assert f"balanced routing ({N * k} rows" in act[ep].detail
        C, F = cfg.hidden_size, cfg.moe_intermediate_size
        grown = plans[ep].phases["block_backward"] - plans[1].phases["block_backward"]
        assert grown == 2 * (rows - N * k) * (3 * F + 2 * C)  # the gradients of the received rows, bf16


def test_qwen35_moe_under_expert_parallel_plans_the_received_rows_too():
    """Qwen3.5's MoE layers (model/qwen3_5/memory.py `moe_terms`) take the exchange from the same bound: the experts'
    inputs, up/gate and SwiGLU outputs grow from N k to the worst case's rows, the exchange's two int64 orders come
    in, the per-layer offsets shrink to E/ep experts; the routing and the experts' outputs stay N k rows."""
    from tests.model.family_fixtures import qwen35_cfg
    cfg = qwen35_cfg(moe=True, num_hidden_layers=2, layer_types=("linear_attention", "full_attention"))
    B, T, ep = 2, 16, 2
    N, k, E, C, F = B * T, cfg.num_experts_per_tok, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    moe = {}
    for e in (1, ep):
        p = plan_memory(cfg, Options(model="x", from_scratch=True, batch_size=B, seq_len=T, expert_parallel=e),
                        world=2, device="cpu")
        moe[e] = sum(t["bytes"] for t in p.activation_breakdown if t["name"].startswith("moe"))
    rows = ep * N * min(k, E // ep)
    per_layer = (rows - N * k) * 2 * (2 * F + C + F) + 16 * rows - 4 * (E - E // ep)  # bf16 rows, int64, offsets
    assert moe[ep] - moe[1] == per_layer  # the breakdown states a routed layer's bytes
