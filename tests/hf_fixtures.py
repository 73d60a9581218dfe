"""Tiny random Hugging Face models of every supported type, built with real `transformers` (no downloads).

Use `TINY_KINDS` to parametrize tests and `save_tiny_hf_model(kind, dir)` to get a directory that looks
like a downloaded checkpoint. Every parameter gets random values (HF initializes norms to 1 and biases
to 0, which would hide a swapped q/k bias or norm in a test).
"""
from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

# kind -> (model_type, tie_word_embeddings, extra HF config kwargs)
TINY_KINDS: dict[str, tuple[str, bool, dict[str, Any]]] = {
    "qwen2": ("qwen2", False, {}),
    "qwen2-tied": ("qwen2", True, {}),
    "llama": ("llama", False, {"rope_theta": 10000.0}),
    "llama3-tied": ("llama", True, {
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64}}),
    "qwen3": ("qwen3", False, {"head_dim": 32}),
    "qwen3-tied": ("qwen3", True, {"head_dim": 32}),
}
TINY_SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)


def tiny_hf_config(kind: str, **overrides: Any):
    """A transformers config object of the given kind (see TINY_KINDS)."""
    from transformers import AutoConfig

    model_type, tied, extra = TINY_KINDS[kind]
    extra = copy.deepcopy(extra)  # transformers adds rope_theta into the rope_scaling dict it is given
    kw = {**TINY_SIZES, **extra, "tie_word_embeddings": tied, "bos_token_id": 1, "eos_token_id": 2, **overrides}
    return AutoConfig.for_model(model_type, **kw)


def tiny_hf_model(kind: str, *, seed: int = 0, **overrides: Any):
    """A transformers CausalLM of the given kind with every parameter random (float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_hf_config(kind, **overrides), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # tied lm_head is the same Parameter as the embedding: filled once
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model.eval()


def save_tiny_hf_model(kind: str, out_dir: str | os.PathLike, *, seed: int = 0, **save_kw: Any) -> Path:
    """save_pretrained a tiny random model of `kind` into out_dir (like a downloaded checkpoint)."""
    out = Path(out_dir)
    tiny_hf_model(kind, seed=seed).save_pretrained(out, **save_kw)
    return out
