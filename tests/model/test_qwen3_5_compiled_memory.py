"""The compiled Qwen3.5 block's statements (qtrain/model/qwen3_5/compiled_memory.py) against what one torch.compile'd
block call saves for backward: saved-tensor hooks around the call, through AOTAutograd's min-cut partitioner
(backend aot_eager_decomp_partition, the partitioner inductor uses, without generating kernels), as
tests/model/test_activations.py measures the Llama family's compiled blocks. The GPU's path is forced on the CPU:
the delta rule as its op pair (its inside stays the twin), the convolution traced as its twin (as
`kernels.dispatch.use_triton` decides while compiling), the SwiGLU with its backward kernel (`swiglu="kernel"`, what
compiled blocks run). Exact (0-dim tensors aside: none here), at a multiple of the delta rule's chunk.

Before: the plan stated the eager op path for compiled blocks; at Qwen3.5-4B's shapes with --recompute-att a
linear-attention layer was stated at 173188 bytes a token and keeps 79172, a full-attention one 115716 against 78852
(the plan's 20.03 GiB of activations at 4096 tokens is 10.3 GiB).
"""
from __future__ import annotations

import pytest
import torch

from qtrain.kernels.delta_rule import CHUNK, causal_conv1d_silu_twin
from qtrain.kernels.rope import rope_tables
from qtrain.model.activations import activation_terms
from qtrain.model.init import init_params
from qtrain.model.matmul import block_linear, block_mlp
from qtrain.model.recompute import block_steps, resolve_flags
from qtrain.model.transformer import allocate_params, make_block_fn
from tests.model.family_fixtures import qwen35_cfg

DT = {"bf16": torch.bfloat16, "fp32": torch.float32}
B, T = 2, 2 * CHUNK
LAYERS = ("linear_attention", "full_attention")
# head dims the Triton delta rule serves (kernels.delta_rule.TRITON_HEAD_DIM_MIN): the op path
HEADS = {"linear_key_head_dim": 32, "linear_value_head_dim": 32}
ALL_SETS = [(), ("norm",), ("swiglu",), ("ffn",), ("qkv",), ("att",), ("norm", "swiglu"), ("qkv", "ffn"),
            ("att", "ffn"), ("norm", "qkv")]  # --recompute-block: the loop reruns the block, which keeps its input


@pytest.fixture
def gpu_path(monkeypatch):
    """The delta rule through its op pair, the convolution as its twin: what a compiled block runs on CUDA."""
    monkeypatch.setattr("qtrain.kernels.delta_rule.use_triton", lambda t: True)
    monkeypatch.setattr("qtrain.model.qwen3_5.linear_attention.causal_conv1d_silu", causal_conv1d_silu_twin)


def saved_by_compiled_block(cfg, layer: int, dtype: str, flags: tuple[str, ...], fp8: bool = False,
                            keep_transposes: bool = False) -> int:
    """Bytes one compiled call of layer `layer` saves for backward (its input, weights and RoPE tables excluded);
    `fp8`: the block linears in e4m3 and the MLP as one FP8 Function, as the Transformer builds them."""
    mm = "e4m3" if fp8 else ""
    fn = make_block_fn(cfg, block_linear(mm, keep_transposes=keep_transposes), recompute=block_steps(flags),
                       compiled=True, swiglu="kernel", rope="kernel",
                       mlp=block_mlp(mm, keep_transposes=keep_transposes))
    torch._dynamo.reset()
    fn = torch.compile(fn, dynamic=False, backend="aot_eager_decomp_partition")
    params = allocate_params(cfg, dtype=DT[dtype], device="cpu")
    init_params(cfg, params)
    w = {k.split(".", 2)[2]: v.requires_grad_() for k, v in params.items() if k.startswith(f"layers.{layer}.")}
    cos, sin = rope_tables(cfg, T, "cpu", DT[dtype])
    x = torch.randn(B, T, cfg.hidden_size, dtype=DT[dtype], requires_grad=True)
    fn(x, w, cos, sin).float().sum().backward()  # compile outside the measurement
    skip = {t.untyped_storage().data_ptr() for t in (x, cos, sin, *w.values())}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        p = t.untyped_storage().data_ptr()
        if p not in skip and t.dtype != torch.uint8:  # uint8: checkpoint's CPU RNG state (host memory)
            seen[p] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x, w, cos, sin)
    return sum(seen.values())


def stated(cfg, layer: int, dtype: str, flags: tuple[str, ...], fp8: bool = False,
           keep_transposes: bool = False) -> int:
    terms = activation_terms(cfg, layer=layer, model_dtype=dtype, compiled=True, recompute=resolve_flags(flags),
                             seq_len=T, delta_rule_kernels=True, matmul_dtype="e4m3" if fp8 else "",
                             fp8_keep_transposes=keep_transposes)
    return sum(t.nbytes(B * T) for t in terms if t.kept and t.name != "input")


def check(cfg, dtype: str, sets, layers: tuple[int, ...] = (0, 1), **fp8) -> None:
    """Exact; with FP8 up to 16 bytes a layer (0-dim scales and abs-maxes, stated as 8 a weight, as the Llama
    family's)."""
    for flags in sets:
        for layer in layers:
            measured = saved_by_compiled_block(cfg, layer, dtype, flags, **fp8)
            diff = stated(cfg, layer, dtype, flags, **fp8) - measured
            assert abs(diff) <= (16 if fp8 else 0), (LAYERS[layer], flags, diff, measured / (B * T))


