"""The block-sharded gradient managers (ZeRO-2): block gradients reduce-scattered, or sent all-to-all and reduced
by their owner, every micro-step into per-rank shards (`qtrain.parallel.gradients` describes the protocol)."""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import torch

from qtrain.kernels.stochastic_rounding import sr_add_, sr_sum_
from qtrain.parallel.comm import Handle
from qtrain.parallel.footprint import Footprint
from qtrain.parallel.gradients.manager import GradientManager, _non_block_bytes, _stages
from qtrain.parallel.layout import FlatLayout, Group, Piece
from qtrain.parallel.staging import StagingRing


@dataclass
class _Slot:
    """A full-size block staging buffer (plus a receive buffer for all-to-all) and the work in flight
    that still reads it: the block's collective and the accumulation chained after it. Slots are as large as
    the largest block; a group uses its first `padded_numel` elements, of which `send[written:]` are zero."""
    send: torch.Tensor
    recv: torch.Tensor | None
    pending: Handle | None = None
    written: int = 0


class _BlockSharded(GradientManager):
    """ZeRO-2 base: block gradients live only as one persistent shard per trainable block group (on the device,
    or in host memory with `offload`); each micro-step a block passes through a full-size staging slot
    (layer % num_slots), is communicated, and the rank's part is accumulated into the shard by work
    chained after the collective (CUDA: queued at once on the side stream; CPU: run when the slot is
    needed again or at the last end_micro_step, like llm.q's deferred `sr_accumulate_layer`)."""

    num_slots: int
    needs_recv: bool

    def __init__(self, layout: FlatLayout, *, offload: bool = False, **kw):
        super().__init__(layout, **kw)
        blocks = layout.trainable_groups(blocks=True)
        n = max((g.padded_numel for g in blocks), default=0)
        self.offload = offload
        pin = offload and torch.cuda.is_available()
        self._shards = {g.key: self._zeros(g.shard_size(self.world), device="cpu" if offload else self.device,
                                           pin=pin) for g in blocks}
        # offloaded shards are accumulated in a device copy (one staging slot) when the compute device is a GPU
        self._staging = (StagingRing(self._scratch_sizes(layout, self.dtype), device=self.device, slots=1,
                                     overlap=False) if _stages(offload, self.device) else None)
        self._slots = [_Slot(self._zeros(n), self._zeros(n) if self.needs_recv else None)
                       for _ in range(self.num_slots)]
        self._pieces: dict[str, list[tuple[int, Piece]]] = {}
        self._pad_start: dict[str, int] = {}  # where each shard's padding tail starts
        for g in blocks:
            index = {seg.name: t for t, seg in enumerate(g.segments)}
            self._pieces[g.key] = [(index[p.segment.name], p) for p in g.shard_pieces(self.rank, self.world)]
            last = self._pieces[g.key][-1][1] if self._pieces[g.key] else None
            self._pad_start[g.key] = last.shard_offset + last.numel if last else 0

    def _accumulate_block(self, group: Group, grads: dict[str, torch.Tensor]) -> None:
        slot = self._slots[group.layer % self.num_slots]
        if slot.pending is not None:  # the layer that used this slot before must be done with it
            slot.pending.wait()
            slot.pending = None
        c, n = group.content_numel, group.padded_numel
        if slot.written > c:  # a larger block's values in this one's padding
            slot.send[c:min(slot.written, n)].zero_()
        slot.written = slot.written if slot.written > n else c
        # a copy; it rounds (with bits apart from the shard's) only if the model dtype differs from ours
        self._write_full(slot.send, group, grads, add=False, extra=(1,))
        slot.pending = self._communicate(group, slot, step=self._step, micro=self._micro,
                                         first=self.first, last=self.last)

    @abstractmethod
    def _communicate(self, group: Group, slot: _Slot, *, step: int, micro: int, first: bool,
                     last: bool) -> Handle:
        """Start the block's collective and chain its accumulation into the shard; return the handle
        after which the slot is free and the shard updated."""

    def _finish_blocks(self) -> None:
        for slot in self._slots:
            if slot.pending is not None:
                slot.pending.wait()
                slot.pending = None

    def _block_shard(self, group: Group) -> torch.Tensor:
        return self._shards[group.key]

    # offload: the accumulation works on a device copy of the host shard (same PCIe traffic as llm.q's
    # zero-copy kernels, but plain copies on the stream the accumulation runs on: one slot, no overlap)
    def _shard_in(self, key: str, *, load: bool) -> torch.Tensor:
        shard = self._shards[key]
        if self._staging is None:
            return shard
        if load:
            self._staging.fetch(0, {"shard": shard})
        return self._staging.acquire(0)["shard"][:shard.numel()]

    def _shard_out(self, key: str) -> None:
        """`_shard_in`'s tensor back to the host shard (nothing to do when the shard is worked on in place)."""
        if self._staging is not None:
            self._staging.write_back(0, {"shard": self._shards[key]})

    @staticmethod
    def _scratch_sizes(layout: FlatLayout, dtype: torch.dtype) -> dict[str, tuple[int, torch.dtype]]:
        return {"shard": (max(g.shard_size(layout.world) for g in layout.trainable_groups(blocks=True)), dtype)}

    @classmethod
    def footprint_of(cls, layout: FlatLayout, *, dtype: torch.dtype, device: torch.device | str,
                     offload: bool = False) -> Footprint:
        """Non-block groups full, one shard per block (host with `offload`), the full-size staging buffers
        (`num_slots`, each with a receive buffer when `needs_recv`) and, offloading to a GPU's host, the
        accumulation's device copy of one shard."""
        blocks = layout.trainable_groups(blocks=True)
        n = max((g.padded_numel for g in blocks), default=0)
        parts = {"non_block": _non_block_bytes(layout, dtype),
                 "block_shards": sum(g.shard_size(layout.world) for g in blocks) * dtype.itemsize,
                 "staging": cls.num_slots * (2 if cls.needs_recv else 1) * n * dtype.itemsize}
        if _stages(offload, device) and blocks:
            parts["offload_scratch"] = StagingRing.bytes(cls._scratch_sizes(layout, dtype), slots=1)
        return Footprint(parts, frozenset({"block_shards"} if offload else ()))


