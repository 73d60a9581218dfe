"""The llmq-profile kind's reading of ncu's CSV and its choice of one optimizer step (the GPU run is the bench)."""
from pathlib import Path

import pytest

from bench.llmq_profile import last_step
from bench.ncu import read_kernels, summarize

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def row(i: int, name: str, value: str, unit: str = "nsecond", metric: str = "gpu__time_duration.sum") -> str:
    return (f'"{i}","7","train","h","{name}","1","7","(256, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler '
            f'metrics","{metric}","{unit}","{value}"')


def test_read_kernels_orders_by_id_converts_units_and_skips_prof_lines(tmp_path: Path):
    log = tmp_path / "ncu.csv"
    log.write_text("\n".join(["==PROF== Connected to process 7", HEADER, row(2, "b", "2.5", "usecond"),
                              row(1, "a", "1,200"), row(3, "c", "9", metric="sm__cycles"), "==PROF== Disconnected"]))
    assert read_kernels(log) == [("a", 1200.0), ("b", 2500.0)]


def test_read_kernels_names_an_unknown_unit(tmp_path: Path):
    log = tmp_path / "ncu.csv"
    log.write_text("\n".join([HEADER, row(1, "a", "3", "cycle")]))
    with pytest.raises(ValueError, match="unknown time unit 'cycle'.*ncu.csv|ncu.csv.*unknown time unit 'cycle'"):
        read_kernels(log)


def step(n_fwd: int, n_adam: int, tag: str) -> list[tuple[str, float]]:
    return [(f"{tag}_fwd", 1e6)] * n_fwd + [("void adamw_kernel<bf16>", 1e5)] * n_adam


def test_last_step_keeps_the_kernels_after_the_previous_update():
    init = [("rng_normal_kernel", 5e6)]
    kernels = init + step(60, 3, "s1") + step(60, 3, "s2") + [("eval_fwd", 1e6)] * 10
    kept = last_step(kernels)
    assert kept == step(60, 3, "s2")
    out = summarize(kept, top=5, label="test")
    assert out["kernels"] == 63 and out["busy_ms"] == pytest.approx(60 + 0.3)


def test_last_step_needs_two_updates():
    with pytest.raises(RuntimeError, match="only one optimizer step"):
        last_step(step(60, 3, "s1"))
    with pytest.raises(RuntimeError, match="no adamw_kernel"):
        last_step([("a", 1.0)] * 5)
