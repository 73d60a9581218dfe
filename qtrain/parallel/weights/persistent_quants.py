"""Persistent quants for sharded weights (`--persistent-quants` with `--shard-weights` / `--zero-level 3`; llm.q's
quantized shards): this rank's e4m3 copy of its shard of every block matrix, made once per weights version.

With FP8 matmuls every linear would quantize the gathered bf16 matrix again in every forward; instead each
rank keeps an e4m3 copy of *its shard* of every block matrix (`PersistentQuants`), made once per weights
version, lazily at the first block gather after `invalidate()` (so once per optimizer step, reused by every
micro-step and by evaluation). Which matrices: of the names the run's FP8 policy puts in FP8, those a layer's
groups hold (`quantized_groups`); layers may differ (a hybrid model's linear-attention layers hold in_proj / out,
its full-attention layers qkv / o), and an MoE layer's expert stacks or a LoRA layer's adapters are no such matrix.
The scale is the FULL tensor's: each rank takes the abs-max of its pieces of every (layer, matrix), one all-reduce
MAX over that small fp32 tensor gives every rank the exact full-tensor abs-max, and each rank quantizes its pieces
with `kernels.fp8_quant.quantize_fp8(piece, amax=...)`, the helper the linears use on the whole tensor: the codes
are bit-identical to quantizing the gathered tensor (the quantization is element-wise once the scale is fixed).
The class also holds the static maps of where a group's pieces sit in a shard (`GroupPlan`, one per distinct
group layout, so identical layers share one), which the gathers use: the matrices' codes go as they lie in the
group's flat layout, its small tensors through an exchange buffer (`ShardedWeights`' docstring says how).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from qtrain import host_memory
from qtrain.kernels.fp8_quant import E4M3, quantize_fp8
from qtrain.parallel.comm import Communicator
from qtrain.parallel.footprint import Footprint
from qtrain.parallel.layout import FlatLayout, Group

__all__ = ["GroupPlan", "PersistentQuants", "quantized_groups"]


_ROW = 4096  # elements: flat pieces are quantized as (rows, _ROW) + a tail, keeping GPU grids small


def _quantize_flat(x: torch.Tensor, amax: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """e4m3 codes of the 1-D `x` (scale from the given abs-max) written into `out` (uint8, same length);
    returns the inverse scale. The quantization is element-wise once the scale is fixed, so the shape only
    matters to the kernel's launch grid: a long piece goes as (rows, _ROW) (a (1, n) grid would exceed CUDA's
    65535 limit on grid y for tens of millions of elements) plus the remainder. An empty `x` still returns
    the scale (a rank that holds no piece of a matrix needs it too)."""
    n = x.numel()
    cut = n - n % _ROW
    inv = None
    if cut:
        q, inv = quantize_fp8(x[:cut].view(-1, _ROW), E4M3, amax)
        out[:cut].copy_(q.view(torch.uint8).view(-1))
    if n > cut or inv is None:
        q, inv = quantize_fp8(x[cut:], E4M3, amax)
        out[cut:].copy_(q.view(torch.uint8))
    return inv


def quantized_groups(layout: FlatLayout, names: tuple[str, ...]) -> list[list[tuple[Group, tuple[str, ...]]]]:
    """Per layer, its groups that hold any of the block matrices `names`, each with those matrices (in group order);
    a layer may have none. A ValueError for a name no layer holds, or a matrix whose e4m3 view could not be a 2-D
    tensor at a multiple of 16 elements of its group (the FP8 GEMM's alignment)."""
    out, seen = [], set()
    for layer in range(layout.cfg.num_hidden_layers):
        row = []
        for g in layout.layer_groups(layer):
            mats = tuple(s.short for s in g.segments if s.short in names)
            for s in g.segments:
                if s.short in names and (s.start % 16 or len(s.shape) != 2):
                    raise ValueError(f"persistent quants: block matrix {s.short!r} {s.shape} starts at element "
                                     f"{s.start} of the block buffer; its e4m3 view needs a 2-D tensor at a multiple "
                                     "of 16 (FP8 GEMM alignment)")
            if mats:
                row.append((g, mats))
                seen.update(mats)
        out.append(row)
    unknown = [n for n in names if n not in seen]
    if unknown and layout.cfg.num_hidden_layers:
        raise ValueError(f"persistent quants: {unknown} are tensors of no block")
    return out


def small_sizes(group: Group, matrices: tuple[str, ...], world: int) -> tuple[int, int]:
    """(elements of the group's small tensors -- all but `matrices` -- back to back, elements of one rank's slot of
    their exchange buffer: the most any rank's shard holds of them)."""
    small = {s.short for s in group.segments if s.short not in matrices}
    return sum(s.numel for s in group.segments if s.short in small), group.max_shard_numel(world, small)


def signature(group: Group) -> tuple:
    """What a group's plan depends on (its tensors' places and its padded size): identical layers share one plan."""
    return tuple((s.short, s.start, s.shape) for s in group.segments), group.padded_numel


@dataclass(frozen=True)
class GroupPlan:
    """How a group laid out one way, holding the quantized `matrices`, travels for rank `rank`: `own` its pieces of
    each matrix ((offset in the shard, numel), or None); the small tensors (everything else) back to back in group
    order (`small_offsets`, `small_numel`), rank r packing its pieces of them (in shard order) into slot r (`slot`
    elements) of the exchange buffer (`pack`: (offset in the shard, offset in the slot, numel)); `recv_idx[i]` is
    where element i of the back-to-back small tensors sits in the gathered exchange."""
    matrices: tuple[str, ...]
    own: tuple[tuple[int, int] | None, ...]
    small_offsets: dict[str, int]
    small_numel: int
    slot: int
    pack: tuple[tuple[int, int, int], ...]
    recv_idx: torch.Tensor

    @classmethod
    def of(cls, g: Group, matrices: tuple[str, ...], *, rank: int, world: int, device: torch.device) -> GroupPlan:
        own = {p.segment.short: (p.shard_offset, p.numel) for p in g.shard_pieces(rank, world, matrices)}
        small_segments = [s for s in g.segments if s.short not in matrices]
        small = {s.short for s in small_segments}
        offsets, n = {}, 0
        for s in small_segments:
            offsets[s.short], n = n, n + s.numel
        small_numel, slot = small_sizes(g, matrices, world)
        idx = torch.empty(n, dtype=torch.long)
        for r in range(world):
            pos = r * slot
            for p in g.shard_pieces(r, world, small):
                start = offsets[p.segment.short] + p.tensor_offset
                idx[start:start + p.numel] = torch.arange(pos, pos + p.numel)
                pos += p.numel
        pack, pos = [], 0
        for p in g.shard_pieces(rank, world, small):
            pack.append((p.shard_offset, pos, p.numel))
            pos += p.numel
        return cls(matrices, tuple(own.get(m) for m in matrices), offsets, small_numel, slot, tuple(pack),
                   idx.to(device))


class PersistentQuants:
    """This rank's e4m3 shard of every group holding block matrices `names` (`codes`, by group key), made once per
    weights version, and the static maps of where those groups' pieces sit in a shard (`plan_of`, by group key).

    `refresh()` is a collective (one all-reduce MAX); `ShardedWeights` calls it at the first block gather of a
    new version, which every rank reaches at the same point of the same pass."""

    def __init__(self, layout: FlatLayout, names: tuple[str, ...], *, rank: int, world: int, dtype: torch.dtype,
                 device: torch.device, offload: bool):
        self.names, self.device, self.dtype = names, device, dtype
        self.num_layers = layout.cfg.num_hidden_layers
        self.layout, self.rank, self.world = layout, rank, world
        self.layers = quantized_groups(layout, names)
        # per layer, its quantized matrices in group order: the order of `inv_scales[layer]`
        self.matrices = [tuple(m for _, mats in row for m in mats) for row in self.layers]
        plans: dict[tuple, GroupPlan] = {}
        self.plan_of: dict[str, GroupPlan] = {}
        for g, mats in (gm for row in self.layers for gm in row):
            if g.ep != 1:
                raise ValueError(f"persistent quants: group {g.key} is split over expert-parallel ranks")
            key = signature(g)
            if key not in plans:
                plans[key] = GroupPlan.of(g, mats, rank=rank, world=world, device=device)
            self.plan_of[g.key] = plans[key]
        self.plans = tuple(plans.values())
        pin = offload and torch.cuda.is_available()
        where = torch.device("cpu") if offload else device
        self.codes: dict[str, torch.Tensor] = {
            g.key: host_memory.zeros(g.shard_size(world), torch.uint8, where, pin=pin)
            for row in self.layers for g, _ in row}
        # host codes go into the rank's own slice of the gather buffer first (on CPU too: one tested path)
        self.staged = offload
        self.inv_scales: list[list[torch.Tensor]] = []  # [layer][matrix of `matrices[layer]`] 0-dim fp32, of `version`
        self.version = -1
        self.quantizations = 0  # (layer, matrix) quantizations done: once per matrix per weights version

    # the plan of blocks laid out alike (one group layout): its maps by their own names
    @property
    def pack(self) -> tuple[tuple[int, int, int], ...]:
        return self._only().pack

    @property
    def recv_idx(self) -> torch.Tensor:
        return self._only().recv_idx

    @property
    def slot(self) -> int:
        return self._only().slot

    def _only(self) -> GroupPlan:
        if len(self.plans) != 1:
            raise ValueError(f"persistent quants: {len(self.plans)} group layouts, not one")
        return self.plans[0]

    def _on_device(self, shard: torch.Tensor) -> torch.Tensor:
        """The shard's values where the kernels run (an offloaded master shard: a stream-ordered copy), in the
        compute dtype (an fp32 master shard: rounded as the gathered weights are)."""
        shard = shard if shard.device == self.device else shard.to(self.device, non_blocking=True)
        return shard if shard.dtype == self.dtype else shard.to(self.dtype)

    def _groups(self) -> Iterator[tuple[int, Group, GroupPlan]]:
        """(layer, group, plan) of every quantized group, in layer and group order: the order of the abs-maxes."""
        for layer, row in enumerate(self.layers):
            for g, _ in row:
                yield layer, g, self.plan_of[g.key]

    @torch.no_grad()
    def refresh(self, shards: dict[str, torch.Tensor], version: int, comm: Communicator) -> None:
        """Quantize this rank's pieces of every block matrix with the scale of the full tensor (module doc); a frozen
        group's (a LoRA base's) only the first time, since it never changes.
        Two passes over the shards (abs-max, then quantize, the all-reduce between them); with --offload-master
        on a GPU each pass copies one group's shard to the device at a time (llm.q instead quantizes right
        after the update touched the layer, which would need the optimizer to all-reduce the abs-maxes)."""
        count = sum(len(m) for m in self.matrices)
        redo = self.version < 0  # the first time every group; then the trainable ones (a frozen base never changes)
        amax = torch.zeros(count, dtype=torch.float32, device=self.device)
        k = 0
        for _, g, plan in self._groups():
            if redo or g.trainable:
                shard = self._on_device(shards[g.key])
                for i, piece in enumerate(plan.own):
                    if piece is not None:
                        a, n = piece
                        amax[k + i] = torch.linalg.vector_norm(shard[a:a + n], float("inf"))
            k += len(plan.own)
        comm.all_reduce(amax, op="max").wait()  # the full tensors' abs-maxes, exact, on every rank
        inv_scales: list[list[torch.Tensor]] = [[] for _ in range(self.num_layers)]
        k = 0
        for layer, g, plan in self._groups():
            if not (redo or g.trainable):  # its codes and scales as they are
                at = len(inv_scales[layer])
                inv_scales[layer].extend(self.inv_scales[layer][at:at + len(plan.own)])
                k += len(plan.own)
                continue
            shard = self._on_device(shards[g.key])
            codes = self.codes[g.key]
            out = codes if codes.device == self.device else torch.zeros_like(codes, device=self.device)
            for piece in plan.own:
                a, n = piece or (0, 0)  # no piece here: the scale is still needed
                inv_scales[layer].append(_quantize_flat(shard[a:a + n], amax[k], out[a:a + n]))
                k += 1
                self.quantizations += 1
            if out is not codes:
                codes.copy_(out, non_blocking=True)
        self.inv_scales, self.version = inv_scales, version

    @staticmethod
    def footprint_of(layout: FlatLayout, names: tuple[str, ...], *, offload: bool) -> Footprint:
        """Bytes: the e4m3 shards of the groups holding the matrices (1 per element; host with `offload`) and one
        fp32 inverse scale per (layer, matrix) (made anew with each version, the previous ones freed once no graph
        refers to them)."""
        groups = [gm for row in quantized_groups(layout, names) for gm in row]
        parts = {"quant_shards": sum(g.shard_size(layout.world) for g, _ in groups),
                 "quant_scales": 4 * sum(len(mats) for _, mats in groups)}
        return Footprint(parts, frozenset({"quant_shards"} if offload else ()))

    @staticmethod
    def index_numel(layout: FlatLayout, names: tuple[str, ...]) -> int:
        """Elements of the `recv_idx` maps: the small tensors of each distinct group layout (one map each)."""
        plans = {signature(g): small_sizes(g, mats, layout.world)[0]
                 for row in quantized_groups(layout, names) for g, mats in row}
        return sum(plans.values())
