"""The `torchtitan` bench kind on the CPU: run_tt.sh's summary line read back, the variant and environment a case
becomes (qwen3 flavors through TT_EXTRA, whose later flags win), what it refuses, its dry run; and (slow, where the
torchtitan wheels are installed: TT_SITE) a tiny Qwen3 MoE trained through the kind and run_tt.sh's CPU check."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from bench import torchtitan as tt
from bench.kinds import Skip
from bench.suite import load, suite_names

ANCHOR = Path("/work/shared/anchor/torchtitan")


def test_summary_line():
    ok = tt.parse_summary("TT model=tiny mm=bf16 batch=2x2 seq=64 tok/s=366 mfu=0.41% peak_mem=61.23GiB status=ok "
                          "variant=tiny-bf16 ac=none tflops=12.5 step_s=0.699 data_load=1.0% steps_logged=5 "
                          "last_loss=10.70526 first_step_s=1 wall_s=29")
    assert (ok["tps"], ok["mfu"], ok["peak_gib"], ok["step_ms"], ok["tt_status"], ok["ac"]) == (
        366, 0.41, 61.23, 699.0, "ok", "none")
    bad = tt.parse_summary("TT model=8B mm=bf16 batch=1x2 seq=32768 tok/s=NA mfu=NA peak_mem=NA status=oom "
                           "variant=8B-bf16-sac ac=selective-op tflops=NA step_s=NA data_load=NA steps_logged=0")
    assert "tps" not in bad and bad["tt_status"] == "oom" and bad["ac"] == "selective-op"


def test_variant_and_environment():
    variant, env = tt.command("Q30B-A3B-L10", "qwen3", 4, 2, 1024, 11, "bf16", False, "none", False, [], 2)
    assert variant == "tiny-bf16"  # run_tt.sh knows only its llama3 models: the flavor comes after, in TT_EXTRA
    assert env["TT_EXTRA"].split() == ["--experimental.custom_import", "tt_qtrain", "--model.name", "qwen3",
                                       "--model.flavor", "Q30B-A3B-L10"]
    assert (env["TT_LBS"], env["TT_GBS"], env["TT_SEQ"], env["TT_STEPS"], env["TT_OOM_FALLBACK"]) == (
        "4", "8", "1024", "11", "0")
    variant, env = tt.command("8B", "llama3", 1, 2, 32768, 6, "bf16", False, "sac", True, [], 2)
    assert variant == "8B-bf16-sac" and "--model.flavor" not in env["TT_EXTRA"] and env["TT_OOM_FALLBACK"] == "0"
    variant, env = tt.command("8B", "llama3", 1, 2, 32768, 6, "bf16", False, "full", False, [], 2)
    assert variant == "8B-bf16" and env["TT_EXTRA"].endswith("--activation_checkpoint.mode full")
    _, env = tt.command("Q30B-A3B-L10", "qwen3", 4, 2, 1024, 11, "fp8-rowwise", True, "none", False,
                        ["--quantize.linear.float8.filter_fqns", "output,router.gate"], 2)
    extra = env["TT_EXTRA"].split()
    assert extra[extra.index("--model.converters") + 1] == "quantize.linear.float8,quantize.grouped_mm.float8"
    assert extra[-2:] == ["--quantize.linear.float8.filter_fqns", "output,router.gate"]


@pytest.mark.parametrize("change, match", [({"mm": "fp8"}, "mm 'fp8'"), ({"ac": "selective"}, "ac 'selective'"),
                                           ({"flags": ["--job.description", "a b"]}, "splits TT_EXTRA")])
def test_refused_parameters(change, match):
    p = dict(model="8B", name="llama3", batch=1, accum=2, seq=8192, steps=6, mm="bf16", fp8_experts=False,
             ac="none", oom_retry=False, flags=[], workers=2)
    with pytest.raises(ValueError, match=match):
        tt.command(**{**p, **change})


def test_every_suite_case_makes_a_command(monkeypatch):
    monkeypatch.delenv("TT_CPU_CHECK", raising=False)
    cases = [r for name in suite_names() for r in load(name).runs if r.kind == "torchtitan"]
    assert {r.case for r in cases} >= {"qwen3-tt", "qwen3-tt-fp8", "tt-8B-32k-sac", "tt-8B-8k"}
    for r in cases:
        with pytest.raises(Skip, match="on the GPU: .*run_tt.sh"):  # no TT_CPU_CHECK here
            tt.dry_run(r.params)


def test_dry_run_without_cpu_check_skips(monkeypatch):
    monkeypatch.delenv("TT_CPU_CHECK", raising=False)
    with pytest.raises(Skip, match="TT_SEQ=32768 .*bash .tt/run_tt.sh 8B-bf16-sac"):
        tt.dry_run({"model": "8B", "batch": 1, "accum": 2, "seq": 32768, "ac": "sac"})


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("TT_SITE") or not ANCHOR.is_dir(),
                    reason="needs the torchtitan wheels installed to TT_SITE (bench/tt/README.md)")
def test_cpu_check_trains_a_tiny_qwen3_moe(tmp_path, monkeypatch):
    """The `moe` suite's torchtitan case, shrunk by the dry run, trains 5 steps of Qtiny-moe (grouped_mm experts)."""
    root = tmp_path / "root"
    shutil.copytree(ANCHOR, root / ".tt")
    monkeypatch.setenv("BENCH_ROOT", str(root))
    monkeypatch.setenv("TT_CPU_CHECK", "1")
    monkeypatch.setenv("OUT", str(tmp_path))
    case = next(r for r in load("moe").runs if r.case == "qwen3-tt")
    params = tt.dry_run(case.params)
    assert params["model"] == "Qtiny-moe"
    res = tt.run(**params)
    assert res["tt_status"] == "ok" and res["tps"] > 0 and res["steps_logged"] == "5"
    log = next(Path(res["tt_log"]).glob("tiny-bf16.log")).read_text()
    assert "Model qwen3 Qtiny-moe" in log and '"use_grouped_mm": true' in log


