"""--fp8-experts in the MoE layer (model/moe.py, model/moe_block.py; the GEMMs in kernels/grouped_gemm_fp8.py): the
routed layer with e4m3 expert GEMMs stays within e4m3's rounding of the model-dtype layer (output and every
gradient), an expert without tokens still gets an exact zero gradient, what a block keeps for backward is the
statements' e4m3 copies and row scales (eager, every recompute switch that touches the experts, bf16 / fp32, with
and without FP8 attention linears), and a Trainer micro-step runs with it on the CPU (the twin) and on the GPU
(`torch._scaled_grouped_mm`) with a loss within tolerance of the model-dtype run.

Tolerance of the layer (fp32 on the CPU, relative error in norm): one FP8 GEMM with both operands quantized is
within 2^-4 sqrt(2) of the exact one (tests/kernels/test_grouped_gemm_fp8.py says why); independent errors of a
chain of GEMMs add in quadrature, and the longest chain here is the input's gradient: the up and down forwards and
the down and up input gradients, four two-operand GEMMs, so 2^-4 sqrt(8) ~ 0.18 bounds every tensor (measured
at most ~0.06).
"""
from __future__ import annotations

import pytest
import torch

from tests.triton_interp import needs_cuda
from qtrain.kernels.rope import rope_tables
from qtrain.model.activations import activation_terms
from qtrain.model.matmul import block_linear
from qtrain.model.moe import EXPERTS_DOWN, EXPERTS_UP_GATE, moe_forward
from qtrain.model.moe_router import RouterLosses
from qtrain.model.qwen3_moe import Qwen3MoeConfig
from qtrain.model.recompute import block_steps, count_saved_bytes, resolve_flags
from qtrain.model.transformer import make_block_fn
from qtrain.model.weights import block_shapes

DT = {"bf16": torch.bfloat16, "fp32": torch.float32}
CFG = Qwen3MoeConfig(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     max_position_embeddings=128, rope_theta=1e4, num_experts=8, num_experts_per_tok=3,
                     norm_topk_prob=True, mlp_only_layers=(1,))
CHAIN = 2.0**-4 * 8**0.5  # module docstring


def _layer(seed=0, N=96, E=8, C=64, F=32, skew=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, C, generator=g)
    router = torch.randn(E, C, generator=g) / C**0.5
    if skew:  # a constant feature that experts 0 and 5 weigh -100: they never win a token (exactly zero gradients)
        h[:, 0] = 1.0
        router[:, 0] = 0.0
        router[0, 0] = router[5, 0] = -100.0
    up = torch.randn(E, 2 * F, C, generator=g) / C**0.5
    down = torch.randn(E, C, F, generator=g) / F**0.5
    dy = torch.randn(N, C, generator=g)
    return h, router, up, down, dy


def _run(fp8: bool, h, router, up, down, dy):
    leaves = [t.clone().requires_grad_(True) for t in (h, router, up, down)]
    out = moe_forward(leaves[0], leaves[1], leaves[2], leaves[3], top_k=3, norm_topk_prob=True, fp8=fp8)
    out.out.backward(dy)
    return out, [out.out.detach(), *(t.grad for t in leaves)]


def _rel(got, want):
    return ((got - want).norm() / want.norm()).item()


def test_fp8_layer_within_e4m3_rounding_of_the_model_dtype_layer():
    data = _layer()
    _, ref = _run(False, *data)
    out, got = _run(True, *data)
    names = ["out", "d(input)", "d(router)", f"d({EXPERTS_UP_GATE})", f"d({EXPERTS_DOWN})"]
    errors = {n: _rel(g, r) for n, g, r in zip(names, got, ref)}
    assert all(e < CHAIN for e in errors.values()), errors
    assert all(e > 0 for e in errors.values()), errors  # the FP8 path ran (the twin differs from the exact GEMMs)
    counts = out.plan.counts.tolist()
    assert counts[0] == counts[5] == 0
    for e in (0, 5):  # experts without a token: exact zeros, and nothing anywhere is NaN
        assert not got[3][e].any() and not got[4][e].any()
    assert all(torch.isfinite(t).all() for t in got)


