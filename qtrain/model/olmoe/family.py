"""The OLMoE family (model_type olmoe): Llama-style attention whose q and k go through RMSNorm over the whole
projection (and an optional clamp of q, k, v: block.py), and a routed MoE MLP in every layer (top-k of E, no
renormalisation by default). `OLMOE` is what `model/registry.py` lists; config.py holds its config.json mapping and
presets, model/moe_family.py and model/moe_block.py the parts the MoE families share.
"""
from __future__ import annotations

from qtrain.model.moe_block import ATTENTION_FP8
from qtrain.model.moe_family import MoeFamily, MoeNames
from qtrain.model.olmoe.block import OlmoeBlock
from qtrain.model.olmoe.config import ARCHITECTURES, PRESETS, OlmoeConfig


def _qk_norm_shapes(cfg: OlmoeConfig) -> dict[str, tuple[int, ...]]:
    """OLMoE's q and k norm gains span the whole projections."""
    return {"q_norm": (cfg.q_dim,), "k_norm": (cfg.kv_dim,)}


OLMOE = MoeFamily(name="olmoe", architectures=ARCHITECTURES, presets=PRESETS, config_cls=OlmoeConfig,
                  names=MoeNames(module="mlp.", up="up_proj", gate="gate_proj", down="down_proj"),
                  fp8_matrices=ATTENTION_FP8, block_cls=OlmoeBlock, qkv_statement=OlmoeBlock.saved_by_qkv,
                  qk_norm_shapes=_qk_norm_shapes)
