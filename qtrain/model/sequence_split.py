"""What the model needs to know when each sequence is split across ranks (context parallelism): which positions
this rank's tokens hold, and attention of its queries over the whole sequence's keys and values. The model stays
single-device code: `parallel/context.py` implements this with its process group, and the Transformer and the
block only call it (RoPE tables at those positions; `attention` instead of the causal SDPA call).
"""
from __future__ import annotations

from typing import Protocol

import torch


class SequenceSplit(Protocol):
    parts: int  # ranks each sequence is split over

    def positions(self, local_len: int, device: torch.device | str) -> torch.Tensor:
        """Global positions (int64, ascending) of this rank's `local_len` tokens of each sequence."""
        ...

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of this rank's queries (B, nh, t, hs) over every rank's keys and values (each (B, nkv,
        t, hs) here): (B, nh, t, hs), differentiable in all three (the other ranks' key and value gradients reach
        them)."""
        ...
