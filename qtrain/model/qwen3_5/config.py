"""The Qwen3.5 family's config: what the `config.json` of a Qwen3.5 / Qwen3.6 text backbone (`qwen3_5_text`, dense;
`qwen3_5_moe_text`, MoE with a shared expert) says, or of the multimodal checkpoint around one (`qwen3_5`,
`qwen3_5_moe`: the text model's keys under `text_config`), and the built-in presets.

A multimodal config.json is read as its text model: `multimodal` keeps the rest of the file (the vision config, the
image / video token ids, the architectures) so that an export writes it back, with the text weights under the prefix
transformers' `Qwen3_5ForConditionalGeneration` reads (`model.language_model.`; tensors.py). The vision tower and
the MTP (multi-token prediction) head are not part of the text model: their weights are ignored on load with one
line (hf_io's notes) and are not in an export.

Read strictly, as every family: a key that would change the model and that qtrain does not implement is an error
naming the file and the key. Dimensions the delta-rule kernels cannot serve (`kernels.delta_rule.LIMITS`) are
refused here, before the model is built, with the values.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from qtrain.fsio import shorten
from qtrain.kernels.delta_rule import LIMITS
from qtrain.model.config import (COMMON_HF_KEYS, ConfigError, HfKeys, ModelConfig, RouterSpec, check_positive_int,
                                 config_error)

# text model_type -> (its CausalLM architecture, the multimodal model_type around it, that one's architecture)
TEXT_TYPES = {"qwen3_5_text": ("Qwen3_5ForCausalLM", "qwen3_5", "Qwen3_5ForConditionalGeneration"),
              "qwen3_5_moe_text": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration")}
MULTIMODAL_TYPES = {mm: text for text, (_, mm, _) in TEXT_TYPES.items()}
ARCHITECTURES = {**{t: a for t, (a, _, _) in TEXT_TYPES.items()}, **{mm: a for _, (_, mm, a) in TEXT_TYPES.items()}}
LAYER_TYPES = ("linear_attention", "full_attention")
MULTIMODAL_PREFIX = "model.language_model."  # where Qwen3_5ForConditionalGeneration keeps the text model
TEXT_PREFIX = "model."


def default_layer_types(layers: int, interval: int = 4) -> tuple[str, ...]:
    """transformers' default: every `interval`-th layer full attention, the others linear attention."""
    return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers))


def layer_types_of(d: dict[str, Any], error: Callable[[str], Exception]) -> tuple[str, ...]:
    """A config.json's `layer_types` (a list of names), else transformers' default from `full_attention_interval`."""
    lt = d.get("layer_types")
    if lt is None:
        return default_layer_types(d["num_hidden_layers"], d.get("full_attention_interval", 4))
    if isinstance(lt, list) and all(isinstance(t, str) for t in lt):
        return tuple(lt)
    raise error(f"layer_types must be a list of strings, got {shorten(repr(lt))}")


def scaling_without_rotary_factor(common: dict[str, Any]) -> None:
    """Drop partial_rotary_factor from the common fields' rope_scaling (in place): in transformers' rope_parameters it
    sits beside the scaling keys (read apart as a field of its own), and the scaling's checks refuse keys they do not
    read."""
    if common["rope_scaling"]:
        common["rope_scaling"] = {k: v for k, v in common["rope_scaling"].items() if k != "partial_rotary_factor"}


