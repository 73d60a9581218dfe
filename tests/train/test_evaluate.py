"""`qtrain eval` / `evaluate_model`: qtrain's loss of a HF model directory on a token file equals the loss
`transformers` computes for the same model on the same sequences (fp32; different kernels, so 1e-5 relative).

The reference cuts the sequences itself from the raw token array (chunk c: inputs tokens[cT:cT+T], targets
tokens[cT+1:cT+T+1], masked targets ignored), so it does not reuse the loader it checks.
"""
from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.hf_fixtures import TINY_SIZES, save_tiny_hf_model  # noqa: E402

from qtrain.model.hf_io import load_hf_weights, load_model_config, save_hf_model  # noqa: E402
from qtrain.data.token_files import DataError, write_token_file  # noqa: E402
from qtrain.cli.evaluate import add_arguments as add_eval_args  # noqa: E402
from qtrain.cli.evaluate import run as run_eval  # noqa: E402
from qtrain.train.evaluate import evaluate_model  # noqa: E402

V = TINY_SIZES["vocab_size"]
T, B = 32, 4
N_TOKENS = 21 * T + 5  # 21 sequences: 5 full batches of 4 and a last batch of 1


def _tokens(seed: int = 0, n: int = N_TOKENS) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, V, size=n, dtype=np.int32)


def hf_reference(model_dir, tokens: np.ndarray, masks: np.ndarray | None, seq_len: int,
                 max_sequences: int | None = None) -> tuple[float, int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    chunks = (len(tokens) - 1) // seq_len
    if max_sequences is not None:
        chunks = min(chunks, max_sequences)
    x = torch.stack([torch.from_numpy(tokens[c * seq_len:(c + 1) * seq_len].astype(np.int64)) for c in range(chunks)])
    y = torch.stack([torch.from_numpy(tokens[c * seq_len + 1:(c + 1) * seq_len + 1].astype(np.int64))
                     for c in range(chunks)])
    if masks is not None:
        keep = torch.stack([torch.from_numpy(masks[c * seq_len + 1:(c + 1) * seq_len + 1].copy())
                            for c in range(chunks)])
        y[~keep] = -100
    with torch.no_grad():
        logits = model(input_ids=x).logits.float()
    total = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum", ignore_index=-100)
    n = int((y != -100).sum())
    return float(total) / n, n


@pytest.mark.parametrize("kind", ["qwen2", "llama3-tied", "qwen3"])
def test_loss_equals_transformers(tmp_path, kind):
    model_dir = save_tiny_hf_model(kind, tmp_path / "model", seed=3)
    tokens = _tokens(1)
    eval_file = write_token_file(tmp_path / "eval.bin", tokens, vocab_size=V)
    r = evaluate_model(model_dir, eval_file, seq_len=T, batch_size=B)
    ref, n = hf_reference(model_dir, tokens, None, T)
    assert r["tokens"] == n == 21 * T
    assert r["batches"] == 6
    assert r["loss"] == pytest.approx(ref, rel=1e-5)
    assert r["ppl"] == pytest.approx(math.exp(r["loss"]), rel=1e-12)


def test_model_saved_by_qtrain_masks_and_max_batches(tmp_path):
    """A directory written by qtrain's own exporter, a masked token file, a glob, and --max-batches."""
    src = save_tiny_hf_model("qwen2-tied", tmp_path / "hf", seed=5)
    cfg = load_model_config(src)
    params = load_hf_weights(src, cfg, dtype=torch.float32)
    model_dir = save_hf_model(tmp_path / "qtrain-export", cfg, params, dtype=torch.float32)

    tokens = _tokens(2)
    masks = np.random.default_rng(3).random(len(tokens)) < 0.7
    write_token_file(tmp_path / "data" / "eval-000.bin", tokens, vocab_size=V, masks=masks)

    r = evaluate_model(model_dir, str(tmp_path / "data" / "eval-*.bin"), seq_len=T, batch_size=B)
    ref, n = hf_reference(model_dir, tokens, masks, T)
    assert r["tokens"] == n < 21 * T
    assert r["loss"] == pytest.approx(ref, rel=1e-5)

    r2 = evaluate_model(model_dir, tmp_path / "data" / "eval-000.bin", seq_len=T, batch_size=B, max_batches=2,
                        lmhead_chunks=3)
    ref2, n2 = hf_reference(model_dir, tokens, masks, T, max_sequences=2 * B)
    assert (r2["tokens"], r2["batches"]) == (n2, 2)
    assert r2["loss"] == pytest.approx(ref2, rel=1e-5)


def test_cli_json_and_errors(tmp_path, capsys):
    model_dir = save_tiny_hf_model("llama", tmp_path / "model", seed=0)
    eval_file = write_token_file(tmp_path / "eval.bin", _tokens(4), vocab_size=V)
    p = argparse.ArgumentParser()
    add_eval_args(p)
    ns = p.parse_args(["--model", str(model_dir), "--eval-file", eval_file, "--seq-len", str(T), "--batch-size", "8",
                       "--device", "cpu", "--json"])
    assert run_eval(ns) == 0
    out = json.loads(capsys.readouterr().out)
    ref, n = hf_reference(model_dir, _tokens(4), None, T)
    assert out["tokens"] == n and out["dtype"] == "float32" and out["batches"] == 3
    assert out["loss"] == pytest.approx(ref, rel=1e-5)

    ns = p.parse_args(["--model", str(model_dir), "--eval-file", eval_file, "--seq-len", str(T)])
    assert run_eval(ns) == 0
    assert capsys.readouterr().out.startswith("eval loss ")

    # a token file whose vocabulary is larger than the model's, and a sequence longer than the file
    big = write_token_file(tmp_path / "big.bin", _tokens(5), vocab_size=V + 1)
    with pytest.raises(DataError, match="exceeds the model's vocab size"):
        evaluate_model(model_dir, big, seq_len=T, batch_size=B)
    short = write_token_file(tmp_path / "short.bin", _tokens(6, n=T), vocab_size=V)
    with pytest.raises(DataError, match="too few"):
        evaluate_model(model_dir, short, seq_len=T, batch_size=B)
    with pytest.raises(ValueError, match="must be positive"):
        evaluate_model(model_dir, eval_file, seq_len=T, batch_size=0)


def _subcommands() -> set[str]:
    from qtrain.cli.main import build_parser
    return {name for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction) for name in a.choices}


@pytest.mark.skipif("eval" not in _subcommands(), reason="`qtrain eval` not wired into qtrain/cli/main.py yet")
def test_qtrain_eval_command(tmp_path, capsys):
    from qtrain.cli.main import main

    model_dir = save_tiny_hf_model("qwen2", tmp_path / "model", seed=1)
    eval_file = write_token_file(tmp_path / "eval.bin", _tokens(6), vocab_size=V)
    assert main(["eval", "--model", str(model_dir), "--eval-file", eval_file, "--seq-len", str(T),
                 "--batch-size", str(B), "--device", "cpu", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["loss"] == pytest.approx(hf_reference(model_dir, _tokens(6), None, T)[0], rel=1e-5)
    assert main(["eval", "--model", str(tmp_path / "nope"), "--eval-file", eval_file]) == 2
    assert "not found" in capsys.readouterr().err
