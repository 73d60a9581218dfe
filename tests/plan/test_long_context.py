"""Long sequences on one GPU (plan/fit.py): `qtrain plan --seq-len N` proposes configurations that fit with the LM
head in chunks, and a run's start (plan/resolution.py, --fit-memory) adds the fewest activation-side switches with
which its plan fits. These are properties of the memory plan, computed on the CPU; how close the plan is to a GPU's
measured peak at these lengths is not claimed here (that needs the GPU machine)."""
from __future__ import annotations

import dataclasses
import io
import json

import pytest

from qtrain.model.registry import preset
from qtrain.options import Options
from qtrain.plan.fit import HEAD_CHUNK_TOKENS, head_chunks
from qtrain.plan.memory import GiB
from qtrain.plan.resolution import plan_memory, resolve_run

H200 = 141 * GiB


def test_head_chunks_cap_the_tokens_of_a_chunk():
    assert head_chunks(4096) == 1 and head_chunks(HEAD_CHUNK_TOKENS) == 1  # short micro-batches: as given
    assert head_chunks(131072) == 8 and head_chunks(32768) == 2 and head_chunks(65536, at_least=8) == 8
    assert head_chunks(3 * 65536, at_least=3) == 12  # 3, 6, 12 (each divides the tokens): 16384 tokens a chunk
    assert head_chunks(3 * HEAD_CHUNK_TOKENS) == 4  # 49152 tokens: 4 chunks of 12288
    odd = 3 * 5 * 7 * 1024 + 1  # no power of two divides it: one chunk, as --lmhead-chunks must divide
    assert head_chunks(odd) == 1


def _plan_json(*args: str) -> dict:
    import argparse
    from qtrain.cli.plan import add_arguments, run
    out = io.StringIO()
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert run(p.parse_args(list(args) + ["--json"]), (), out=out) == 0
    return json.loads(out.getvalue())


@pytest.mark.parametrize("model, seq_len", [("Qwen2.5-7B", 131072), ("Qwen2.5-7B", 65536), ("Qwen2.5-7B", 32768),
                                            ("Llama-3.1-8B", 131072)])
def test_plan_proposes_a_chunked_head_that_fits(model, seq_len):
    """`qtrain plan --model M --seq-len N --gpu-memory 141GiB`: the recommended configuration fits, and every
    proposal runs the LM head in chunks of at most HEAD_CHUNK_TOKENS tokens (before: one 37 GiB chunk at 7B x
    131072, 42.5 GiB of workspace)."""
    d = _plan_json("--model", model, "--seq-len", str(seq_len), "--gpu-memory", "141GiB")
    assert d["recommended"] is not None and d["proposals"]
    for prop in d["proposals"]:
        plan = prop["plan"]
        assert plan["fits"] and plan["device_total"] <= H200
        tokens = plan["batch_size"] * seq_len
        chunks = plan["settings"]["lmhead_chunks"]
        assert chunks == prop["changes"]["lmhead_chunks"] and tokens // chunks <= HEAD_CHUNK_TOKENS
    best = d["proposals"][d["recommended"]]["plan"]
    if (model, seq_len, best["batch_size"]) == ("Qwen2.5-7B", 131072, 1):  # the case: 42.5 GiB before
        assert best["phases"]["lm_head"] < 12 * GiB and best["settings"]["lmhead_chunks"] == 8


def test_plan_of_short_sequences_keeps_one_chunk():
    """4 x 1024 tokens: the head stays in one chunk (nothing changes below HEAD_CHUNK_TOKENS per micro-batch)."""
    d = _plan_json("--model", "Qwen2.5-0.5B", "--seq-len", "1024", "--gpu-memory", "80GiB", "--max-batch", "8")
    assert all("lmhead_chunks" not in p["changes"] for p in d["proposals"] if p["plan"]["batch_size"] <= 16)


@pytest.mark.parametrize("seq_len, want", [(32768, {"lmhead_chunks": 2, "recompute_ffn": True}),
                                           (65536, {"lmhead_chunks": 4, "recompute_block": True}),
                                           (131072, {"lmhead_chunks": 8, "recompute_block": True})])
