"""The Llama family: Llama 2/3, Qwen2/2.5 and Qwen3 dense (family.py says where each part lives)."""
from qtrain.model.llama.block import FP8_MATRICES
from qtrain.model.llama.config import LlamaConfig
from qtrain.model.llama.family import LLAMA

__all__ = ["FP8_MATRICES", "LLAMA", "LlamaConfig"]
