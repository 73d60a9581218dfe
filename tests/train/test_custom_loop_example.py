"""examples/custom_loop.py (the Python API guide's example) runs as a user would run it, in a fresh
directory: the loss goes down, the run log is complete, the checkpoint restores, and the export loads in
`transformers`, which computes the same eval loss as the example's final evaluation (fp32, 1e-5 relative).
On the same token files as `qtrain train` (with masked targets), it logs exactly the same losses."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from qtrain.data.loader import TokenLoader  # noqa: E402
from qtrain.data.token_files import write_token_file  # noqa: E402
from qtrain.data.tokenizers import get_tokenizer  # noqa: E402
from qtrain.observe.log import read_log  # noqa: E402
from qtrain.options import Options  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "custom_loop.py"
STEPS, B, T, EVAL_BATCHES = 20, 4, 64, 4
MASKED_STEPS, MASKED_TOKENS = 4, 4_000


def example_env() -> dict[str, str]:
    pythonpath = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {**os.environ, "PYTHONPATH": pythonpath}  # this checkout's qtrain, whatever is installed
    # one intra-op thread: on a small shared machine, a second busy process makes two spinning OpenMP threads
    # several times slower than one (seen: 7 s vs 1.7 s per step on 2 cores); alone, one thread costs little
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def test_custom_loop_example(tmp_path):
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--steps", str(STEPS), "--batch-size", str(B), "--seq-len",
                           str(T), "--eval-batches", str(EVAL_BATCHES)], cwd=tmp_path, env=example_env(),
                          capture_output=True, text=True, timeout=600)
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


def test_custom_loop_logs_the_losses_of_qtrain_train(tmp_path):
    """The example and `qtrain train`, on the same token files with the same settings, log identical step
    losses, norms and learning rates (fp32 on CPU, one thread each: the same operations in the same order).
    The training file is real text (GPT-2 tokens of argparse's source) with runs of masked targets, so the
    micro-batches of a step have different numbers of valid targets, and a loop that normalised per
    micro-batch would log other losses."""
    tok = get_tokenizer("gpt2")
    tokens = np.asarray(tok.encode(Path(argparse.__file__).read_text(encoding="utf-8"))[:MASKED_TOKENS], np.int32)
    rng = np.random.default_rng(3)
    keep = np.ones(len(tokens), dtype=bool)
    for start in rng.integers(0, len(tokens), len(tokens) // 40):  # masked runs of 1..40 tokens
        keep[start:start + rng.integers(1, 41)] = False
    masked, eval_bin = tmp_path / "masked-train.bin", tmp_path / "eval.bin"
    write_token_file(masked, tokens, vocab_size=tok.vocab_size, masks=keep)
    # two batches: `qtrain train` evaluates on the whole file at the end
    eval_tokens = tok.encode(Path(textwrap.__file__).read_text(encoding="utf-8"))[:2 * 2 * 32 + 1]
    write_token_file(eval_bin, np.asarray(eval_tokens, np.int32), vocab_size=tok.vocab_size)
    settings = {"--batch-size": "2", "--seq-len": "32", "--grad-accumulation": "2", "--lr": "3e-3"}

    # the two micro-batches of a step (the loader's order with the training seed) differ in valid targets
    loader = TokenLoader(masked, 32, seed=Options().train_seed)
    valid = [int((loader.next_batch(2)[1] != -100).sum()) for _ in range(MASKED_STEPS * 2)]
    assert min(valid) > 0 and any(valid[2 * s] != valid[2 * s + 1] for s in range(MASKED_STEPS)), valid

    data = ["--train-file", str(masked), "--eval-file", str(eval_bin), "--steps", str(MASKED_STEPS),
            *sum(settings.items(), ())]
    for cwd, cmd in (("example", [str(EXAMPLE), *data, "--eval-batches", "1"]),
                     ("cli", ["-m", "qtrain.cli.main", "train", *data, "--model-dtype", "fp32", "--warmup", "3",
                              "--final-lr-fraction", "0.1", "--lr-schedule", "cosine", "--seed", "7",
                              "--device", "cpu", "--log-file", "cli.jsonl"])):
        (tmp_path / cwd).mkdir()
        proc = subprocess.run([sys.executable, *cmd], cwd=tmp_path / cwd, env=example_env(), capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    def steps(path) -> list[tuple[float, float, float]]:
        return [(e["loss"], e["norm"], e["lr"]) for e in read_log(path) if e["log"] == "step"]

    ours, cli = steps(tmp_path / "example" / "logs" / "custom-loop.jsonl"), steps(tmp_path / "cli" / "cli.jsonl")
    assert len(cli) == MASKED_STEPS
    assert ours == cli
