"""`qtrain plot` and `qtrain export-wandb` read llm.q's run logs (`qtrain.observe.llmq_log`): a JSON array of
objects with llm.q's types and fields (reference/llmq.md §2.2), written here the way llm.q's logger writes it
(`[`, one object per line with a trailing comma but the last, `]`), including a run killed mid-write.
"""
from __future__ import annotations

import json
import math

import pytest

from qtrain.cli.main import main
from qtrain.observe.history import LogError, load_run, read_events

TIME = "2025-09-26 10:11:{:02d}.123456789"


def llmq_objects(*, restart: bool = False) -> list[dict]:
    """An llm.q run: cmd, options, gpu-model, dataset, sol, 6 steps with an eval at 3 and a final eval, gpu
    telemetry at step 0 and 5; with `restart`, a second run resumed at step 4 (`--continue`)."""
    objs: list[dict] = [
        {"log": "cmd", "time": TIME.format(0), "step": 0, "cmd": ["./build/train", "--model=Qwen/Qwen2.5-0.5B"]},
        *({"log": "option", "time": TIME.format(0), "step": 0, "name": k, "value": v}
          for k, v in (("name", "llmq-run"), ("learning-rate", 1e-5), ("grad-accumulation", 8), ("batch-size", 8))),
        {"log": "gpu-model", "time": TIME.format(0), "step": 0, "rank": 0, "id": 0, "name": "NVIDIA GeForce RTX 4090",
         "memory": 25393692672},
        {"log": "dataset", "time": TIME.format(0), "step": 0, "split": "train", "files": 1, "tokens": 329663,
         "file_index": 0, "chunk_index": 0, "seed": 2209106498},
        {"log": "sol", "time": TIME.format(0), "step": 0, "rank": 0, "blocks": 2146959360, "lm_head": 1401421824,
         "attention": 150994944, "tps": 164000.0, "bf16_peak": 165.2, "fp8_peak": 330.3},
    ]
    for s in range(6):
        if s == 3:
            objs.append({"log": "eval", "time": TIME.format(s), "step": s, "eval_tokens": 65536,
                         "duration_ms": 165, "loss": 2.945187, "loss_1k": 2.91})
        objs.append({"log": "step", "time": TIME.format(s), "step": s, "step_tokens": 65536, "duration_ms": 1709,
                     "norm": 4.3 - 0.1 * s, "loss": 3.28 - 0.05 * s, "lr": 1e-5, "lse_max": 21.5,
                     "lse_mean": 12.1, "loss_1k": 3.2})
        if s in (0, 5):
            objs.append({"log": "gpu", "time": TIME.format(s), "step": s, "id": 0, "clock": 2520, "max_clock": 3105,
                         "fan": 30, "power": 287000, "power_limit": 450000, "temperature": 61, "temp_slowdown": 90,
                         "gpu_util": 99, "mem_util": 41, "throttle": "power", "dram_free": 1 << 30, "pcie_rx": 120,
                         "pcie_tx": 80})
    if restart:
        objs.append({"log": "cmd", "time": TIME.format(9), "step": 4, "cmd": ["./build/train", "--continue"]})
        objs.append({"log": "option", "time": TIME.format(9), "step": 4, "name": "name", "value": "llmq-run"})
        for s in (4, 5):
            objs.append({"log": "step", "time": TIME.format(9), "step": s, "step_tokens": 65536, "duration_ms": 1000,
                         "norm": 1.0, "loss": 2.0, "lr": 1e-5})
    objs.append({"log": "eval", "time": TIME.format(10), "step": 6, "eval_tokens": 33698, "duration_ms": 90,
                 "loss": 2.9, "loss_1k": 2.88})
    return objs


