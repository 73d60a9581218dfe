"""Fault injection (tests/reliability/faults.py has the harness and what each trial checks).

CI runs a fast subset: three write/rename/unlink windows and one random moment for one process, and one
random kill of the `--gpus 2` launcher. The full suite (`-m slow`, >= 100 trials: every fault point an
uninterrupted run passes, random moments, and `--gpus 2` trials killing the launcher, a worker, or a worker
inside a window) is recorded in RELIABILITY.md; with QTRAIN_RELIABILITY_JSON=FILE it writes its counts there.
"""
from __future__ import annotations

import json
import os
import random
import time
import traceback

import pytest

from tests.reliability.faults import STEPS, Trial, fault_plan, make_template, reference, run_trial


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    return make_template(tmp_path_factory.mktemp("template"))


@pytest.fixture(scope="module")
def ref1(template, tmp_path_factory):
    return reference(template, tmp_path_factory.mktemp("ref1") / "root", gpus=1)


@pytest.fixture(scope="module")
def ref2(template, tmp_path_factory):
    return reference(template, tmp_path_factory.mktemp("ref2") / "root", gpus=2)


@pytest.mark.parametrize("point", [("ckpt.shard", 2), ("ckpt.delete.unlink", 1), ("export.rename", 1)])
def test_kill_inside_a_write_window(template, ref1, tmp_path, point):
    assert point in fault_plan(ref1[1])  # the run really passes there
    assert run_trial(Trial(f"{point}", fault=point), template, tmp_path / "root", ref1[0]) == "exit -9"


def test_kill_at_a_random_moment(template, ref1, tmp_path):
    rng = random.Random(17)
    run_trial(Trial("random", kill_after_step=rng.randrange(STEPS), delay=rng.uniform(0, 0.3)), template,
              tmp_path / "root", ref1[0])


def test_kill_the_gpus_2_launcher(template, ref2, tmp_path):
    assert run_trial(Trial("gpus2-launcher", gpus=2, kill_after_step=1, delay=0.1), template, tmp_path / "root",
                     ref2[0]) == "exit -9"


def full_plan(points1: list[str], points2: list[str], seed: int = 2024) -> list[Trial]:
    """The full suite's trials: every fault point of a one-process run, as many random moments, and
    --gpus 2 trials (launcher or worker killed at random moments, workers killed inside windows)."""
    rng = random.Random(seed)
    trials = [Trial(f"1p {name}#{n}", fault=(name, n)) for name, n in fault_plan(points1)]
    trials += [Trial(f"1p random {i}", kill_after_step=rng.randrange(STEPS), delay=round(rng.uniform(0, 0.5), 3))
               for i in range(35)]
    trials += [Trial(f"2p launcher {i}", gpus=2, kill_after_step=rng.randrange(STEPS),
                     delay=round(rng.uniform(0, 0.5), 3)) for i in range(14)]
    trials += [Trial(f"2p worker {i}", gpus=2, kill_after_step=rng.randrange(STEPS), delay=round(rng.uniform(0, 0.5), 3),
                     target="worker") for i in range(8)]
    per_rank = sorted({(name, n) for name, n in fault_plan(points2) if n <= 2})  # each rank counts its own hits
    trials += [Trial(f"2p {name}#{n}", gpus=2, fault=(name, n)) for name, n in rng.sample(per_rank, min(8, len(per_rank)))]
    return trials


@pytest.mark.slow
def test_full_fault_suite(template, ref1, ref2, tmp_path):
    trials = full_plan(ref1[1], ref2[1])
    assert len(trials) >= 100
    results = []
    for i, t in enumerate(trials):
        t0 = time.monotonic()
        try:
            killed = run_trial(t, template, tmp_path / f"t{i}", (ref1 if t.gpus == 1 else ref2)[0])
            results.append({"trial": t.name, "killed_run": killed, "passed": True})
        except Exception:
            results.append({"trial": t.name, "passed": False, "error": traceback.format_exc()[-3000:]})
        results[-1]["seconds"] = round(time.monotonic() - t0, 1)
        print(json.dumps(results[-1])[:400], flush=True)
    summary = {"trials": len(results), "passed": sum(r["passed"] for r in results),
               "one_process": sum(1 for t in trials if t.gpus == 1), "gpus_2": sum(1 for t in trials if t.gpus == 2),
               "killed": sum(1 for r in results if r.get("killed_run", "").startswith("exit -9")
                             or r.get("killed_run") == "exit 1"),
               "results": results}
    if os.environ.get("QTRAIN_RELIABILITY_JSON"):
        with open(os.environ["QTRAIN_RELIABILITY_JSON"], "w") as f:
            json.dump(summary, f, indent=1)
    failed = [r for r in results if not r["passed"]]
    assert not failed, "\n\n".join(f"{r['trial']}:\n{r['error']}" for r in failed)
