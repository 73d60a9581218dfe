"""The fault-injection harness: a real `qtrain train` (one process, or `--gpus 2` with gloo workers) is
killed with SIGKILL, either at the N-th time it reaches a named moment between two file operations
(`qtrain.fsio.fault_point`, through QTRAIN_FAULT) or at a random moment chosen by the test; then the same
command with `--continue` finishes the run. After each trial:

  1. the latest checkpoint left by the killed run is complete (its meta names its step, every shard loads);
  2. what the user had (files beside qtrain's in the checkpoint, output and log folders; the model and the
     token files) is byte for byte unchanged;
  3. the resumed run exits 0, and leaves no temp, renamed-aside or half-deleted files anywhere;
  4. its final checkpoint and export are bitwise identical to an uninterrupted run's, and so are the
     losses and gradient norms of every step it ran.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from qtrain.observe.log import read_log
from qtrain.train import checkpoint_io as cio
from tests.run_utils import make_run_root, qtrain_popen, snapshot, train_argv

STEPS = 4
USER_FILES = {"ckpt/run/NOTES.txt": "the user's notes", "out/run/README.md": "the user's readme",
              "logs/other.jsonl": "the user's other log\n"}
LEFTOVER = re.compile(r"\.(tmp|old|del)-")


def argv(root: Path, gpus: int) -> list[str]:
    return train_argv(root, steps=STEPS, name="run", ckpt_interval=2, ckpt_keep_n=1, gpus=gpus, eval_num_steps=2,
                      eval_every_n_steps=2)


def make_template(root: Path) -> Path:
    return make_run_root(root, tokens=3000)


def _fresh(template: Path, dest: Path) -> Path:
    shutil.copytree(template, dest)
    for rel, text in USER_FILES.items():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_text(text)
    return dest


@dataclass
class Outcome:
    """What one run left: its final checkpoint's tensors, its export, and its per-step loss and norm."""
    checkpoint: dict[str, dict[str, torch.Tensor]]
    export: dict[str, torch.Tensor]
    steps: dict[int, tuple[float, float]]


def outcome(root: Path) -> Outcome:
    ckpt = cio.find_checkpoint(root / "ckpt" / "run")
    _, files = cio.read_checkpoint(ckpt)
    steps = {}
    for e in read_log(root / "logs" / "run.jsonl"):
        if e["log"] == "step":
            steps[e["step"]] = (e["loss"], e["norm"])  # a resumed step: the last time it ran
    return Outcome({n: files.load(n) for n in files.names}, load_file(root / "out" / "run" / "model.safetensors"), steps)


def _run(root: Path, args: list[str], timeout: float = 900, **env: str) -> subprocess.CompletedProcess:
    p = qtrain_popen(args, cwd=root, **env)
    out, err = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def reference(template: Path, dest: Path, gpus: int) -> tuple[Outcome, list[str]]:
    """An uninterrupted run's outcome and the fault points it passed, in order."""
    root = _fresh(template, dest)
    trace = dest / "trace.txt"
    r = _run(root, argv(root, gpus), QTRAIN_FAULT_TRACE=str(trace))
    assert r.returncode == 0, r.stderr[-4000:]
    return outcome(root), trace.read_text().split()


def fault_plan(points: list[str]) -> list[tuple[str, int]]:
    """Every point of a trace as (name, n): kill at the n-th time `name` is reached."""
    seen: Counter = Counter()
    plan = []
    for p in points:
        seen[p] += 1
        plan.append((p, seen[p]))
    return plan


def _workers(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "State:\tZ" not in f.read()
    except FileNotFoundError:
        return False


@dataclass
class Trial:
    name: str
    gpus: int = 1
    fault: tuple[str, int] | None = None  # kill at the n-th time this point is reached
    kill_after_step: int | None = None  # or: SIGKILL once the log shows this step, after `delay` seconds
    delay: float = 0.0
    target: str = "launcher"  # with --gpus 2 and a timed kill: "launcher" or "worker"
    notes: list[str] = field(default_factory=list)


def run_trial(trial: Trial, template: Path, dest: Path, ref: Outcome) -> str:
    """Run one trial (see the module docstring); returns what happened to the killed run."""
    root = _fresh(template, dest)
    mine = {k: v for k, v in snapshot(root).items() if not k.startswith(("ckpt", "out", "logs"))}
    args = argv(root, trial.gpus)
    env = {"QTRAIN_FAULT": f"{trial.fault[0]}:{trial.fault[1]}"} if trial.fault else {}
    p = qtrain_popen(args, cwd=root, **env)
    if trial.kill_after_step is not None:
        log = root / "logs" / "run.jsonl"
        deadline = time.monotonic() + 600
        while p.poll() is None and time.monotonic() < deadline:
            if log.exists() and any(e["log"] == "step" and e["step"] >= trial.kill_after_step for e in read_log(log)):
                break
            time.sleep(0.02)
        time.sleep(trial.delay)
        kids = _workers(p.pid)
        if p.poll() is None:
            victim = kids[-1] if (trial.target == "worker" and kids) else p.pid
            os.kill(victim, signal.SIGKILL)
        p.communicate(timeout=600)
        deadline = time.monotonic() + 60
        while any(_alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(k) for k in kids), f"{trial.name}: workers outlived their launcher"
    else:
        p.communicate(timeout=900)
    killed = f"exit {p.returncode}"

    # 1. the latest checkpoint is complete
    latest = cio.find_checkpoint(root / "ckpt" / "run")
    if latest is not None:
        meta, files = cio.read_checkpoint(latest)
        assert meta["step"] == cio.checkpoint_step(latest), trial.name
        world = meta["distributed"]["world"]
        want = sorted(f"{k}.shard_{r:03d}_of_{world:03d}" for k in ("weights", "adam.m", "adam.v") for r in range(world))
        assert files.names == want, (trial.name, files.names)
        for n in want:
            files.load(n)
    # 2. nothing the user had is lost (before and after the resume)
    _check_user_files(root, mine, trial.name)

    # 3-4. the resume finishes, leaves nothing behind, and matches the uninterrupted run bit for bit
    r = _run(root, args + ["--continue"])
    assert r.returncode == 0, (trial.name, killed, r.stderr[-4000:])
    left = [str(q) for q in root.rglob("*") if LEFTOVER.search(q.name)]
    assert not left, (trial.name, left)
    _check_user_files(root, mine, trial.name)
    got = outcome(root)
    assert got.steps == ref.steps, (trial.name, got.steps, ref.steps)
    assert got.checkpoint.keys() == ref.checkpoint.keys(), trial.name
    for n, tensors in ref.checkpoint.items():
        for k, t in tensors.items():
            assert torch.equal(got.checkpoint[n][k], t), (trial.name, n, k)
    assert got.export.keys() == ref.export.keys() and all(torch.equal(got.export[k], ref.export[k])
                                                          for k in ref.export), trial.name
    return killed


def _check_user_files(root: Path, mine: dict[str, bytes], name: str) -> None:
    for rel, text in USER_FILES.items():
        assert (root / rel).read_text() == text, (name, rel)
    now = {k: v for k, v in snapshot(root).items() if k in mine}
    assert now == mine, (name, sorted(k for k in mine if now.get(k) != mine[k]))