def write_llmq_log(path, objs, *, cut_at: int | None = None) -> str:
    """As llm.q's logger leaves the file: '[', objects one per line, ',' between them, then '\\n]'. With `cut_at`,
    a run killed while writing object `cut_at` (no closing bracket, that line cut in half)."""
    lines = [json.dumps(o) for o in objs]
    if cut_at is None:
        text = "[\n" + ",\n".join(lines) + "\n]"
    else:
        text = "[\n" + ",\n".join(lines[:cut_at]) + ",\n" + lines[cut_at][: len(lines[cut_at]) // 2]
    with open(path, "w") as f:
        f.write(text)
    return str(path)


def test_history_of_an_llmq_log(tmp_path):
    h = load_run(write_llmq_log(tmp_path / "log.json", llmq_objects()))
    assert h.name == "llmq-run" and h.options["learning_rate"] == 1e-5 and h.options["grad_accumulation"] == 8
    assert h.steps == [0, 1, 2, 3, 4, 5]
    assert h.loss == pytest.approx([3.28 - 0.05 * s for s in range(6)])
    assert h.tokens_per_s == pytest.approx([65536 * 1000 / 1709] * 6)  # derived: llm.q does not log it
    assert h.tokens == [65536 * s for s in range(6)]
    assert h.eval_steps == [3, 6] and h.eval_loss == [2.945187, 2.9]
    assert h.eval_ppl[0] == pytest.approx(math.exp(2.945187))


def test_restarted_llmq_run_keeps_the_last_version_of_each_step(tmp_path):
    h = load_run(write_llmq_log(tmp_path / "log.json", llmq_objects(restart=True)))
    assert h.steps == [0, 1, 2, 3, 4, 5] and h.loss[4:] == [2.0, 2.0]


def test_killed_llmq_run_drops_only_the_cut_line(tmp_path):
    objs = llmq_objects()
    cut = next(i for i, o in enumerate(objs) if o["log"] == "step" and o["step"] == 4)
    h = load_run(write_llmq_log(tmp_path / "log.json", objs, cut_at=cut))
    assert h.steps == [0, 1, 2, 3]


def test_corrupt_llmq_log_names_the_file(tmp_path):
    path = tmp_path / "log.json"
    path.write_text('[\n{"log": "cmd", "step": 0},\n{"log": "step", "step": 0, oops},\n{"log": "eval"}\n]')
    with pytest.raises(LogError, match="log.json"):
        read_events(path)
    path.write_text("[1, 2]")
    with pytest.raises(LogError, match="not an object"):
        read_events(path)


def test_qtrain_plot_reads_an_llmq_log(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    log = write_llmq_log(tmp_path / "log.json", llmq_objects())
    out = tmp_path / "plot.png"
    assert main(["plot", log, "--out", str(out), "--no-show"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_qtrain_export_wandb_reads_an_llmq_log(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from tests.observe.test_wandb import offline_run

    for var, val in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_ERROR_REPORTING": "false",
                     "WANDB_CONFIG_DIR": str(tmp_path / "cfg"), "WANDB_CACHE_DIR": str(tmp_path / "cache"),
                     "WANDB_DATA_DIR": str(tmp_path / "data")}.items():
        monkeypatch.setenv(var, val)
    from qtrain.observe.wandb import export_wandb
    r = export_wandb(write_llmq_log(tmp_path / "log.json", llmq_objects()), project="p", dir=tmp_path / "w")
    assert (r.steps, r.evals, r.name) == (6, 2, "llmq-run")
    run = offline_run(r.run_dir)
    assert run["config"]["learning_rate"] == 1e-5 and run["config"]["device_name"] == "NVIDIA GeForce RTX 4090"
    h = run["history"]
    assert h[0]["train/loss"] == 3.28 and h[0]["train/lse_max"] == 21.5 and h[3]["eval/loss"] == 2.945187
    assert h[0]["gpu/power"] == 287000 and h[5]["gpu/gpu_util"] == 99 and "gpu/throttle" not in h[5]
    assert h[6]["eval/loss"] == 2.9
