"""`--continue` keeps what --fit-memory chose that changes the numbers (`plan/fit.CHANGES_NUMBERS`: the LM head's
chunks regroup its sums). A resumed run re-runs the fit for its own device: a run whose head the fit put in 2 chunks,
resumed on a device where the options fit as given, ran it in one, and a run of one chunk resumed on a smaller device
in 2, so the loss no longer continued bit for bit and nothing said so. Now the checkpoint records how its run held
its activations (`checkpoint.json`'s `memory`), the resume keeps the chunks (the fit recomputes instead where that
fits) and says, one line each, what it could not keep and what follows the device (recomputation: the same numbers).

Through the real CLI on the CPU. The device is a CUDA GPU of `device["bytes"]` by stand-in: the preflight resolves for
it (the plan is arithmetic), the run runs on the CPU; HEAD_CHUNK_TOKENS is 16, so the tiny run's 2 x 16 tokens are a
"long" micro-batch."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from qtrain.cli.main import main
from qtrain.observe.log import read_log
from qtrain.options import Options
from qtrain.plan import fit, resolution
from tests.run_utils import CFG, make_run_root, train_argv

# the tiny model with a vocabulary large enough that the LM head's transient counts in the plan
MODEL = dataclasses.replace(CFG, vocab_size=512)
# what train_argv's run is, for its plans
OPTS = Options(model="x", from_scratch=True, device="cpu", compile="off", batch_size=2, seq_len=16,
               grad_accumulation=1, eval_num_steps=0, model_dtype="fp32")
BLOCK = {"recompute_block": True, "offload_residual": True}


def _need(**changes) -> int:
    """The device bytes the tiny run's plan takes with these option changes."""
    return resolution.plan_memory(MODEL, dataclasses.replace(OPTS, **changes), gpu_memory=1 << 40).device_total


def _between(a: int, b: int) -> int:
    assert a < b
    return (a + b) // 2


@pytest.fixture
def device(monkeypatch) -> dict:
    import qtrain.train.preflight as preflight
    monkeypatch.setattr(fit, "HEAD_CHUNK_TOKENS", 16)
    budget: dict = {"bytes": None}

    def resolve(opts, cfg, world, **kw):
        run = resolution.resolve_run(cfg, opts, world=world, device="cuda", gpu_memory=budget["bytes"], **kw)
        return dataclasses.replace(run, device="cpu", cuda_graphs=False,
                                   sdpa_backend=resolution.sdpa_backend(opts, torch.device("cpu")))
    monkeypatch.setattr(preflight, "resolve", resolve)
    return budget


@pytest.fixture
def root(tmp_path) -> Path:
    root = make_run_root(tmp_path)
    (root / "model" / "config.json").write_text(json.dumps(MODEL.to_hf_dict()))
    return root


def _steps(root: Path, name: str) -> list[tuple[int, float]]:
    return [(e["step"], e["loss"]) for e in read_log(root / "logs" / f"{name}.jsonl") if e["log"] == "step"]


def _resume_from_step_2(root: Path, name: str) -> list[str]:
    """Drop the run's step-4 checkpoint and export, resume it to step 4; the resume's --continue lines."""
    shutil.rmtree(root / "ckpt" / name / "step_00000004")
    shutil.rmtree(root / "out" / name)
    before = len(read_log(root / "logs" / f"{name}.jsonl"))
    assert main(train_argv(root, steps=4, name=name, extra=("--continue",))) == 0
    return [e["message"] for e in read_log(root / "logs" / f"{name}.jsonl")[before:]
            if e["log"] == "message" and e["message"].startswith("--continue: --")]


def _memory(root: Path, name: str) -> dict:
    return json.loads((root / "ckpt" / name / "step_00000002" / "checkpoint.json").read_text())["memory"]


def test_a_resume_on_a_larger_device_keeps_the_lm_head_chunks_the_fit_chose(root, device):
    device["bytes"] = _between(_need(lmhead_chunks=2), _need())  # fits with the head in 2 chunks
    assert main(train_argv(root, steps=4, name="run")) == 0
    assert _memory(root, "run")["lmhead_chunks"] == 2 and not _memory(root, "run")["recompute_swiglu"]
    whole = _steps(root, "run")
    device["bytes"] = 2 * _need()  # the options fit as given (and one chunk's loss differs: the next test)
    lines = _resume_from_step_2(root, "run")  # one line: the chunks kept where the command says 1
    assert len(lines) == 1 and lines[0].startswith("--continue: --lmhead-chunks 1 -> 2") and "kept" in lines[0], lines
    assert _steps(root, "run")[4:] == whole[2:], "the resumed steps equal the uninterrupted run's, bit for bit"
    assert _memory(root, "run")["lmhead_chunks"] == 2  # the resumed run's checkpoints record it again


