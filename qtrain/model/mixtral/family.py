"""The Mixtral family (model_type mixtral): Llama's attention (GQA, no biases, no qk-norm) with a routed MoE MLP in
every layer (top-k of E experts, renormalised), whose checkpoint names are `block_sparse_moe.gate` and
`block_sparse_moe.experts.{e}.w1 / w2 / w3` (gate / down / up). `MIXTRAL` is what `model/registry.py` lists; config.py
holds its config.json mapping and presets, model/moe_family.py and model/moe_block.py the parts the MoE families share.
"""
from __future__ import annotations

from qtrain.model.mixtral.config import ARCHITECTURES, PRESETS, MixtralConfig
from qtrain.model.moe_block import ATTENTION_FP8
from qtrain.model.moe_family import MoeFamily, MoeNames

MIXTRAL = MoeFamily(name="mixtral", architectures=ARCHITECTURES, presets=PRESETS, config_cls=MixtralConfig,
                    names=MoeNames(module="block_sparse_moe.", up="w3", gate="w1", down="w2", also_under=("mlp.",)),
                    fp8_matrices=ATTENTION_FP8)
