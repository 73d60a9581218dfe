"""The OLMoE family (family.py says where each part lives)."""
from qtrain.model.olmoe.config import OlmoeConfig
from qtrain.model.olmoe.family import OLMOE

__all__ = ["OLMOE", "OlmoeConfig"]
