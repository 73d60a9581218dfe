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

import csv
import glob
import os
import shutil
import stat
import tempfile
from pathlib import Path

from bench.kinds import Skip
from bench.llmq import script_path, spec
from bench.profile_step import category
from bench.subproc import stream

STEP_END = "adamw_kernel"  # llm.q's update: one launch per parameter tensor, the last kernels of a step
NS_PER = {"nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6}


def find_ncu(ncu: str = "") -> str:
    found = ncu or shutil.which("ncu") or next(iter(sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"),
                                                             reverse=True)), "")
    if not found or not os.access(found, os.X_OK):
        raise FileNotFoundError(f"Nsight Compute's ncu not found ({ncu or 'PATH, /opt/nvidia/nsight-compute'})")
    return found


def read_kernels(log: Path) -> list[tuple[str, float]]:
    """(kernel name, ns) in launch order from ncu's `--csv` output; ncu's own `==PROF==` lines are skipped."""
    rows = [line for line in log.read_text(errors="replace").splitlines() if line.startswith('"')]
    out: list[tuple[int, str, float]] = []
    for r in csv.DictReader(rows):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = r.get("Metric Unit", "nsecond")
        if unit not in NS_PER:
            raise ValueError(f"{log}: unknown time unit {unit!r} for kernel {r['Kernel Name'][:80]}")
        ns = float(r["Metric Value"].replace(",", "")) * NS_PER[unit]
        out.append((int(r["ID"]), r["Kernel Name"], ns))
    return [(name, ns) for _, name, ns in sorted(out)]


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


def summarize(kernels: list[tuple[str, float]], top: int) -> dict:
    sums: dict[str, float] = {}
    by_name: dict[str, list[float]] = {}
    for name, ns in kernels:
        sums[category(name)] = sums.get(category(name), 0.0) + ns / 1e6
        by_name.setdefault(name, []).append(ns / 1e6)
    busy = sum(sums.values())
    print(f"llm.q step under ncu: {len(kernels)} kernels, GPU busy {busy:.1f} ms")
    for cat, ms in sorted(sums.items(), key=lambda kv: -kv[1]):
        print(f"  {cat:16s} {ms:8.1f} ms  {100 * ms / busy:5.1f}%")
    tops = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    for name, times in tops:
        print(f"  {sum(times):8.2f} ms {len(times):5d}x  {category(name):14s} {name[:170]}")
    return {"busy_ms": round(busy, 1), "kernels": len(kernels),
            "categories": {k: round(v, 2) for k, v in sorted(sums.items(), key=lambda kv: -kv[1])},
            "top": [dict(ms=round(sum(t), 3), count=len(t), category=category(n), kernel=n[:170]) for n, t in tops],
            "summary": " ".join(f"{k} {v:.0f}" for k, v in sorted(sums.items(), key=lambda kv: -kv[1])[:4]) + " ms"}


def run(size: str, batch: int, accum: int, steps: int = 2, flags: list[str] = (), top: int = 30,
        script: str = ".llmq/bench_llmq.sh", ncu: str = "") -> dict:
    path = script_path(script)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: copy ../shared/anchor/llmq into .llmq/ and carry it (bench/README.md)")
    tool = find_ncu(ncu)
    with tempfile.TemporaryDirectory(prefix="llmq-ncu-") as tmp:
        log, wrapper = Path(tmp) / "ncu.csv", Path(tmp) / "train"
        real = path.parent.resolve() / "train"
        wrapper.write_text("#!/bin/bash\n"
                           f"exec '{tool}' --clock-control none --cache-control none --metrics gpu__time_duration.sum "
                           f"--csv --print-units base --log-file '{log}' '{real}' \"$@\"\n")
        wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
        env = {**os.environ, "LLMQ_BIN": str(wrapper), "GRAPHS": "", "FINISH": "1", "GPUS": "1"}
        fin = stream(["bash", str(path), spec(size, "bf16", batch, accum, steps, list(flags))], env=env,
                     echo=lambda line: not line.startswith("==PROF==") or "rror" in line)
        if not log.is_file():
            raise RuntimeError(f"ncu wrote no results (exit status {fin.returncode}): {fin.last(3)}")
        if os.environ.get("OUT"):  # the raw per-kernel times come back with the device call
            shutil.copy(log, Path(os.environ["OUT"]) / f"llmq-ncu-{size}-{batch}x{accum}.csv")
        kernels = read_kernels(log)
    if not kernels:
        raise RuntimeError(f"ncu timed no kernel (exit status {fin.returncode}): {fin.last(3)}")
    return {"system": "llm.q", **summarize(last_step(kernels), top)}


def dry_run(params: dict) -> dict:
    p = {"steps": 2, "flags": [], "script": ".llmq/bench_llmq.sh", **params}
    if not script_path(p["script"]).is_file():
        raise Skip(f"{p['script']} is missing (copy ../shared/anchor/llmq there)")
    raise Skip("profiles llm.q's CUDA kernels under ncu: needs a CUDA GPU")
