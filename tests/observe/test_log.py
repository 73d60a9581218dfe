"""Run log: JSON Lines content, console format, rank gating, outliers, crash tolerance."""
import datetime as dt
import io
import json
import math
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from qtrain.observe.log import OutlierDetector, RunLogger, read_log

ROOT = Path(__file__).resolve().parents[2]


def make(tmp_path, **kw):
    out = io.StringIO()
    kw.setdefault("progress", False)
    return RunLogger(tmp_path / "logs" / "run.jsonl", stream=out, **kw), out


def test_events_round_trip(tmp_path):
    log, out = make(tmp_path, total_steps=100)
    log.log_cmd(["qtrain", "train", "--steps", "100"])
    log.log_options({"lr": 3e-4, "steps": 100, "model": "Qwen2.5-0.5B"})
    log.log_dataset("train", files=2, tokens=123456, seed=7)
    log.log_device(name="cpu", rank=0)
    log.log_sol(blocks=100, lm_head=10, attention=5, ns_per_token=None)
    log.log_step(0, step_tokens=4096, duration_ms=100.0, norm=1.5, loss=4.0, lr=1e-4, lse_max=12.0)
    log.log_eval(0, loss=3.0, eval_tokens=1000, duration_ms=50.0)
    log.log_memory(allocated=1 << 30, reserved=2 << 30, peak=3 << 30)
    log.message("hello")
    log.log_abs_maxes(0, {"act.ln1.0": 2.5})
    log.close()

    objs = read_log(tmp_path / "logs" / "run.jsonl")
    assert [o["log"] for o in objs] == ["cmd", "options", "dataset", "gpu-model", "sol", "step", "eval", "memory",
                                        "message", "abs-maxes"]
    for o in objs:
        assert {"log", "time", "step"} <= set(o)
        assert dt.datetime.fromisoformat(o["time"]).tzinfo is not None
    cmd, opts, ds, dev, sol, step, ev, mem, msg, am = objs
    assert cmd["cmd"] == ["qtrain", "train", "--steps", "100"]
    assert opts["options"] == {"lr": 3e-4, "steps": 100, "model": "Qwen2.5-0.5B"}
    assert (ds["split"], ds["files"], ds["tokens"], ds["seed"]) == ("train", 2, 123456, 7)
    assert sol["tps"] is None
    assert step == {**step, "step": 0, "step_tokens": 4096, "duration_ms": 100.0, "norm": 1.5, "loss": 4.0,
                    "lr": 1e-4, "tokens_per_s": 40960.0, "sol": None, "mfu": None, "lse_max": 12.0}
    assert ev["loss"] == 3.0 and ev["ppl"] == pytest.approx(math.exp(3.0)) and ev["train_avg"] == 4.0
    assert (mem["allocated"], mem["reserved"], mem["peak"]) == (1 << 30, 2 << 30, 3 << 30)
    assert msg["message"] == "hello" and msg["level"] == "info" and msg["step"] == 0
    assert am["abs_maxes"] == [{"name": "act.ln1.0", "value": 2.5}]


def test_console_lines_llmq_style(tmp_path):
    log, out = make(tmp_path, total_steps=1000)
    # SOL 456 ns/token over 1000 tokens = 0.456 ms of a 1 ms step -> 45.6%
    log.log_sol(blocks=1, lm_head=1, attention=1, ns_per_token=456.0, mfu_flops_per_token=1e9,
                bf16_peak_tflops=1000.0)
    obj = log.log_step(12, step_tokens=1000, duration_ms=1.0, norm=1.2345, loss=3.4567, lr=1e-3)
    lines = out.getvalue().splitlines()
    assert lines[-1] == "[T] step    12 [  1.3%] | time:    1 ms | norm   1.2345 | loss   3.4567 | tps  1.00M | sol 45.6%"
    assert obj["sol"] == pytest.approx(0.456)
    assert obj["mfu"] == pytest.approx(1e6 * 1e9 / 1e15)  # 1M tok/s * 1 GFLOP/token / 1 PFLOP/s
    log.log_step(13, step_tokens=1512, duration_ms=123.0, norm=1.0, loss=3.0433, lr=1e-3)
    assert out.getvalue().splitlines()[-1].startswith(
        "[T] step    13 [  1.4%] | time:  123 ms | norm   1.0000 | loss   3.0433 | tps  12.3k | sol")
    log.log_eval(13, loss=2.5, eval_tokens=2048, duration_ms=2048.0)  # before step 13: 13 of 1000 steps done
    assert out.getvalue().splitlines()[-1] == (
        "[V] step    13 [  1.3%] | time: 2048 ms | eval loss   2.5000 | ppl    12.182 | train avg   3.2500 | "
        "tps   1.0k")
    log.close()


