"""Model shapes a benchmark asks for that no preset has: a preset cut to fewer layers (the largest MoE that fits one
GPU), or shrunk to a CPU-sized model of the same family (dry runs). Written as a config.json directory, which
qtrain reads for --from-scratch and the `hf-train` kind turns into a transformers config, so both systems train
one shape."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Any

from bench.compat import model_config

TINY_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16)
"""bf16 matmuls are slow on a CPU (the 50k-vocab LM head of qtrain-tiny takes seconds): keep every dim small."""

TINY_FAMILY_SHAPE = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,  # MoE
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,  # Qwen3.5
)
"""The family-specific dims shrunk too (only those the config has): 128 experts or 32 delta-rule heads of 128 would
make a 'tiny' model slow on a CPU."""


def with_layers(cfg: Any, layers: int) -> Any:
    """`cfg` with its first `layers` layers: the per-layer lists (Qwen3.5's layer_types, Qwen3-MoE's
    mlp_only_layers) cut to match, so the kept layers are those of the full model."""
    if not isinstance(layers, int) or isinstance(layers, bool) or not 1 <= layers <= cfg.num_hidden_layers:
        raise ValueError(f"layers={layers!r}: want 1..{cfg.num_hidden_layers} (the model's num_hidden_layers)")
    changes: dict[str, Any] = {"num_hidden_layers": layers}
    if getattr(cfg, "layer_types", None):
        changes["layer_types"] = tuple(cfg.layer_types[:layers])
    if getattr(cfg, "mlp_only_layers", None):
        changes["mlp_only_layers"] = tuple(i for i in cfg.mlp_only_layers if i < layers)
    return cfg.replace(**changes)


def shaped_config(model: str, layers: int | None = None, **overrides: Any) -> Any:
    """The qtrain config of `model` (a preset name or a config.json directory) with `overrides` (config fields),
    then cut to `layers` layers when given."""
    cfg = model_config(model)
    if overrides:
        cfg = cfg.replace(**overrides)
    return cfg if layers is None else with_layers(cfg, layers)


def tiny_config(model: str, **overrides: Any) -> Any:
    """`model`'s family (bias, tied embeddings, qk-norm, rope scaling, experts, layer kinds) at TINY_SHAPE (with
    `overrides`, e.g. the real vocab_size)."""
    base = model_config(model if model and model != "qtrain-tiny" else "Qwen2.5-0.5B")
    shape = {**TINY_SHAPE, **{k: v for k, v in TINY_FAMILY_SHAPE.items() if hasattr(base, k)}, **overrides}
    if getattr(base, "moe_intermediate_size", None) and base.intermediate_size == base.moe_intermediate_size:
        shape["intermediate_size"] = shape["moe_intermediate_size"]  # OLMoE: one width for both (its config checks)
    if getattr(base, "num_experts", 0) == 0 and "num_experts" in shape:
        shape["num_experts"] = 0  # a dense Qwen3.5 stays dense
    if getattr(base, "layer_types", None):  # both layer kinds, whatever the preset's first layers are
        kinds = sorted(set(base.layer_types), reverse=True)  # linear_attention first, as the real models start
        shape.setdefault("layer_types", tuple(kinds[i % len(kinds)] for i in range(shape["num_hidden_layers"])))
    ids = {k: shape["vocab_size"] - 1 for k in ("bos_token_id", "eos_token_id", "pad_token_id")
           if getattr(base, k, None) is not None and getattr(base, k) >= shape["vocab_size"]}  # inside the small vocab
    return base.replace(**shape, **ids)


def config_dir(cfg: Any) -> str:
    """A model directory holding only `cfg`'s config.json (for --from-scratch), written once per config under the
    temp dir (named by its hash; concurrent writers replace it atomically with the same text)."""
    text = json.dumps(cfg.to_hf_dict(), sort_keys=True)
    d = os.path.join(tempfile.gettempdir(), "qtrain-bench-shapes", hashlib.sha1(text.encode()).hexdigest()[:12])
    path = os.path.join(d, "config.json")
    if not os.path.isfile(path):
        os.makedirs(d, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    return d


def model_arg(model: str, layers: int | None) -> str:
    """What a qtrain run is given as its model: the preset or directory itself, or a directory of its first
    `layers` layers."""
    return model if layers is None else config_dir(shaped_config(model, layers))

