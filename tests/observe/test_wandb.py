"""export_wandb replays a JSON Lines log into an *offline* W&B run (no server is contacted: WANDB_MODE=offline,
error reporting off, every wandb directory inside tmp_path). The test reads the run back from the offline run's
`.wandb` file, the record log `wandb sync` would upload: a LevelDB-style log (32 KiB blocks, 7-byte record
headers: crc32, length, type) of `wandb_internal_pb2.Record` protobufs. wandb 0.31 no longer ships a Python
reader for it (the Go core writes it), so the ~20 lines of `read_wandb_records` below do it."""
from __future__ import annotations

import argparse
import glob
import io
import json
import math
import os
import struct
import zlib

import pytest

wandb = pytest.importorskip("wandb")

from qtrain.observe.history import LogError  # noqa: E402
from qtrain.cli.wandb import add_arguments as add_export_wandb_args  # noqa: E402
from qtrain.cli.wandb import run as run_export_wandb  # noqa: E402
from qtrain.observe.wandb import export_wandb  # noqa: E402
from qtrain.observe.log import RunLogger  # noqa: E402

BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_wandb_records(path: str) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1, data[:7]
    pos, payloads, pending = 7, [], b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # block trailer padding
            pos += left
            continue
        crc, length, typ = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        if typ == 0 and length == 0:  # zero padding to the end of a block
            pos += left
            continue
        assert zlib.crc32(bytes([typ]) + chunk) == crc, f"bad record checksum at byte {pos}"
        pos += 7 + length
        if typ == FULL:
            payloads.append(chunk)
        elif typ == FIRST:
            pending = chunk
        elif typ == MIDDLE:
            pending += chunk
        elif typ == LAST:
            payloads.append(pending + chunk)
    records = []
    for p in payloads:
        r = pb.Record()
        r.ParseFromString(p)
        records.append(r)
    return records


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def offline_run(run_dir: str) -> dict:
    """{'run': RunRecord, 'config': {...}, 'history': {step: {key: value}}} of an offline run directory."""
    files = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    assert len(files) == 1, files
    out: dict = {"run": None, "config": {}, "history": {}}
    for r in read_wandb_records(files[0]):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out["run"] = r.run
            out["config"].update({_key(i): json.loads(i.value_json) for i in r.run.config.update})
        elif kind == "config":
            out["config"].update({_key(i): json.loads(i.value_json) for i in r.config.update})
        elif kind == "history":
            row = {_key(i): json.loads(i.value_json) for i in r.history.item}
            assert r.history.step.num not in out["history"], "one history row per step"
            out["history"][r.history.step.num] = row
    return out


@pytest.fixture
def offline_env(tmp_path, monkeypatch):
    for var, val in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_ERROR_REPORTING": "false",
                     "WANDB_DIR": str(tmp_path / "wandb-default"), "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
                     "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"), "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
                     }.items():
        monkeypatch.setenv(var, val)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    wandb.teardown()  # stop wandb's service process


def write_log(path, *, name="wb-run"):
    """Steps 0-5 with evals at 3 and 6, then a run resumed from step 4 (whose steps 4-5 replace the first
    run's), through the real RunLogger."""
    log = RunLogger(path, stream=io.StringIO())
    log.log_cmd(["qtrain", "train"])
    log.log_options({"name": name, "learning_rate": 3e-3, "batch_size": 4, "seq_len": 64})
    log.log_dataset("train", files=1, tokens=300_000, seed=1)
    log.log_dataset("eval", files=1, tokens=15_000, seed=2)
    log.log_device(name="cpu", rank=0, world=1)
    for s in range(6):
        if s == 3:
            log.log_eval(s, loss=4.0, eval_tokens=512, duration_ms=40.0)
        log.log_step(s, step_tokens=256, duration_ms=100.0, norm=1.0 + s, loss=6.0 - s, lr=1e-3 * (s + 1),
                     epoch=s / 100)
    log.close()
    log = RunLogger(path, stream=io.StringIO())  # resumed: appends to the same log
    log.log_cmd(["qtrain", "train", "--continue"])
    log.log_options({"name": name, "learning_rate": 3e-3, "batch_size": 4, "seq_len": 64})
    for s in range(4, 6):
        log.log_step(s, step_tokens=256, duration_ms=50.0, norm=0.5, loss=1.5 if s == 4 else float("nan"),
                     lr=9e-3, lse_max=12.5)
    log.log_eval(6, loss=3.5, eval_tokens=1024, duration_ms=80.0)
    log.close()


