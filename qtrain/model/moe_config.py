"""What the Mixture-of-Experts families (`qwen3_moe/`, `olmoe/`, `mixtral/`) share in their configs: the expert
count, top-k and width, the routing's renormalisation and the load-balancing loss's weight, which layers route, and
the reading of those keys from a config.json (each family's `config.py` maps its own keys and writes its own file).

All three are Llama-style decoders (pre-norm, RoPE, GQA, SwiGLU) whose MLP routes each token to k of E experts
(`model/moe.py`); they borrow the Llama family's attention (`llama/block.py`), which reads `qkv_dim`, `qk_norm` and,
for the layers that keep a dense MLP (Qwen3-MoE's `mlp_only_layers` / `decoder_sparse_step`), `intermediate_size`.

Dimension letters: E experts, k experts per token, F an expert's intermediate size (`moe_intermediate_size`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from qtrain.fsio import shorten
from qtrain.model.config import HfKeys, ModelConfig, RouterSpec, check_positive_int, config_error

# config.json keys of transformers' MoE configs that change nothing qtrain computes: whether the HF model returns the
# router logits (qtrain always adds the load-balancing loss to the gradient, as transformers does when it does)
MOE_METADATA_KEYS = frozenset({"output_router_logits"})


@dataclass(kw_only=True)
class MoeConfig(ModelConfig):
    """The fields the MoE families share besides the common ones (module docstring for E, k, F)."""

    intermediate_size: int = 6144  # the dense MLP's width in the layers that do not route (Qwen3-MoE); where every
    # layer routes (OLMoE, Mixtral) it is the experts' width, as their config.json says
    moe_intermediate_size: int = 768  # F: each expert's SwiGLU width
    num_experts: int = 128  # E: experts per MoE layer
    num_experts_per_tok: int = 8  # k: experts each token is routed to (top-k of the router's softmax)
    norm_topk_prob: bool = False  # renormalise the k kept probabilities to sum to 1 (Mixtral always does)
    router_aux_loss_coef: float = 0.001  # weight of the load-balancing loss (transformers adds coef * aux_loss)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3-MoE), as the Llama block reads it
    attention_bias: ClassVar[bool] = False  # none of these families has QKV biases (the Llama block's statements)

    @property
    def qkv_dim(self) -> int:
        """Rows of the fused [q; k; v] projection (the Llama block's attention)."""
        return self.q_dim + 2 * self.kv_dim

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is dense (`intermediate_size`), not routed: none unless the family says."""
        return ()

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers whose MLP routes to experts."""
        return tuple(i for i in range(self.num_hidden_layers) if i not in self.dense_layers)

    @property
    def router(self) -> RouterSpec | None:
        layers = self.moe_layers
        if not layers:
            return None
        return RouterSpec(layers=layers, experts=self.num_experts, top_k=self.num_experts_per_tok,
                          aux_loss_coef=self.router_aux_loss_coef)

    def validate(self) -> None:
        super().validate()
        for name in ("intermediate_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok"):
            check_positive_int(self, name)
        if self.num_experts_per_tok > self.num_experts:
            raise config_error(f"num_experts_per_tok={self.num_experts_per_tok} exceeds num_experts="
                               f"{self.num_experts}: a token cannot be routed to more experts than a layer has")
        c = self.router_aux_loss_coef
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c < 0:
            raise config_error(f"router_aux_loss_coef must be a finite number >= 0, got {c!r}")


def experts_from_hf(r: HfKeys, *, names: tuple[str, ...], default: int) -> int:
    """The expert count, under either of the names transformers maps onto each other for a family (its config's
    `attribute_map`: num_experts <-> num_local_experts; its save_pretrained may write either); both given must
    agree."""
    found = {k: r.typed(k, "int") for k in names if r.get(k) is not None}
    if len(set(found.values())) > 1:
        raise r.error(f"{' and '.join(f'{k}={v}' for k, v in found.items())} disagree (transformers reads them as "
                      f"one value)")
    n = next(iter(found.values()), default)
    if n <= 0:
        raise r.error(f"{next(iter(found), names[0])} must be a positive integer, got {n}")
    return n


def moe_fields_from_hf(r: HfKeys, *, experts: int, top_k_default: int, aux_default: float,
                       norm_topk_default: bool | None) -> dict[str, Any]:
    """The shared MoE fields of a config.json (`MoeConfig`), absent keys taking the family's transformers defaults;
    `norm_topk_default` None: the family always renormalises and has no such key (Mixtral)."""
    r.typed("num_experts_per_tok", "int")
    r.typed("router_aux_loss_coef", "number")
    k = r.get("num_experts_per_tok", top_k_default)
    if k <= 0:
        raise r.error(f"num_experts_per_tok must be a positive integer, got {k}")
    if k > experts:
        raise r.error(f"num_experts_per_tok={k} exceeds the number of experts ({experts})")
    coef = r.get("router_aux_loss_coef", aux_default)
    if coef < 0:
        raise r.error(f"router_aux_loss_coef must be >= 0, got {coef}")
    if norm_topk_default is None:
        norm = True
    else:
        r.typed("norm_topk_prob", "bool")
        norm = bool(r.get("norm_topk_prob", norm_topk_default))
    return dict(num_experts=experts, num_experts_per_tok=k, router_aux_loss_coef=float(coef), norm_topk_prob=norm)


def refuse_common(r: HfKeys) -> None:
    """What none of the MoE families implements, refused by key: another activation, attention dropout or biases."""
    if r.get("hidden_act", "silu") != "silu":
        raise r.error(f"hidden_act={shorten(repr(r.get('hidden_act')))} is not supported (only 'silu')")
    if float(r.get("attention_dropout", 0.0) or 0.0) != 0.0:
        raise r.error("attention_dropout != 0 is not supported")
    r.typed("attention_bias", "bool")
    if r.get("attention_bias", False):
        raise r.error("attention_bias=true is not supported (q/k/v/o biases)")


def moe_hf_dict(cfg: MoeConfig, *, architecture: str, dtype: str) -> dict[str, Any]:
    """The keys every MoE family's config.json shares: the common ones and the routing's (the family adds its own)."""
    d = cfg.hf_common_dict(architecture=architecture, dtype=dtype)
    d.update(num_experts_per_tok=cfg.num_experts_per_tok, router_aux_loss_coef=cfg.router_aux_loss_coef,
             output_router_logits=False)
    return d
