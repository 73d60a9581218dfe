"""Qwen3-Next (`model_type` qwen3_next, transformers' `Qwen3NextForCausalLM`): the Qwen3.5 hybrid decoder in an earlier
layout, so it is this family's config with three differences, all in the data:

* the linear-attention input projection is two HF tensors whose rows interleave per key-head group
  (`in_proj_qkvz`, `in_proj_ba`; tensors.py maps them onto qtrain's fused in_proj by a row permutation);
* an MoE model may keep dense MLP layers (`mlp_only_layers`, `decoder_sparse_step`: transformers' rule in
  `Qwen35Config.is_moe_layer`), with `intermediate_size` for them, and `norm_topk_prob` is a key;
* no multimodal wrapper: the text model's tensors sit under `model.`.

The block, the kernels and every norm are Qwen3.5's (zero-centred RMSNorms, the gated norm, gated full attention with
partial rotary embeddings, the shared expert behind a sigmoid gate).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from qtrain.fsio import shorten
from qtrain.model.config import COMMON_HF_KEYS, ConfigError, HfKeys
from qtrain.model.qwen3_5.config import Qwen35Config, layer_types_of, scaling_without_rotary_factor

NEXT_TYPE = "qwen3_next"
ARCHITECTURE = "Qwen3NextForCausalLM"
# transformers' Qwen3NextConfig defaults (the shapes of Qwen3-Next-80B-A3B), for keys a config.json leaves out
_DEFAULTS = dict(vocab_size=151936, intermediate_size=5632, num_key_value_heads=2, head_dim=256,
                 linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                 linear_num_value_heads=32, decoder_sparse_step=1, moe_intermediate_size=512,
                 shared_expert_intermediate_size=512, num_experts_per_tok=10, num_experts=512, norm_topk_prob=True,
                 router_aux_loss_coef=0.001)
_INTS = ("intermediate_size", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
         "linear_num_key_heads", "linear_num_value_heads", "decoder_sparse_step", "moe_intermediate_size",
         "shared_expert_intermediate_size", "num_experts_per_tok", "full_attention_interval")
_KNOWN_KEYS = COMMON_HF_KEYS | set(_DEFAULTS) | {
    "attention_bias", "layer_types", "full_attention_interval", "partial_rotary_factor", "mlp_only_layers",
    "output_router_logits", "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings"}


@dataclass(kw_only=True)
class Qwen3NextConfig(Qwen35Config):
    """Qwen3.5's fields read from and written to a qwen3_next config.json (module docstring)."""

    MODEL_TYPES = (NEXT_TYPE,)
    MIXED_MLP = True

    model_type: str = NEXT_TYPE
    vocab_size: int = 151936

    @property
    def hf_prefix(self) -> str:
        return "model."

    @property
    def architecture(self) -> str:
        return ARCHITECTURE

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], *, source: str = "config.json") -> "Qwen3NextConfig":
        r = HfKeys(d, source)
        r.check_keys(frozenset(_KNOWN_KEYS), ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"))
        r.check_types(ints=_INTS + ("num_experts", "mtp_num_hidden_layers"),
                      numbers=("partial_rotary_factor", "router_aux_loss_coef"),
                      bools=("attention_bias", "norm_topk_prob", "output_router_logits"),
                      positive=tuple(k for k in _INTS if k != "full_attention_interval"))
        if d.get("hidden_act", "silu") != "silu":
            raise r.error(f"hidden_act={shorten(repr(d['hidden_act']))} is not supported (only 'silu')")
        if d.get("attention_bias", False):
            raise r.error("attention_bias=true is not supported (Qwen3-Next has no attention biases)")
        if float(d.get("attention_dropout", 0.0) or 0.0) != 0.0:
            raise r.error("attention_dropout != 0 is not supported")
        layer_types = layer_types_of(d, r.error)
        mlp_only = d.get("mlp_only_layers") or []
        if not isinstance(mlp_only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in mlp_only):
            raise r.error(f"mlp_only_layers must be a list of layer indices, got {shorten(repr(mlp_only))}")
        if d.get("num_experts", 0) < 0:
            raise r.error(f"num_experts must be >= 0, got {d['num_experts']}")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        prf = d.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))
        r.typed("partial_rotary_factor", "number", inner={"partial_rotary_factor": prf})
        common = r.common_fields(max_position_embeddings=32768, head_dim=_DEFAULTS["head_dim"])
        common["num_key_value_heads"] = d.get("num_key_value_heads") or _DEFAULTS["num_key_value_heads"]
        scaling_without_rotary_factor(common)
        fields = {k: d.get(k, v) for k, v in _DEFAULTS.items() if k not in ("vocab_size", "num_key_value_heads",
                                                                              "head_dim")}
        fields.update(layer_types=layer_types, partial_rotary_factor=float(prf), mlp_only_layers=tuple(mlp_only),
                      router_aux_loss_coef=float(fields["router_aux_loss_coef"]),
                      norm_topk_prob=bool(fields["norm_topk_prob"]))
        try:
            return cls(**common, **fields)
        except ConfigError as e:
            raise r.error(str(e).removeprefix("model config: ")) from None

    def to_hf_dict(self, *, dtype: str = "bfloat16") -> dict[str, Any]:
        """A config.json that transformers' Qwen3NextConfig reads as this exact model."""
        d = self.text_hf_dict(dtype=dtype)
        d.update(intermediate_size=self.intermediate_size,
                 decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=list(self.mlp_only_layers),
                 norm_topk_prob=self.norm_topk_prob, num_experts=self.num_experts,
                 num_experts_per_tok=self.num_experts_per_tok, moe_intermediate_size=self.moe_intermediate_size,
                 shared_expert_intermediate_size=self.shared_expert_intermediate_size,
                 router_aux_loss_coef=self.router_aux_loss_coef)
        return d


def _next(layers: int = 48) -> Qwen3NextConfig:
    return Qwen3NextConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers, num_attention_heads=16,
                           num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                           linear_key_head_dim=128, linear_value_head_dim=128, num_experts=512, num_experts_per_tok=10,
                           moe_intermediate_size=512, shared_expert_intermediate_size=512,
                           max_position_embeddings=262144, rope_theta=10_000_000.0, tie_word_embeddings=False,
                           eos_token_id=151645)


# Qwen3-Next-80B-A3B's shapes: transformers' Qwen3NextConfig defaults (the published config.json as recalled: rope_theta
# 1e7, 262144 positions); a run from a checkpoint reads its config.json, never this.
PRESETS: dict[str, Callable[[], Qwen35Config]] = {"Qwen3-Next-80B-A3B": _next}
