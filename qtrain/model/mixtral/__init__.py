"""The Mixtral family (family.py says where each part lives)."""
from qtrain.model.mixtral.config import MixtralConfig
from qtrain.model.mixtral.family import MIXTRAL

__all__ = ["MIXTRAL", "MixtralConfig"]
