"""--dry-run support: the kinds shrink their cases to something a CPU runs in seconds (same model family, same
options, a tiny model), so CI tests the harness, the suites and the benchmark code without a GPU."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile

from bench.compat import model_config

TINY_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16)
"""bf16 matmuls are slow on a CPU (the 50k-vocab LM head of qtrain-tiny takes seconds): keep every dim small."""


def tiny_model_dir(model: str, **overrides) -> str:
    """A model directory (config.json only, for --from-scratch) of `model`'s family (bias, tied embeddings,
    qk-norm, rope scaling) at TINY_SHAPE (with `overrides`, e.g. the real vocab_size); written once per family
    under the temp dir."""
    shape = {**TINY_SHAPE, **overrides}
    cfg = model_config(model if model and model != "qtrain-tiny" else "Qwen2.5-0.5B")
    ids = {k: shape["vocab_size"] - 1 for k in ("bos_token_id", "eos_token_id", "pad_token_id")
           if getattr(cfg, k, None) is not None and getattr(cfg, k) >= shape["vocab_size"]}  # inside the small vocab
    cfg = cfg.replace(**shape, **ids)
    text = json.dumps(cfg.to_hf_dict(), sort_keys=True)
    d = os.path.join(tempfile.gettempdir(), "qtrain-bench-tiny", hashlib.sha1(text.encode()).hexdigest()[:12])
    path = os.path.join(d, "config.json")
    if not os.path.isfile(path):
        os.makedirs(d, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    return d


def divisor_or_one(n: int, total: int) -> int:
    """A chunk count kept only where it still divides the shrunk size."""
    return n if n >= 1 and total % n == 0 else 1
