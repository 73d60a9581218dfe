"""MFU of a Mixture-of-Experts counts the FLOPs a token runs: per routed layer the router, the k of E experts it is
routed to and any shared expert, not every expert the model stores (which made the logged MFU ~5x too high for
Qwen3-30B-A3B). The expected counts are written out from the config here, not taken from the families' statements."""
from __future__ import annotations

import pytest

from qtrain.model.qwen3_moe.config import Qwen3MoeConfig
from qtrain.model.registry import preset
from qtrain.model.weights import num_params
from qtrain.observe.metrics import model_flops_per_token


def tiny_qwen3_moe(top_k: int = 3) -> Qwen3MoeConfig:
    """3 layers, layer 1 dense (mlp_only_layers): both kinds of layer; untied, so the LM head is its own matrix."""
    return Qwen3MoeConfig(vocab_size=100, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, intermediate_size=48, moe_intermediate_size=24,
                          num_experts=8, num_experts_per_tok=top_k, mlp_only_layers=(1,), tie_word_embeddings=False)


def by_hand(top_k: int, seq: int) -> int:
    """6 x the parameters a token runs + the causal attention term, from tiny_qwen3_moe's numbers."""
    V, C, L, F, Fd, E, hd = 100, 32, 3, 24, 48, 8, 16
    q_dim, kv_dim = 4 * hd, 2 * hd
    attention_linears = C * (q_dim + 2 * kv_dim) + q_dim * C  # fused qkv, o
    norms = 2 * C + 2 * hd  # input and post-attention RMSNorm, Qwen3's per-head q/k norms
    routed = attention_linears + norms + E * C + top_k * 3 * C * F  # router + top_k SwiGLU experts (up, gate, down)
    dense = attention_linears + norms + 3 * C * Fd
    active = 2 * routed + dense + C + V * C  # final norm, LM head (the input embedding is a lookup, no FLOPs)
    return 6 * active + 6 * L * q_dim * seq  # attention: 3 x (QK^T + PV over seq / 2 keys) = 6 q_dim T per layer


def test_tiny_qwen3_moe_counts_the_routed_experts_only():
    cfg = tiny_qwen3_moe(top_k=3)
    assert model_flops_per_token(cfg, 64) == by_hand(3, 64)
    # dense-equivalent: k = E runs every expert, the count of every parameter but the embedding
    every = tiny_qwen3_moe(top_k=8)
    assert model_flops_per_token(every, 64) == by_hand(8, 64)
    assert model_flops_per_token(every, 64) == 6 * num_params(every, include_embedding=False) + 6 * 3 * 64 * 64
    assert model_flops_per_token(every, 64) - model_flops_per_token(cfg, 64) == 6 * 2 * (8 - 3) * 3 * 32 * 24


@pytest.mark.parametrize("name", ["Qwen3-30B-A3B", "OLMoE-1B-7B", "Mixtral-8x7B-v0.1", "Qwen3.5-35B-A3B",
                                  "Qwen3-Next-80B-A3B"])
def test_presets_leave_out_the_idle_experts(name):
    """Every MoE family: k of E experts in each routed layer (cfg.router), everything else (router, shared expert,
    dense layers, linear attention) as counted for a dense model."""
    cfg = preset(name)
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    idle = len(cfg.router.layers) * (E - k) * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    every = cfg.replace(num_experts_per_tok=E)
    assert model_flops_per_token(cfg, 1024) == model_flops_per_token(every, 1024) - 6 * idle
    assert model_flops_per_token(cfg, 1024) < model_flops_per_token(every, 1024) / 3  # ~3B active of 30-80B, 1B of 7B


def test_active_parameters_of_known_models():
    """The count's active parameters plus the input embedding are the model cards' active sizes (given to 2-3
    digits: within 3%): OLMoE-1B-7B 1.3B of 6.9B, Qwen3-30B-A3B 3.3B of 30.5B, Mixtral-8x7B 12.9B of 46.7B."""
    for name, published in (("OLMoE-1B-7B", 1.3e9), ("Qwen3-30B-A3B", 3.3e9), ("Mixtral-8x7B-v0.1", 12.9e9)):
        cfg = preset(name)
        attention = 6 * cfg.num_hidden_layers * cfg.q_dim * 1024
        active = (model_flops_per_token(cfg, 1024) - attention) / 6 + cfg.vocab_size * cfg.hidden_size
        assert active == pytest.approx(published, rel=0.03), name
