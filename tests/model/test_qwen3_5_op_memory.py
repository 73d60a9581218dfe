"""The memory plan's statements of a Qwen3.5 linear-attention layer on the GPU path (`ActivationSettings.
delta_rule_kernels`): on CUDA the convolution and the delta rule run as op pairs (kernels/delta_rule:
causal_conv1d_silu_op, gated_delta_rule_op.chunk_core_op) that keep their inputs only and recompute the rest in
backward, so the layer keeps the op pairs' inputs and the preparation's own saved tensors, not the twins' chunk
buffers. On the CPU the op pairs run their twins inside (the same custom ops, the same saving), so forcing the op path
here (the dispatch decision of `kernels.delta_rule`, nothing else) checks the statements exactly, as
tests/plan/test_lora_activations.py checks the twins' (what the graph holds after one block forward, weights, input
and RoPE tables excluded; 16 bytes of 0-dim scalars a layer). The GPU test compares them with the CUDA allocator.

Before: the plan stated the twins' chunk buffers for every run; at the tiny config (H = 4, dk = dv = 16, T = 128) a
bf16 linear-attention layer (full fine-tune) was stated at 13494 bytes a token where the op path keeps 5010 (the delta
rule alone: 9168 against 1344, a layer's (C, C) mask besides).
"""
from __future__ import annotations

import pytest
import torch

from qtrain.kernels import dispatch
from qtrain.kernels.delta_rule import op_pairs_on
from qtrain.kernels.delta_rule.gated_delta_rule_op import chunk_core_op
from qtrain.kernels.document_attention import document_mask
from qtrain.kernels.rope import rope_tables
from qtrain.model.activations import activation_memory, activation_terms
from qtrain.model.init import init_params
from qtrain.model.transformer import allocate_params, make_block_fn
from tests.model.family_fixtures import qwen35_cfg

# head dims the Triton delta rule serves (kernels.delta_rule.TRITON_HEAD_DIM_MIN: smaller heads run the twin)
HEADS = {"linear_key_head_dim": 32, "linear_value_head_dim": 32}
from tests.plan.test_lora_activations import kept_after_forward

DT = {"bf16": torch.bfloat16, "fp32": torch.float32}
B, T = 2, 128  # two delta-rule chunks a sequence


@pytest.fixture
def op_path(monkeypatch):
    """The model's convolution and delta rule through their op pairs, as on CUDA (their insides stay the twins)."""
    monkeypatch.setattr("qtrain.kernels.delta_rule.use_triton", lambda t: True)


def stated(cfg, layer: int, dtype: str, *, frozen: bool, documents: bool, kernels: bool = True,
           shape: tuple[int, int] = (B, T)) -> int:
    """Layer `layer`'s statements for `shape` (B, T) tokens, its input aside."""
    terms = activation_terms(cfg, layer=layer, model_dtype=dtype, seq_len=shape[1], documents=documents,
                             frozen_base=frozen, delta_rule_kernels=kernels)
    return sum(t.nbytes(shape[0] * shape[1]) for t in terms if t.kept and t.name != "input")


def block_inputs(cfg, dtype: str, frozen: bool, device: str = "cpu", shape: tuple[int, int] = (B, T)):
    """Layer 0's weights (learning unless `frozen`), an input and the RoPE tables."""
    params = allocate_params(cfg, dtype=DT[dtype], device=device)
    init_params(cfg, params)
    w = {k.split(".", 2)[2]: v.requires_grad_(not frozen) for k, v in params.items() if k.startswith("layers.0.")}
    cos, sin = rope_tables(cfg, shape[1], device, DT[dtype])
    x = torch.randn(*shape, cfg.hidden_size, dtype=DT[dtype], device=device, requires_grad=True)
    return x, w, cos, sin


