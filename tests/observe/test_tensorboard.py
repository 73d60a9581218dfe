"""TensorBoardSink writes the run log's metrics through torch's SummaryWriter; read back with TensorBoard's
own reader (EventAccumulator), the scalars have exactly the logged values, steps and wall times."""
from __future__ import annotations

import datetime as dt
import io
import math

import pytest

pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from qtrain.observe.log import RunLogger  # noqa: E402
from qtrain.observe.tensorboard import TensorBoardSink, replay_log  # noqa: E402


def read_scalars(log_dir) -> dict[str, list[tuple[int, float, float]]]:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value, e.wall_time) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_texts(log_dir) -> dict[str, list[tuple[int, str]]]:
    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]
            for tag in acc.Tags()["tensors"]}


def f32(x: float) -> float:
    """Scalars are stored as float32."""
    import struct
    return struct.unpack("f", struct.pack("f", x))[0]


def run_logged(path, sink: TensorBoardSink) -> list[dict]:
    """A short run through the real RunLogger; every object it returns goes to the sink (as loop.py does)."""
    objs = []
    log = RunLogger(path, stream=io.StringIO())
    sink.on_event(log.log("cmd", cmd=["qtrain", "train"]))
    sink.on_event(log.log("options", options={"name": "tb", "learning_rate": 3e-3, "model": "a|b"}))
    log.log_sol(blocks=1000, lm_head=100, attention=10, ns_per_token=2.0, mfu_flops_per_token=1200.0,
                bf16_peak_tflops=1e-6)
    for s in range(6):
        if s == 3:
            objs.append(log.log_eval(s, loss=3.25, eval_tokens=512, duration_ms=40.0))
        objs.append(log.log_step(s, step_tokens=256, duration_ms=100.0 + s, norm=1.5 / (s + 1), loss=5.0 - 0.3 * s,
                                 lr=1e-3 * (s + 1)))
    objs.append(log.log_eval(6, loss=2.5, eval_tokens=1024, duration_ms=80.0))
    log.message("loss spiked", level="warning")
    log.log_memory(allocated=3 << 20, reserved=4 << 20, peak=5 << 20)
    log.close()
    for o in objs:
        sink.on_event(o)
    # log_memory / message return nothing: feed the objects they wrote (a logger-level hook would see those)
    from qtrain.observe.log import read_log
    for o in read_log(path):
        if o["log"] in ("memory", "message"):
            sink.on_event(o)
    for unknown in ({"log": "abs-maxes", "step": 1, "abs_maxes": []}, {"log": "gpu", "step": 2, "clock": 1.0},
                    {"step": 3}, {}, None):
        sink.on_event(unknown)  # ignored
    return objs


def test_metrics_read_back_exactly(tmp_path):
    with TensorBoardSink(tmp_path / "tb") as sink:
        objs = run_logged(tmp_path / "log.jsonl", sink)
    steps = [o for o in objs if o["log"] == "step"]
    evals = [o for o in objs if o["log"] == "eval"]
    sc = read_scalars(tmp_path / "tb")

    assert set(sc) == {"train/loss", "train/norm", "train/lr", "train/tokens_per_s", "train/sol", "train/mfu",
                       "eval/loss", "eval/ppl", "memory/allocated_mib", "memory/reserved_mib", "memory/peak_mib"}
    for field in ("loss", "norm", "lr", "tokens_per_s", "sol", "mfu"):
        assert [(s, v) for s, v, _ in sc[f"train/{field}"]] == [(o["step"], f32(o[field])) for o in steps], field
    assert [(s, v) for s, v, _ in sc["eval/loss"]] == [(3, 3.25), (6, 2.5)]
    assert [(s, v) for s, v, _ in sc["eval/ppl"]] == [(3, f32(math.exp(3.25))), (6, f32(math.exp(2.5)))]
    assert [(s, v) for s, v, _ in sc["memory/peak_mib"]] == [(6, 5.0)]
    # tokens/s is what RunLogger derived: 256 tokens in 100 ms -> 2560
    assert sc["train/tokens_per_s"][0][1] == 2560.0
    # wall time = the log object's time stamp
    for (_, _, wt), o in zip(sc["train/loss"], steps):
        assert wt == pytest.approx(dt.datetime.fromisoformat(o["time"]).timestamp(), abs=1e-3)
    assert [(s, v) for s, v, _ in sc["eval/loss"]] == [(o["step"], o["loss"]) for o in evals]

    texts = read_texts(tmp_path / "tb")
    assert "options/text_summary" in texts and "warnings/text_summary" in texts
    assert "| learning_rate | 0.003 |" in texts["options/text_summary"][0][1]
    assert "a\\|b" in texts["options/text_summary"][0][1]
    assert texts["warnings/text_summary"] == [(6, "loss spiked")]