def test_offline_history_config_and_name(offline_env):
    write_log("run.jsonl")
    r = export_wandb("run.jsonl", project="qtrain-test", dir="out")
    assert (r.steps, r.evals, r.name) == (6, 2, "wb-run")
    assert os.path.basename(r.run_dir).startswith("offline-run-") and r.run_dir.endswith(r.run_id)
    assert os.path.realpath(os.path.dirname(r.run_dir)) == os.path.realpath(os.path.join("out", "wandb"))

    run = offline_run(r.run_dir)
    assert run["run"].display_name == "wb-run" and run["run"].project == "qtrain-test"
    cfg = run["config"]
    assert cfg["learning_rate"] == 3e-3 and cfg["batch_size"] == 4 and cfg["name"] == "wb-run"
    assert cfg["dataset/train/tokens"] == 300_000 and cfg["dataset/eval/files"] == 1 and cfg["device_name"] == "cpu"

    h = run["history"]
    assert sorted(h) == [0, 1, 2, 3, 4, 5, 6]
    for s in range(4):  # first run's steps
        assert h[s]["train/loss"] == 6.0 - s and h[s]["train/norm"] == 1.0 + s
        assert h[s]["train/lr"] == pytest.approx(1e-3 * (s + 1), rel=1e-15)
        assert h[s]["train/tokens_per_s"] == 2560.0 and h[s]["train/step_tokens"] == 256
        assert h[s]["train/duration_ms"] == 100.0 and h[s]["train/tokens"] == 256 * s
        assert h[s]["train/epoch"] == s / 100
        assert not any(k.startswith("eval/") for k in h[s]) or s == 3
    # the eval before step 3 shares step 3's row
    assert h[3]["eval/loss"] == 4.0 and h[3]["eval/eval_tokens"] == 512
    assert h[3]["eval/ppl"] == pytest.approx(math.exp(4.0), rel=1e-15) and h[3]["eval/tokens"] == 3 * 256
    # steps 4-5 come from the resumed run (the first run's values for them are gone)
    assert h[4]["train/loss"] == 1.5 and h[4]["train/lr"] == 9e-3 and h[4]["train/lse_max"] == 12.5
    assert h[4]["train/tokens_per_s"] == 5120.0
    assert math.isnan(h[5]["train/loss"])
    # the final eval, after the last step
    assert set(k for k in h[6] if not k.startswith("_")) == {
        "eval/loss", "eval/ppl", "eval/eval_tokens", "eval/duration_ms", "eval/train_avg", "eval/tokens"}
    assert h[6]["eval/loss"] == 3.5 and h[6]["eval/tokens"] == 6 * 256 and h[6]["_step"] == 6
    # nothing that was not exported
    assert not any(k.startswith(("train/time", "train/log", "eval/log", "train/sol", "train/mfu"))
                   for row in h.values() for k in row)


def test_cli_name_override_and_errors(offline_env, capsys):
    write_log("run.jsonl")
    p = argparse.ArgumentParser()
    add_export_wandb_args(p)
    ns = p.parse_args(["run.jsonl", "--project", "proj", "--name", "renamed", "--dir", "cli-out", "--tag", "x"])
    assert run_export_wandb(ns) == 0
    out = capsys.readouterr().out
    assert "exported 6 steps and 2 evaluations" in out and "wandb sync" in out
    (run_dir,) = glob.glob(os.path.join("cli-out", "wandb", "offline-run-*"))
    run = offline_run(run_dir)
    assert run["run"].display_name == "renamed" and list(run["run"].tags) == ["x"]
    assert run["history"][0]["train/loss"] == 6.0

    with pytest.raises(LogError, match="cannot read log"):
        export_wandb("missing.jsonl", project="p")
    with open("bad.jsonl", "w") as f:
        f.write('{"log": "step"\n{"log": "eval", "step": 1}\n')
    with pytest.raises(LogError, match="bad.jsonl:1"):
        export_wandb("bad.jsonl", project="p")
    with pytest.raises(LogError, match="--mode"):
        export_wandb("run.jsonl", project="p", mode="cloud")


