"""Flat buffer layout shared by weights, gradients and optimizer state.

Every parameter belongs to a *group*: each transformer block is one group (all its tensors back to back,
in the order its family's `block_tensors` states them), and each non-block tensor (`embed`, `norm`, `lm_head`) is
a group of its own. A group lives in one flat 1-D buffer padded to a multiple of `world * ALIGN` elements, so:
  - one collective per group moves a whole block (one reduce-scatter / all-gather instead of seven);
  - rank r's shard is the contiguous slice [r*n/W, (r+1)*n/W) of the buffer, the same slice in the
    weights, the gradients and the Adam moments;
  - tensors are plain views into the buffer, so nothing is copied between "model" and "flat" form.
A shard may cut through a tensor; `shard_pieces` says which part of which tensor a shard holds, which is
what the optimizer needs (weight decay is per tensor; the SR counter offset is the element's index in
its tensor, so a sharded update is bit-identical to an unsharded one).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Collection

import torch

from qtrain.model.config import ModelConfig
from qtrain.model.registry import family_of

ALIGN = 64  # elements; keeps every shard start 128-byte aligned in bf16 (vector loads, NCCL)


@dataclass(frozen=True)
class Segment:
    """One tensor inside a group buffer."""
    name: str  # internal parameter name, e.g. 'layers.3.qkv'
    start: int  # offset in the group buffer
    shape: tuple[int, ...]
    decay: bool = True  # AdamW weight decay (the family's TensorSpec.decay)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def short(self) -> str:
        """The name inside its group: 'qkv' for 'layers.3.qkv' (a non-block name is its own)."""
        return self.name.rsplit(".", 1)[-1]


@dataclass(frozen=True)
class Piece:
    """The part of one tensor that a shard holds."""
    segment: Segment
    tensor_offset: int  # first element of the tensor in this piece
    shard_offset: int  # where the piece starts inside the shard
    numel: int


@dataclass(frozen=True)
class Group:
    key: str  # 'block.3' or a non-block tensor name
    index: int  # position in FlatLayout.groups: used in RNG keys
    layer: int | None
    segments: tuple[Segment, ...]
    padded_numel: int

    def shard_size(self, world: int) -> int:
        return self.padded_numel // world

    def shard_range(self, rank: int, world: int) -> tuple[int, int]:
        s = self.shard_size(world)
        return rank * s, (rank + 1) * s

    def shard_pieces(self, rank: int, world: int, names: Collection[str] | None = None) -> list[Piece]:
        """The pieces of rank `rank`'s shard, in buffer order; only of the tensors `names` (short names) if given."""
        lo, hi = self.shard_range(rank, world)
        pieces = []
        for seg in self.segments:
            if names is not None and seg.short not in names:
                continue
            a, b = max(lo, seg.start), min(hi, seg.start + seg.numel)
            if a < b:
                pieces.append(Piece(seg, a - seg.start, a - lo, b - a))
        return pieces

    def max_shard_numel(self, world: int, names: Collection[str]) -> int:
        """The most elements of the tensors `names` (short names) that any one rank's shard holds: the size of
        a per-rank slot that can carry every rank's part of them in one equal-split all-gather."""
        return max(sum(p.numel for p in self.shard_pieces(r, world, names)) for r in range(world))


class FlatLayout:
    def __init__(self, cfg: ModelConfig, world: int = 1):
        self.cfg, self.world = cfg, world
        family = family_of(cfg)
        groups: list[Group] = []
        unit = world * ALIGN
        for t in family.non_block_tensors(cfg):
            seg = Segment(t.name, 0, t.shape, t.decay)
            groups.append(Group(t.name, len(groups), None, (seg,), -(-seg.numel // unit) * unit))
        for layer in range(cfg.num_hidden_layers):
            segs, off = [], 0
            for t in family.block_tensors(cfg, layer):
                segs.append(Segment(f"layers.{layer}.{t.name}", off, t.shape, t.decay))
                off += segs[-1].numel
            groups.append(Group(f"block.{layer}", len(groups), layer, tuple(segs), -(-off // unit) * unit))
        self.groups = groups
        self.by_key = {g.key: g for g in groups}
        self.group_of = {s.name: g for g in groups for s in g.segments}

    def block(self, layer: int) -> Group:
        return self.by_key[f"block.{layer}"]

    def non_block_groups(self) -> list[Group]:
        return [g for g in self.groups if g.layer is None]

    def total_numel(self) -> int:
        return sum(g.padded_numel for g in self.groups)

    def allocate(self, *, dtype: torch.dtype, device: torch.device | str, shard: bool = False,
                 rank: int = 0, pin_memory: bool = False) -> dict[str, torch.Tensor]:
        """Zeroed group buffers keyed by group key: full size, or only this rank's shard (`shard=True`)."""
        out = {}
        for g in self.groups:
            n = g.shard_size(self.world) if shard else g.padded_numel
            t = torch.zeros(n, dtype=dtype, device=device, pin_memory=pin_memory)
            out[g.key] = t
        return out

    def views(self, buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Tensor views (internal name -> shaped view) into full group buffers."""
        out = {}
        for g in self.groups:
            buf = buffers[g.key]
            for s in g.segments:
                out[s.name] = buf[s.start:s.start + s.numel].view(s.shape)
        return out

    def block_views(self, buffer: torch.Tensor, layer: int) -> dict[str, torch.Tensor]:
        """Short name -> shaped view into one block's full buffer (e.g. a rotating gradient buffer)."""
        out = {}
        for s in self.block(layer).segments:
            out[s.name.rsplit(".", 1)[1]] = buffer[s.start:s.start + s.numel].view(s.shape)
        return out