def _measure(dtype: str, *, flags=(), fp8_linears=False, B=2, T=32) -> tuple[int, int]:
    """(bytes one routed block call keeps for backward, its input, weights, RoPE tables and router slot excluded,
    tokens), as tests/model/test_moe_activations.py measures them, with --fp8-experts."""
    fn = make_block_fn(CFG, block_linear("e4m3" if fp8_linears else ""), recompute=block_steps(flags),
                       fp8_experts=True)
    g = torch.Generator().manual_seed(0)
    w = {n: (0.1 * torch.randn(s, generator=g)).to(DT[dtype]).requires_grad_()
         for n, s in block_shapes(CFG, 0).items()}
    w.update(RouterLosses(CFG.router, B * T, torch.device("cpu"), z_loss=True).slot(0))
    cos, sin = rope_tables(CFG, T, "cpu", DT[dtype])
    x = torch.randn(B, T, CFG.hidden_size, generator=g).to(DT[dtype]).requires_grad_()
    with count_saved_bytes(exclude=[x, cos, sin, *w.values()]) as c:
        fn(x, w, cos, sin)
        return c.bytes, B * T


@pytest.mark.parametrize("dtype,fp8_linears", [("bf16", False), ("fp32", False), ("bf16", True)])
def test_saved_bytes_are_the_statements_e4m3_copies(dtype, fp8_linears):
    """Eager, within 16 bytes per layer (0-dim tensors), for the switches that drop the experts' inputs or not."""
    for flags in [(), ("swiglu",), ("ffn",), ("norm",), ("att", "ffn")]:
        measured, tokens = _measure(dtype, flags=flags, fp8_linears=fp8_linears)
        terms = activation_terms(CFG, layer=0, model_dtype=dtype, matmul_dtype="e4m3" if fp8_linears else "",
                                 recompute=resolve_flags(flags), fp8_experts=True)
        plan = sum(t.nbytes(tokens) for t in terms if t.kept and t.name != "input")
        assert abs(plan - measured) <= 16, (dtype, fp8_linears, flags, plan, measured)
    k, C, F = CFG.num_experts_per_tok, CFG.hidden_size, CFG.moe_intermediate_size
    by_name = {t.name: t for t in activation_terms(CFG, layer=0, model_dtype=dtype, fp8_experts=True)}
    assert by_name["moe_up_in"].per_token == k * (C + 4) and by_name["moe_swiglu"].per_token == k * (F + 4)


def test_the_run_plan_counts_the_e4m3_copies():
    """--fp8-experts reaches the run's memory plan (plan/memory.py): its activation row is, per routed layer and
    token, the two expert inputs' model-dtype bytes less their e4m3 copies and row scales smaller (eager, bf16)."""
    from qtrain.options import Options
    from qtrain.plan.resolution import plan_memory
    B, T = 2, 64
    acts = {on: plan_memory(CFG, Options(model="m", batch_size=B, seq_len=T, matmul_dtype="e4m3", fp8_policy="all",
                                         fp8_experts=on), device="cpu", compiled=False).item("activations").device
            for on in (False, True)}
    k, C, F, routed = CFG.num_experts_per_tok, CFG.hidden_size, CFG.moe_intermediate_size, 1  # layer 1 is dense
    assert acts[False] - acts[True] == routed * B * T * k * (2 * (C + F) - (C + 4) - (F + 4))