def _subcommands() -> set[str]:
    from qtrain.cli.main import build_parser
    return {name for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction) for name in a.choices}


@pytest.mark.skipif("export-wandb" not in _subcommands(),
                    reason="`qtrain export-wandb` not wired into qtrain/cli/main.py yet")
def test_qtrain_export_wandb_command(offline_env, capsys):
    from qtrain.cli.main import main

    write_log("run.jsonl", name="via-cli")
    assert main(["export-wandb", "run.jsonl", "--project", "p", "--dir", "o"]) == 0
    (run_dir,) = glob.glob(os.path.join("o", "wandb", "offline-run-*"))
    run = offline_run(run_dir)
    assert run["run"].display_name == "via-cli" and run["history"][6]["eval/loss"] == 3.5
    assert main(["export-wandb", "missing.jsonl", "--project", "p"]) == 2


def test_live_wandb_logging_of_a_training_run(offline_env):
    """`qtrain train --wandb PROJECT` (WANDB_MODE=offline): every step and evaluation reaches the live run as it
    trains, under the same names as the replay, with the options as config."""
    import numpy as np

    from qtrain.cli.main import main
    from qtrain.data.token_files import write_token_file
    from qtrain.model.llama import LlamaConfig
    from qtrain.observe.log import read_log

    cfg = LlamaConfig(model_type="llama", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    os.makedirs("tiny")
    with open("tiny/config.json", "w") as f:
        json.dump(cfg.to_hf_dict(), f)
    rng = np.random.default_rng(0)
    write_token_file("train.bin", rng.integers(0, 256, 2000), vocab_size=256)
    write_token_file("eval.bin", rng.integers(0, 256, 200), vocab_size=256)
    assert main(["train", "--model", "tiny", "--from-scratch", "--train-file", "train.bin", "--eval-file", "eval.bin",
                 "--steps", "4", "--eval-every-n-steps", "2", "--eval-num-steps", "1", "--seq-len", "16",
                 "--batch-size", "2", "--grad-accumulation", "2", "--model-dtype", "fp32", "--name", "live-run",
                 "--wandb", "qtrain-live", "--debug-time-breakdown", "--no-save-training-state",
                 "--log-file", "run.jsonl"]) == 0
    wandb.teardown()  # the offline run's files are complete once wandb's service has stopped
    (run_dir,) = glob.glob(os.path.join(os.environ["WANDB_DIR"], "wandb", "offline-run-*"))
    run = offline_run(run_dir)
    assert run["run"].display_name == "live-run" and run["run"].project == "qtrain-live"
    assert run["config"]["wandb"] == "qtrain-live" and run["config"]["batch_size"] == 2
    h = run["history"]
    steps = [e for e in read_log("run.jsonl") if e["log"] == "step"]
    assert sorted(h) == [0, 1, 2, 3, 4]
    for e in steps:
        row = h[e["step"]]
        assert row["train/loss"] == e["loss"] and row["train/norm"] == e["norm"] and row["train/lr"] == e["lr"]
        assert row["train/tokens"] == 64 * e["step"] and len([k for k in row if k.startswith("time/")]) >= 2
    evals = {e["step"]: e["loss"] for e in read_log("run.jsonl") if e["log"] == "eval"}
    assert {s: h[s]["eval/loss"] for s in (2, 4)} == evals  # the periodic eval and the final one
    assert [m["message"] for m in read_log("run.jsonl") if m["log"] == "message" and "W&B run" in m["message"]]
