"""examples/custom_loop.py (the Python API guide's example) runs as a user would run it, in a fresh
directory: the loss goes down, the run log is complete, the checkpoint restores, and the export loads in
`transformers`, which computes the same eval loss as the example's final evaluation (fp32, 1e-5 relative)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qtrain.data.loader import TokenLoader  # noqa: E402
from qtrain.observe.log import read_log  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "custom_loop.py"
STEPS, B, T, EVAL_BATCHES = 20, 4, 64, 4


def test_custom_loop_example(tmp_path):
    pythonpath = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {**os.environ, "PYTHONPATH": pythonpath}  # this checkout's qtrain, whatever is installed
    # one intra-op thread: on a small shared machine, a second busy process makes two spinning OpenMP threads
    # several times slower than one (seen: 7 s vs 1.7 s per step on 2 cores); alone, one thread costs little
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--steps", str(STEPS), "--batch-size", str(B), "--seq-len",
                           str(T), "--eval-batches", str(EVAL_BATCHES)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    step_lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(step_lines) == STEPS
    assert "restored ckpt" in out and "exported to output/custom-loop" in out

    # the run log: 20 steps, the loss went down, eval before and after
    events = read_log(tmp_path / "logs" / "custom-loop.jsonl")
    steps = [e for e in events if e["log"] == "step"]
    evals = [e for e in events if e["log"] == "eval"]
    assert [s["step"] for s in steps] == list(range(STEPS))
    first = sum(s["loss"] for s in steps[:3]) / 3
    last = sum(s["loss"] for s in steps[-3:]) / 3
    assert last < first - 2.0, f"loss did not go down: {first:.3f} -> {last:.3f}"
    assert [e["step"] for e in evals] == [0, STEPS]
    assert evals[1]["loss"] < evals[0]["loss"] - 2.0
    assert os.path.isdir(tmp_path / "ckpt" / "custom-loop" / f"step_{STEPS:08d}")

    # the export loads in transformers and gives the example's final eval loss on the same batches
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "output" / "custom-loop", dtype=torch.float32)
    eval_bin = next((tmp_path / "data" / "qtrain-default").glob("*/eval.bin"))
    total, n = 0.0, 0
    with torch.no_grad():
        for x, y in TokenLoader(eval_bin, T, shuffle=False).iterate_eval_batches(B, EVAL_BATCHES):
            logits = model(input_ids=x).logits.float()
            total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
            n += y.numel()
    assert n == evals[1]["eval_tokens"] == B * T * EVAL_BATCHES
    assert total / n == pytest.approx(evals[1]["loss"], rel=1e-5)