@dataclass(kw_only=True)
class Qwen35Config(ModelConfig):
    """The hybrid decoder's fields besides the common ones (maps to the text config.json). Letters: F =
    intermediate_size; the linear-attention (Gated DeltaNet) layers have Hk key heads of dk and H value heads of dv."""

    MODEL_TYPES = tuple(TEXT_TYPES)  # what this class reads (a class attribute, not a field)
    MIXED_MLP = False  # whether an MoE model may keep dense MLP layers (Qwen3-Next's mlp_only_layers)
    HF_LEGACY_KEYS = False  # only transformers 5.x has these families: rope_parameters and dtype alone

    model_type: str = "qwen3_5_text"
    vocab_size: int = 248320  # Qwen3.5's tokenizer
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 256  # full-attention layers: wider heads than hidden / heads
    intermediate_size: int = 12288
    layer_types: tuple[str, ...] = ()  # per layer: 'linear_attention' or 'full_attention' (() = every 4th full)
    partial_rotary_factor: float = 0.25  # RoPE rotates the first 64 of 256 dims of a full-attention head
    linear_conv_kernel_dim: int = 4  # causal depthwise convolution width over [q; k; v] of the linear layers
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    # MoE (qwen3_5_moe_text): every layer's MLP is routed experts + a gated shared expert; 0 experts = dense
    num_experts: int = 0
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    router_aux_loss_coef: float = 0.001  # the load-balancing loss's weight (transformers' default; `router`)
    # which layers route (Qwen3-Next's keys; Qwen3.5 routes in every layer of the MoE variant, `is_moe_layer`) and
    # whether the top-k weights are renormalised (Qwen3.5 always; Qwen3-Next per config)
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    norm_topk_prob: bool = True
    # the multimodal config.json this text model came from, without its text_config (None: a text checkpoint)
    multimodal: dict[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = default_layer_types(self.num_hidden_layers)
        self.layer_types = tuple(self.layer_types)
        self.mlp_only_layers = tuple(self.mlp_only_layers)
        if self.num_experts > 0 and self.MIXED_MLP is False:
            self.intermediate_size = 0  # no dense MLP (transformers' Qwen3.5 MoE config has no such key)
        super().__post_init__()

    # ---- derived sizes, defined once ----
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def zero_centered_norms(self) -> bool:
        return True  # every RMSNorm but the gated one scales by (1 + w), w initialised to 0

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: [q; k; v] of a linear-attention layer."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def in_proj_dim(self) -> int:
        """Rows of a linear-attention layer's fused input projection [qkv; z; b; a]."""
        return self.conv_dim + self.linear_value_dim + 2 * self.linear_num_value_heads

    @property
    def q_gate_dim(self) -> int:
        """Rows of a full-attention layer's q projection: per head, hs rows of q then hs rows of its output gate."""
        return 2 * self.q_dim

    @property
    def attn_qkv_dim(self) -> int:
        """Rows of a full-attention layer's fused [q + gate; k; v] projection."""
        return self.q_gate_dim + 2 * self.kv_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def router(self) -> RouterSpec | None:
        """Every layer of the MoE variant routes (no dense layers): the load-balancing loss transformers'
        Qwen3_5MoeForCausalLM adds with output_router_logits (model/moe_router.py), weighted by
        router_aux_loss_coef; None for the dense variant."""
        layers = tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))
        if not layers:
            return None
        return RouterSpec(layers=layers, experts=self.num_experts,
                          top_k=self.num_experts_per_tok, aux_loss_coef=self.router_aux_loss_coef)

    @property
    def architecture(self) -> str:
        """The CausalLM class transformers builds for this text config."""
        return ARCHITECTURES[self.model_type]

    @property
    def hf_prefix(self) -> str:
        """Where the text model's tensors sit in the checkpoint (module docstring)."""
        return MULTIMODAL_PREFIX if self.multimodal is not None else TEXT_PREFIX

    def is_linear(self, layer: int) -> bool:
        return self.layer_types[layer] == "linear_attention"

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP routes to experts (transformers' Qwen3-Next rule; every layer of a Qwen3.5
        MoE model)."""
        return self.is_moe and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @property
    def has_dense_layers(self) -> bool:
        return any(not self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    def validate(self) -> None:
        if self.model_type not in self.MODEL_TYPES:
            raise config_error(f"unknown model_type {self.model_type!r}; supported: {', '.join(self.MODEL_TYPES)}")
        super().validate()
        for name in (*(("intermediate_size",) if self.has_dense_layers else ()), "linear_conv_kernel_dim",
                     "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
                     "decoder_sparse_step"):
            check_positive_int(self, name)
        bad = [i for i in self.mlp_only_layers if not (isinstance(i, int) and 0 <= i < self.num_hidden_layers)]
        if bad:
            raise config_error(f"mlp_only_layers {shorten(repr(bad))} are not layers of this model "
                               f"(0..{self.num_hidden_layers - 1})")
        if len(self.layer_types) != self.num_hidden_layers or any(t not in LAYER_TYPES for t in self.layer_types):
            bad = sorted({str(t) for t in self.layer_types if t not in LAYER_TYPES})
            raise config_error(f"layer_types must list {self.num_hidden_layers} entries (num_hidden_layers), each one of "
                               f"{LAYER_TYPES}; got {len(self.layer_types)} entries"
                               + (f", unsupported {shorten(repr(bad))}" if bad else ""))
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise config_error(f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                               f"linear_num_key_heads={self.linear_num_key_heads}")
        for name in ("linear_key_head_dim", "linear_value_head_dim"):
            d = getattr(self, name)
            if d > LIMITS["head_dim_max"] or d % LIMITS["head_dim_multiple"]:
                raise config_error(f"{name}={d}: the delta-rule kernels serve head dims up to {LIMITS['head_dim_max']} "
                                   f"in multiples of {LIMITS['head_dim_multiple']}")
        kc = self.linear_conv_kernel_dim
        if not LIMITS["conv_min"] <= kc <= LIMITS["conv_max"]:
            raise config_error(f"linear_conv_kernel_dim={kc}: the convolution kernel serves widths "
                               f"{LIMITS['conv_min']}..{LIMITS['conv_max']}")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise config_error(f"partial_rotary_factor={self.partial_rotary_factor!r} must be in (0, 1] and give an "
                               f"even number of rotated dims (head_dim={self.head_dim})")
        if self.is_moe:
            for name in ("num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
                check_positive_int(self, name)
            if self.num_experts_per_tok > self.num_experts:
                raise config_error(f"num_experts_per_tok={self.num_experts_per_tok} exceeds num_experts="
                                   f"{self.num_experts}")
            c = self.router_aux_loss_coef
            if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c < 0:
                raise config_error(f"router_aux_loss_coef must be a finite number >= 0, got {shorten(repr(c))}")
        elif self.model_type == "qwen3_5_moe_text":
            raise config_error("qwen3_5_moe_text needs num_experts > 0")
        if not self.MIXED_MLP and (self.mlp_only_layers or self.decoder_sparse_step != 1 or not self.norm_topk_prob):
            raise config_error(f"{self.model_type} routes in every layer and renormalises the top-k weights "
                               "(mlp_only_layers, decoder_sparse_step and norm_topk_prob are Qwen3-Next's)")

    # ---- HF interop ----
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], *, source: str = "config.json") -> "Qwen35Config":
        """From a parsed config.json: a text one (model_type in TEXT_TYPES) or a multimodal one (MULTIMODAL_TYPES),
        whose `text_config` is read and whose other keys are kept (module docstring)."""
        mt = d["model_type"]
        multimodal = None
        if mt in MULTIMODAL_TYPES:
            text = d.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError(f"{source}: model_type {mt!r} needs a 'text_config' object")
            multimodal = copy.deepcopy({k: v for k, v in d.items() if k != "text_config"})
            top_tied = d.get("tie_word_embeddings")
            d = {"model_type": MULTIMODAL_TYPES[mt], **text}
            if d["model_type"] != MULTIMODAL_TYPES[mt]:
                raise ConfigError(f"{source}: text_config.model_type {shorten(repr(d['model_type']))} does not "
                                  f"belong to {mt!r} (expected {MULTIMODAL_TYPES[mt]!r})")
            if top_tied is not None:  # transformers' multimodal class ties by the top-level key
                d["tie_word_embeddings"] = top_tied
            source = f"{source}: text_config"
        r = HfKeys(d, source)
        moe = d["model_type"] == "qwen3_5_moe_text"
        r.check_keys(_KNOWN_KEYS | (_MOE_KEYS if moe else frozenset()), _REQUIRED_KEYS)
        ints = ("intermediate_size", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                "linear_num_key_heads", "linear_num_value_heads", "full_attention_interval", "mtp_num_hidden_layers")
        moe_ints = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
        r.check_types(ints=ints + (moe_ints if moe else ()), numbers=("partial_rotary_factor", "router_aux_loss_coef"),
                      bools=("attention_bias", "attn_output_gate", "norm_topk_prob"),
                      positive=tuple(k for k in ints if k != "mtp_num_hidden_layers"))
        if d.get("hidden_act", "silu") != "silu":
            raise r.error(f"hidden_act={shorten(repr(d['hidden_act']))} is not supported (only 'silu')")
        if d.get("attention_bias", False):
            raise r.error("attention_bias=true is not supported (Qwen3.5 has no attention biases)")
        if d.get("attn_output_gate", True) is not True:
            raise r.error("attn_output_gate=false is not supported (Qwen3.5's full attention is gated)")
        if moe and d.get("norm_topk_prob", True) is not True:
            raise r.error("norm_topk_prob=false is not supported (Qwen3.5-MoE renormalises the top-k weights)")
        if float(d.get("attention_dropout", 0.0) or 0.0) != 0.0:
            raise r.error("attention_dropout != 0 is not supported")
        if d.get("mamba_ssm_dtype", "float32") != "float32":
            raise r.error(f"mamba_ssm_dtype={shorten(repr(d['mamba_ssm_dtype']))}: the delta-rule state is fp32")
        layer_types = layer_types_of(d, r.error)
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        prf = d.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))
        r.typed("partial_rotary_factor", "number", inner={"partial_rotary_factor": prf})
        common = r.common_fields(max_position_embeddings=32768, head_dim=256)
        common.update(model_type=d["model_type"], num_key_value_heads=d.get("num_key_value_heads") or (2 if moe else 4))
        scaling_without_rotary_factor(common)
        fields = dict(intermediate_size=d.get("intermediate_size", 12288), layer_types=layer_types,
                      partial_rotary_factor=float(prf),
                      **{k: d.get(k, getattr(cls, k)) for k in ("linear_conv_kernel_dim", "linear_key_head_dim",
                                                                "linear_value_head_dim", "linear_num_key_heads",
                                                                "linear_num_value_heads")})
        if moe:
            fields.update({k: d.get(k, _MOE_DEFAULTS[k]) for k in _MOE_DEFAULTS})
            fields["router_aux_loss_coef"] = float(fields["router_aux_loss_coef"])
        try:
            cfg = cls(**common, **fields, multimodal=multimodal)
        except ConfigError as e:
            raise r.error(str(e).removeprefix("model config: ")) from None
        return cfg

    def hf_rope_parameters(self) -> dict[str, Any]:
        return {**super().hf_rope_parameters(), "partial_rotary_factor": self.partial_rotary_factor}

    def text_hf_dict(self, *, dtype: str = "bfloat16") -> dict[str, Any]:
        """The text model's config.json (a multimodal export nests it under `text_config`)."""
        d = self.hf_common_dict(architecture=self.architecture, dtype=dtype)
        d.update(attention_bias=False, layer_types=list(self.layer_types),
                 linear_conv_kernel_dim=self.linear_conv_kernel_dim, linear_key_head_dim=self.linear_key_head_dim,
                 linear_value_head_dim=self.linear_value_head_dim, linear_num_key_heads=self.linear_num_key_heads,
                 linear_num_value_heads=self.linear_num_value_heads)
        if self.is_moe:
            d.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                     moe_intermediate_size=self.moe_intermediate_size,
                     shared_expert_intermediate_size=self.shared_expert_intermediate_size,
                     router_aux_loss_coef=self.router_aux_loss_coef)
        else:
            d["intermediate_size"] = self.intermediate_size
        return d

    def to_hf_dict(self, *, dtype: str = "bfloat16") -> dict[str, Any]:
        """A config.json that transformers loads as this exact model: the text config, or the multimodal one it came
        from with this text config inside (the text weights then sit where that class reads them, tensors.py)."""
        text = self.text_hf_dict(dtype=dtype)
        if self.multimodal is None:
            return text
        text.pop("architectures")
        return {**copy.deepcopy(self.multimodal), "text_config": text, "tie_word_embeddings": self.tie_word_embeddings,
                "dtype": dtype}


_REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
_KNOWN_KEYS = COMMON_HF_KEYS | {
    "intermediate_size", "attention_bias", "layer_types", "full_attention_interval", "partial_rotary_factor",
    "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
    "linear_num_value_heads", "attn_output_gate", "mamba_ssm_dtype", "base_config_key",
    # MTP (multi-token prediction) head: its weights are dropped on load (hf_io notes it), its keys change nothing here
    "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings"}
_MOE_DEFAULTS = {"num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
                 "shared_expert_intermediate_size": 512, "router_aux_loss_coef": 0.001}
_MOE_KEYS = frozenset(_MOE_DEFAULTS) | {"norm_topk_prob", "output_router_logits"}


def _qwen35(h: int, f: int, layers: int, heads: int, kv: int, v_heads: int, tied: bool) -> Qwen35Config:
    return Qwen35Config(model_type="qwen3_5_text", vocab_size=248320, hidden_size=h, intermediate_size=f,
                        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv, head_dim=256,
                        linear_num_key_heads=16, linear_num_value_heads=v_heads, linear_key_head_dim=128,
                        linear_value_head_dim=128, linear_conv_kernel_dim=4, partial_rotary_factor=0.25,
                        max_position_embeddings=262144, rope_theta=10_000_000.0, rms_norm_eps=1e-6,
                        tie_word_embeddings=tied, bos_token_id=None, eos_token_id=248044)


