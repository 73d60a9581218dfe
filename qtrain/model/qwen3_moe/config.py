"""The Qwen3-MoE config: what a Hugging Face `config.json` of model_type `qwen3_moe` says (Qwen3's attention with
per-head qk-norm, routed experts in every `decoder_sparse_step`-th layer except `mlp_only_layers`), and presets.

Read strictly (`config.HfKeys`): a key that would change the model and that qtrain does not implement is an error
naming the file and the key; absent keys take transformers' `Qwen3MoeConfig` defaults, so both read one model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from qtrain.fsio import shorten
from qtrain.model.config import COMMON_HF_KEYS, HfKeys, check_positive_int, config_error
from qtrain.model.moe_config import (MOE_METADATA_KEYS, MoeConfig, experts_from_hf, moe_fields_from_hf, moe_hf_dict,
                                     refuse_common)

ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM"}


@dataclass(kw_only=True)
class Qwen3MoeConfig(MoeConfig):
    """Qwen3-MoE's fields besides the shared MoE ones (moe_config.MoeConfig)."""

    model_type: str = "qwen3_moe"
    qk_norm: bool = True  # Qwen3's per-head RMSNorm of q and k
    decoder_sparse_step: int = 1  # layer l routes when (l + 1) % decoder_sparse_step == 0 (and is not MLP-only)
    mlp_only_layers: tuple[int, ...] = ()  # layers with a dense MLP of `intermediate_size` whatever the step

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """transformers' rule (Qwen3MoeDecoderLayer): dense where listed in mlp_only_layers or off the sparse step."""
        return tuple(i for i in range(self.num_hidden_layers)
                     if i in self.mlp_only_layers or (i + 1) % self.decoder_sparse_step != 0)

    def validate(self) -> None:
        if self.model_type not in ARCHITECTURES:
            raise config_error(f"model_type {self.model_type!r} is not qwen3_moe")
        check_positive_int(self, "decoder_sparse_step")
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in self.mlp_only_layers):
            raise config_error(f"mlp_only_layers must be layer indices, got {shorten(repr(self.mlp_only_layers))}")
        super().validate()

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], *, source: str = "config.json") -> "Qwen3MoeConfig":
        """Build from a parsed config.json of model_type qwen3_moe; `source` names the file in error messages."""
        r = HfKeys(d, source)
        r.check_keys(_KNOWN_KEYS, _REQUIRED_KEYS)
        r.check_types(ints=("intermediate_size", "moe_intermediate_size", "decoder_sparse_step", "max_window_layers"),
                      positive=("intermediate_size", "moe_intermediate_size", "decoder_sparse_step"),
                      bools=("use_sliding_window", "norm_topk_prob", "output_router_logits"))
        refuse_common(r)
        if d.get("use_sliding_window", False):
            raise r.error("use_sliding_window=true is not supported")
        mlp_only = d.get("mlp_only_layers") or []
        if not isinstance(mlp_only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in mlp_only):
            raise r.error(f"mlp_only_layers must be a list of layer indices, got {shorten(repr(mlp_only))}")
        experts = experts_from_hf(r, names=("num_experts", "num_local_experts"), default=128)
        moe = moe_fields_from_hf(r, experts=experts, top_k_default=8, aux_default=0.001, norm_topk_default=False)
        common = r.common_fields(max_position_embeddings=32768)  # no head_dim key: hidden / heads, as transformers
        return r.build(cls, **common, intermediate_size=d.get("intermediate_size", 6144),
                       moe_intermediate_size=d.get("moe_intermediate_size", 768),
                       decoder_sparse_step=d.get("decoder_sparse_step", 1), mlp_only_layers=tuple(mlp_only), **moe)

    def to_hf_dict(self, *, dtype: str = "bfloat16") -> dict[str, Any]:
        """A config.json that transformers loads as this exact model."""
        d = moe_hf_dict(self, architecture=ARCHITECTURES[self.model_type], dtype=dtype)
        d.update(intermediate_size=self.intermediate_size,
                 moe_intermediate_size=self.moe_intermediate_size, num_experts=self.num_experts,
                 norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=self.decoder_sparse_step,
                 mlp_only_layers=list(self.mlp_only_layers), attention_bias=False, use_sliding_window=False,
                 sliding_window=None)
        return d


_REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
# the common keys, this model type's, and metadata keys of its HF class that do not change the math of training
# (sliding_window and max_window_layers do nothing while use_sliding_window is false, which is all qtrain reads)
_KNOWN_KEYS = COMMON_HF_KEYS | MOE_METADATA_KEYS | {
    "intermediate_size", "moe_intermediate_size", "num_experts", "num_local_experts", "num_experts_per_tok",
    "norm_topk_prob", "router_aux_loss_coef", "decoder_sparse_step", "mlp_only_layers", "attention_bias",
    "use_sliding_window", "sliding_window", "max_window_layers"}


# Built-in presets for --from-scratch without a config.json (sizes from the published config.json files).
PRESETS: dict[str, Callable[[], Qwen3MoeConfig]] = {
    "Qwen3-30B-A3B": lambda: Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960, rope_theta=1e6,
        rms_norm_eps=1e-6, tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        router_aux_loss_coef=0.001, bos_token_id=151643, eos_token_id=151645),
}