def test_op_pair_keeps_its_inputs_only():
    """What autograd saves around `chunk_core_op` is its inputs themselves (the same tensors), nothing computed."""
    g = torch.Generator().manual_seed(0)
    n, C, H, dk, dv = 2, 64, 2, 16, 16
    q, k = (torch.randn(B, H, n, C, dk, generator=g).requires_grad_() for _ in range(2))
    v = torch.randn(B, H, n, C, dv, generator=g).requires_grad_()
    gate = (-torch.rand(B, H, n, C, generator=g)).requires_grad_()
    beta = torch.rand(B, H, n, C, generator=g).requires_grad_()
    d = torch.zeros(B, 1, n, C, dtype=torch.long)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        o, _ = chunk_core_op(q, k, v, gate, beta, d, None)
    assert len(saved) == 6 and all(a is b for a, b in zip(saved, (q, k, v, gate, beta, d)))
    o.sum().backward()
    assert all(t.grad is not None for t in (q, k, v, gate, beta))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("heads", [2, 4])  # key heads: fewer than the 4 value heads (repeated), or as many
def test_statements_hold_what_the_op_path_keeps(op_path, dtype, frozen, heads):
    """A full fine-tune and a frozen base (LoRA's, no adapters), fp32 and bf16, with and without documents."""
    cfg = qwen35_cfg(**HEADS, num_hidden_layers=2, layer_types=("linear_attention", "full_attention"),
                     linear_num_key_heads=heads)
    fn = make_block_fn(cfg)
    positions = torch.cat([torch.arange(50), torch.arange(78)]).repeat(B, 1)  # two documents a row
    for docs in (None, document_mask(positions, kind="varlen")):
        x, w, cos, sin = block_inputs(cfg, dtype, frozen)
        kept = kept_after_forward(lambda x, w, cos, sin: fn(x, w, cos, sin, docs), x, w, cos, sin)
        assert abs(kept - stated(cfg, 0, dtype, frozen=frozen, documents=docs is not None)) <= 16, docs


def test_plan_states_the_path_of_the_device(monkeypatch):
    """The plan takes the op path where the run does (`op_pairs_on`: CUDA with Triton, not forced to the twins):
    the same options planned for CUDA keep, per linear-attention layer, the twins' statements less the op path's."""
    from qtrain.options import Options
    from qtrain.plan.resolution import plan_memory

    monkeypatch.setattr(dispatch, "HAS_TRITON", True)  # what a CUDA machine has; nothing is launched here
    cfg = qwen35_cfg(**HEADS, num_hidden_layers=4)  # three linear-attention layers, one full-attention
    o = Options(model="x", batch_size=B, seq_len=T, model_dtype="bf16")
    assert op_pairs_on("cuda") and not op_pairs_on("cpu")

    def acts(device: str) -> int:
        return plan_memory(cfg, o, device=device, compiled=False).item("activations").device

    linear = sum(cfg.is_linear(i) for i in range(cfg.num_hidden_layers))
    twin, ops = (stated(cfg, 0, "bf16", frozen=False, documents=False, kernels=k) for k in (False, True))
    assert acts("cpu") - acts("cuda") == linear * (twin - ops) > 0
    with dispatch.backend("twin"):
        assert acts("cuda") == acts("cpu")
    N = B * T
    assert activation_memory(cfg, N, model_dtype="bf16", seq_len=T, delta_rule_kernels=True).blocks < \
        activation_memory(cfg, N, model_dtype="bf16", seq_len=T).blocks


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_op_path_statements_against_the_cuda_allocator(dtype):
    """On CUDA (the Triton op pairs, eager): the bytes the allocator holds after a linear-attention block's forward,
    less its output, against the statements of the path `op_pairs_on('cuda')` names. A first forward and backward
    first, so cuBLAS's workspace and Triton's compiled kernels are in place; tolerance: 2% (the allocator rounds each
    block to 512 bytes; 8192 tokens keep about 30 MB)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    assert op_pairs_on("cuda")
    shape = (4, 2048)
    cfg = qwen35_cfg(**HEADS, num_hidden_layers=2, layer_types=("linear_attention", "full_attention"),
                     max_position_embeddings=shape[1])
    fn = make_block_fn(cfg)
    x, w, cos, sin = block_inputs(cfg, dtype, frozen=False, device="cuda", shape=shape)
    fn(x, w, cos, sin).float().sum().backward()
    x.grad = None
    for p in w.values():
        p.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = fn(x, w, cos, sin)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before - y.untyped_storage().nbytes()
    expected = stated(cfg, 0, dtype, frozen=False, documents=False, shape=shape)
    assert abs(kept - expected) <= 0.02 * expected, (kept, expected)