def test_a_resume_on_a_smaller_device_recomputes_to_keep_them_and_says_what_it_cannot_keep(root, device):
    device["bytes"] = 2 * _need()
    assert main(train_argv(root, steps=4, name="run")) == 0
    assert _memory(root, "run")["lmhead_chunks"] == 1
    whole = _steps(root, "run")

    # 2 chunks would fit, so would 1 with recomputation: the chunks stay, the recomputation follows the device
    device["bytes"] = _between(_need(lmhead_chunks=2), _need())
    lines = _resume_from_step_2(root, "run")
    assert _steps(root, "run")[4:] == whole[2:], "bit for bit"
    assert len(lines) == 2 and all("-> True" in m and "the numbers stay the same" in m for m in lines), lines
    assert {m.split()[1] for m in lines} == {"--recompute-swiglu", "--recompute-norm"}

    # only 2 chunks fit (with the block recomputed): the head changes, and the resume says so
    device["bytes"] = _between(_need(lmhead_chunks=2, **BLOCK), _need(**BLOCK))
    lines = _resume_from_step_2(root, "run")
    assert _steps(root, "run")[8:] != whole[2:]  # the head's chunks change the numbers
    chunks = [m for m in lines if m.startswith("--continue: --lmhead-chunks 1 -> 2 (checkpoint step 2): ")]
    assert len(chunks) == 1 and "do not continue bit for bit" in chunks[0], lines
    assert any(m.startswith("--continue: --recompute-block False -> True") for m in lines), lines


def test_a_resume_keeps_the_mlp_slices_the_fit_chose(root, device):
    """The fit's last rung, the MLP in token slices (2 x 16 tokens in slices of 16), regroups the block weights'
    gradient sums: a resume on a device where the options fit as given keeps the slices (and the head's chunks), bit
    for bit, and only the recomputation follows the device."""
    rungs = dict(lmhead_chunks=2, recompute_swiglu=True, recompute_norm=True, recompute_ffn=True, **BLOCK)
    device["bytes"] = _between(_need(**rungs, mlp_chunks=2), _need(**rungs))
    assert main(train_argv(root, steps=4, name="run")) == 0
    assert _memory(root, "run")["mlp_chunks"] == 2
    whole = _steps(root, "run")
    device["bytes"] = 2 * _need()
    lines = _resume_from_step_2(root, "run")
    assert _steps(root, "run")[4:] == whole[2:], "bit for bit"
    assert _memory(root, "run")["mlp_chunks"] == 2 and _memory(root, "run")["lmhead_chunks"] == 2
    kept = [m for m in lines if "kept as the checkpoint's run ran it" in m]
    assert {m.split()[1] for m in kept} == {"--mlp-chunks", "--lmhead-chunks"}, lines
    assert all("the numbers stay the same" in m for m in lines if m not in kept), lines


def test_a_resume_whose_pins_fit_nowhere_runs_as_a_new_run_would_and_says_so(root, device):
    """An e4m3 run checkpointed with the one-pass FP8 SwiGLU on (a device where the options fit as given), resumed on
    one where only the MLP's slices make the plan fit: the pinned one-pass SwiGLU refuses the slices (and the MLP
    split), so with the pins nothing fits; the resume then takes the fit a new run makes and says what it dropped,
    one line each (before: it kept the pins and the plan did not fit, an out-of-memory on a GPU)."""
    model = dataclasses.replace(MODEL, intermediate_size=1024)  # an MLP whose slices the plan sees
    (root / "model" / "config.json").write_text(json.dumps(model.to_hf_dict()))
    e4m3 = dict(matmul_dtype="e4m3", model_dtype="bf16", opt_m_dtype="bf16", opt_v_dtype="bf16")
    argv = {k: v for k, v in e4m3.items()}
    rungs = dict(lmhead_chunks=2, recompute_swiglu=True, recompute_norm=True, recompute_ffn=True, **BLOCK)
    need = {k: resolution.plan_memory(model, dataclasses.replace(OPTS, **e4m3, **c), gpu_memory=1 << 40).device_total
            for k, c in (("given", {}), ("sliced", {**rungs, "mlp_chunks": 2, "fp8_swiglu_onepass": False}),
                         ("unsliced", {**rungs, "fp8_swiglu_onepass": False}))}
    device["bytes"] = 2 * need["given"]
    assert main(train_argv(root, steps=4, name="run", **argv)) == 0
    device["bytes"] = _between(need["sliced"], need["unsliced"])
    shutil.rmtree(root / "ckpt" / "run" / "step_00000004")
    shutil.rmtree(root / "out" / "run")
    before = len(read_log(root / "logs" / "run.jsonl"))
    assert main(train_argv(root, steps=4, name="run", extra=("--continue",), **argv)) == 0
    lines = [e["message"] for e in read_log(root / "logs" / "run.jsonl")[before:]
             if e["log"] == "message" and e["message"].startswith("--continue: --")]
    onepass = [m for m in lines if m.startswith("--continue: --fp8-swiglu-onepass True -> False")]
    assert len(onepass) == 1 and "do not continue bit for bit" in onepass[0], lines
    assert any(m.startswith("--continue: --mlp-chunks 1 -> 2") for m in lines), lines
    ran = json.loads((root / "ckpt" / "run" / "step_00000004" / "checkpoint.json").read_text())
    assert ran["memory"]["mlp_chunks"] == 2 and ran["options"]["fp8_swiglu_onepass"] is False
