"""The Mixtral config: what a Hugging Face `config.json` of model_type `mixtral` says (Llama's attention without
biases or qk-norm, E experts of which each token takes the top k, always renormalised), and presets.

Read strictly (`config.HfKeys`): a key that would change the model and that qtrain does not implement is an error
naming the file and the key -- a sliding attention window (`sliding_window` other than null: qtrain's attention is
causal over the whole sequence) and router jitter noise among them; absent keys take transformers' `MixtralConfig`
defaults, so both read one model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from qtrain.fsio import shorten
from qtrain.model.config import COMMON_HF_KEYS, HfKeys, config_error
from qtrain.model.moe_config import (MOE_METADATA_KEYS, MoeConfig, experts_from_hf, moe_fields_from_hf, moe_hf_dict,
                                     refuse_common)

ARCHITECTURES = {"mixtral": "MixtralForCausalLM"}


@dataclass(kw_only=True)
class MixtralConfig(MoeConfig):
    """Mixtral's fields are the shared MoE ones (moe_config.MoeConfig); its config.json's intermediate_size is the
    experts' width (every layer routes) and it always renormalises the top-k probabilities."""

    model_type: str = "mixtral"
    norm_topk_prob: bool = True

    def validate(self) -> None:
        if self.model_type not in ARCHITECTURES:
            raise config_error(f"model_type {self.model_type!r} is not mixtral")
        super().validate()
        if self.intermediate_size != self.moe_intermediate_size:
            raise config_error(f"intermediate_size={self.intermediate_size} is the experts' width in Mixtral: it "
                               f"must equal moe_intermediate_size={self.moe_intermediate_size}")
        if not self.norm_topk_prob:
            raise config_error("Mixtral always renormalises the top-k probabilities (norm_topk_prob must be true)")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], *, source: str = "config.json") -> "MixtralConfig":
        """Build from a parsed config.json of model_type mixtral; `source` names the file in error messages."""
        r = HfKeys(d, source)
        r.check_keys(_KNOWN_KEYS, _REQUIRED_KEYS)
        r.check_types(ints=("intermediate_size", "sliding_window"), numbers=("router_jitter_noise",),
                      positive=("intermediate_size",), bools=("output_router_logits",))
        refuse_common(r)
        if d.get("sliding_window") is not None:
            raise r.error(f"sliding_window={shorten(repr(d['sliding_window']))} is not supported: qtrain's attention "
                          f"is causal over the whole sequence (set it to null for full attention)")
        if float(d.get("router_jitter_noise", 0.0) or 0.0) != 0.0:
            raise r.error("router_jitter_noise != 0 is not supported (training-time noise on the router's input)")
        experts = experts_from_hf(r, names=("num_local_experts", "num_experts"), default=8)
        moe = moe_fields_from_hf(r, experts=experts, top_k_default=2, aux_default=0.001, norm_topk_default=None)
        common = r.common_fields(max_position_embeddings=4096 * 32)
        common["rms_norm_eps"] = float(d.get("rms_norm_eps", 1e-5))
        width = d.get("intermediate_size", 14336)
        return r.build(cls, **common, intermediate_size=width, moe_intermediate_size=width, **moe)

    def to_hf_dict(self, *, dtype: str = "bfloat16") -> dict[str, Any]:
        """A config.json that transformers loads as this exact model."""
        d = moe_hf_dict(self, architecture=ARCHITECTURES[self.model_type], dtype=dtype)
        d.update(intermediate_size=self.moe_intermediate_size,
                 num_local_experts=self.num_experts, sliding_window=None, router_jitter_noise=0.0)
        return d


_REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
_KNOWN_KEYS = COMMON_HF_KEYS | MOE_METADATA_KEYS | {
    "intermediate_size", "num_local_experts", "num_experts", "num_experts_per_tok", "router_aux_loss_coef",
    "sliding_window", "router_jitter_noise"}


# Built-in presets for --from-scratch without a config.json (sizes from the published config.json of
# mistralai/Mixtral-8x7B-v0.1)
PRESETS: dict[str, Callable[[], MixtralConfig]] = {
    "Mixtral-8x7B-v0.1": lambda: MixtralConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, moe_intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
        rope_theta=1e6, rms_norm_eps=1e-5, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, router_aux_loss_coef=0.02, bos_token_id=1, eos_token_id=2),
}
