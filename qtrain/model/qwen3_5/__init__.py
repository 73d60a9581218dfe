"""The Qwen3.5 family: hybrid Gated DeltaNet + gated full attention, dense and MoE (family.py says where each part
lives)."""
from qtrain.model.qwen3_5.config import Qwen35Config
from qtrain.model.qwen3_5.family import QWEN3_5

__all__ = ["QWEN3_5", "Qwen35Config"]