def test_start_seconds_from_the_launch_stamp_to_the_step_1_line():
    """The real wrapper (run_tt.sh's TT_PYTHON in the kind's runs) stamps a launch; a process that logs torchtitan's
    step-1 line (its logger's format, local time) 0.3 s later is read back as a start of 0.3 s and more (the
    interpreter's own start adds to it; 5 s bounds a loaded CI machine)."""
    import subprocess
    import sys
    code = ("import time, datetime; time.sleep(0.3); t = datetime.datetime.now(); "
            "print('[titan] ' + t.strftime('%Y-%m-%d %H:%M:%S,') + f'{t.microsecond // 1000:03d}' + "
            "' - root - INFO - step:  1  loss: 12.1  memory: 3.2GiB(4%)  tps: 1,234')")
    p = subprocess.run([str(tt.TT_DIR / "launch_stamp.sh"), "-c", code], env={**os.environ,
                       "TT_REAL_PYTHON": sys.executable}, capture_output=True, text=True, check=True)
    text = p.stderr + p.stdout  # run_tt.sh sends both to the log
    assert text.startswith("TT-LAUNCH ")
    assert 0.3 <= tt.start_seconds(text) < 5.0, text
    assert tt.start_seconds(p.stdout) is None and tt.start_seconds(p.stderr) is None  # one of the two missing
    later = text.replace("step:  1 ", "step:  2 ")
    assert tt.start_seconds(later) is None  # only step 1 ends the start


@pytest.mark.parametrize("stamped", [True, False])
def test_a_start_run_without_steady_steps_counts_by_its_start(tmp_path, monkeypatch, stamped):
    """A start case runs 2 steps: torchtitan's summary says ok(no_steady_steps) and has no tokens/s. With its launch
    stamp and step-1 line in the log, the start time is the result; without them it is a failure, as before."""
    monkeypatch.delenv("OUT", raising=False)
    lines = "echo \"TT-LAUNCH $(date +%s.%N)\"; "
    lines += ("python3 -c \"import datetime; t = datetime.datetime.now(); print('[titan] ' + "
              "t.strftime('%Y-%m-%d %H:%M:%S,') + f'{t.microsecond // 1000:03d}' + ' - root - INFO - step:  1  "
              "loss: 12.1')\"; ") if stamped else ""
    script = tmp_path / "run_tt.sh"
    script.write_text(f"#!/bin/bash\n{{ {lines}}} > \"$TT_LOGDIR/$1.log\" 2>&1\n"
                      "echo 'TT model=Q0.5B mm=bf16 batch=32x1 seq=1024 tok/s=NA mfu=NA status=ok(no_steady_steps) "
                      "variant=Q0.5B-bf16 steps_logged=2 first_step_s=3 wall_s=33'\n")
    if stamped:
        res = tt.run(model="Q0.5B", batch=32, accum=1, steps=2, script=str(script))
        assert res["tt_status"] == "ok(no_steady_steps)" and "tps" not in res and 0 <= res["start_s"] < 5.0
    else:
        with pytest.raises(RuntimeError, match="no_steady_steps"):
            tt.run(model="Q0.5B", batch=32, accum=1, steps=2, script=str(script))
