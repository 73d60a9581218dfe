"""Kind `cli`: `qtrain train` as a user runs it (data loader, schedule, logging; 1..N GPUs) on a file of random
tokens, measured from its JSON log the way bench_llmq.sh measures llm.q: tokens/s is the median of the steady
steps (all GPUs together), so the two compare step for step.

Parameters: model (preset or directory), batch (per GPU), accum, steps (8), gpus (1), seq (1024), skip (steps
left out as warm-up, 3), flags (more `qtrain train` flags, e.g. ["--opt-m-dtype", "bf16"]), device (none:
qtrain's default), train_file (none: random tokens, made once per size under $BENCH_DATA or the temp dir).
The run is stopped once its last step and memory are logged (no final export: 28 GB at 14B). Result: tps
(median), tps_mean, step_ms (median), mfu, peak_gib (rank 0, max_memory_allocated), plan_gib (the memory-plan
event, reserve included), loss (last step), losses (every step's: the loss curve), steps_logged.
"""
from __future__ import annotations

import datetime
import glob
import json
import os
import shutil
import statistics
import sys
import tempfile

from bench.compat import has_module, model_config, qtrain
from bench.dry import tiny_model_dir
from bench.subproc import stream

DATA_DIR = os.environ.get("BENCH_DATA") or os.path.join(tempfile.gettempdir(), "qtrain-bench-data")


def token_file(n_tokens: int, vocab: int) -> str:
    """A file of at least n_tokens random tokens below `vocab` (llm.q's format), reused across runs."""
    have = []
    for f in glob.glob(os.path.join(DATA_DIR, f"rand-v{vocab}-*.bin")):
        n = f.rsplit("-", 1)[-1][:-4]
        if n.isdigit() and int(n) >= n_tokens:
            have.append((int(n), f))
    if have:
        return min(have)[1]
    import numpy as np

    os.makedirs(DATA_DIR, exist_ok=True)
    path = os.path.join(DATA_DIR, f"rand-v{vocab}-{n_tokens}.bin")
    tokens = np.random.default_rng(0).integers(0, vocab, n_tokens, dtype=np.int32)
    qtrain("write_token_file")(path, tokens, vocab_size=vocab)  # atomic
    print(f"made {path} ({n_tokens} random tokens)", flush=True)
    return path


def read_log(path: str) -> list[dict]:
    events = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # a line being written
    except FileNotFoundError:
        pass
    return events


def summarize(events: list[dict], skip: int) -> dict:
    steps = [e for e in events if e.get("log") == "step"]
    steady = [e for e in steps if e["step"] >= skip] or steps[-1:]
    if not steady:
        raise RuntimeError("qtrain train logged no step")
    tps = [e["tokens_per_s"] for e in steady if e.get("tokens_per_s")]
    mfu = [e["mfu"] for e in steady if e.get("mfu") is not None]
    peaks = [e["peak"] for e in events if e.get("log") == "memory"]
    plans = [e["device_total"] for e in events if e.get("log") == "memory-plan"]
    return dict(system="qtrain", tps=round(statistics.median(tps)), tps_mean=round(statistics.mean(tps)),
                step_ms=round(statistics.median(e["duration_ms"] for e in steady), 1),
                mfu=round(statistics.median(mfu), 3) if mfu else None,
                peak_gib=round(max(peaks) / 2**30, 2) if peaks else None,
                plan_gib=round(plans[0] / 2**30, 2) if plans else None,
                loss=round(steps[-1]["loss"], 4), losses=[round(e["loss"], 4) for e in steps],
                steps_logged=len(steps), steady=len(steady))


def run(model: str, batch: int, accum: int, steps: int = 8, gpus: int = 1, seq: int = 1024, skip: int = 3,
        flags: list[str] = (), device: str | None = None, train_file: str | None = None) -> dict:
    events = run_events(model, batch, accum, steps, gpus=gpus, seq=seq, flags=flags, device=device,
                        train_file=train_file)
    return summarize(events, skip)


