"""Model configuration: what a Hugging Face `config.json` says about a Llama-family decoder.

One dataclass serves Qwen2/Qwen2.5 (QKV bias), Llama 2/3 (no biases, llama3 rope scaling) and Qwen3
(qk-norm, explicit head_dim). `from_hf_dict` validates a `config.json` strictly: a key that would change
the model and that qtrain does not implement is an error naming the file and the key, not a silent
difference from `transformers`.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

from qtrain.fsio import CONFIG_MAX_BYTES, InputError, read_json_input, shorten

MODEL_TYPES = ("qwen2", "llama", "qwen3")
ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


class ConfigError(ValueError):
    """A config.json (or preset) that qtrain cannot represent faithfully."""


@dataclass(kw_only=True)
class ModelConfig:
    """Maps to a HF config.json. Dimension letters used in model code: C = hidden_size,
    F = intermediate_size, nh = num_attention_heads, nkv = num_key_value_heads, hs = head_dim."""

    model_type: str = "qwen2"  # qwen2 | llama | qwen3: selects QKV bias / qk-norm defaults and the HF class
    vocab_size: int = 151936
    hidden_size: int = 896
    intermediate_size: int = 4864
    num_hidden_layers: int = 24
    num_attention_heads: int = 14
    num_key_value_heads: int = 2  # GQA: each kv head serves nh // nkv query heads
    head_dim: int = 0  # 0 => hidden_size // num_attention_heads (Qwen3 sets it explicitly)
    max_position_embeddings: int = 32768
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] | None = None  # llama3 frequency scaling, or None for plain RoPE
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True  # LM head shares the embedding matrix
    attention_bias: bool = True  # QKV bias (Qwen2 has it, Llama and Qwen3 do not)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    bos_token_id: int | None = 151643
    eos_token_id: int | None = 151643
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // max(self.num_attention_heads, 1)
        self.validate()

    # ---- derived sizes, defined once ----
    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def qkv_dim(self) -> int:
        """Rows of the fused [q; k; v] projection."""
        return self.q_dim + 2 * self.kv_dim

    def num_params(self, *, include_embedding: bool = True) -> int:
        C, F, L = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        block = C * self.qkv_dim + self.q_dim * C + 3 * C * F + 2 * C
        if self.attention_bias:
            block += self.qkv_dim
        if self.qk_norm:
            block += 2 * self.head_dim
        n = L * block + C  # + final norm
        if include_embedding:
            n += self.vocab_size * C * (1 if self.tie_word_embeddings else 2)
        elif not self.tie_word_embeddings:
            n += self.vocab_size * C  # the untied LM head is a real matmul
        return n

    def validate(self) -> None:
        def bad(msg: str) -> ConfigError:
            return ConfigError(f"model config: {msg}")

        if self.model_type not in MODEL_TYPES:
            raise bad(f"unknown model_type {self.model_type!r}; supported: {', '.join(MODEL_TYPES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise bad(f"{name} must be a positive integer, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                      f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise bad(f"head_dim={self.head_dim} must be even for RoPE")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise bad(f"rope_theta must be positive, got {self.rope_theta!r}")
        if not (0 < self.rms_norm_eps < 1):
            raise bad(f"rms_norm_eps must be in (0, 1), got {self.rms_norm_eps!r}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind != "llama3":
                raise bad(f"rope scaling type {kind!r} is not supported (only 'llama3')")
            for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                if k not in self.rope_scaling:
                    raise bad(f"llama3 rope scaling needs {k!r}")

    # ---- HF interop ----
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], *, source: str = "config.json") -> "ModelConfig":
        """Build from a parsed config.json; `source` names the file in error messages."""
        def bad(msg: str) -> ConfigError:
            return ConfigError(f"{source}: {msg}")

        if not isinstance(d, dict):
            raise bad("expected a JSON object")
        mt = d.get("model_type")
        if mt is None:
            raise bad("missing key 'model_type'")
        if mt not in MODEL_TYPES:
            raise bad(f"unknown model_type {shorten(repr(mt))}; supported: {', '.join(MODEL_TYPES)}")
        unknown = sorted(k for k in d if k not in _KNOWN_KEYS and not k.startswith("_"))
        if unknown:
            raise bad(f"unknown config key(s) {shorten(repr(unknown))}; qtrain refuses keys it does not understand "
                      f"rather than train a different model than transformers would load")
        for k in _REQUIRED_KEYS:
            if k not in d:
                raise bad(f"missing key {k!r}")
        def typed(key: str, kind: str, default: Any = None, inner: dict | None = None) -> Any:
            """d[key] (or inner[key]) checked against JSON's types: a string where a number belongs is an
            error naming the key, not a raw ValueError from float()."""
            src = d if inner is None else inner
            v = src.get(key, default)
            if v is None:
                return v
            ok = {"int": isinstance(v, int) and not isinstance(v, bool),
                  "number": isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
                  "bool": isinstance(v, bool), "str": isinstance(v, str)}[kind]
            if not ok:
                want = {"int": "an integer", "number": "a finite number", "bool": "true or false",
                        "str": "a string"}[kind]
                raise bad(f"{key} must be {want}, got {shorten(repr(v))}")
            return v

        for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings", "pretraining_tp"):
            typed(k, "int")
        for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if d.get(k) is not None and d[k] <= 0:  # explicit: only an absent key takes the default (head_dim 0)
                raise bad(f"{k} must be a positive integer, got {d[k]}")
        for k in ("rms_norm_eps", "attention_dropout", "rope_theta", "initializer_range"):
            typed(k, "number")
        for k in ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window"):
            typed(k, "bool")
        typed("hidden_act", "str")
        for k in ("bos_token_id", "pad_token_id"):
            typed(k, "int")
        if isinstance(d.get("eos_token_id"), list):
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in d["eos_token_id"]):
                raise bad(f"eos_token_id must be an integer or a list of integers, got "
                          f"{shorten(repr(d['eos_token_id']))}")
        else:
            typed("eos_token_id", "int")
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            for i in (d[k] if isinstance(d.get(k), list) else [d.get(k)]):
                if i is not None and d.get("vocab_size") is not None and not 0 <= i < d["vocab_size"]:
                    raise bad(f"{k} {i} is not a token id of the vocabulary (0..{d['vocab_size'] - 1}); fix it "
                              f"or remove the key")
        for k in ("rope_parameters", "rope_scaling"):
            if d.get(k) is not None and not isinstance(d[k], dict):
                raise bad(f"{k} must be an object, got {shorten(repr(d[k]))}")
        if d.get("layer_types") is not None and not isinstance(d["layer_types"], list):
            raise bad(f"layer_types must be a list, got {shorten(repr(d['layer_types']))}")
        if d.get("hidden_act", "silu") != "silu":
            raise bad(f"hidden_act={shorten(repr(d['hidden_act']))} is not supported (only 'silu')")
        if d.get("mlp_bias", False):
            raise bad("mlp_bias=true is not supported")
        if d.get("use_sliding_window", False):
            raise bad("use_sliding_window=true is not supported")
        if any(t != "full_attention" for t in (d.get("layer_types") or [])):
            raise bad("layer_types other than 'full_attention' are not supported")
        if float(d.get("attention_dropout", 0.0) or 0.0) != 0.0:
            raise bad("attention_dropout != 0 is not supported")
        if int(d.get("pretraining_tp", 1) or 1) != 1:
            raise bad("pretraining_tp != 1 is not supported")

        rope = dict(d.get("rope_parameters") or {})
        legacy_scaling = d.get("rope_scaling")
        if legacy_scaling:
            rope = {**legacy_scaling, **rope}
        theta = d.get("rope_theta", rope.get("rope_theta"))
        if theta is None:
            raise bad("missing key 'rope_theta' (top level or inside 'rope_parameters')")
        typed("rope_theta", "number", inner={"rope_theta": theta})
        rtype = rope.get("rope_type", rope.get("type", "default"))
        scaling = None
        if rtype == "llama3":
            scaling = {k: rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                            "original_max_position_embeddings") if k in rope}
            for k in scaling:
                typed(k, "number", inner=scaling)
            scaling["rope_type"] = "llama3"
        elif rtype not in ("default", None):
            raise bad(f"rope_type {shorten(repr(rtype))} is not supported (only 'default' and 'llama3')")

        # Absent keys take transformers' class defaults (4.5x and 5.x agree), so both read one model.
        default_bias = {"qwen2": True, "llama": False, "qwen3": False}[mt]
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        kv = d.get("num_key_value_heads") or d["num_attention_heads"]
        try:
            return cls(
                model_type=mt,
                vocab_size=d["vocab_size"],
                hidden_size=d["hidden_size"],
                intermediate_size=d["intermediate_size"],
                num_hidden_layers=d["num_hidden_layers"],
                num_attention_heads=d["num_attention_heads"],
                num_key_value_heads=kv,
                head_dim=d.get("head_dim") or (128 if mt == "qwen3" else 0),
                max_position_embeddings=d.get("max_position_embeddings", 2048 if mt == "llama" else 32768),
                rope_theta=float(theta),
                rope_scaling=scaling,
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias", default_bias)) if mt != "qwen2" else True,
                qk_norm=(mt == "qwen3"),
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=eos,
                pad_token_id=d.get("pad_token_id"),
            )
        except ConfigError as e:
            raise bad(str(e).removeprefix("model config: ")) from None

    def to_hf_dict(self, *, dtype: str = "bfloat16") -> dict[str, Any]:
        """A config.json that transformers (4.5x and 5.x) loads as this exact model."""
        rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope_parameters = {**self.rope_scaling, "rope_theta": self.rope_theta}
        d: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope_parameters,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": True,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": dtype,
        }
        if self.pad_token_id is not None:
            d["pad_token_id"] = self.pad_token_id
        if self.rope_scaling:
            d["rope_scaling"] = dict(self.rope_scaling)
        if self.model_type == "qwen2":
            d.update(use_sliding_window=False, sliding_window=None, max_window_layers=self.num_hidden_layers)
        else:
            d.update(attention_bias=self.attention_bias, mlp_bias=False)
        return d

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "ModelConfig":
        """Read and validate a config.json; a FIFO, a huge or deeply nested file is refused before parsing."""
        path = os.fspath(path)
        if not os.path.lexists(path):
            raise ConfigError(f"{path}: file not found")
        try:
            d = read_json_input(path, "", CONFIG_MAX_BYTES)
        except InputError as e:
            raise ConfigError(str(e)) from None
        return cls.from_hf_dict(d, source=path)

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# Keys we read, plus metadata keys that do not change the math of training.
_KNOWN_KEYS = frozenset({
    "model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rope_theta",
    "rope_parameters", "rope_scaling", "rms_norm_eps", "tie_word_embeddings", "attention_bias", "mlp_bias",
    "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act", "attention_dropout", "initializer_range",
    "use_cache", "torch_dtype", "dtype", "transformers_version", "use_sliding_window", "sliding_window",
    "max_window_layers", "layer_types", "pretraining_tp", "use_mrope", "output_hidden_states",
    "output_attentions", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "id2label",
    "label2id", "problem_type", "tokenizer_class", "bos_token", "eos_token", "name_or_path",
})


def _qwen25(h: int, f: int, layers: int, heads: int, kv: int, tied: bool) -> ModelConfig:
    return ModelConfig(model_type="qwen2", vocab_size=151936, hidden_size=h, intermediate_size=f,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                       max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=tied,
                       attention_bias=True, bos_token_id=151643, eos_token_id=151643)


def _llama3(h: int, f: int, layers: int, heads: int, kv: int, tied: bool, factor: float) -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=128256, hidden_size=h, intermediate_size=f,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                       max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                       tie_word_embeddings=tied, attention_bias=False, bos_token_id=128000, eos_token_id=128001,
                       rope_scaling={"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})


# Built-in presets for --from-scratch without a config.json (sizes from the published config.json files).
PRESETS: dict[str, Any] = {
    "Qwen2.5-0.5B": lambda: _qwen25(896, 4864, 24, 14, 2, True),
    "Qwen2.5-1.5B": lambda: _qwen25(1536, 8960, 28, 12, 2, True),
    "Qwen2.5-3B": lambda: _qwen25(2048, 11008, 36, 16, 2, True),
    "Qwen2.5-7B": lambda: _qwen25(3584, 18944, 28, 28, 4, False),
    "Qwen2.5-14B": lambda: _qwen25(5120, 13824, 48, 40, 8, False),
    "Qwen2.5-32B": lambda: _qwen25(5120, 27648, 64, 40, 8, False),
    "Llama-3.2-1B": lambda: _llama3(2048, 8192, 16, 32, 8, True, 32.0),
    "Llama-3.2-3B": lambda: _llama3(3072, 8192, 28, 24, 8, True, 32.0),
    "Llama-3.1-8B": lambda: _llama3(4096, 14336, 32, 32, 8, False, 8.0),
}


def preset(name: str) -> ModelConfig:
    """Look a preset up by name, case-insensitively, with or without an `org/` prefix."""
    key = name.rsplit("/", 1)[-1].lower()
    for k, make in PRESETS.items():
        if k.lower() == key:
            return make()
    raise ConfigError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}")
