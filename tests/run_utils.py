"""A tiny real training setup for end-to-end tests of `qtrain train` (in-process through
`qtrain.cli.main.main`, or as a subprocess where a real kill or signal is needed).

    root = make_run_root(tmp_path)          # model/config.json (tiny llama), train.bin, eval.bin
    argv = train_argv(root, steps=6)        # `qtrain train` flags: fp32 on CPU, outputs under root
    rc = main(argv)  /  qtrain_subprocess(argv, cwd=root)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from qtrain.data.token_files import write_token_file
from qtrain.model.llama import LlamaConfig

REPO = str(Path(__file__).resolve().parents[1])
CFG = LlamaConfig(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0,
                  tie_word_embeddings=False, attention_bias=False, bos_token_id=0, eos_token_id=0)


def make_run_root(root: Path, *, tokens: int = 4000) -> Path:
    """model/config.json of CFG, train.bin and eval.bin (random ids below the vocabulary)."""
    root = Path(root)
    (root / "model").mkdir(parents=True, exist_ok=True)
    (root / "model" / "config.json").write_text(json.dumps(CFG.to_hf_dict()))
    rng = np.random.default_rng(7)
    write_token_file(root / "train.bin", rng.integers(0, CFG.vocab_size, tokens, dtype=np.int32),
                     vocab_size=CFG.vocab_size)
    write_token_file(root / "eval.bin", rng.integers(0, CFG.vocab_size, 600, dtype=np.int32),
                     vocab_size=CFG.vocab_size)
    return root


def train_argv(root: Path, *, steps: int = 6, name: str = "run", extra: tuple[str, ...] = (), **flags) -> list[str]:
    """`qtrain train` arguments for the tiny model; outputs under root/ckpt, root/out, root/logs (by --name)."""
    root = Path(root)
    opts = {"model": root / "model", "train-file": root / "train.bin", "eval-file": root / "eval.bin",
            "batch-size": 2, "seq-len": 16, "grad-accumulation": 1, "steps": steps, "ckpt-interval": 2,
            "eval-every-n-steps": 1000, "eval-num-steps": 0, "lr": 1e-3, "device": "cpu", "compile": "off",
            "model-dtype": "fp32", "name": name, "out-dir": root / "out" / "%n",
            "checkpoint-dir": root / "ckpt" / "%n", "log-file": root / "logs" / "%n.jsonl"}
    for k, v in flags.items():
        opts[k.replace("_", "-")] = v
    argv = ["train", "--from-scratch"]
    for k, v in opts.items():
        if v is not None:
            argv += [f"--{k}", str(v)]
    return argv + list(extra)


def subprocess_env(**extra: str) -> dict[str, str]:
    """This checkout's qtrain on the path, one thread per process (the CI machine has two cores)."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.update(extra)
    return env


def qtrain_popen(argv: list[str], *, cwd: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "qtrain.cli.main", *argv], cwd=cwd, env=subprocess_env(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def qtrain_run(argv: list[str], *, cwd: Path, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qtrain.cli.main", *argv], cwd=cwd, env=subprocess_env(**env),
                          capture_output=True, text=True, timeout=timeout)


def snapshot(root: Path, skip: tuple[str, ...] = ()) -> dict[str, bytes]:
    """Every file under root (relative path -> bytes), to assert that nothing changed."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = Path(dirpath) / f
            rel = str(p.relative_to(root))
            if not rel.startswith(skip):
                out[rel] = p.read_bytes()
    return out