class ReduceScatterGradients(_BlockSharded):
    """llm.q `LLamaGradientsBlockSharded_ScatterReduce`. Per block and micro-step: copy into slot
    layer % 2, reduce-scatter(avg) in place, then shard = slice (first micro-step) or SR(shard + slice).
    The cross-rank sum is the backend's (bf16 reductions round on every hop, as ncclAvg does)."""

    kind = "reduce-scatter"
    num_slots = 2  # in place, so two full block buffers; a slot is free two blocks of backward later
    needs_recv = False

    def _communicate(self, group, slot, *, step, micro, first, last):
        lo, hi = group.shard_range(self.rank, self.world)
        out = slot.send[lo:hi]
        comm = self._comm_of(group)
        h = comm.reduce_scatter(out, slot.send[:group.padded_numel], op="avg")
        return comm.then(h, lambda: self._accumulate(group, out, step=step, micro=micro, first=first))

    def _accumulate(self, group: Group, src: torch.Tensor, *, step: int, micro: int, first: bool) -> None:
        work = self._shard_in(group.key, load=not first)
        if first:
            work.copy_(src)  # same dtype, exact; padding included (src's padding is a reduction of zeros)
        else:
            for t, p in self._pieces[group.key]:
                sl = slice(p.shard_offset, p.shard_offset + p.numel)
                sr_add_(work[sl], src[sl], key=self._key(group, t, step, micro), offset=p.tensor_offset)
        self._shard_out(group.key)


class AllToAllGradients(_BlockSharded):
    """llm.q `LLamaGradientsBlockSharded_AllToAll`. Per block and micro-step: copy into the send buffer,
    all-to-all (slice j to rank j), then the owner reduces in fp32 with one rounding:
        shard = SR(scale * (shard + sum_j received_j)),  scale = 1/world on the last micro-step, else 1
    (on the first micro-step the old shard is left out). So the cross-rank sum is fp32, not the
    backend's bf16 reduction.

    Differences from llm.q, both from using a separate receive buffer instead of its destructive in-place
    exchange: the own slice joins the single rounding above (llm.q SR-adds it into the shard before the
    exchange, because the exchange overwrites it: two roundings per micro-step); and staging is one
    send + one receive buffer (two full block buffers, like the reduce-scatter kind). One slot still
    overlaps a block's exchange with the next block's backward, as llm.q's two slots do: llm.q's GEMMs
    write into the slot during backward, our fresh tensors arrive only after it."""

    kind = "all-to-all"
    num_slots = 1
    needs_recv = True

    def _communicate(self, group, slot, *, step, micro, first, last):
        comm = self._comm_of(group)
        h = comm.all_to_all(slot.recv[:group.padded_numel], slot.send[:group.padded_numel])
        scale = 1.0 / comm.world if last else 1.0
        return comm.then(h, lambda: self._reduce(group, slot.recv, step=step, micro=micro, first=first,
                                                 scale=scale, world=comm.world))

    def _reduce(self, group: Group, recv: torch.Tensor, *, step: int, micro: int, first: bool,
                scale: float, world: int) -> None:
        work = self._shard_in(group.key, load=not first)
        parts = recv[:group.padded_numel].view(world, -1)
        # fixed order (old shard, then ranks 0..W-1): the fp32 sum is bit-reproducible; one pass per piece
        for t, p in self._pieces[group.key]:
            sl = slice(p.shard_offset, p.shard_offset + p.numel)
            sr_sum_(work[sl], parts[:, sl], key=self._key(group, t, step, micro), scale=scale,
                    offset=p.tensor_offset, add=not first)
        if first:
            work[self._pad_start[group.key]:].zero_()
        self._shard_out(group.key)

