"""Kernel times from Nsight Compute (`ncu`), shared by the kinds that profile a step under it (`llmq-profile` for
llm.q, `profile` with ncu=true for qtrain), so that both systems' kernels are timed the same way: one at a time,
`gpu__time_duration` only (one pass, no replay), clocks and caches left as they are. ncu runs the kernels with
gaps between them, so the card runs cooler than in a real step and compute-bound kernels come out a few percent
faster: compare ncu sums with ncu sums, never with the torch profiler's."""
from __future__ import annotations

import csv
import glob
import os
import shutil
from pathlib import Path

from bench.kernel_categories import step_report

METRIC = "gpu__time_duration.sum"
NS_PER = {"nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6}


def find_ncu(ncu: str = "") -> str:
    found = ncu or shutil.which("ncu") or next(iter(sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"),
                                                             reverse=True)), "")
    if not found or not os.access(found, os.X_OK):
        raise FileNotFoundError(f"Nsight Compute's ncu not found ({ncu or 'PATH, /opt/nvidia/nsight-compute'})")
    return found


def ncu_command(tool: str, log: Path, from_start: bool = True) -> list[str]:
    """ncu's options before the profiled program; without `from_start` only kernels between the program's
    cudaProfilerStart and cudaProfilerStop (`torch.cuda.profiler.start/stop`), from every thread: an NVTX range
    would miss the kernels of autograd's backward, which its own thread launches."""
    cmd = [tool, "--clock-control", "none", "--cache-control", "none", "--metrics", METRIC, "--csv",
           "--print-units", "base", "--log-file", str(log)]
    return cmd + ([] if from_start else ["--profile-from-start", "off"])


def keep_raw(log: Path, name: str) -> None:
    """With $OUT set (the device call's output folder), the raw per-kernel CSV comes back with the call."""
    if os.environ.get("OUT"):
        shutil.copy(log, Path(os.environ["OUT"]) / name)


def read_kernels(log: Path) -> list[tuple[str, float]]:
    """(kernel name, ns) in launch order from ncu's `--csv` output; ncu's own `==PROF==` lines are skipped."""
    rows = [line for line in log.read_text(errors="replace").splitlines() if line.startswith('"')]
    out: list[tuple[int, str, float]] = []
    for r in csv.DictReader(rows):
        if r.get("Metric Name") != METRIC:
            continue
        unit = r.get("Metric Unit", "nsecond")
        if unit not in NS_PER:
            raise ValueError(f"{log}: unknown time unit {unit!r} for kernel {r['Kernel Name'][:80]}")
        out.append((int(r["ID"]), r["Kernel Name"], float(r["Metric Value"].replace(",", "")) * NS_PER[unit]))
    return [(name, ns) for _, name, ns in sorted(out)]


def summarize(kernels: list[tuple[str, float]], top: int, label: str) -> dict:
    """GPU time by the profile kind's categories and the top kernels by total time, printed and returned."""
    per_kernel: dict[str, tuple[float, int]] = {}
    for name, ns in kernels:
        ms, count = per_kernel.get(name, (0.0, 0))
        per_kernel[name] = (ms + ns / 1e6, count + 1)
    return {"kernels": len(kernels), **step_report(
        per_kernel, top, lambda busy: f"{label} under ncu: {len(kernels)} kernels, GPU busy {busy:.1f} ms")}
