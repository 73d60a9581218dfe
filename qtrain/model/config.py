"""Model configuration common to every family: the fields of a Hugging Face `config.json` that the
family-independent code reads (the per-block loop, the embedding, RoPE tables, the final norm, the LM head
and loss, token ids, checkpoints), and the checks a `config.json` goes through key by key.

Each family extends `ModelConfig` with its own fields and its own mapping from and to `config.json`
(`qtrain/model/<family>/config.py`, e.g. `llama.LlamaConfig`); `model/registry.py` picks the family from the
file's `model_type`. Code outside a family folder reads only the fields defined here.

The validation of a config lives in one place per level: `ModelConfig.validate` checks the common fields,
a family's `validate` adds its own (calling this one first); `HfKeys` checks the JSON types of what a
`config.json` says before any of it is used, so a string where a number belongs is an error naming the file
and the key, not a raw ValueError from float().
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable

from qtrain.fsio import shorten
from qtrain.kernels.rope_scaling import SCALING_KEYS, scaled_context


class ConfigError(ValueError):
    """A config.json (or preset) that qtrain cannot represent faithfully."""


@dataclass(frozen=True)
class RouterSpec:
    """What the family-independent code knows of a Mixture-of-Experts model's routers (`ModelConfig.router`): which
    layers route their tokens to experts, and the load-balancing loss of transformers' MoE models
    (`moe_router.load_balancing_loss`, weighted by `aux_loss_coef`)."""
    layers: tuple[int, ...]  # the layers whose MLP is a routed mixture of experts
    experts: int
    top_k: int
    aux_loss_coef: float


@dataclass(kw_only=True)
class ModelConfig:
    """Maps to a HF config.json (the keys every supported family shares). Dimension letters used in model code:
    C = hidden_size, nh = num_attention_heads, nkv = num_key_value_heads, hs = head_dim, V = vocab_size."""

    model_type: str = ""  # HF model_type: the family that reads and builds it (model/registry.py)
    vocab_size: int = 151936
    hidden_size: int = 896
    num_hidden_layers: int = 24
    num_attention_heads: int = 14
    num_key_value_heads: int = 2  # GQA: each kv head serves nh // nkv query heads
    head_dim: int = 0  # 0 => hidden_size // num_attention_heads (Qwen3 sets it explicitly)
    max_position_embeddings: int = 32768
    rope_theta: float = 1_000_000.0
    # long-context frequency scaling: {"rope_type": llama3 | yarn | linear | dynamic, its keys} (the HF keys,
    # kernels/rope_scaling.py), or None for plain RoPE
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-6  # the final norm's (and, in the families so far, every block norm's)
    tie_word_embeddings: bool = True  # LM head shares the embedding matrix
    bos_token_id: int | None = None  # the presets and config.json name them; none is assumed
    eos_token_id: int | None = None  # the first where config.json lists several (Llama 3: [128001, 128008, 128009])
    pad_token_id: int | None = None
    # every EOS id config.json names, where it lists several (a document of a token file may end with any of them:
    # `end_of_document_ids`); not compared, and not written back (`to_hf_dict` keeps eos_token_id's one id)
    eos_token_ids: tuple[int, ...] = dataclasses.field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // max(self.num_attention_heads, 1)
        self.validate()

    @property
    def end_of_document_ids(self) -> tuple[int, ...]:
        """The ids after which a document of an unannotated token file ends (--document-masking): every EOS id."""
        if self.eos_token_ids:
            return self.eos_token_ids
        return () if self.eos_token_id is None else (self.eos_token_id,)

    # ---- derived sizes, defined once ----
    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def hf_prefix(self) -> str:
        """Where the decoder's tensors sit in a checkpoint ('model.': `model.layers.{l}.`, `model.embed_tokens`); a
        family whose checkpoint nests its text model elsewhere says so (Qwen3.5's multimodal layout)."""
        return "model."

    @property
    def router(self) -> RouterSpec | None:
        """The model's routers (a Mixture-of-Experts family says), None for a dense model."""
        return None

    @property
    def rotary_dim(self) -> int:
        """Dimensions of a head that RoPE rotates, the width of the RoPE tables the loop hands every block: all of
        them here; a family with partial rotary embeddings says fewer."""
        return self.head_dim

    @property
    def zero_centered_norms(self) -> bool:
        """Whether the RMSNorm gains are stored as w with the norm scaling by (1 + w) (Qwen3.5, Qwen3-Next): the final
        norm follows it (layers.final_norm_fn); the families so far scale by w."""
        return False

    @property
    def context_length(self) -> int:
        """Tokens a sequence may hold: max_position_embeddings, or what the RoPE scaling extends it to."""
        return scaled_context(self)

    def validate(self) -> None:
        """The checks of the common fields (a family's `validate` calls this first, then checks its own)."""
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "max_position_embeddings"):
            check_positive_int(self, name)
        if self.num_attention_heads % self.num_key_value_heads:
            raise config_error(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                               f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise config_error(f"head_dim={self.head_dim} must be even for RoPE")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise config_error(f"rope_theta must be positive, got {self.rope_theta!r}")
        if not (0 < self.rms_norm_eps < 1):
            raise config_error(f"rms_norm_eps must be in (0, 1), got {self.rms_norm_eps!r}")
        if self.rope_scaling is not None:
            check_rope_scaling(self.rope_scaling)
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            i = getattr(self, k)
            if i is not None and not 0 <= i < self.vocab_size:
                raise config_error(f"{k} {i} is not a token id of the vocabulary (0..{self.vocab_size - 1})")

    # Whether transformers 4.5x reads the family too: its config.json then also carries the 4.x spellings (the
    # top-level rope_theta, rope_scaling, torch_dtype); a family only 5.x has writes rope_parameters and dtype alone.
    HF_LEGACY_KEYS: ClassVar[bool] = True

    def to_hf_dict(self, *, dtype: str = "bfloat16") -> dict[str, Any]:
        """A config.json that transformers loads as this exact model (each family writes its own, starting from
        `hf_common_dict`)."""
        raise NotImplementedError(f"{type(self).__name__} has no config.json mapping")

    def hf_rope_parameters(self) -> dict[str, Any]:
        """transformers 5.x's `rope_parameters`: rope_theta with the scaling type and its keys (a family with keys
        of its own there, such as a partial rotary factor, adds them)."""
        return {**(self.rope_scaling or {"rope_type": "default"}), "rope_theta": self.rope_theta}

    def hf_common_dict(self, *, architecture: str, dtype: str) -> dict[str, Any]:
        """The keys every family's config.json writes the same way (sizes, RoPE, norm eps, tying, token ids, the
        fixed activation / dropout / init keys, dtype); a family's `to_hf_dict` adds its own keys to it."""
        d: dict[str, Any] = {
            "architectures": [architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            **({"rope_theta": self.rope_theta} if self.HF_LEGACY_KEYS else {}),
            "rope_parameters": self.hf_rope_parameters(),
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": True,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype" if self.HF_LEGACY_KEYS else "dtype": dtype,
        }
        if self.pad_token_id is not None:
            d["pad_token_id"] = self.pad_token_id
        if self.rope_scaling and self.HF_LEGACY_KEYS:
            d["rope_scaling"] = dict(self.rope_scaling)
        return d

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def config_error(msg: str) -> ConfigError:
    return ConfigError(f"model config: {msg}")


def check_positive_int(cfg: Any, name: str) -> None:
    v = getattr(cfg, name)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise config_error(f"{name} must be a positive integer, got {v!r}")


ROPE_TYPES = ("default", *SCALING_KEYS)  # the `rope_type`s qtrain computes (kernels/rope_scaling.py)
_ROPE_INTS, _ROPE_BOOLS = ("original_max_position_embeddings",), ("truncate",)


def _scaling_part(rope: dict[str, Any]) -> dict[str, Any]:
    """A rope dict without rope_theta, its legacy `type` read as `rope_type`: what two spellings must agree on."""
    out = {k: v for k, v in rope.items() if k not in ("rope_theta", "type")}
    out["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    return out


def check_rope_scaling(sc: dict[str, Any]) -> None:
    """A scaling dict names a supported type, has that type's required keys and no key it does not read, and holds
    numbers where numbers belong (factors positive, llama3's high_freq_factor above its low_freq_factor)."""
    kind = sc.get("rope_type")
    if kind not in SCALING_KEYS:
        raise config_error(f"rope scaling type {shorten(repr(kind))} is not supported "
                           f"(supported: {', '.join(map(repr, SCALING_KEYS))})")
    required, optional = SCALING_KEYS[kind]
    for k in required:
        if k not in sc:
            raise config_error(f"{kind} rope scaling needs {k!r}")
    unknown = sorted(set(sc) - {*required, *optional, "rope_type"})
    if unknown:
        raise config_error(f"{kind} rope scaling key(s) {shorten(repr(unknown))} not understood; qtrain refuses "
                           f"them rather than compute other frequencies than transformers")
    for k, v in sc.items():
        if k == "rope_type" or v is None and (kind == "yarn" and k != "original_max_position_embeddings"):
            continue  # yarn's optional keys (and its factor) may be null: transformers derives them
        if k in _ROPE_BOOLS:
            ok = isinstance(v, bool)
        elif k in _ROPE_INTS:
            ok = isinstance(v, int) and not isinstance(v, bool) and v > 0
        else:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (
                v > 0 or k in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"))
        if not ok:
            raise config_error(f"{kind} rope scaling {k} must be "
                               f"{'true or false' if k in _ROPE_BOOLS else 'a positive number'}, "
                               f"got {shorten(repr(v))}")
    if kind == "llama3" and not sc["high_freq_factor"] > sc["low_freq_factor"]:
        raise config_error(f"llama3 rope scaling needs high_freq_factor > low_freq_factor, got "
                           f"{sc['high_freq_factor']!r} and {sc['low_freq_factor']!r}")


# Keys of a decoder config.json that every family reads the same way (`HfKeys.common_fields`), plus metadata keys
# that do not change the math of training; a family adds its own to form the keys it accepts.
COMMON_HF_KEYS = frozenset({
    "model_type", "architectures", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rope_theta", "rope_parameters", "rope_scaling",
    "rms_norm_eps", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act",
    "attention_dropout", "initializer_range", "use_cache", "torch_dtype", "dtype", "transformers_version",
    "output_hidden_states", "output_attentions", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder",
    "id2label", "label2id", "problem_type", "tokenizer_class", "bos_token", "eos_token", "name_or_path",
})

_JSON_KINDS = {
    "int": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "number": ("a finite number",
               lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
}


class HfKeys:
    """A parsed config.json (`d`, from file `source`) read key by key; every error names the file and the key."""

    def __init__(self, d: dict[str, Any], source: str):
        self.d, self.source = d, source

    def error(self, msg: str) -> ConfigError:
        return ConfigError(f"{self.source}: {msg}")

    def get(self, key: str, default: Any = None) -> Any:
        return self.d.get(key, default)

    def typed(self, key: str, kind: str, default: Any = None, inner: dict | None = None) -> Any:
        """d[key] (or inner[key]) checked against JSON's types (`kind`: int, number, bool, str); None passes."""
        v = (self.d if inner is None else inner).get(key, default)
        want, ok = _JSON_KINDS[kind]
        if v is not None and not ok(v):
            raise self.error(f"{key} must be {want}, got {shorten(repr(v))}")
        return v

    def check_keys(self, known: frozenset[str], required: Iterable[str]) -> None:
        """Refuse keys outside `known` (a key qtrain does not implement could change the model) and missing
        `required` ones."""
        unknown = sorted(k for k in self.d if k not in known and not k.startswith("_"))
        if unknown:
            raise self.error(f"unknown config key(s) {shorten(repr(unknown))}; qtrain refuses keys it does not "
                             f"understand rather than train a different model than transformers would load")
        for k in required:
            if k not in self.d:
                raise self.error(f"missing key {k!r}")

    def check_types(self, *, ints: Iterable[str] = (), numbers: Iterable[str] = (), bools: Iterable[str] = (),
                    strs: Iterable[str] = (), positive: Iterable[str] = ()) -> None:
        """The JSON types of the common keys and of the family's own (`ints`, ...); the sizes (the common ones and
        the family's `positive`) above zero when given; token ids inside the vocabulary."""
        for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "max_position_embeddings", *ints):
            self.typed(k, "int")
        for k in ("rms_norm_eps", "attention_dropout", "rope_theta", "initializer_range", *numbers):
            self.typed(k, "number")
        for k in ("tie_word_embeddings", *bools):
            self.typed(k, "bool")
        for k in ("hidden_act", *strs):
            self.typed(k, "str")
        for k in ("bos_token_id", "pad_token_id"):
            self.typed(k, "int")
        eos = self.d.get("eos_token_id")
        if isinstance(eos, list):
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in eos):
                raise self.error(f"eos_token_id must be an integer or a list of integers, got {shorten(repr(eos))}")
        else:
            self.typed("eos_token_id", "int")
        for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "max_position_embeddings", *positive):
            if self.d.get(k) is not None and self.d[k] <= 0:  # explicit: only an absent key takes the default
                raise self.error(f"{k} must be a positive integer, got {self.d[k]}")
        vocab = self.d.get("vocab_size")
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            v = self.d.get(k)
            for i in (v if isinstance(v, list) else [v]):
                if i is not None and vocab is not None and not 0 <= i < vocab:
                    raise self.error(f"{k} {i} is not a token id of the vocabulary (0..{vocab - 1}); fix it or "
                                     f"remove the key")
        for k in ("rope_parameters", "rope_scaling"):
            if self.d.get(k) is not None and not isinstance(self.d[k], dict):
                raise self.error(f"{k} must be an object, got {shorten(repr(self.d[k]))}")

    def rope(self, max_position_embeddings: int | None = None) -> tuple[float, dict[str, Any] | None]:
        """(rope_theta, the scaling dict or None) from the top level and `rope_parameters` (transformers 5.x) or
        `rope_scaling` (4.x). The scaling dict keeps the type's keys as HF names them; an absent
        `original_max_position_embeddings` of llama3 or yarn is `max_position_embeddings` (as transformers' loading
        fills it in; `max_position_embeddings`: the family's default where the file has none)."""
        rope = dict(self.d.get("rope_parameters") or {})
        legacy_scaling = self.d.get("rope_scaling")
        if legacy_scaling:
            if rope and _scaling_part(rope) != _scaling_part(legacy_scaling):
                # transformers 5.x then reads rope_scaling alone, 4.x reads it beside rope_theta: refuse the doubt
                raise self.error(f"rope_scaling {shorten(repr(legacy_scaling))} and rope_parameters "
                                 f"{shorten(repr(rope))} disagree; keep one of them")
            rope = {**legacy_scaling, **rope}
        theta = self.d.get("rope_theta", rope.get("rope_theta"))
        if theta is None:
            raise self.error("missing key 'rope_theta' (top level or inside 'rope_parameters')")
        self.typed("rope_theta", "number", inner={"rope_theta": theta})
        rtype = rope.get("rope_type", rope.get("type", "default"))
        if rtype in ("default", None):
            return float(theta), None
        if rtype not in SCALING_KEYS:
            raise self.error(f"rope_type {shorten(repr(rtype))} is not supported (supported: "
                             f"{', '.join(map(repr, ROPE_TYPES))})")
        scaling = {k: v for k, v in rope.items() if k not in ("rope_type", "type", "rope_theta")}
        for k in scaling:
            self.typed(k, "bool" if k in _ROPE_BOOLS else "int" if k in _ROPE_INTS else "number", inner=scaling)
        max_pos = self.d.get("max_position_embeddings", max_position_embeddings)
        if rtype in ("llama3", "yarn") and max_pos is not None:
            scaling.setdefault("original_max_position_embeddings", max_pos)
        return float(theta), {"rope_type": rtype, **scaling}

    def common_fields(self, *, max_position_embeddings: int, head_dim: int = 0) -> dict[str, Any]:
        """The `ModelConfig` fields of this config.json; absent keys take the defaults given (transformers' class
        defaults of the family, so that both read one model)."""
        d = self.d
        max_pos = d.get("max_position_embeddings", max_position_embeddings)
        theta, scaling = self.rope(max_pos)
        eos = d.get("eos_token_id")
        eos_all = tuple(eos) if isinstance(eos, list) else ()
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return dict(
            model_type=d["model_type"], vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            num_hidden_layers=d["num_hidden_layers"], num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=d.get("head_dim") or head_dim,
            max_position_embeddings=max_pos,
            rope_theta=theta, rope_scaling=scaling, rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"), eos_token_id=eos, pad_token_id=d.get("pad_token_id"),
            eos_token_ids=eos_all)

    def build(self, cls: type[ModelConfig], **fields: Any) -> ModelConfig:
        """cls(**fields), its validation errors reported against this file."""
        try:
            return cls(**fields)
        except ConfigError as e:
            raise self.error(str(e).removeprefix("model config: ")) from None