def run_events(model: str, batch: int, accum: int, steps: int, *, gpus: int = 1, seq: int = 1024,
               flags: list[str] = (), device: str | None = None, train_file: str | None = None,
               env: dict[str, str] | None = None, python: tuple[str, ...] = (), to_exit: bool = False) -> list[dict]:
    """`qtrain train` on random tokens until its last step and memory are logged; its JSON log's events, plus a
    `launch` event (the wall-clock time, as the log's `time` stamps, just before the process started). `python`:
    interpreter arguments before `-m qtrain.cli.main` (e.g. `-m cProfile -o FILE`: the start kind's profile);
    `to_exit`: let the run finish (its export included) instead of stopping it after its last step (a profile is
    written at the interpreter's orderly exit, which a stop's signal may cut short)."""
    if not all(isinstance(f, str) for f in flags):
        raise ValueError(f"flags must be strings, e.g. [\"--lmhead-chunks\", \"4\"]; got {list(flags)!r}")
    vocab = model_config(model).vocab_size
    data = train_file or token_file((steps + 1) * batch * accum * seq * gpus + 1, vocab)
    work = tempfile.mkdtemp(prefix="qtrain-bench-cli-")
    log = os.path.join(work, "log.jsonl")
    cmd = [sys.executable, *python, "-m", "qtrain.cli.main", "train", "--model", model, "--from-scratch", "--train-file", data,
           "--gpus", str(gpus), "--batch-size", str(batch), "--grad-accumulation", str(accum), "--steps", str(steps),
           "--seq-len", str(seq), "--eval-num-steps", "0", "--no-save-training-state", "--lr", "1e-4",
           "--out-dir", os.path.join(work, "out"), "--checkpoint-dir", os.path.join(work, "ckpt"), "--log-file", log,
           *(["--device", device] if device else []), *flags]
    print("$", " ".join(cmd), flush=True)

    def done() -> bool:
        """The last step and the closing memory event are logged: what follows is the HF export."""
        ev = read_log(log)
        return any(e.get("log") == "step" and e["step"] == steps - 1 for e in ev) and \
            (any(e.get("log") == "memory" for e in ev) or device == "cpu")
    in_options = [False]

    def echo(line: str) -> bool:
        """Everything but the [Options] block (the run's parameters are in the result)."""
        if line.startswith("["):
            in_options[0] = line.startswith("[Options]")
        return not in_options[0]
    try:
        launched = datetime.datetime.now().astimezone().isoformat(timespec="milliseconds")
        fin = stream(cmd, stop=None if to_exit else done, echo=echo, env=None if env is None else {**os.environ, **env})
        events = read_log(log)
        if fin.returncode != 0 and not fin.stopped:
            raise RuntimeError(f"qtrain train exited with status {fin.returncode}: {fin.last(2)}")
        return [{"log": "launch", "time": launched}, *events]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def dry_run(params: dict) -> dict:
    """The same flags on a tiny model of the family, 2 x 32 tokens, 2 steps (up to 2 processes), on the CPU,
    blocks compiled only for --swiglu-epilogue on (less --use-cuda-graphs, which --device cpu refuses, after
    checking the case against what a CUDA run of it refuses: `check_cuda_rules`)."""
    check_cuda_rules(params)
    flags = [f for f in params.get("flags", []) if f not in CUDA_ONLY_FLAGS]
    # blocks compiled only where the case needs them (--swiglu-epilogue on applies to compiled blocks alone)
    compiled = any(a == "--swiglu-epilogue" and b == "on" for a, b in zip(flags, flags[1:]))
    return {**params, "model": tiny_model_dir(params["model"]), "batch": 2, "seq": 32,
            "accum": min(params["accum"], 2), "steps": 2, "gpus": min(params.get("gpus", 1), 2), "skip": 0,
            "device": "cpu", "flags": [*flags, "--compile", "on" if compiled else "off"],
            "train_file": None}  # random tokens: a real token file's vocabulary exceeds the tiny model's


CUDA_ONLY_FLAGS = ("--use-cuda-graphs",)


def check_cuda_rules(params: dict) -> None:
    """Raise what the case's `qtrain train` would refuse on a CUDA device only: --use-cuda-graphs with what graphs
    cannot capture (`plan.resolution.check_cuda_graphs`, earlier in train/cuda_graphs.py, which a CPU run skips and
    the dry run drops the flag for): a device start spent on a case that asks for graphs with --persistent-quants
    finds only the refusal."""
    flags = list(params.get("flags", []))
    if "--use-cuda-graphs" not in flags or not has_module("qtrain.train.cuda_graphs"):
        return
    import argparse

    from qtrain.cli.options import add_train_args, options_from_args
    if has_module("qtrain.plan.resolution"):
        from qtrain.plan.resolution import check_cuda_graphs
    else:  # a baseline checkout from before the run's one resolution
        from qtrain.train.cuda_graphs import check_cuda_graphs  # type: ignore[no-redef]

    p = argparse.ArgumentParser()
    add_train_args(p)
    ns = p.parse_args(["--model", tiny_model_dir(params["model"]), "--batch-size", str(params["batch"]),
                       "--grad-accumulation", str(params["accum"]), *flags])
    check_cuda_graphs(options_from_args(ns), world=params.get("gpus", 1), device_type="cuda")
