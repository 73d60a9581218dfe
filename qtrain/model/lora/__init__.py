"""LoRA adapters over a frozen base (docs/lora.md): spec.py (the settings), tensors.py (the adapters as tensor
statements with PEFT's names), adapter.py (the term the block adds to its linears), init.py (their initial values:
peft's, or an existing PEFT adapter), peft_io.py (PEFT's adapter files, read and written), merge.py (W + s B A)."""
from qtrain.model.lora.adapter import LoraAdapter
from qtrain.model.lora.spec import DEFAULT_TARGETS, LoraError, LoraSpec

__all__ = ["DEFAULT_TARGETS", "LoraAdapter", "LoraError", "LoraSpec"]
