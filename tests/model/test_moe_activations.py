"""The MoE blocks' saved-bytes statements (model/moe_block.py, olmoe/block.py) against what autograd keeps for one
block call, as tests/model/test_activations.py checks the dense families': eager exactly (within 16 bytes per layer,
0-dim tensors) for every recompute switch, bf16 / fp32 and e4m3, a routed and a dense layer, the three families and
OLMoE's clamp; compiled (AOTAutograd's min-cut partitioner, the one inductor uses; no kernels generated) within the
routing term, which the statements give as an upper bound (the partitioner may keep the bf16 logits instead of the
fp32 probabilities, depending on E and k), and exactly for OLMoE's attention with its clamp.

The block runs as in training: with its row of the router statistics and the router losses' gradients
(`RouterLosses.slot`), so the node that injects them is in the graph. Dropless routing: the tokens' spread over the
experts changes none of the sizes (the test's random router sends them unevenly).
"""
from __future__ import annotations

import pytest
import torch

from qtrain.model.activations import activation_terms
from qtrain.kernels.rope import rope_tables
from qtrain.model.matmul import block_linear
from qtrain.model.mixtral import MixtralConfig
from qtrain.model.moe_router import RouterLosses
from qtrain.model.olmoe import OlmoeConfig
from qtrain.model.qwen3_moe import Qwen3MoeConfig
from qtrain.model.recompute import block_steps, count_saved_bytes, resolve_flags
from qtrain.model.transformer import make_block_fn
from qtrain.model.weights import block_shapes

DT = {"bf16": torch.bfloat16, "fp32": torch.float32}
BASE = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            rope_theta=1e4)
CONFIGS = {
    "qwen3_moe": Qwen3MoeConfig(**BASE, head_dim=32, intermediate_size=96, moe_intermediate_size=40, num_experts=8,
                                num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=(1,)),
    "olmoe": OlmoeConfig(**BASE, intermediate_size=40, moe_intermediate_size=40, num_experts=8, num_experts_per_tok=2),
    "olmoe-clip": OlmoeConfig(**BASE, intermediate_size=40, moe_intermediate_size=40, num_experts=8,
                              num_experts_per_tok=2, clip_qkv=0.5),
    "mixtral": MixtralConfig(**BASE, intermediate_size=40, moe_intermediate_size=40, num_experts=4,
                             num_experts_per_tok=2),
}
FLAGS = [(), ("norm",), ("swiglu",), ("ffn",), ("qkv",), ("att",), ("norm", "swiglu"), ("att", "ffn")]


def measure(cfg, dtype: str, *, layer: int = 0, flags=(), fp8=False, compiled=False, B=2, T=32) -> tuple[int, int]:
    """(bytes one block call keeps for backward -- its input, weights, RoPE tables and router slot excluded --,
    tokens)."""
    fn = make_block_fn(cfg, block_linear("e4m3" if fp8 else ""), recompute=block_steps(flags), compiled=compiled)
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, dynamic=False, backend="aot_eager_decomp_partition")
    g = torch.Generator().manual_seed(0)
    w = {n: (0.1 * torch.randn(s, generator=g)).to(DT[dtype]).requires_grad_()
         for n, s in block_shapes(cfg, layer).items()}
    w.update(RouterLosses(cfg.router, B * T, torch.device("cpu"), z_loss=True).slot(layer))
    cos, sin = rope_tables(cfg, T, "cpu", DT[dtype])
    x = torch.randn(B, T, cfg.hidden_size, generator=g).to(DT[dtype]).requires_grad_()
    excluded = [x, cos, sin, *w.values()]
    if not compiled:
        with count_saved_bytes(exclude=excluded) as c:
            y = fn(x, w, cos, sin)
            return c.bytes, B * T
    fn(x, w, cos, sin).sum().backward()  # compile outside the measurement
    skip, seen = {t.untyped_storage().data_ptr() for t in excluded}, {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip and t.dtype != torch.uint8:  # uint8: checkpoint's RNG state
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(x, w, cos, sin)
    del y
    return sum(seen.values()), B * T


def planned(cfg, tokens: int, *, layer: int = 0, **kw) -> tuple[int, int]:
    """(the statements' bytes besides the input, the routing term's bytes)."""
    terms = activation_terms(cfg, layer=layer, **kw)
    routing = sum(t.nbytes(tokens) for t in terms if t.name == "moe_routing" and t.kept)
    return sum(t.nbytes(tokens) for t in terms if t.kept and t.name != "input"), routing


@pytest.mark.parametrize("name", list(CONFIGS))
def test_eager_terms_match_saved_tensors(name):
    cfg = CONFIGS[name]
    for dtype, fp8 in (("bf16", False), ("fp32", False), ("bf16", True)):
        for layer in ((0, 1) if cfg.dense_layers else (0,)):
            for flags in FLAGS:
                measured, tokens = measure(cfg, dtype, layer=layer, flags=flags, fp8=fp8)
                plan, _ = planned(cfg, tokens, layer=layer, model_dtype=dtype, matmul_dtype="e4m3" if fp8 else "",
                                  recompute=resolve_flags(flags))
                assert abs(plan - measured) <= 16, (dtype, fp8, layer, flags, plan, measured)


@pytest.mark.parametrize("name,flags", [("qwen3_moe", ("ffn",)), ("mixtral", ("norm",)), ("olmoe-clip", ())])
def test_compiled_terms_bound_what_the_partitioner_keeps(name, flags):
    """What the partitioner keeps is the statements' bytes less at most the routing term (its upper bound): qwen3_moe
    (renormalised top-k) measured 12 bytes per token below, Mixtral (E = 4) 16, OLMoE exact. (Every switch set of the
    eager test was measured this way for the four configs, bf16 and fp32 and e4m3; these three keep CI short.)"""
    cfg = CONFIGS[name]
    measured, tokens = measure(cfg, "bf16", flags=flags, compiled=True)
    plan, routing = planned(cfg, tokens, model_dtype="bf16", compiled=True, recompute=resolve_flags(flags))
    assert 0 <= plan - measured <= routing, (plan, measured, routing)
    if name.startswith("olmoe"):
        assert plan == measured


def test_the_routed_terms_scale_with_top_k_not_with_imbalance():
    """Per token, a routed layer keeps k copies' worth of expert activations and E-wide routing, whatever the spread:
    the statements have no term that depends on how tokens fall (a capacity-padded router would)."""
    cfg = CONFIGS["qwen3_moe"]
    names = {t.name: t for t in activation_terms(cfg, layer=0, model_dtype="bf16")}
    C, F, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    assert names["moe_up_in"].per_token == names["moe_down_out"].per_token == 2 * k * C
    assert names["moe_up_out"].per_token == 2 * k * 2 * F and names["moe_swiglu"].per_token == 2 * k * F
    assert names["moe_routing"].per_layer == 4 * cfg.num_experts
    dense = {t.name for t in activation_terms(cfg, layer=1, model_dtype="bf16")}
    assert "mlp_up" in dense and not any(n.startswith("moe_") for n in dense)
