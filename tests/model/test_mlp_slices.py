"""--mlp-chunks: the MLP over token slices, each a checkpoint rerun in backward, computes what the unsliced block
computes (fp32, CPU), through the whole model with the recompute settings and with documents; e4m3 within FP8's own
error; the families without slices refuse it; the plan's workspace shrinks with the slices and bounds a real
micro-step (the per-layer terms: tests/model/test_activations.py).

Tolerance: the block output is the same per-token arithmetic in either layout (equal bit for bit here); a weight
gradient is a sum over the tokens, one GEMM unsliced and one per slice added by autograd, so the two differ by fp32
rounding of regrouped sums: per tensor an error norm below 1e-5 of the gradient's norm (observed ~1e-7), as the
document-masking tests allow for the same regrouping.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from qtrain.model.registry import preset
from qtrain.model.transformer import RunOptions, Transformer
from qtrain.options import Options, OptionsError
from qtrain.parallel.weights.replicated import ParamWeights
from qtrain.plan.fit import activation_rungs, mlp_chunks
from qtrain.plan.resolution import check_cuda_graphs, check_model_support, plan_memory
from qtrain.plan.step_cost import recompute_flops_per_token
from tests.model.family_fixtures import Collect
from tests.model.test_document_masking import packed_batch, params_of
from tests.model.test_transformer import tiny_cfg
from tests.plan.test_memory import measure_micro_step


def _run(cfg, params, run: RunOptions, inputs, targets, positions=None):
    sink = Collect()
    loss = Transformer(cfg, run).forward_backward(ParamWeights(cfg, params), inputs, targets, grads=sink,
                                                  loss_scale=1.0, positions=positions)
    return loss, sink.grads


def _assert_close(a, b, rel=1e-5):
    (la, ga), (lb, gb) = a, b
    assert torch.allclose(la, lb, rtol=1e-6, atol=0), (la, lb)
    assert ga.keys() == gb.keys()
    for k in ga:
        err = (ga[k] - gb[k]).norm().item()
        assert err <= rel * gb[k].norm().item(), f"{k}: error norm {err:.3e} of {gb[k].norm().item():.3e}"


@pytest.mark.parametrize("model_type,recompute", [("qwen2", ()), ("qwen3", ("block",)), ("llama", ("att", "ffn"))])
def test_sliced_mlp_trains_as_the_unsliced_block(model_type, recompute):
    """Loss and every gradient of a micro-step; slices of unequal size (3 over 64 tokens) and a run of documents."""
    cfg = tiny_cfg(model_type, tied=model_type == "qwen2")
    params = params_of(cfg)
    inputs, targets, positions, _ = packed_batch(cfg.vocab_size)
    for pos in (None, positions):
        whole = _run(cfg, params, RunOptions(recompute=frozenset(recompute)), inputs, targets, pos)
        sliced = _run(cfg, params, RunOptions(recompute=frozenset(recompute), mlp_chunks=3), inputs, targets, pos)
        _assert_close(sliced, whole)


def test_sliced_e4m3_mlp_stays_within_fp8_error():
    """In e4m3 each slice scales its own FP8 operands, so the numbers differ from the unsliced block's by FP8 rounding,
    not more: gradient cosines above 0.99 (e4m3's 3-bit mantissa: the FP8 tests' bound for whole blocks)."""
    cfg = tiny_cfg("qwen2", tied=True)
    params = params_of(cfg)
    inputs, targets, _, _ = packed_batch(cfg.vocab_size)
    (la, ga), (lb, gb) = (_run(cfg, params, RunOptions(matmul_dtype="e4m3", mlp_chunks=n), inputs, targets)
                          for n in (1, 2))
    assert abs(la.item() - lb.item()) <= 2e-2 * abs(lb.item())
    for k in gb:
        c = torch.nn.functional.cosine_similarity(ga[k].flatten().double(), gb[k].flatten().double(), dim=0).item()
        assert c > 0.99, (k, c)


def test_families_without_slices_refuse_it():
    """An MoE block records its router statistics per call: one line before the model is built, and the block
    function refuses it too for a caller that skips the options (Qwen3.5's likewise)."""
    cfg = dataclasses.replace(preset("Qwen3-30B-A3B"), num_hidden_layers=2)
    with pytest.raises(OptionsError, match="--mlp-chunks 2: model_type 'qwen3_moe' is not supported"):
        check_model_support(cfg, Options(mlp_chunks=2), device_type="cpu")
    with pytest.raises(ValueError, match="mlp_chunks 2"):
        Transformer(cfg, RunOptions(mlp_chunks=2))


def test_option_checks():
    with pytest.raises(OptionsError, match="--mlp-chunks=3 must divide the tokens of a micro-batch on one rank"):
        Options(batch_size=2, seq_len=64, mlp_chunks=3).validate()
    with pytest.raises(OptionsError, match="--mlp-chunks must be >= 1"):
        Options(mlp_chunks=0).validate()
    with pytest.raises(OptionsError, match="--lora-dropout with --mlp-chunks"):
        Options(lora_rank=8, lora_dropout=0.1, mlp_chunks=2).validate()
    with pytest.raises(OptionsError, match="--fp8-swiglu-onepass with --mlp-chunks"):
        Options(matmul_dtype="e4m3", fp8_swiglu_onepass=True, mlp_chunks=2).validate()


def test_plan_workspace_shrinks_and_bounds_a_real_micro_step():
    """Llama-3.1-8B at 128k tokens with the block recomputed: the block backward's workspace (the MLP's 2F-wide
    saved set and gradients) falls by more than half with 8 slices, and the step model charges the MLP's GEMMs once
    more. On a tiny model the plan's activations + workspace bound the measured peak of a real micro-step."""
    cfg = preset("Llama-3.1-8B")
    o = dict(batch_size=1, seq_len=131072, recompute_block=True, lmhead_chunks=8)
    whole, sliced = (plan_memory(cfg, Options(**o, mlp_chunks=n), gpu_memory=80 << 30).phases["block_backward"]
                     for n in (1, 8))
    assert sliced < 0.55 * whole, (sliced, whole)
    mlp = 2 * 3 * cfg.hidden_size * cfg.intermediate_size * cfg.num_hidden_layers  # up (2F) and down (F) GEMMs
    extra = (recompute_flops_per_token(cfg, 131072, {"block"}, mlp_chunks=8)
             - recompute_flops_per_token(cfg, 131072, {"block"}))
    assert extra == mlp

    small = tiny_cfg("qwen2", tied=True)
    B, T = 2, 64
    for flags in ((), ("block",)):
        at_head, peak = measure_micro_step(small, "bf16", flags=flags, B=B, T=T, mlp_chunks=4)
        plan = plan_memory(small, Options(model_dtype="bf16", batch_size=B, seq_len=T, mlp_chunks=4,
                                          recompute_block="block" in flags), device="cpu", compiled=False)
        assert plan.item("activations").device == pytest.approx(at_head, rel=0.10)
        transient = plan.item("activations").device + plan.item("workspace").device
        assert peak <= transient <= 1.6 * peak, (flags, peak, transient)


def test_fit_slices_the_mlp_only_for_long_micro_batches():
    """The fit's last rung: slices of at most 16k tokens, and none where one slice would hold the micro-batch."""
    assert mlp_chunks(131072) == 8 and mlp_chunks(16384) == 1
    assert [r for r, _ in activation_rungs(Options(batch_size=1, seq_len=131072))][-1] == "mlp chunks"
    assert "mlp chunks" not in [r for r, _ in activation_rungs(Options(batch_size=4, seq_len=4096))]


def test_proposals_without_anything_to_slice_are_those_of_a_model_without_slices(monkeypatch):
    """The MLP rung carries its switch into the later rungs of its ladder: where there is nothing to slice (a short
    micro-batch) or the options refuse slices (--lora-dropout), those rungs still run (they were skipped: the 7B
    proposals at 4k tokens on 80 GiB got slower, and LoRA with dropout at 32k found none)."""
    import qtrain.plan.propose as propose_module
    from qtrain.plan.propose import propose
    cfg = preset("Qwen2.5-7B")
    cases = [Options(seq_len=4096, batch_size=1, grad_accumulation=8),
             Options(seq_len=32768, batch_size=1, lora_rank=16, lora_dropout=0.1)]
    found = [[(c, p.device_total) for c, p in propose(cfg, o, 80 << 30, max_batch=8)] for o in cases]
    monkeypatch.setattr(propose_module, "mlp_chunks_refusal", lambda cfg: "no slices")
    assert found == [[(c, p.device_total) for c, p in propose(cfg, o, 80 << 30, max_batch=8)] for o in cases]
    assert all(found), found


def test_slices_refused_where_they_cannot_run():
    with pytest.raises(OptionsError, match="each slice's 24 tokens must be a multiple of 16"):
        Options(batch_size=2, seq_len=48, matmul_dtype="e4m3", mlp_chunks=4).validate()
    with pytest.raises(OptionsError, match="--debug-log-abs-max with --mlp-chunks"):
        Options(debug_log_abs_max=1, mlp_chunks=2).validate()
    with pytest.raises(OptionsError, match="--use-cuda-graphs does not support --mlp-chunks"):
        check_cuda_graphs(Options(use_cuda_graphs=True, mlp_chunks=2), world=1, device_type="cuda")
    assert mlp_chunks(32800) == 2  # slices of 16400 tokens, not 4 of 8200 (not a multiple of 16)
