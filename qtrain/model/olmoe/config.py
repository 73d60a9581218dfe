"""The OLMoE config: what a Hugging Face `config.json` of model_type `olmoe` says (routed experts in every layer,
RMSNorm of the whole q and k projections, an optional clamp of q, k and v), and presets.

Read strictly (`config.HfKeys`): a key that would change the model and that qtrain does not implement is an error
naming the file and the key; absent keys take transformers' `OlmoeConfig` defaults, so both read one model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from qtrain.model.config import COMMON_HF_KEYS, HfKeys, config_error
from qtrain.model.moe_config import (MOE_METADATA_KEYS, MoeConfig, experts_from_hf, moe_fields_from_hf, moe_hf_dict,
                                     refuse_common)

ARCHITECTURES = {"olmoe": "OlmoeForCausalLM"}


@dataclass(kw_only=True)
class OlmoeConfig(MoeConfig):
    """OLMoE's fields besides the shared MoE ones (moe_config.MoeConfig). Its config.json's intermediate_size is the
    experts' width (every layer routes): `moe_intermediate_size` and `intermediate_size` are that one number."""

    model_type: str = "olmoe"
    qk_norm: bool = True  # q and k go through RMSNorm, over the whole projection (not per head: olmoe/block.py)
    clip_qkv: float | None = None  # clamp q, k and v (after the norms) to [-clip_qkv, clip_qkv]; None: no clamp

    def validate(self) -> None:
        if self.model_type not in ARCHITECTURES:
            raise config_error(f"model_type {self.model_type!r} is not olmoe")
        super().validate()
        if self.intermediate_size != self.moe_intermediate_size:
            raise config_error(f"intermediate_size={self.intermediate_size} is the experts' width in OLMoE: it must "
                               f"equal moe_intermediate_size={self.moe_intermediate_size}")
        if self.head_dim * self.num_attention_heads != self.hidden_size:
            raise config_error(f"head_dim={self.head_dim}: OLMoE's q norm spans hidden_size={self.hidden_size}, so "
                               f"head_dim must be hidden_size / num_attention_heads")
        c = self.clip_qkv
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c <= 0):
            raise config_error(f"clip_qkv must be a positive number or null, got {c!r}")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], *, source: str = "config.json") -> "OlmoeConfig":
        """Build from a parsed config.json of model_type olmoe; `source` names the file in error messages."""
        r = HfKeys(d, source)
        r.check_keys(_KNOWN_KEYS, _REQUIRED_KEYS)
        r.check_types(ints=("intermediate_size",), numbers=("clip_qkv",), positive=("intermediate_size",),
                      bools=("norm_topk_prob", "output_router_logits"))
        refuse_common(r)
        experts = experts_from_hf(r, names=("num_experts", "num_local_experts"), default=64)
        moe = moe_fields_from_hf(r, experts=experts, top_k_default=8, aux_default=0.01, norm_topk_default=False)
        common = r.common_fields(max_position_embeddings=4096)
        if "pad_token_id" not in d:  # transformers' OlmoeConfig default, which its embedding takes as padding_idx
            common["pad_token_id"] = 1 if d["vocab_size"] > 1 else None
        if "eos_token_id" not in d:
            common["eos_token_id"] = 50279 if d["vocab_size"] > 50279 else None
        common["rms_norm_eps"] = float(d.get("rms_norm_eps", 1e-5))
        width = d.get("intermediate_size", 2048)
        return r.build(cls, **common, intermediate_size=width, moe_intermediate_size=width,
                       clip_qkv=d.get("clip_qkv"), **moe)

    def to_hf_dict(self, *, dtype: str = "bfloat16") -> dict[str, Any]:
        """A config.json that transformers loads as this exact model."""
        d = moe_hf_dict(self, architecture=ARCHITECTURES[self.model_type], dtype=dtype)
        d.update(intermediate_size=self.moe_intermediate_size, num_experts=self.num_experts,
                 norm_topk_prob=self.norm_topk_prob, clip_qkv=self.clip_qkv, attention_bias=False,
                 pad_token_id=self.pad_token_id)
        return d


_REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
_KNOWN_KEYS = COMMON_HF_KEYS | MOE_METADATA_KEYS | {
    "intermediate_size", "num_experts", "num_local_experts", "num_experts_per_tok", "norm_topk_prob",
    "router_aux_loss_coef", "clip_qkv", "attention_bias"}


def _olmoe(**kw: Any) -> OlmoeConfig:
    return OlmoeConfig(vocab_size=50304, hidden_size=2048, intermediate_size=1024, moe_intermediate_size=1024,
                       num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
                       max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                       num_experts=64, num_experts_per_tok=8, norm_topk_prob=False, router_aux_loss_coef=0.01,
                       pad_token_id=1, eos_token_id=50279, **kw)


# Built-in presets for --from-scratch without a config.json (sizes from the published config.json, allenai's
# OLMoE-1B-7B-0924; both names)
PRESETS: dict[str, Callable[[], OlmoeConfig]] = {"OLMoE-1B-7B": _olmoe, "OLMoE-1B-7B-0924": _olmoe}
