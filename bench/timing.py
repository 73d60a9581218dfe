"""Timing shared by the kernel benchmarks."""
from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch


def time_ms(fn: Callable[[], object], *, samples: int, warmup: int, target_ms: float = 2.0,
            device: str = "cuda") -> float:
    """Median milliseconds per call. Each sample times `reps` back-to-back calls between two events so
    event overhead is amortized; reps is picked from a first estimate so a sample lasts ~target_ms.
    On the CPU (dry runs) the same with the host clock."""
    if torch.device(device).type != "cuda":
        return _cpu_time_ms(fn, samples=samples, warmup=warmup)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    torch.cuda.synchronize()
    reps = max(1, int(target_ms / max(s.elapsed_time(e), 1e-3)))
    times = []
    for _ in range(samples):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / reps)
    return statistics.median(times)


def _cpu_time_ms(fn: Callable[[], object], *, samples: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(samples):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def graphed_ms(fn: Callable[[], object], *, samples: int, warmup: int) -> float:
    """Median milliseconds per call of `fn` captured in a CUDA graph: GPU time without host launch
    overhead (what a trainer using CUDA graphs or torch.compile's reduce-overhead would pay). nan if the
    capture fails."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception as exc:  # noqa: BLE001 - a benchmark reports and goes on
        print(f"  (CUDA graph capture failed: {type(exc).__name__}: {exc})", file=sys.stderr)
        return float("nan")
    return time_ms(graph.replay, samples=samples, warmup=warmup)
