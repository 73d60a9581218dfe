"""The MoE families' tensors in the flat layout (parallel/layout.py): a routed layer is its block's group (attention,
norms, router) and a group of its own for the expert stacks, which expert parallelism can split into whole experts
by rank; a dense layer (Qwen3-MoE's mlp_only_layers) is one group. Sharded weights gather each layer's groups, so
`qtrain plan` proposes them, with --persistent-quants too (e4m3 shards of each layer's own matrices)."""
from __future__ import annotations

import dataclasses

from qtrain.model.qwen3_moe import Qwen3MoeConfig
from qtrain.options import Options
from qtrain.parallel.layout import FlatLayout
from qtrain.plan.propose import propose
from qtrain.plan.resolution import sharded_weights_refusal

CFG = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=1e4, num_experts=8,
                     num_experts_per_tok=2, mlp_only_layers=(1,))


def test_routed_layers_hold_their_experts_in_a_group_of_their_own():
    layout = FlatLayout(CFG, world=2)
    assert [g.key for g in layout.layer_groups(0)] == ["block.0", "block.0.experts"]
    assert [g.key for g in layout.layer_groups(1)] == ["block.1"]  # dense: the Llama block's tensors
    experts = layout.by_key["block.2.experts"]
    assert [(s.short, s.shape, s.experts) for s in experts.segments] == [
        ("experts_up_gate", (8, 32, 32), 8), ("experts_down", (8, 32, 16), 8)]
    assert "layers.2.router" in {s.name for s in layout.by_key["block.2"].segments}
    for ep in (2, 4):  # expert parallelism: rank r holds experts [r E/ep, (r+1) E/ep) of both stacks, whole
        pieces = [experts.expert_pieces(r, ep) for r in range(ep)]
        per_rank = sum(p.numel for p in pieces[0])
        assert all(sum(p.numel for p in ps) == per_rank for ps in pieces)
        assert per_rank * ep == experts.content_numel
        assert all(p.tensor_offset % p.segment.expert_numel == 0 for ps in pieces for p in ps)


def test_sharded_weights_are_proposed_for_moe_blocks():
    """The sharded weight source gathers each layer's own groups (the experts' included), so the plan may shard and
    offload an MoE model's weights, with --persistent-quants too (e4m3 shards of each layer's attention and dense MLP
    matrices, the experts gathered as they are)."""
    opts = Options(model="x", from_scratch=True, batch_size=1, seq_len=16, grad_accumulation=1)
    # too small for anything (the CUDA context's reserve alone is 1 GiB): every rung is tried, the sharded and
    # offloaded weights' included (their plan states the experts' group in the gathered slots)
    assert propose(CFG, opts, gpu_bytes=1 << 20, world=2, max_batch=2) == []
    quants = dataclasses.replace(opts, persistent_quants=True)
    assert sharded_weights_refusal(CFG, opts) is None
    assert sharded_weights_refusal(CFG, quants) is None


def test_persistent_quants_of_sharded_weights_resolve_under_expert_parallelism():
    """The alignment check of the e4m3 shards builds the run's layout at a world its --expert-parallel divides
    (before, at world 1, EP 2 raised 'must divide the world size' and was reported as an FP8 alignment problem)."""
    from qtrain.plan.resolution import fp8_choice, persistent_quants
    for ep in (1, 2):
        opts = Options(model="x", from_scratch=True, batch_size=1, seq_len=16, zero_level=3, persistent_quants=True,
                       matmul_dtype="e4m3", model_dtype="bf16", fp8_policy="all", expert_parallel=ep)
        assert persistent_quants(CFG, opts, fp8_choice(CFG, opts)), ep