def test_compiled_block_keeps_no_weight_copy_and_what_the_statements_say():
    """torch.compile (AOTAutograd's min-cut partitioner, the one inductor uses; no kernels generated): the block keeps
    the statements' bytes (the routing term exact here) -- the up GEMM's e4m3 input and scales, the down GEMM's
    rebuilt from the up/gate output -- and no e4m3 copy of an expert weight (`grouped_gemm_fp8._after`: without it
    the partitioner moved the input gradient's weight quantization into the forward and kept its result)."""
    B, T = 2, 32
    torch._dynamo.reset()
    fn = torch.compile(make_block_fn(CFG, block_linear(""), compiled=True, fp8_experts=True), dynamic=False,
                       backend="aot_eager_decomp_partition")
    g = torch.Generator().manual_seed(0)
    w = {n: (0.1 * torch.randn(s, generator=g)).to(torch.bfloat16).requires_grad_()
         for n, s in block_shapes(CFG, 0).items()}
    w.update(RouterLosses(CFG.router, B * T, torch.device("cpu"), z_loss=True).slot(0))
    cos, sin = rope_tables(CFG, T, "cpu", torch.bfloat16)
    x = torch.randn(B, T, CFG.hidden_size, generator=g).to(torch.bfloat16).requires_grad_()
    fn(x, w, cos, sin).sum().backward()  # compile outside the measurement
    excluded = [x, cos, sin, *w.values()]
    skip, seen = {t.untyped_storage().data_ptr() for t in excluded}, {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip and t.dtype != torch.uint8:
            seen[t.untyped_storage().data_ptr()] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x, w, cos, sin)
    e4m3 = [tuple(t.shape) for t in seen.values() if t.dtype == torch.float8_e4m3fn]
    assert e4m3 == [(B * T * CFG.num_experts_per_tok, CFG.hidden_size)], e4m3  # the up GEMM's input, nothing else
    measured = sum(t.untyped_storage().nbytes() for t in seen.values())
    terms = activation_terms(CFG, layer=0, model_dtype="bf16", compiled=True, fp8_experts=True)
    assert sum(t.nbytes(B * T) for t in terms if t.kept and t.name != "input") == measured


def _trainer(device: str, tmp_path, fp8_experts: bool, dtype: str = "bf16"):
    from qtrain.options import Options
    from qtrain.parallel.dist import DistContext
    from qtrain.train.trainer import Trainer
    from tests.dist_utils import write_model_dir
    opts = Options(model=write_model_dir(tmp_path, CFG), from_scratch=True, device=device, compile="off",
                   model_dtype=dtype, matmul_dtype="e4m3", fp8_policy="all", fp8_experts=fp8_experts,
                   batch_size=2, seq_len=32, grad_accumulation=1, seed=1)
    return Trainer(opts, DistContext(rank=0, world=1, local_rank=0, device=torch.device(device)))


def _first_losses(device: str, tmp_path, fp8_experts: bool, steps: int = 2, dtype: str = "bf16") -> list[float]:
    from tests.dist_utils import random_batch
    d = tmp_path / ("fp8" if fp8_experts else "plain")
    d.mkdir()
    tr = _trainer(device, d, fp8_experts, dtype)
    return [float(tr.step([random_batch(CFG.vocab_size, 2, 32, s, 0, 0)], lr=1e-3)["loss"]) for s in range(steps)]


def test_trainer_micro_step_with_fp8_experts_on_the_cpu(tmp_path):
    """The CPU runs the twin: two steps' losses (the same initial weights and batches) are within e4m3's rounding of
    the run without (a loss of ~ln(96) = 4.6 from random init; the routed layer's output is within 2^-4 sqrt(8) of
    itself, a residual branch among others, so the loss moves by far less: 1%)."""
    plain = _first_losses("cpu", tmp_path, False, dtype="fp32")
    fp8 = _first_losses("cpu", tmp_path, True, dtype="fp32")
    assert fp8 == pytest.approx(plain, rel=0.01) and fp8 != plain, (fp8, plain)


@pytest.mark.gpu
@needs_cuda
def test_gpu_training_step_with_fp8_experts_is_close_to_bf16(tmp_path):
    """Two tiny qwen3_moe steps on the GPU with the experts through torch._scaled_grouped_mm: losses within 1% of the
    same steps with the experts in bf16 (both with the attention linears in e4m3), and finite."""
    plain = _first_losses("cuda", tmp_path, False)
    fp8 = _first_losses("cuda", tmp_path, True)
    assert all(torch.isfinite(torch.tensor(fp8))) and fp8 == pytest.approx(plain, rel=0.01), (fp8, plain)
