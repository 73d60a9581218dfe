"""Replicated weights: every rank holds every parameter (the default, ZeRO-1/2), as views into the flat
group buffers of `parallel/layout.py` that the optimizer updates and all-gathers in place."""
from __future__ import annotations

import torch

from qtrain.model.config import ModelConfig
from qtrain.model.weights import block_tensor_names, non_block_names, split_name
from qtrain.parallel.footprint import Footprint
from qtrain.parallel.layout import FlatLayout


class ParamWeights:
    """The plain weight source: a flat dict of full parameter tensors (replicated weights)."""

    def __init__(self, cfg: ModelConfig, params: dict[str, torch.Tensor]):
        self.params = params
        self._block_names = [block_tensor_names(cfg, layer) for layer in range(cfg.num_hidden_layers)]
        for name in params:  # tensors beyond the family's (LoRA adapters: model/lora/) follow theirs
            layer, short = split_name(name)
            if layer is not None and short not in self._block_names[layer]:
                self._block_names[layer].append(short)
        self._non_block_names = non_block_names(cfg)

    def block(self, layer: int) -> dict[str, torch.Tensor]:
        return {n: self.params[f"layers.{layer}.{n}"] for n in self._block_names[layer]}

    def non_block(self) -> dict[str, torch.Tensor]:
        return {n: self.params[n] for n in self._non_block_names}

    def release_block(self, layer: int) -> None:
        pass

    def invalidate(self) -> None:
        pass


def replicated_footprint(layout: FlatLayout, dtype: torch.dtype, frozen_dtype: torch.dtype | None = None) -> Footprint:
    """Every group's full buffer (`layout.allocate`; the parameters are views into them): the weights and, with no
    separate copy, the master, in `dtype`; frozen groups in `frozen_dtype` (default `dtype`: they have no master,
    `factory.build_weights` keeps them in the compute dtype)."""
    frozen = sum(g.padded_numel for g in layout.groups if not g.trainable)
    return Footprint({"params": (layout.total_numel() - frozen) * dtype.itemsize
                      + frozen * (frozen_dtype or dtype).itemsize})