def _qwen35_moe(h: int, layers: int, heads: int, kv: int, experts: int, top_k: int, f_moe: int) -> Qwen35Config:
    return Qwen35Config(model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=h, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=kv, head_dim=256, linear_num_key_heads=16,
                        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                        max_position_embeddings=262144, rope_theta=10_000_000.0, rms_norm_eps=1e-6,
                        tie_word_embeddings=False, num_experts=experts, num_experts_per_tok=top_k,
                        moe_intermediate_size=f_moe, shared_expert_intermediate_size=f_moe, eos_token_id=248044)


# Built-in presets for --from-scratch without a config.json. Source: the text_config of the published Qwen/Qwen3.5-*
# config.json files as recalled at the time of writing (hidden, layers, heads and head_dim of the 4B also in its model
# card; the 9B's are transformers' Qwen3_5TextConfig defaults, "Qwen3.5-9B style"; the 35B-A3B's are
# Qwen3_5MoeTextConfig's defaults); every 4th layer full attention. Check them against the model's own config.json
# before relying on a shape; a run from a checkpoint reads its config.json, never these.
PRESETS: dict[str, Callable[[], Qwen35Config]] = {
    "Qwen3.5-4B": lambda: _qwen35(2560, 9216, 32, 16, 4, 32, True),
    "Qwen3.5-9B": lambda: _qwen35(4096, 12288, 32, 16, 4, 32, False),
    "Qwen3.5-27B": lambda: _qwen35(5120, 17408, 64, 24, 4, 48, False),
    "Qwen3.5-35B-A3B": lambda: _qwen35_moe(2048, 40, 16, 2, 256, 8, 512),
}
