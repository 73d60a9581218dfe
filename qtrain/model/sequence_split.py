"""What the model needs to know when each sequence is split across ranks (context parallelism): which positions
this rank's tokens hold, and attention of its queries over the whole sequence's keys and values. The model stays
single-device code: `parallel/context.py` implements this with its process group, and the Transformer and the
block only call it (RoPE tables at those positions; `attention` instead of the causal SDPA call). With documents
(--document-masking) the model gets the whole rows' position ids, keeps this rank's part for its RoPE rows
(`shard`) and hands `documents(...)` of the whole rows to every block's attention; without documents it hands
`causal(...)`. Both are made once per micro-step and are block inputs, so a compiled block does not rebuild them.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch


class SequenceSplit(Protocol):
    parts: int  # ranks each sequence is split over

    def positions(self, local_len: int, device: torch.device | str) -> torch.Tensor:
        """Global positions (int64, ascending) of this rank's `local_len` tokens of each sequence."""
        ...

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T) per-token values of whole sequences -> this rank's (B, T / parts), in position order."""
        ...

    def causal(self, local_len: int, device: torch.device | str) -> Any:
        """What `attention` takes as `docs` for whole sequences (once per micro-step)."""
        ...

    def documents(self, positions: torch.Tensor, device: torch.device | str) -> Any:
        """The whole rows' (B, T) position ids of documents -> what `attention` takes as `docs` (once per micro-step)."""
        ...

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Any = None) -> torch.Tensor:
        """Causal attention of this rank's queries (B, nh, t, hs) over every rank's keys and values (each (B, nkv,
        t, hs) here), inside each document with `docs`: (B, nh, t, hs), differentiable in all three (the other ranks'
        key and value gradients reach them)."""
        ...
