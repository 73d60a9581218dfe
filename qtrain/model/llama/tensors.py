"""The Llama family's block tensors and their Hugging Face names, as data.

The block linears are fused the way llm.q fuses them, so each block runs two fewer GEMMs than the HF layout:
  qkv       (qkv_dim, C)   rows [q; k; v]       <- self_attn.q_proj / k_proj / v_proj
  qkv_bias  (qkv_dim,)     [q; k; v]            (Qwen2 only)
  up        (2F, C)        rows [up; gate]      <- mlp.up_proj / gate_proj
Everything else maps one to one (`BLOCK_HF`). `model/weights.py` turns these statements into the whole model's
names and the HF mapping in both directions.
"""
from __future__ import annotations

from qtrain.model.family import TensorSpec
from qtrain.model.llama.config import LlamaConfig

# short block-tensor name -> HF suffix(es) under "model.layers.{i}."; a tuple means rows concatenated in order
BLOCK_HF: dict[str, str | tuple[str, ...]] = {
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
NO_DECAY = frozenset({"ln1", "ln2", "q_norm", "k_norm", "qkv_bias"})  # norm gains and biases
# from-scratch init (model/init.py): the projections into the residual stream are depth-scaled, gains start at 1
INIT = {"o": "residual", "down": "residual", "ln1": "ones", "ln2": "ones", "q_norm": "ones", "k_norm": "ones",
        "qkv_bias": "zeros"}


def block_tensor_names(cfg: LlamaConfig) -> list[str]:
    """Short names of one block's tensors, in the fixed order used for buffers and RNG keys."""
    names = ["ln1", "qkv"]
    if cfg.attention_bias:
        names.append("qkv_bias")
    if cfg.qk_norm:
        names += ["q_norm", "k_norm"]
    names += ["o", "ln2", "up", "down"]
    return names


def block_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    C, F, hs = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    all_shapes = {
        "ln1": (C,), "qkv": (cfg.qkv_dim, C), "qkv_bias": (cfg.qkv_dim,), "q_norm": (hs,), "k_norm": (hs,),
        "o": (C, cfg.q_dim), "ln2": (C,), "up": (2 * F, C), "down": (C, F),
    }
    return {n: all_shapes[n] for n in block_tensor_names(cfg)}


def _hf_rows(cfg: LlamaConfig, short: str) -> list[int]:
    """Rows of each HF tensor that a fused tensor concatenates."""
    if short in ("qkv", "qkv_bias"):
        return [cfg.q_dim, cfg.kv_dim, cfg.kv_dim]
    return [cfg.intermediate_size, cfg.intermediate_size]  # up: [up; gate]


def block_tensors(cfg: LlamaConfig, layer: int) -> tuple[TensorSpec, ...]:
    """Block `layer`'s tensors (every layer has the same ones)."""
    prefix = f"{cfg.hf_prefix}layers.{layer}."
    specs = []
    for short, shape in block_shapes(cfg).items():
        hf = BLOCK_HF[short]
        if isinstance(hf, str):
            parts = ((prefix + hf, shape),)
        else:
            parts = tuple((prefix + s, (rows, *shape[1:])) for s, rows in zip(hf, _hf_rows(cfg, short)))
        specs.append(TensorSpec(short, shape, parts, decay=short not in NO_DECAY, init=INIT.get(short, "normal")))
    return tuple(specs)