@pytest.mark.parametrize("dtype,sets", [("bf16", [(), ("qkv",), ("att",), ("norm", "swiglu")]),
                                        ("fp32", [(), ("att",)])])
def test_compiled_statements_hold_what_the_partitioner_keeps(gpu_path, dtype, sets):
    """Both layer kinds; switch sets that move different terms (CI time: each compiles a block; every set, and
    the MoE variant's, in the slow test below)."""
    check(qwen35_cfg(**HEADS, num_hidden_layers=2, layer_types=LAYERS), dtype, sets)


def test_compiled_statements_moe_and_as_many_key_heads(gpu_path):
    """The MoE variant's linear-attention layer (routed experts + shared expert), and key heads as many as value
    heads (q and k not repeated)."""
    check(qwen35_cfg(moe=True, **HEADS, num_hidden_layers=2, layer_types=LAYERS), "bf16", [()], layers=(0,))
    check(qwen35_cfg(**HEADS, num_hidden_layers=2, layer_types=LAYERS, linear_num_key_heads=4), "bf16", [()],
          layers=(0,))


def test_compiled_moe_recompute_switches_drop_what_their_steps_keep(gpu_path):
    """--recompute-swiglu and --recompute-ffn on a compiled MoE layer: the statements (compiled_memory.moe_terms)
    exact, and what the MLP steps drop worked out by hand per token (bf16, E = 2 bytes an element; k = 2 experts of
    F = 16, a shared expert of Fs = 40, C = 64: 2F != C tells the experts' input from their up/gate output):
    'swiglu' both SwiGLU outputs (k F + Fs); 'ffn' those, the experts' permuted input (k C) and the shared expert's
    up/gate output (2 Fs), and RMSNorm-2's rstd (4 bytes, LN2 rerun). The experts' up/gate output (2 k F) stays: the
    partitioner keeps the grouped GEMM's output rather than rerun it. Before: the MoE MLP took no step, so both kept
    everything."""
    cfg = qwen35_cfg(moe=True, **HEADS, num_hidden_layers=2, layer_types=LAYERS, moe_intermediate_size=16,
                     shared_expert_intermediate_size=40)
    kept = {f: saved_by_compiled_block(cfg, 0, "bf16", f) for f in [(), ("swiglu",), ("ffn",)]}
    for f, n in kept.items():
        assert stated(cfg, 0, "bf16", f) - n == 0, (f, n / (B * T))
    kept = {f: n / (B * T) for f, n in kept.items()}
    E, k, C, F, Fs = 2, 2, 64, 16, 40
    assert kept[()] - kept[("swiglu",)] == E * (k * F + Fs)
    assert kept[()] - kept[("ffn",)] == E * (k * F + Fs) + E * (k * C + 2 * Fs) + 4


# FP8 GEMMs need dimensions in multiples of 16: 8 value heads make the projection 784 wide
FP8_CFG = dict(**HEADS, linear_num_value_heads=8, linear_num_key_heads=4, num_hidden_layers=2, layer_types=LAYERS)


@pytest.mark.parametrize("keep_transposes", [False, pytest.param(True, marks=pytest.mark.slow)])  # CI: one (~10 s)
def test_compiled_statements_fp8(gpu_path, keep_transposes):
    """e4m3 block linears: the e4m3 copies of the norms' outputs (and so the outputs) are rebuilt, the full-attention
    gated output's too, unless --fp8-keep-transposes keeps them; the weights' e4m3 copies are kept per layer."""
    sets = [(), ("att", "ffn")] if keep_transposes else [("qkv",), ("swiglu",)]
    check(qwen35_cfg(**FP8_CFG), "bf16", sets, fp8=True, keep_transposes=keep_transposes)


@pytest.mark.slow
@pytest.mark.parametrize("keep_transposes", [False, True])
def test_compiled_statements_fp8_every_switch(gpu_path, keep_transposes):
    check(qwen35_cfg(**FP8_CFG), "bf16", ALL_SETS, fp8=True, keep_transposes=keep_transposes)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("moe", [False, True])
def test_compiled_statements_every_switch(gpu_path, dtype, moe):
    check(qwen35_cfg(moe=moe, **HEADS, num_hidden_layers=2, layer_types=LAYERS), dtype, ALL_SETS)


def test_plan_states_compiled_blocks_below_eager_ones():
    """The compiled statements replace the eager op path's only where they hold (compiled_memory.states), and state
    less: at Qwen3.5-4B's shapes with --recompute-att (the measured H100 run) 79172 bytes a token for a
    linear-attention layer and 78852 for a full-attention one, besides the block input."""
    from qtrain.model.registry import preset

    cfg = preset("Qwen3.5-4B")
    kw = dict(model_dtype="bf16", recompute=resolve_flags({"att"}), seq_len=4096, delta_rule_kernels=True)

    def per_token(layer: int, **extra) -> int:
        return sum(t.per_token for t in activation_terms(cfg, layer=layer, **kw, **extra)
                   if t.kept and t.name != "input")

    assert (per_token(0, compiled=True), per_token(3, compiled=True)) == (79172, 78852)
    assert per_token(0) > per_token(0, compiled=True) and per_token(3) > per_token(3, compiled=True)
    # --document-masking keeps the eager statements (not measured compiled)
    assert per_token(0, compiled=True, documents=True) == per_token(0, documents=True)
