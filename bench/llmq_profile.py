"""Kind `llmq-profile`: where llm.q's step goes, kernel by kernel, to set beside qtrain's `profile` kind. llm.q is a
C++ program, so the torch profiler cannot see it: this runs its trainer (through `.llmq/bench_llmq.sh`, the `llmq`
kind's driver) under Nsight Compute (`ncu`), timing every kernel (`gpu__time_duration`, one pass, clocks and
caches left alone), and keeps the kernels of one optimizer step: those after the previous step's last AdamW
launch, through this step's last. CUDA graphs are off (the same kernels, launched one by one).

ncu runs the kernels one at a time with gaps between them, so the card runs cooler than in a real step: the sum
is the step's GPU busy time at best. Compare it with llm.q's own ms/step from the `llmq` kind in the same call.

Parameters: size, batch, accum, flags (as the `llmq` kind), steps (2: the last is kept), top (kernels listed,
30), script (".llmq/bench_llmq.sh"), ncu ("" = `ncu` on PATH, else the newest /opt/nvidia/nsight-compute/*/ncu).
Result: busy_ms (the kept step's kernel time), kernels, `categories` (ms each, the `profile` kind's categories),
`top` (kernels by time).
"""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from bench.kinds import Skip
from bench.llmq import script_path, spec
from bench.ncu import find_ncu, keep_raw, ncu_command, read_kernels, summarize
from bench.subproc import stream

STEP_END = "adamw_kernel"  # llm.q's update: one launch per parameter tensor, the last kernels of a step


def last_step(kernels: list[tuple[str, float]], end: str = STEP_END, min_between: int = 50
              ) -> list[tuple[str, float]]:
    """The kernels of the last whole optimizer step: after the previous step's last `end` launch, through this
    step's last. A step's `end` launches come in one run (fewer than `min_between` other kernels apart)."""
    ends = [i for i, (name, _) in enumerate(kernels) if end in name]
    if not ends:
        raise RuntimeError(f"no {end} launch among {len(kernels)} kernels: not one optimizer step was profiled")
    step_last = [a for a, b in zip(ends, ends[1:]) if b - a >= min_between] + [ends[-1]]
    if len(step_last) < 2:
        raise RuntimeError(f"only one optimizer step among {len(kernels)} kernels: run at least 2 steps")
    return kernels[step_last[-2] + 1: step_last[-1] + 1]


def run(size: str, batch: int, accum: int, steps: int = 2, flags: list[str] = (), top: int = 30,
        script: str = ".llmq/bench_llmq.sh", ncu: str = "") -> dict:
    path = script_path(script)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: copy ../shared/anchor/llmq into .llmq/ and carry it (bench/README.md)")
    tool = find_ncu(ncu)
    with tempfile.TemporaryDirectory(prefix="llmq-ncu-") as tmp:
        log, wrapper = Path(tmp) / "ncu.csv", Path(tmp) / "train"
        real = path.parent.resolve() / "train"
        wrapper.write_text("#!/bin/bash\nexec " + " ".join(f"'{a}'" for a in [*ncu_command(tool, log), real])
                           + ' "$@"\n')
        wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
        env = {**os.environ, "LLMQ_BIN": str(wrapper), "GRAPHS": "", "FINISH": "1", "GPUS": "1"}
        fin = stream(["bash", str(path), spec(size, "bf16", batch, accum, steps, list(flags))], env=env,
                     echo=lambda line: not line.startswith("==PROF==") or "rror" in line)
        if not log.is_file():
            raise RuntimeError(f"ncu wrote no results (exit status {fin.returncode}): {fin.last(3)}")
        keep_raw(log, f"llmq-ncu-{size}-{batch}x{accum}.csv")
        kernels = read_kernels(log)
    if not kernels:
        raise RuntimeError(f"ncu timed no kernel (exit status {fin.returncode}): {fin.last(3)}")
    return {"system": "llm.q", **summarize(last_step(kernels), top, f"llm.q {size} {batch} x {accum}")}


def dry_run(params: dict) -> dict:
    p = {"steps": 2, "flags": [], "script": ".llmq/bench_llmq.sh", **params}
    if not script_path(p["script"]).is_file():
        raise Skip(f"{p['script']} is missing (copy ../shared/anchor/llmq there)")
    raise Skip("profiles llm.q's CUDA kernels under ncu: needs a CUDA GPU")
