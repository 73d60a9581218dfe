"""The Llama family's config: what a Hugging Face `config.json` of Qwen2/Qwen2.5 (QKV bias), Llama 2/3 (no biases,
llama3 rope scaling) or Qwen3 dense (qk-norm, explicit head_dim) says, and its built-in presets.

`LlamaConfig.from_hf_dict` reads a `config.json` strictly: a key that would change the model and that qtrain does
not implement is an error naming the file and the key, not a silent difference from `transformers`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from qtrain.fsio import shorten
from qtrain.model.config import COMMON_HF_KEYS, HfKeys, ModelConfig, check_positive_int, config_error

ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
MODEL_TYPES = tuple(ARCHITECTURES)


@dataclass(kw_only=True)
class LlamaConfig(ModelConfig):
    """The Llama family's fields besides the common ones. F = intermediate_size."""

    model_type: str = "qwen2"  # qwen2 | llama | qwen3: selects QKV bias / qk-norm defaults and the HF class
    intermediate_size: int = 4864
    attention_bias: bool = True  # QKV bias (Qwen2 has it, Llama and Qwen3 do not)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)

    @property
    def qkv_dim(self) -> int:
        """Rows of the fused [q; k; v] projection."""
        return self.q_dim + 2 * self.kv_dim

    def validate(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise config_error(f"unknown model_type {self.model_type!r}; supported: {', '.join(MODEL_TYPES)}")
        super().validate()
        check_positive_int(self, "intermediate_size")

    # ---- HF interop ----
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], *, source: str = "config.json") -> "LlamaConfig":
        """Build from a parsed config.json whose model_type is one of MODEL_TYPES; `source` names the file in
        error messages."""
        r = HfKeys(d, source)
        mt = d["model_type"]
        r.check_keys(_KNOWN_KEYS, _REQUIRED_KEYS)
        r.check_types(ints=("intermediate_size", "pretraining_tp"), positive=("intermediate_size",), bools=("attention_bias", "mlp_bias",
                                                                           "use_sliding_window"))
        if d.get("layer_types") is not None and not isinstance(d["layer_types"], list):
            raise r.error(f"layer_types must be a list, got {shorten(repr(d['layer_types']))}")
        if d.get("hidden_act", "silu") != "silu":
            raise r.error(f"hidden_act={d['hidden_act']!r} is not supported (only 'silu')")
        if d.get("mlp_bias", False):
            raise r.error("mlp_bias=true is not supported")
        if d.get("use_sliding_window", False):
            raise r.error("use_sliding_window=true is not supported")
        if any(t != "full_attention" for t in (d.get("layer_types") or [])):
            raise r.error("layer_types other than 'full_attention' are not supported")
        if float(d.get("attention_dropout", 0.0) or 0.0) != 0.0:
            raise r.error("attention_dropout != 0 is not supported")
        if int(d.get("pretraining_tp", 1) or 1) != 1:
            raise r.error("pretraining_tp != 1 is not supported")
        # Absent keys take transformers' class defaults (4.5x and 5.x agree), so both read one model.
        common = r.common_fields(max_position_embeddings=2048 if mt == "llama" else 32768,
                                 head_dim=128 if mt == "qwen3" else 0)
        default_bias = {"qwen2": True, "llama": False, "qwen3": False}[mt]
        return r.build(cls, **common, intermediate_size=d["intermediate_size"],
                       attention_bias=bool(d.get("attention_bias", default_bias)) if mt != "qwen2" else True,
                       qk_norm=(mt == "qwen3"))

    def to_hf_dict(self, *, dtype: str = "bfloat16") -> dict[str, Any]:
        """A config.json that transformers (4.5x and 5.x) loads as this exact model."""
        d = self.hf_common_dict(architecture=ARCHITECTURES[self.model_type], dtype=dtype)
        d["intermediate_size"] = self.intermediate_size
        if self.model_type == "qwen2":
            d.update(use_sliding_window=False, sliding_window=None, max_window_layers=self.num_hidden_layers)
        else:
            d.update(attention_bias=self.attention_bias, mlp_bias=False)
        return d


_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# the common keys, this family's, and metadata keys of its HF classes that do not change the math of training
_KNOWN_KEYS = COMMON_HF_KEYS | {"intermediate_size", "attention_bias", "mlp_bias", "use_sliding_window",
                                "sliding_window", "max_window_layers", "layer_types", "pretraining_tp", "use_mrope"}


def _qwen25(h: int, f: int, layers: int, heads: int, kv: int, tied: bool, vocab: int = 151936) -> LlamaConfig:
    return LlamaConfig(model_type="qwen2", vocab_size=vocab, hidden_size=h, intermediate_size=f,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                       max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=tied,
                       attention_bias=True, bos_token_id=151643, eos_token_id=151643)


def _llama3(h: int, f: int, layers: int, heads: int, kv: int, tied: bool, factor: float) -> LlamaConfig:
    return LlamaConfig(model_type="llama", vocab_size=128256, hidden_size=h, intermediate_size=f,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                       max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                       tie_word_embeddings=tied, attention_bias=False, bos_token_id=128000, eos_token_id=128001,
                       rope_scaling={"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})


# Built-in presets for --from-scratch without a config.json (sizes from the published config.json files).
PRESETS: dict[str, Callable[[], LlamaConfig]] = {
    "Qwen2.5-0.5B": lambda: _qwen25(896, 4864, 24, 14, 2, True),
    "Qwen2.5-1.5B": lambda: _qwen25(1536, 8960, 28, 12, 2, True),
    "Qwen2.5-3B": lambda: _qwen25(2048, 11008, 36, 16, 2, True),
    "Qwen2.5-7B": lambda: _qwen25(3584, 18944, 28, 28, 4, False),
    "Qwen2.5-14B": lambda: _qwen25(5120, 13824, 48, 40, 8, False),
    "Qwen2.5-32B": lambda: _qwen25(5120, 27648, 64, 40, 8, False),
    "Qwen2.5-72B": lambda: _qwen25(8192, 29568, 80, 64, 8, False, vocab=152064),
    "Llama-3.2-1B": lambda: _llama3(2048, 8192, 16, 32, 8, True, 32.0),
    "Llama-3.2-3B": lambda: _llama3(3072, 8192, 28, 24, 8, True, 32.0),
    "Llama-3.1-8B": lambda: _llama3(4096, 14336, 32, 32, 8, False, 8.0),
}