def test_replay_log_matches_live_sink(tmp_path):
    with TensorBoardSink(tmp_path / "live") as sink:
        run_logged(tmp_path / "log.jsonl", sink)
    n = replay_log(tmp_path / "log.jsonl", tmp_path / "replayed")
    assert n > 10
    live, replayed = read_scalars(tmp_path / "live"), read_scalars(tmp_path / "replayed")
    assert live == replayed


def test_nonfinite_and_missing_values(tmp_path):
    with TensorBoardSink(tmp_path / "tb") as sink:
        sink.on_event({"log": "step", "time": "2026-01-01T00:00:00.000+00:00", "step": 0, "loss": float("nan"),
                       "norm": float("inf"), "lr": 1e-3, "tokens_per_s": None, "sol": None, "mfu": None})
        sink.on_event({"log": "step", "step": 1, "loss": 2.0, "norm": 1.0, "lr": 2e-3})  # no time: now
        sink.on_event({"log": "eval", "time": "not a time", "step": 2, "loss": 1.0})
    sc = read_scalars(tmp_path / "tb")
    assert set(sc) == {"train/loss", "train/norm", "train/lr", "eval/loss"}
    assert math.isnan(sc["train/loss"][0][1]) and sc["train/loss"][1][:2] == (1, 2.0)
    assert sc["train/norm"][0][1] == math.inf
    assert sc["train/loss"][0][2] == dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc).timestamp()
    assert sc["eval/loss"][0][:2] == (2, 1.0)


def _loop_has_tensorboard() -> bool:
    import inspect

    import qtrain.train.loop as loop
    return "TensorBoardSink" in inspect.getsource(loop)


@pytest.mark.skipif(not _loop_has_tensorboard(), reason="--tensorboard not wired into qtrain/train/loop.py yet")
def test_qtrain_train_tensorboard(tmp_path, monkeypatch):
    """`qtrain train --tensorboard DIR` (tiny model, random tokens, 4 steps): the scalars equal the run log's."""
    import numpy as np

    from qtrain.cli.main import main
    from qtrain.data.token_files import write_token_file
    from qtrain.observe.log import read_log

    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    write_token_file("train.bin", rng.integers(0, 50257, 2000, dtype=np.int32), vocab_size=50257)
    write_token_file("eval.bin", rng.integers(0, 50257, 100, dtype=np.int32), vocab_size=50257)
    assert main(["train", "--train-file", "train.bin", "--eval-file", "eval.bin", "--model-dtype", "fp32",
                 "--batch-size", "2", "--seq-len", "16", "--grad-accumulation", "1", "--steps", "4", "--warmup", "1",
                 "--eval-every-n-steps", "2", "--eval-num-steps", "1", "--log-file", "log.jsonl",
                 "--tensorboard", "tb/%n", "--name", "tbrun", "--out-dir", "out", "--checkpoint-dir", "ckpt",
                 "--no-save-training-state"]) == 0
    events = read_log("log.jsonl")
    steps = [e for e in events if e["log"] == "step"]
    evals = [e for e in events if e["log"] == "eval"]
    sc = read_scalars(tmp_path / "tb" / "tbrun")
    for field in ("loss", "norm", "lr", "tokens_per_s"):
        assert [(s, v) for s, v, _ in sc[f"train/{field}"]] == [(e["step"], f32(e[field])) for e in steps], field
    assert [(s, v) for s, v, _ in sc["eval/loss"]] == [(e["step"], f32(e["loss"])) for e in evals]
    assert [s for s, _, _ in sc["eval/loss"]] == [2, 4]