def test_run_start_fits_long_sequences(seq_len, want):
    """A run of Qwen2.5-7B, one sequence per micro-step with Adam m offloaded, on a 141 GiB GPU: its given options
    do not fit; the resolution adds the fewest switches that make the plan fit (LM head chunks, then the first
    recompute rung that is enough), and every choice is made for the options with them, as a run given those
    flags would make it."""
    cfg = preset("Qwen2.5-7B")
    opts = Options(model="Qwen2.5-7B", seq_len=seq_len, batch_size=1, grad_accumulation=4, offload_opt_m=True)
    assert not plan_memory(cfg, opts, gpu_memory=H200).fits
    run = resolve_run(cfg, opts, device="cuda", gpu_memory=H200)
    assert dict(run.memory_changes) == want
    assert run.plan.fits and run.plan.device_total <= H200
    assert run.lmhead_chunks == want["lmhead_chunks"] and not run.offload_residual
    assert run.recompute == dataclasses.replace(opts, **want).recompute
    flagged = resolve_run(cfg, dataclasses.replace(opts, **want), device="cuda", gpu_memory=H200)
    assert flagged.memory_changes == () and flagged.plan.to_dict() == run.plan.to_dict()
    assert dataclasses.replace(run, memory_changes=()) == flagged
    note = run.memory_note()
    assert note.startswith("memory: the given options do not fit 141.0 GiB; the run adds --lmhead-chunks")
    assert "--no-fit-memory" in note


def test_run_start_changes_nothing_it_need_not():
    """No change: where the options fit, with --no-fit-memory, where the budget is unknown (CPU runs, a plan without
    --gpu-memory), and where nothing fits (the plan then says so and the options stay the user's)."""
    cfg = preset("Qwen2.5-7B")
    long = Options(model="Qwen2.5-7B", seq_len=131072, batch_size=1, grad_accumulation=4, offload_opt_m=True)
    short = dataclasses.replace(long, seq_len=4096)
    assert resolve_run(cfg, short, device="cuda", gpu_memory=H200).memory_changes == ()
    assert resolve_run(cfg, dataclasses.replace(long, fit_memory=False), device="cuda",
                       gpu_memory=H200).memory_changes == ()
    assert resolve_run(cfg, long, device="cuda", gpu_memory=None).memory_changes == ()
    assert resolve_run(cfg, long, device="cpu", gpu_memory=H200).memory_changes == ()
    tiny = resolve_run(cfg, long, device="cuda", gpu_memory=24 * GiB)  # the weights alone do not fit
    assert tiny.memory_changes == () and not tiny.plan.fits and tiny.memory_note() is None


def test_run_start_offloads_residuals_last_and_not_under_cuda_graphs():
    """Where recomputing the whole block is not enough, the block inputs go to the host (--offload-residual); a run
    that asks for CUDA graphs, which cannot capture that, gets no such change."""
    cfg = preset("Qwen2.5-7B")
    opts = Options(model="Qwen2.5-7B", seq_len=131072, batch_size=1, grad_accumulation=4, offload_opt_m=True,
                   offload_opt_v=True)
    block = dataclasses.replace(opts, recompute_block=True, lmhead_chunks=8)
    need = plan_memory(cfg, block, gpu_memory=H200).device_total
    residual = plan_memory(cfg, dataclasses.replace(block, offload_residual=True), gpu_memory=H200).device_total
    budget = (need + residual) // 2  # between: only the offload makes it fit
    run = resolve_run(cfg, opts, device="cuda", gpu_memory=budget)
    assert dict(run.memory_changes) == {"lmhead_chunks": 8, "recompute_block": True, "offload_residual": True}
    assert run.offload_residual and run.plan.fits
    graphs = resolve_run(cfg, dataclasses.replace(opts, use_cuda_graphs=True), device="cuda", gpu_memory=budget)
    assert graphs.memory_changes == () and not graphs.plan.fits


def test_the_trainer_runs_what_the_resolution_chose(tmp_path):
    """The model's run options take the LM head chunks and the residual offload from the resolution (so what
    --fit-memory adds is what runs), not from the options."""
    from qtrain.train.trainer import Trainer
    from tests.dist_utils import write_model_dir
    from tests.run_utils import CFG
    model_dir = write_model_dir(tmp_path, CFG)
    opts = Options(model=str(model_dir), from_scratch=True, device="cpu", compile="off", batch_size=2, seq_len=16,
                   model_dtype="fp32")
    run = resolve_run(CFG, opts, device="cpu")
    fitted = dataclasses.replace(run, lmhead_chunks=4, offload_residual=True,
                                 recompute=dataclasses.replace(opts, recompute_block=True).recompute,
                                 memory_changes=(("lmhead_chunks", 4), ("recompute_block", True),
                                                 ("offload_residual", True)))
    tr = Trainer(opts, run=fitted)
    assert (tr.model.run.lmhead_chunks, tr.model.run.offload_residual) == (4, True)
    assert "block" in tr.model.run.recompute


def test_fit_memory_is_an_option():
    """On unless --no-fit-memory; `qtrain plan` prints the plan of the options as given either way."""
    import argparse
    from qtrain.cli.options import add_train_args, options_from_args
    p = argparse.ArgumentParser()
    add_train_args(p)
    assert options_from_args(p.parse_args([])).fit_memory is True
    assert options_from_args(p.parse_args(["--no-fit-memory"])).fit_memory is False
