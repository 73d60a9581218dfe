"""The memory plan of an MoE model (a routed and a dense layer) against a real Trainer and a real micro-step, as
tests/plan/test_components.py and test_memory.py check the dense families: the expert stacks' weights, gradients
and Adam state come from the layout's groups (the experts' group included) byte for byte, for the gradient kinds
and the optimizer-state offload an MoE run can use; the activation row is what forward_backward holds when the LM
head starts (the blocks' saved bytes, measured exactly per block in tests/model/test_moe_activations.py), within
1% (measured: 400 bytes of 0.75 MB; the dense tests allow 10%), and the micro-step's peak stays below
activations + workspace."""
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
