"""The one-pass FP8 SwiGLU's state: each layer's scale hints, kept across calls and saved by checkpoints.

`fp8_onepass.py` predicts the power-of-two scales of h and du from the exponents the same layer used in its previous
call (two int32 per layer, h's and du's). The one-function FP8 MLP reads and updates them in place, so the tensor a
layer gets must be the same one at every call: every micro-step, a `--recompute-block` rerun and every CUDA-graph
replay (which bakes in its address). They are run state, not weights: the scales a layer picks depend on them within
one binade, so a checkpoint saves them (`state()`, per rank) and a resumed run starts from them (`load()`), which
keeps resuming bit for bit. A layer that has not run yet reads unset (`HINT_UNSET`: its first call takes the second
pass and the tensor's own exponent).
"""
from __future__ import annotations

import torch
from torch import Tensor

from qtrain.kernels.swiglu.fp8_onepass import HINT_UNSET, new_scale_hint

__all__ = ["ScaleHints"]


class ScaleHints:
    """The hints of a model's `layers` layers: one int32 (2,) tensor per (layer, device), made at the layer's first
    call (from the loaded state, if any), then the same tensor for good."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self._hints: dict[tuple[int, str], Tensor] = {}
        self._loaded: Tensor | None = None  # (layers, 2) from a checkpoint, for hints not made yet

    def of(self, layer: int, device: torch.device) -> Tensor:
        """Layer `layer`'s hints on `device` (what the block hands the FP8 MLP as its `scale_hint`)."""
        key = (layer, str(device))
        if key not in self._hints:
            self._hints[key] = new_scale_hint(device)
            if self._loaded is not None:
                self._hints[key].copy_(self._loaded[layer])
        return self._hints[key]

    def __len__(self) -> int:
        """How many (layer, device) hint tensors exist (a layer that has not run has none)."""
        return len(self._hints)

    def state(self) -> Tensor:
        """Every layer's hints as one (layers, 2) int32 CPU tensor (a checkpoint's); a layer that has not run reads the
        loaded state, or unset."""
        out = torch.full((self.layers, 2), HINT_UNSET, dtype=torch.int32)
        if self._loaded is not None:
            out.copy_(self._loaded)
        for (layer, _), hint in self._hints.items():
            out[layer] = hint.cpu()
        return out

    @torch.no_grad()
    def load(self, hints: Tensor) -> None:
        """Continue from `state()`'s tensor: the layers' tensors take it now, those not made yet when they are.
        Refused (ValueError) unless it is (layers, 2) int32."""
        shape = (self.layers, 2)
        if hints.dtype != torch.int32 or tuple(hints.shape) != shape:
            raise ValueError(f"scale hints: expected {shape} int32, got {tuple(hints.shape)} {hints.dtype}")
        self._loaded = hints.detach().cpu().clone()
        for (layer, _), hint in self._hints.items():
            hint.copy_(self._loaded[layer])
