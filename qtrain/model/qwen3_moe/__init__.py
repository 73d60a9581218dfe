"""The Qwen3-MoE family (family.py says where each part lives)."""
from qtrain.model.qwen3_moe.config import Qwen3MoeConfig
from qtrain.model.qwen3_moe.family import QWEN3_MOE

__all__ = ["QWEN3_MOE", "Qwen3MoeConfig"]