def test_quiet_and_nonzero_rank(tmp_path):
    log, out = make(tmp_path, verbosity=-1)
    log.log_step(0, step_tokens=1, duration_ms=1.0, norm=1.0, loss=1.0, lr=1.0)
    assert out.getvalue() == ""  # quiet: no step lines
    log.log_eval(0, loss=1.0, eval_tokens=1, duration_ms=1.0)
    assert out.getvalue().startswith("[V]")
    log.close()

    out1 = io.StringIO()
    path1 = tmp_path / "rank1.jsonl"
    log1 = RunLogger(path1, rank=1, stream=out1, progress=True, total_steps=10)
    log1.log_step(0, step_tokens=1, duration_ms=1.0, norm=1.0, loss=1.0, lr=1.0)
    log1.message("x", level="warning")
    log1.close()
    assert out1.getvalue() == "" and not path1.exists()


def test_no_file(tmp_path):
    out = io.StringIO()
    log = RunLogger(None, stream=out, progress=False)
    assert log.log_step(0, step_tokens=10, duration_ms=1.0, norm=1.0, loss=1.0, lr=1.0)["tokens_per_s"] == 1e4
    log.close()
    assert out.getvalue().startswith("[T] step     0")


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_on_tty(tmp_path):
    out = _Tty()
    log = RunLogger(None, stream=out, total_steps=10)
    for s in range(3):
        log.log_step(s, step_tokens=10, duration_ms=1000.0, norm=1.0, loss=1.0, lr=1.0)
    text = out.getvalue()
    assert "\r\x1b[K[#########.....................] 3/10 | ETA 0:00:07" in text
    assert text.count("[T] step") == 3
    log.close()
    assert out.getvalue().endswith("\r\x1b[K")  # bar erased at the end
    plain = io.StringIO()  # not a TTY: plain lines only
    log = RunLogger(None, stream=plain, total_steps=10)
    log.log_step(0, step_tokens=10, duration_ms=1000.0, norm=1.0, loss=1.0, lr=1.0)
    assert "\r" not in plain.getvalue() and "ETA" not in plain.getvalue()


def test_outlier_detector():
    rng = random.Random(0)
    det = OutlierDetector(window=100, threshold=10.0)
    values = [3.0 + rng.gauss(0, 0.01) for _ in range(100)]
    assert all(det.update(v) is None for v in values)  # window still filling
    z = det.zscore(3.0)
    assert abs(z) < 5
    assert det.is_outlier(det.zscore(3.5))  # 50 sigma spike
    assert not det.is_outlier(det.zscore(2.5))  # a sudden drop is not a spike
    assert det.update(float("nan")) is None and len(det.values) == 100  # NaN never enters the window

    clone = OutlierDetector()
    clone.load_state_dict(json.loads(json.dumps(det.state_dict())))  # goes through checkpoint.json
    assert clone.zscore(3.02) == det.zscore(3.02)
    assert clone.update(3.01) == det.update(3.01)
    assert list(clone.values) == list(det.values)

    const = OutlierDetector(window=3)
    for v in (1.0, 1.0, 1.0):
        const.update(v)
    assert const.zscore(1.0) == 0.0 and const.zscore(1.1) == math.inf


def test_outlier_warning_logged(tmp_path):
    log, out = make(tmp_path, outlier_window=10)
    for s in range(10):
        log.log_step(s, step_tokens=1, duration_ms=1.0, norm=1.0 + 0.01 * (s % 2), loss=2.0 + 0.01 * (s % 3), lr=1.0)
    log.log_step(10, step_tokens=1, duration_ms=1.0, norm=1.0, loss=9.0, lr=1.0)
    log.log_step(11, step_tokens=1, duration_ms=1.0, norm=float("nan"), loss=2.0, lr=1.0)
    log.close()
    warnings = [o for o in read_log(tmp_path / "logs" / "run.jsonl") if o["log"] == "message"]
    assert [(w["step"], w["level"]) for w in warnings] == [(10, "warning"), (11, "warning")]
    assert "loss 9.0000 is an outlier" in warnings[0]["message"]
    assert "norm is nan" in warnings[1]["message"]
    assert "[!] step 10: loss" in out.getvalue()
    state = log.state_dict()
    assert len(state["loss_outliers"]["values"]) == 10 and len(state["norm_outliers"]["values"]) == 10


