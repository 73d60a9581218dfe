"""Parameter names, shapes and the Hugging Face name mapping, as data.

qtrain keeps a model's parameters in one flat `dict[str, Tensor]` with short internal names. The block
linears are fused the way llm.q fuses them, so each block runs two fewer GEMMs than the HF layout:
  layers.{i}.qkv       (qkv_dim, C)   rows [q; k; v]       <- q_proj / k_proj / v_proj
  layers.{i}.qkv_bias  (qkv_dim,)     [q; k; v]            (Qwen2 only)
  layers.{i}.up        (2F, C)        rows [up; gate]      <- up_proj / gate_proj
Everything else maps one to one. `hf_to_internal` / `internal_to_hf` are the only places that know
the HF layout.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch

from qtrain.model.config import ModelConfig

# short block-tensor name -> HF suffix(es) under "model.layers.{i}."; a tuple means rows concatenated in order
_BLOCK_HF: dict[str, str | tuple[str, ...]] = {
    "ln1": "input_layernorm.weight",
    "qkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "qkv_bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "o": "self_attn.o_proj.weight",
    "ln2": "post_attention_layernorm.weight",
    "up": ("mlp.up_proj.weight", "mlp.gate_proj.weight"),
    "down": "mlp.down_proj.weight",
}
_NON_BLOCK_HF = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}

# Tensors without weight decay (norm gains and biases), by short block name / non-block name.
NO_DECAY = frozenset({"ln1", "ln2", "q_norm", "k_norm", "qkv_bias", "norm"})


def block_tensor_names(cfg: ModelConfig) -> list[str]:
    """Short names of one block's tensors, in the fixed order used for buffers and RNG keys."""
    names = ["ln1", "qkv"]
    if cfg.attention_bias:
        names.append("qkv_bias")
    if cfg.qk_norm:
        names += ["q_norm", "k_norm"]
    names += ["o", "ln2", "up", "down"]
    return names


def non_block_names(cfg: ModelConfig) -> list[str]:
    return ["embed", "norm"] + ([] if cfg.tie_word_embeddings else ["lm_head"])


def block_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    C, F, hs = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    all_shapes = {
        "ln1": (C,), "qkv": (cfg.qkv_dim, C), "qkv_bias": (cfg.qkv_dim,), "q_norm": (hs,), "k_norm": (hs,),
        "o": (C, cfg.q_dim), "ln2": (C,), "up": (2 * F, C), "down": (C, F),
    }
    return {n: all_shapes[n] for n in block_tensor_names(cfg)}


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every internal parameter name -> shape, in canonical order (non-block first, then blocks)."""
    V, C = cfg.vocab_size, cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"embed": (V, C), "norm": (C,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (V, C)
    for i in range(cfg.num_hidden_layers):
        for n, s in block_shapes(cfg).items():
            shapes[f"layers.{i}.{n}"] = s
    return shapes


def split_name(name: str) -> tuple[int | None, str]:
    """'layers.3.qkv' -> (3, 'qkv'); 'embed' -> (None, 'embed')."""
    if name.startswith("layers."):
        _, i, short = name.split(".", 2)
        return int(i), short
    return None, name


def is_decayed(name: str) -> bool:
    return split_name(name)[1] not in NO_DECAY


def hf_parts(cfg: ModelConfig, name: str) -> list[tuple[str, int]]:
    """HF tensor names that make up internal tensor `name`, each with its number of dim-0 rows."""
    layer, short = split_name(name)
    if layer is None:
        return [(_NON_BLOCK_HF[short], cfg.vocab_size if short != "norm" else cfg.hidden_size)]
    spec = _BLOCK_HF[short]
    prefix = f"model.layers.{layer}."
    if isinstance(spec, str):
        return [(prefix + spec, block_shapes(cfg)[short][0])]
    if short in ("qkv", "qkv_bias"):
        rows = [cfg.q_dim, cfg.kv_dim, cfg.kv_dim]
    else:  # up
        rows = [cfg.intermediate_size, cfg.intermediate_size]
    return [(prefix + s, r) for s, r in zip(spec, rows)]


def hf_names(cfg: ModelConfig) -> Iterator[str]:
    """All HF tensor names this config expects in a checkpoint."""
    for name in param_shapes(cfg):
        for hf, _ in hf_parts(cfg, name):
            yield hf


def internal_to_hf(cfg: ModelConfig, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Split fused tensors into HF tensors (views; no copies)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in params.items():
        parts = hf_parts(cfg, name)
        start = 0
        for hf, rows in parts:
            out[hf] = t[start:start + rows] if len(parts) > 1 else t
            start += rows
    return out


def hf_to_internal(cfg: ModelConfig, get: Callable[[str], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (internal name, tensor) built from HF tensors fetched one by one through `get(hf_name)`,
    so a loader can stream without holding the whole HF state dict twice."""
    for name in param_shapes(cfg):
        parts = [get(hf) for hf, _ in hf_parts(cfg, name)]
        yield name, parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
