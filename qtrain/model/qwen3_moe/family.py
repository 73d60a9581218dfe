"""The Qwen3-MoE family (model_type qwen3_moe): Qwen3's attention (per-head qk-norm, no biases) with routed experts
(top-k of E, `norm_topk_prob` either way) in the layers `decoder_sparse_step` and `mlp_only_layers` leave routed, a
dense SwiGLU MLP in the others. `QWEN3_MOE` is what `model/registry.py` lists; config.py holds its config.json
mapping and presets, model/moe_family.py and model/moe_block.py the parts the MoE families share.
"""
from __future__ import annotations

from qtrain.model.llama import FP8_MATRICES
from qtrain.model.moe_family import MoeFamily, MoeNames
from qtrain.model.qwen3_moe.config import ARCHITECTURES, PRESETS, Qwen3MoeConfig

QWEN3_MOE = MoeFamily(name="qwen3_moe", architectures=ARCHITECTURES, presets=PRESETS, config_cls=Qwen3MoeConfig,
                      names=MoeNames(module="mlp.", up="up_proj", gate="gate_proj", down="down_proj"),
                      fp8_matrices=FP8_MATRICES)  # the dense layers' up / down too; the experts stay bf16