def test_read_log_truncated_and_corrupt(tmp_path):
    p = tmp_path / "log.jsonl"
    p.write_text('{"log": "step", "step": 1}\n{"log": "step", "step": 2}\n{"log": "st')
    assert [o["step"] for o in read_log(p)] == [1, 2]
    p.write_text('{"log": "step", "step": 1}\n{"log": "st\n{"log": "step", "step": 2}\n')
    with pytest.raises(ValueError, match=":2:"):
        read_log(p)
    # reopening a log that ends in a partial line drops it, then appends: the file stays valid
    p.write_text('{"log": "step", "time": "t", "step": 1}\n{"log": "st')
    log = RunLogger(p, stream=io.StringIO(), progress=False)
    log.message("resumed", step=2)
    log.close()
    assert [(o["log"], o["step"]) for o in read_log(p)] == [("step", 1), ("message", 2)]


def test_killed_process_leaves_valid_log(tmp_path):
    p = tmp_path / "killed.jsonl"
    code = textwrap.dedent(f"""
        import io, os, signal
        from qtrain.observe.log import RunLogger
        log = RunLogger({str(p)!r}, stream=io.StringIO(), progress=False)
        for s in range(50):
            log.log_step(s, step_tokens=1, duration_ms=1.0, norm=1.0, loss=1.0, lr=1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT)
    assert r.returncode != 0
    assert [o["step"] for o in read_log(p)] == list(range(50))


def test_progress_never_exceeds_100_percent(tmp_path):
    # a 3-step run: the final evaluation is logged at step 3, after the last step (it showed 133% before)
    log, out = make(tmp_path, total_steps=3)
    for s in range(3):
        log.log_step(s, step_tokens=10, duration_ms=1.0, norm=1.0, loss=1.0, lr=1.0)
    log.log_eval(3, loss=1.0, eval_tokens=10, duration_ms=1.0)
    log.close()
    shown = [line.split("[", 2)[2].split("%")[0].strip() for line in out.getvalue().splitlines()
             if line.startswith(("[T]", "[V]"))]
    assert shown == ["33.3", "66.7", "100.0", "100.0"]


def test_outputs_are_logged_and_printed(tmp_path):
    log, out = make(tmp_path, verbosity=-1)  # shown even when quiet: it is where the results are
    log.log_outputs(export="output/run", checkpoint="ckpt/run/step_00000010", log_file="logs/run.jsonl",
                    tensorboard=None)
    log.close()
    assert out.getvalue().splitlines()[-1] == \
        "[Done] export: output/run | checkpoint: ckpt/run/step_00000010 | log file: logs/run.jsonl"
    [obj] = [e for e in read_log(tmp_path / "logs" / "run.jsonl") if e["log"] == "outputs"]
    assert obj["export"] == "output/run" and "tensorboard" not in obj
    with pytest.raises(ValueError, match="log object fields"):
        log.log_outputs(log="x")


def test_a_failing_sink_is_dropped_with_a_warning(tmp_path):
    seen = []

    class Flaky:
        def on_event(self, obj):
            seen.append(obj["log"])
            if obj["log"] == "step":
                raise ConnectionError("dashboard down")

    log, out = make(tmp_path)
    log.add_sink(Flaky())
    log.log_step(0, step_tokens=1, duration_ms=1.0, norm=1.0, loss=1.0, lr=1.0)
    log.log_step(1, step_tokens=1, duration_ms=1.0, norm=1.0, loss=1.0, lr=1.0)  # still logged, sink gone
    log.close()
    assert seen == ["step"]
    assert [e["step"] for e in read_log(tmp_path / "logs" / "run.jsonl") if e["log"] == "step"] == [0, 1]
    assert "Flaky stopped: ConnectionError: dashboard down" in out.getvalue()
