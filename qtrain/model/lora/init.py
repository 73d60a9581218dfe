"""The adapters' initial values: peft's (A kaiming-uniform, B zero: the adapted model starts as the base), or an
existing PEFT adapter's (--lora-init-from).

peft initialises A with `nn.init.kaiming_uniform_(A, a=sqrt(5))`, i.e. U(-1/sqrt(in), 1/sqrt(in)); here each target's
A draws from its own generator seeded by (seed, tensor name, target), so the values depend neither on the order of
initialisation nor on the number of ranks (as `model/init.py` does for the base).
"""
from __future__ import annotations

import math

import torch

from qtrain.model.config import ModelConfig
from qtrain.model.init import _tensor_seed
from qtrain.model.lora.spec import LoraSpec
from qtrain.model.lora.tensors import adapter_specs
from qtrain.model.weights import from_hf


@torch.no_grad()
def init_adapters(cfg: ModelConfig, spec: LoraSpec, views: dict[str, torch.Tensor], *, seed: int,
                  source: dict[str, torch.Tensor] | None = None) -> None:
    """Fill the adapter tensors `views` (internal name -> tensor) in place: from `source` (PEFT key -> tensor, a
    checked adapter: peft_io.read_adapter) when given, else peft's initialisation (module docstring)."""
    specs = adapter_specs(cfg, spec)
    for name, t in views.items():
        parts = specs[name].hf
        if source is not None:
            t.copy_(from_hf(specs[name], [source[k] for k, _ in parts]))
        elif name.endswith("_lora_b"):
            t.zero_()
        else:
            rows = []
            for k, shape in parts:
                bound = 1.0 / math.sqrt(shape[1])
                gen = torch.Generator(device=t.device).manual_seed(_tensor_seed(seed, k))
                rows.append(torch.empty(shape, dtype=torch.float32, device=t.device).uniform_(-bound, bound,
                                                                                               generator=gen))
            t.copy_(torch.cat(rows))
