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

What the next families and training modes need, stated here and nowhere else:
  - layers may hold different tensors (a hybrid model's linear- and full-attention layers): each layer's groups
    come from its family's `block_tensors(cfg, layer)`, and nothing assumes that blocks look alike;
  - a tensor may name a group of its own within its layer (`TensorSpec.group`: 'block.{l}.X', e.g. adapters);
  - a group may be *frozen* (`FlatLayout(..., frozen=keys)`, `Group.trainable` False): it has weights, but the
    gradient managers, the optimizer and the memory plan allocate nothing for it; `FlatLayout(..., lora=spec)` is
    the frozen base with each layer's LoRA adapters as a trainable group 'block.{l}.lora' (model/lora/);
  - a tensor may be a stack of identical experts (`Segment.experts`, shape (E, ...)): expert parallelism gives
    each of its ranks whole experts, `Group.expert_pieces`;
  - expert parallelism (`FlatLayout(..., expert_parallel=ep)`, parallel/experts.py): a group of expert stacks holds
    only a rank's E/ep experts (the same shapes on every rank, other experts), and it is sharded over the world/ep
    ranks that hold the same experts (`Group.ep`): rank r = d ep + e holds experts e and shard d of them, so
    `shard_size` / `shard_range` / `shard_pieces` of the world's rank give the right part to every consumer.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Collection, Sequence

import torch

from qtrain import host_memory
from qtrain.model.config import ModelConfig
from qtrain.model.family import TensorSpec
from qtrain.model.lora import tensors as lora_tensors
from qtrain.model.lora.spec import LoraSpec
from qtrain.model.weights import statements

ALIGN = 64  # elements; keeps every shard start 128-byte aligned in bf16 (vector loads, NCCL)


@dataclass(frozen=True)
class Segment:
    """One tensor inside a group buffer."""
    name: str  # internal parameter name, e.g. 'layers.3.qkv'
    start: int  # offset in the group buffer
    shape: tuple[int, ...]
    decay: bool = True  # AdamW weight decay (the family's TensorSpec.decay)
    experts: int = 0  # > 0: a stack of that many identical expert tensors along dim 0, expert e at t[e]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def short(self) -> str:
        """The name inside its group: 'qkv' for 'layers.3.qkv' (a non-block name is its own)."""
        return self.name.rsplit(".", 1)[-1]

    @property
    def expert_numel(self) -> int:
        """Elements of one expert of a stack."""
        if not self.experts:
            raise ValueError(f"{self.name} is not a stack of experts")
        return self.numel // self.experts

    def expert_span(self, first: int, count: int = 1) -> tuple[int, int]:
        """[start, stop) in the group buffer of experts first .. first + count - 1 of this stack (contiguous)."""
        if not 0 <= first <= first + count <= self.experts:
            raise ValueError(f"{self.name}: experts [{first}, {first + count}) outside [0, {self.experts})")
        return self.start + first * self.expert_numel, self.start + (first + count) * self.expert_numel


@dataclass(frozen=True)
class Piece:
    """The part of one tensor that a shard holds."""
    segment: Segment
    tensor_offset: int  # first element of the tensor in this piece
    shard_offset: int  # where the piece starts inside the shard
    numel: int


@dataclass(frozen=True)
class Group:
    key: str  # 'block.3' (or 'block.3.X' for a layer's group X) or a non-block tensor name
    index: int  # position in FlatLayout.groups: used in RNG keys
    layer: int | None
    segments: tuple[Segment, ...]
    padded_numel: int
    trainable: bool = True  # False: frozen, no gradients and no optimizer state anywhere
    ep: int = 1  # > 1: a group of expert stacks split over that many expert-parallel ranks (module docstring)

    @property
    def content_numel(self) -> int:
        """Elements of its tensors (the buffer before the padding that depends on the world size)."""
        last = self.segments[-1]
        return last.start + last.numel

    def shard_size(self, world: int) -> int:
        """Elements of one rank's shard: of world ranks, or, for an expert-parallel group, of the world / ep ranks
        that hold the same experts."""
        return self.padded_numel // (world // self.ep)

    def shard_range(self, rank: int, world: int) -> tuple[int, int]:
        """[lo, hi) of rank `rank`'s shard in the group buffer (an expert-parallel group: shard rank // ep)."""
        s = self.shard_size(world)
        i = rank // self.ep
        return i * s, (i + 1) * s

    def shard_pieces(self, rank: int, world: int, names: Collection[str] | None = None) -> list[Piece]:
        """The pieces of rank `rank`'s shard, in buffer order; only of the tensors `names` (short names) if given."""
        return self.pieces(*self.shard_range(rank, world), names=names)

    def pieces(self, lo: int, hi: int, names: Collection[str] | None = None) -> list[Piece]:
        """The parts of the tensors in buffer elements [lo, hi), in buffer order (shard_offset: from lo)."""
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

    @property
    def experts(self) -> int:
        """The number of experts of the group's stacks (they all have the same), 0 if it holds none."""
        counts = {s.experts for s in self.segments if s.experts}
        if len(counts) > 1:
            raise ValueError(f"group {self.key} holds stacks of {sorted(counts)} experts")
        return counts.pop() if counts else 0

    def expert_pieces(self, ep_rank: int, ep_world: int) -> list[Piece]:
        """The parts of the group's expert stacks that expert-parallel rank `ep_rank` of `ep_world` holds: experts
        [r E/W, (r+1) E/W) of every stack, each a contiguous run (shard_offset: where it goes in the rank's
        buffer of its experts, stacks back to back in group order)."""
        E = self.experts
        if not E or E % ep_world or not 0 <= ep_rank < ep_world:
            raise ValueError(f"group {self.key}: {E} experts cannot be split evenly over {ep_world} ranks "
                             f"(rank {ep_rank})")
        n, out, pos = E // ep_world, [], 0
        for s in self.segments:
            if s.experts:
                a, b = s.expert_span(ep_rank * n, n)
                out.append(Piece(s, a - s.start, pos, b - a))
                pos += b - a
        return out


def local_experts(t: TensorSpec, ep: int) -> TensorSpec:
    """A stack of E experts as one of `ep` expert-parallel ranks holds it: E/ep experts (other tensors as they are)."""
    if not t.experts:
        return t
    if t.experts % ep:
        raise ValueError(f"{t.name}: {t.experts} experts cannot be split evenly over {ep} expert-parallel ranks")
    n = t.experts // ep
    return dataclasses.replace(t, shape=(n, *tuple(t.shape)[1:]), experts=n)


class FlatLayout:
    """The groups of a model (`cfg`, its family's tensors) for state sharded over `world` ranks. `frozen`: keys of
    groups that are not trained. `tensors`: (non-block tensors, each layer's tensors) instead of the family's
    statements (tests, and families built on another's)."""

    def __init__(self, cfg: ModelConfig, world: int = 1, *, frozen: Collection[str] = (),
                 tensors: tuple[Sequence[TensorSpec], Sequence[Sequence[TensorSpec]]] | None = None,
                 lora: LoraSpec | None = None, expert_parallel: int = 1):
        self.cfg, self.world, self.lora, self.expert_parallel = cfg, world, lora, expert_parallel
        if lora is not None:  # the base frozen, each layer's adapters a trainable group 'block.{l}.lora'
            if tensors is not None or frozen:
                raise ValueError("FlatLayout: lora= states the tensors and the frozen groups itself")
            tensors = lora_tensors.model_tensors(cfg, lora)
            # every base group: the non-block tensors, each block's own and its other groups (an MoE's experts)
            frozen = [t.name for t in tensors[0]] + [
                f"block.{i}" + (f".{g}" if g else "") for i, specs in enumerate(tensors[1])
                for g in dict.fromkeys(t.group for t in specs) if g != lora_tensors.GROUP]
        if tensors is None:
            st = statements(cfg)
            tensors = (st.non_block, st.blocks)
        non_block, blocks = tensors
        ep = expert_parallel
        if ep < 1 or world % ep:
            raise ValueError(f"expert_parallel {ep} must divide the world size {world}")
        if ep > 1:  # each rank's stacks: E/ep experts (`local_experts`)
            blocks = [[local_experts(t, ep) for t in specs] for specs in blocks]
        self.num_layers = len(blocks)
        groups: list[Group] = []
        unit = world * ALIGN
        frozen = set(frozen)

        def add(key: str, layer: int | None, specs: Sequence[TensorSpec], prefix: str) -> None:
            segs, off = [], 0
            for t in specs:
                segs.append(Segment(prefix + t.name, off, tuple(t.shape), t.decay, t.experts))
                off += segs[-1].numel
            experts = [s.experts > 0 for s in segs]
            if ep > 1 and any(experts) and not all(experts):
                raise ValueError(f"group {key} mixes expert stacks with other tensors: expert parallelism needs the "
                                 f"stacks in a group of their own")
            groups.append(Group(key, len(groups), layer, tuple(segs), -(-off // unit) * unit, key not in frozen,
                                ep if all(experts) and ep > 1 else 1))

        for t in non_block:
            add(t.name, None, [t], "")
        for layer, specs in enumerate(blocks):
            names = [t.name for t in specs]
            if len(set(names)) != len(names):
                raise ValueError(f"layer {layer}: tensor names repeat: {names}")
            by_group: dict[str, list[TensorSpec]] = {}
            for t in specs:
                by_group.setdefault(t.group, []).append(t)
            for label, members in by_group.items():
                add(f"block.{layer}" + (f".{label}" if label else ""), layer, members, f"layers.{layer}.")
        self.groups = groups
        self.by_key = {g.key: g for g in groups}
        unknown = sorted(frozen - set(self.by_key))
        if unknown:
            raise ValueError(f"frozen groups {unknown} are not groups of this model (groups: {list(self.by_key)})")
        self.group_of = {s.name: g for g in groups for s in g.segments}
        self._layers: dict[int, list[Group]] = {}
        for g in groups:
            if g.layer is not None:
                self._layers.setdefault(g.layer, []).append(g)

    def block(self, layer: int) -> Group:
        """Layer `layer`'s own group ('block.{layer}')."""
        return self.by_key[f"block.{layer}"]

    def layer_groups(self, layer: int) -> list[Group]:
        """Every group of layer `layer`: its own first, then those its tensors name (`TensorSpec.group`)."""
        return self._layers.get(layer, [])

    def non_block_groups(self) -> list[Group]:
        return [g for g in self.groups if g.layer is None]

    def trainable_groups(self, *, blocks: bool | None = None) -> list[Group]:
        """The groups that have gradients and optimizer state (all but the frozen ones); only the blocks' (`blocks`
        True) or only the others (False)."""
        return [g for g in self.groups if g.trainable and (blocks is None or blocks == (g.layer is not None))]

    def total_numel(self) -> int:
        return sum(g.padded_numel for g in self.groups)

    def allocate(self, *, dtype: torch.dtype, device: torch.device | str, shard: bool = False,
                 rank: int = 0, pin: bool = False,
                 groups: Sequence[Group] | None = None) -> dict[str, torch.Tensor]:
        """Zeroed group buffers keyed by group key: full size, or only this rank's shard (`shard=True`); of every
        group, or of `groups`; on the host pinned when `pin` (qtrain.host_memory: exactly sized)."""
        out = {}
        for g in self.groups if groups is None else groups:
            n = g.shard_size(self.world) if shard else g.padded_numel
            out[g.key] = host_memory.zeros(n, dtype, device, pin=pin)
        return out

    def views(self, buffers: dict[str, torch.Tensor], groups: list[Group] | None = None) -> dict[str, torch.Tensor]:
        """Tensor views (internal name -> shaped view) into full group buffers: of every group, or of `groups`."""
        out = {}
        for g in self.groups if groups is None else groups:
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
