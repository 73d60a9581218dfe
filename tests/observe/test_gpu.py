"""GPU telemetry (`--log-gpu-util N`, `qtrain.observe.gpu`): the `gpu` log object in llm.q's fields and units,
the no-NVML / CPU paths (nothing sampled, said once), and on a GPU real NVML samples every N steps."""
from __future__ import annotations

import io
import json

import pytest
import torch

from qtrain.observe.gpu import THROTTLE_REASONS, GpuMonitor, make_gpu_sink, throttle_text
from qtrain.observe.log import RunLogger, read_log

SAMPLE = {"id": 0, "clock": 1980, "max_clock": 1980, "fan": None, "power": 612000, "power_limit": 700000,
          "temperature": 54, "temp_slowdown": 87, "gpu_util": 100, "mem_util": 37, "throttle": "power",
          "dram_free": 1 << 33, "dram_used": 1 << 34, "dram_total": 3 << 33, "pcie_rx": 210, "pcie_tx": 95}


def test_gpu_event_format(tmp_path):
    log = RunLogger(tmp_path / "log.jsonl", stream=io.StringIO(), verbosity=1)
    log.log_gpu(SAMPLE, step=25)
    log.close()
    [obj] = [e for e in read_log(tmp_path / "log.jsonl") if e["log"] == "gpu"]
    assert obj["step"] == 25 and {k: obj[k] for k in SAMPLE} == SAMPLE  # llm.q's names, units: mW, MHz, bytes
    assert "[GPU 0] util 100% | power 612 W | clock 1980 MHz | 54 C | throttle power" in log.stream.getvalue()


def test_throttle_reasons_by_name():
    assert throttle_text(0) == "" and throttle_text(0x1) == ""  # 0x1 = idle: not a throttle
    assert throttle_text(0x4 | 0x40) == "power,hw-thermal"
    assert len(set(THROTTLE_REASONS.values())) == len(THROTTLE_REASONS)


def test_cpu_runs_sample_nothing(tmp_path):
    log = RunLogger(tmp_path / "log.jsonl", stream=io.StringIO())
    assert make_gpu_sink(log, torch.device("cpu"), 25) is None
    assert make_gpu_sink(log, torch.device("cpu"), 0) is None
    log.close()
    assert [e for e in read_log(tmp_path / "log.jsonl") if e["log"] in ("gpu", "message")] == []


def test_without_nvml_there_is_no_monitor():
    import importlib.util
    if importlib.util.find_spec("pynvml") is not None:
        pytest.skip("nvidia-ml-py is installed here")
    assert GpuMonitor.create(0) is None


@pytest.mark.gpu
def test_gpu_run_logs_real_telemetry_every_n_steps(tmp_path, monkeypatch):
    pytest.importorskip("pynvml")
    from qtrain.cli.main import main
    from tests.cli.test_llmq_command_lines import TINY
    from qtrain.data.token_files import write_token_file
    import numpy as np

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(json.dumps(TINY.to_hf_dict()))
    write_token_file("train.bin", np.random.default_rng(0).integers(0, 500, 20000), vocab_size=512)
    assert main(["train", "--model", "tiny", "--from-scratch", "--train-file", "train.bin", "--steps", "5",
                 "--seq-len", "64", "--batch-size", "4", "--log-gpu-util", "2", "--no-save-training-state",
                 "--log-file", "log.jsonl"]) == 0
    gpu = [e for e in read_log("log.jsonl") if e["log"] == "gpu"]
    n = torch.cuda.device_count()  # every GPU of the machine, each sampled at steps 0, 2, 4
    assert [(e["step"], e["id"]) for e in gpu] == [(s, i) for s in (0, 2, 4) for i in range(n)]
    for e in gpu:
        assert e["power"] > 10_000 and e["power_limit"] >= e["power"] and e["clock"] > 100
        assert 0 <= e["gpu_util"] <= 100 and e["dram_total"] > e["dram_used"] > 0
