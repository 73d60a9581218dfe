"""Gradient managers: where a micro-step's weight gradients go, how they are averaged over ranks and summed
over micro-steps, and which shard of the result each rank keeps for the optimizer.

Seed: llm.q `src/training/gradients.{h,cpp}` and `src/models/llama_gradients.cpp` (see
`reference/llmq.md` §4.2). Three strategies, chosen with `make_gradient_manager(kind, ...)`:

  kind              persistent state per rank               communication
  'unsharded'       full gradient of every group (ZeRO-1)   reduce-scatter(avg) of each group, last micro-step only
  'reduce-scatter'  non-block groups full, block shards     blocks: reduce-scatter(avg) every micro-step;
                    + 2 full block staging buffers (ZeRO-2)  non-block groups as 'unsharded'
  'all-to-all'      as 'reduce-scatter', staging = one       blocks: all-to-all every micro-step, reduced
                    send + one receive block buffer          in fp32 by the owner; non-block as 'unsharded'

The protocol (the model's `GradientSink` plus the trainer's brackets), per micro-step:

    grads.start_micro_step(step=s, micro_step=m, num_micro_steps=n)
    model.forward_backward(..., grads=grads)   # accumulate_non_block({'norm'[, 'lm_head']}),
                                               # accumulate_block(L-1) ... accumulate_block(0),
                                               # accumulate_non_block({'embed'})
    grads.end_micro_step()                     # after m == n-1: every shard is final
    ... optimizer reads grads.grad_shard(group_key) for each group ...

Accumulation over micro-steps. The model hands over fresh tensors (owned by the manager), so the first
micro-step of a step *sets* every buffer (copy) and later ones *add* with stochastic rounding when the
buffers are bf16 (an exact fp32 add otherwise). Nothing is ever zeroed: llm.q zeroes the tensors its
kernels accumulate into by `+=` from the start (norm weights, biases, the untied embedding), which cannot
happen here. Group padding is zero from allocation and never written (the first micro-step's piecewise
copy re-zeroes a shard's padding tail explicitly), so padding contributes nothing to norms. Frozen groups
(`Group.trainable` False) have no buffers here: the model hands over no gradients for them.

Random bits. Every SR of tensor t (position `t` in its group) of group g at (step, micro-step) uses
`rng_key(seed, step, micro_step, g.index, t)` with the element's index *in the tensor* as counter
(`Piece.tensor_offset` where a shard cuts through a tensor), so a rank's shard draws the same bits for an
element whatever the world size. llm.q reuses one key for every micro-step of a step (a quirk); we
include the micro-step.

Key table (CUDA graphs, `use_key_table`). A micro-step replayed from a CUDA graph cannot take its SR keys as
kernel scalars (the capture bakes them in). In this mode every SR launch of the manager reads its key from a
device table (`qtrain.kernels.rng.KeyTable`, one slot per tensor of every group) that `start_micro_step`
refills for (step, micro-step) with one stream-ordered copy: the same keys, so the same bits, as the scalar
path. After a replay, `replayed()` stands in for the accumulate calls the graph's kernels did.
Unsharded gradients on one rank only (the collectives of the other kinds stay outside this round).

Asynchrony (see `comm.py`). Calls never block the host on CUDA: collectives and the work chained after
them run on the communicator's side stream, bracketed by events, and "wait" means the compute stream
waits. On CPU (gloo) collectives are async work handles and the host blocks at the point of need.
  - accumulate_block(l): returns once block l's gradients have been copied (stream-ordered) into
    manager buffers; the caller may drop the tensors. Its communication runs in the background and
    overlaps the backward of the blocks below.
  - accumulate_non_block: the same; on the last micro-step it starts that group's reduce-scatter.
  - end_micro_step: on a non-last micro-step it returns at once (the last blocks' communication may
    overlap the next micro-step's forward); on the last it waits (CUDA: the current stream waits) until
    every shard is final. Host code that reads a CUDA or offloaded shard directly must synchronise the
    current stream first.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from qtrain.kernels.rng import KeySlot, KeyTable, rng_key
from qtrain.kernels.stochastic_rounding import sr_add_, sr_copy_, sr_sum_
from qtrain.parallel.comm import Communicator, Handle
from qtrain.parallel.experts import ExpertParallel
from qtrain.parallel.footprint import Footprint
from qtrain.parallel.layout import FlatLayout, Group, Piece
from qtrain.parallel.staging import StagingRing

__all__ = ["KINDS", "GradientManager", "UnshardedGradients", "ReduceScatterGradients", "AllToAllGradients",
           "make_gradient_manager", "gradient_footprint"]

KINDS = ("unsharded", "reduce-scatter", "all-to-all")
OFFLOAD_NEEDS_SHARDING = "--offload-gradients requires sharded gradients (--shard-gradients or --zero-level 2)"


def _short(name: str) -> str:
    """'layers.3.qkv' -> 'qkv'; 'embed' -> 'embed'."""
    return name.rsplit(".", 1)[-1]


class GradientManager(ABC):
    """Owns the gradient buffers of one rank and implements the model's `GradientSink`.

    After the last micro-step's `end_micro_step`, `grad_shard(key)` is this rank's slice
    `[rank*n/W, (rank+1)*n/W)` of group `key`'s flat gradient, averaged over ranks and summed over
    micro-steps, for every kind. Non-block groups (embed, norm, lm_head) are handled identically by all
    kinds: a full replicated buffer each, reduce-scattered in place on the last micro-step."""

    kind: str

    def __init__(self, layout: FlatLayout, *, comm: Communicator, dtype: torch.dtype,
                 device: torch.device | str, seed: int, experts: ExpertParallel | None = None):
        if layout.world != comm.world:
            raise ValueError(f"layout was built for world {layout.world}, communicator has world {comm.world}")
        if layout.expert_parallel != (experts.ep if experts is not None else 1):
            raise ValueError(f"layout was built for expert parallelism {layout.expert_parallel}, the manager got "
                             f"{experts.ep if experts is not None else 1}")
        self.experts = experts  # expert groups: averaged over the replicas holding the same experts (experts.py)
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"gradient dtype must be float32 or bfloat16, got {dtype}")
        self.layout, self.comm, self.dtype, self.seed = layout, comm, dtype, seed
        self.device = torch.device(device)
        self.offload = False
        self.rank, self.world = comm.rank, comm.world
        self._trained = layout.trainable_groups()
        self._nb_full = {g.key: self._zeros(g.padded_numel) for g in layout.trainable_groups(blocks=False)}
        self._nb_comm: dict[str, Handle] = {}
        # protocol state
        self._step = -1
        self._micro = -1
        self._num_micro = 0
        self._open = False  # between start_micro_step and end_micro_step
        self._final = False  # shards hold the finished gradient of step `_step`
        self._seen: set[str] = set()
        self._keys: KeyTable | None = None  # SR keys from a device table (use_key_table)

    def _zeros(self, n: int, *, device: torch.device | str | None = None, pin: bool = False) -> torch.Tensor:
        return torch.zeros(n, dtype=self.dtype, device=device or self.device, pin_memory=pin)

    # ---- protocol ----
    @property
    def first(self) -> bool:
        """Current micro-step is the first of its step: buffers are set, not added to."""
        return self._micro == 0

    @property
    def last(self) -> bool:
        """Current micro-step is the last of its step: the cross-rank average completes in it."""
        return self._micro == self._num_micro - 1

    def start_micro_step(self, *, step: int, micro_step: int, num_micro_steps: int) -> None:
        """Begin micro-step `micro_step` (0-based) of `num_micro_steps` of optimizer step `step`. Does not
        block. Micro-steps of a step must come in order, each closed by `end_micro_step`."""
        if self._open:
            raise RuntimeError(f"start_micro_step: micro-step {self._micro} of step {self._step} was not ended "
                               f"(call end_micro_step first)")
        if not 0 <= micro_step < num_micro_steps:
            raise ValueError(f"start_micro_step: micro_step={micro_step} not in [0, {num_micro_steps})")
        if micro_step > 0 and (step, micro_step, num_micro_steps) != (self._step, self._micro + 1, self._num_micro):
            raise RuntimeError(f"start_micro_step: expected micro-step {self._micro + 1}/{self._num_micro} of step "
                               f"{self._step}, got {micro_step}/{num_micro_steps} of step {step}")
        self._step, self._micro, self._num_micro = step, micro_step, num_micro_steps
        self._open, self._seen = True, set()
        self._final = False
        if self._keys is not None:
            self._keys.fill(self.seed, step, micro_step)  # before any of this micro-step's SR kernels

    def use_key_table(self) -> None:
        """From now on every SR launch reads its key from a device table refilled by `start_micro_step`, so
        the micro-step's kernels can be captured in a CUDA graph and replayed at any (step, micro-step)
        (see the module docstring). Same keys, same bits as without it."""
        if self.kind != "unsharded" or self.world != 1:
            raise ValueError(f"the SR key table (--use-cuda-graphs) needs unsharded gradients on one rank, this "
                             f"manager is {self.kind!r} on {self.world} ranks")
        self._keys = KeyTable(_key_recipes(self.layout), device=self.device)

    def replayed(self) -> None:
        """A CUDA graph captured from an earlier micro-step of the same phase (first / middle / last) has
        queued this micro-step's accumulation: count every group as received (key table mode only)."""
        if self._keys is None:
            raise RuntimeError("replayed: only a manager using the SR key table (use_key_table) can be replayed")
        if not self._open or self._seen:
            raise RuntimeError("replayed: call it once, right after start_micro_step, instead of the accumulate calls")
        self._seen = {g.key for g in self._trained}

    def accumulate_non_block(self, grads: dict[str, torch.Tensor]) -> None:
        """Take this micro-step's gradients of non-block groups ('embed', 'norm', 'lm_head'). Does not
        block; on the last micro-step each group's reduce-scatter starts here."""
        for name, g in grads.items():
            group = self.layout.by_key.get(name)
            if group is None or group.layer is not None or not group.trainable:
                raise KeyError(f"accumulate_non_block: {name!r} is not a trainable non-block group of this model "
                               f"(have {list(self._nb_full)})")
            self._receive(group)
            self._accumulate_full(group, self._nb_full[name], {name: g}, self._nb_comm)

    def accumulate_block(self, layer: int, grads: dict[str, torch.Tensor]) -> None:
        """Take block `layer`'s gradients (short name -> tensor, of its trainable groups) right after its backward.
        Does not block the host on CUDA; its communication (if any) starts here and overlaps later backward."""
        groups = [g for g in self.layout.layer_groups(layer) if g.trainable]
        expected = {_short(s.name) for g in groups for s in g.segments}
        if set(grads) != expected:
            raise KeyError(f"accumulate_block({layer}): got tensors {sorted(grads)}, expected {sorted(expected)}")
        for group in groups:
            self._receive(group)
            if group.ep > 1:  # the token group's sum: the world's mean is the replicas' mean / ep (experts.py)
                for s in group.segments:
                    grads[_short(s.name)].mul_(1.0 / group.ep)
            self._accumulate_block(group, {_short(s.name): grads[_short(s.name)] for s in group.segments})

    def end_micro_step(self) -> None:
        """Close the micro-step. After the last micro-step of a step this waits (CUDA: the current stream
        waits) until every shard is final; before it, it returns without waiting."""
        if not self._open:
            raise RuntimeError("end_micro_step: no micro-step is open (call start_micro_step first)")
        missing = [g.key for g in self._trained if g.key not in self._seen]
        if missing:
            raise RuntimeError(f"end_micro_step: no gradients were received for {missing} in micro-step "
                               f"{self._micro} of step {self._step}")
        self._open = False
        if self.last:
            self._finish_blocks()
            for h in self._nb_comm.values():
                h.wait()
            self._nb_comm.clear()
            self._final = True

    def grad_shard(self, group_key: str) -> torch.Tensor:
        """This rank's 1-D slice (`group.shard_size(world)` elements) of group `group_key`'s gradient,
        averaged over ranks and summed over the micro-steps of the finished step. A view of manager state:
        valid until the next step's first micro-step writes it; device memory, or host memory for block
        groups of an offloading manager. A frozen group has none (KeyError)."""
        if not self._final:
            raise RuntimeError("grad_shard: gradients are final only after end_micro_step of a step's last "
                               "micro-step")
        group = self.layout.by_key[group_key]
        if not group.trainable:
            raise KeyError(f"grad_shard: group {group_key!r} is frozen: it has no gradient")
        if group.layer is None:
            lo, hi = group.shard_range(self.rank, self.world)
            return self._nb_full[group_key][lo:hi]
        return self._block_shard(group)

    def grad_shards(self) -> dict[str, torch.Tensor]:
        """`grad_shard` of every trainable group, in layout order."""
        return {g.key: self.grad_shard(g.key) for g in self._trained}

    # ---- memory ----
    @classmethod
    @abstractmethod
    def footprint_of(cls, layout: FlatLayout, *, dtype: torch.dtype, device: torch.device | str,
                     offload: bool = False) -> Footprint:
        """Bytes of persistent gradient state per rank of a manager of this kind, by buffer kind, without
        allocating it (what the constructor allocates)."""

    def footprint(self) -> Footprint:
        fp = self.footprint_of(self.layout, dtype=self.dtype, device=self.device, offload=self.offload)
        return _with_key_table(fp, self.layout) if self._keys is not None else fp

    def memory(self) -> dict[str, int]:
        """Bytes of persistent gradient state on this rank, by buffer kind (`footprint_of`)."""
        return dict(self.footprint().parts)

    def host_memory_keys(self) -> set[str]:
        """Which `memory()` entries live in host memory (offloaded)."""
        return set(self.footprint().host_keys)

    def shard_nbytes(self) -> int:
        """All persistent gradient state of this rank, in bytes (device and, when offloading, host)."""
        return sum(self.memory().values())

    # ---- helpers shared by the strategies ----
    def _comm_of(self, group: Group) -> Communicator:
        """The ranks `group` is averaged and sharded over: the world's, or an expert group's replicas."""
        return self.comm if self.experts is None else self.experts.comm_of(group, self.comm)

    def _receive(self, group: Group) -> None:
        if not self._open:
            raise RuntimeError(f"gradients for {group.key!r} arrived outside a micro-step (call start_micro_step)")
        if group.key in self._seen:
            raise RuntimeError(f"gradients for {group.key!r} arrived twice in micro-step {self._micro}")
        self._seen.add(group.key)

    def _key(self, group: Group, tensor_index: int, step: int, micro: int, *extra: int) -> int:
        return rng_key(self.seed, step, micro, group.index, tensor_index, *extra)

    def _full_key(self, group: Group, tensor_index: int, n: int, extra: tuple[int, ...]) -> int | KeySlot:
        """The key of a whole tensor's SR in the current micro-step: its table slot in key table mode."""
        if self._keys is not None:
            return self._keys.slot((group.index, tensor_index, *extra), 0, n)
        return self._key(group, tensor_index, self._step, self._micro, *extra)

    def _set(self, dst: torch.Tensor, src: torch.Tensor, *, key: int | KeySlot, scale: float = 1.0,
             offset: int = 0) -> None:
        """dst <- scale*src: a plain copy when that is exact, else rounded (SR into bf16)."""
        if scale == 1.0 and src.dtype == dst.dtype:
            dst.view(src.shape).copy_(src)
        else:
            sr_copy_(dst, src, key=key, scale=scale, offset=offset)

    def _write_full(self, buf: torch.Tensor, group: Group, grads: dict[str, torch.Tensor], *, add: bool,
                    extra: tuple[int, ...] = ()) -> None:
        """Fresh tensors -> full group buffer: copy (add=False) or SR-add. Padding is never touched.
        `extra` ids give a second rounding of the same elements in one micro-step its own bits."""
        for t, seg in enumerate(group.segments):
            src = grads[_short(seg.name)]
            if tuple(src.shape) != seg.shape:
                raise ValueError(f"gradient of {seg.name} has shape {tuple(src.shape)}, expected {seg.shape}")
            dst = buf[seg.start:seg.start + seg.numel]
            key = self._full_key(group, t, seg.numel, extra)
            if add:
                sr_add_(dst, src, key=key)
            else:
                self._set(dst, src, key=key)

    def _accumulate_full(self, group: Group, buf: torch.Tensor, grads: dict[str, torch.Tensor],
                         handles: dict) -> None:
        """The replicated (ZeRO-1) path: accumulate locally; on the last micro-step reduce-scatter(avg) in
        place, so the rank's slice of `buf` becomes its final shard."""
        self._write_full(buf, group, grads, add=not self.first)
        if self.last:
            lo, hi = group.shard_range(self.rank, self.world)
            handles[group.key] = self._comm_of(group).reduce_scatter(buf[lo:hi], buf, op="avg")

    @abstractmethod
    def _accumulate_block(self, group: Group, grads: dict[str, torch.Tensor]) -> None: ...

    @abstractmethod
    def _finish_blocks(self) -> None:
        """Wait until every block shard holds the finished gradient (last micro-step only)."""

    @abstractmethod
    def _block_shard(self, group: Group) -> torch.Tensor: ...


class UnshardedGradients(GradientManager):
    """ZeRO-1: every group, blocks included, is treated like a non-block group. Full replicated buffers,
    local accumulation, and one reduce-scatter(avg) per group on the last micro-step, started as soon as
    that group's gradient is complete (block by block, overlapping the rest of the backward)."""

    kind = "unsharded"

    def __init__(self, layout: FlatLayout, **kw):
        super().__init__(layout, **kw)
        self._full = {g.key: self._zeros(g.padded_numel) for g in layout.trainable_groups(blocks=True)}
        self._comm: dict[str, Handle] = {}

    def _accumulate_block(self, group: Group, grads: dict[str, torch.Tensor]) -> None:
        self._accumulate_full(group, self._full[group.key], grads, self._comm)

    def _finish_blocks(self) -> None:
        for h in self._comm.values():
            h.wait()
        self._comm.clear()

    def _block_shard(self, group: Group) -> torch.Tensor:
        lo, hi = group.shard_range(self.rank, self.world)
        return self._full[group.key][lo:hi]

    @classmethod
    def footprint_of(cls, layout: FlatLayout, *, dtype: torch.dtype, device: torch.device | str,
                     offload: bool = False) -> Footprint:
        """Every trainable group full: the non-block groups and the blocks."""
        blocks = sum(g.padded_numel for g in layout.trainable_groups(blocks=True))
        return Footprint({"non_block": _non_block_bytes(layout, dtype), "blocks": blocks * dtype.itemsize})


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


def _non_block_bytes(layout: FlatLayout, dtype: torch.dtype) -> int:
    return sum(g.padded_numel for g in layout.trainable_groups(blocks=False)) * dtype.itemsize


def _stages(offload: bool, device: torch.device | str) -> bool:
    """Offloaded shards go through a device copy unless the compute device is the CPU (where host is device)."""
    return offload and torch.device(device).type != "cpu"


def _manager_class(kind: str, offload: bool) -> type[GradientManager]:
    classes = {"unsharded": UnshardedGradients, "reduce-scatter": ReduceScatterGradients,
               "all-to-all": AllToAllGradients}
    if kind not in classes:
        raise ValueError(f"unknown gradient manager kind {kind!r}; choose one of {', '.join(KINDS)}")
    if offload and kind == "unsharded":
        raise ValueError(OFFLOAD_NEEDS_SHARDING)
    return classes[kind]


def make_gradient_manager(kind: str, layout: FlatLayout, *, comm: Communicator, dtype: torch.dtype,
                          device: torch.device | str, seed: int, offload: bool = False,
                          experts: ExpertParallel | None = None) -> GradientManager:
    """Build the gradient manager `kind` ('unsharded' | 'reduce-scatter' | 'all-to-all'). `offload` keeps
    the block shards in (pinned, when CUDA is available) host memory and needs a sharded kind. `experts`: expert
    parallelism (the layout's expert groups are averaged over their replicas)."""
    cls = _manager_class(kind, offload)
    common = dict(comm=comm, dtype=dtype, device=device, seed=seed, experts=experts)
    return cls(layout, **common) if kind == "unsharded" else cls(layout, offload=offload, **common)


def gradient_footprint(kind: str, layout: FlatLayout, *, dtype: torch.dtype, device: torch.device | str,
                       offload: bool = False, key_table: bool = False) -> Footprint:
    """What `make_gradient_manager` with these arguments allocates per rank, without allocating it
    (`key_table`: and `use_key_table`, which CUDA graphs call)."""
    fp = _manager_class(kind, offload).footprint_of(layout, dtype=dtype, device=device, offload=offload)
    return _with_key_table(fp, layout) if key_table else fp


def _key_recipes(layout: FlatLayout) -> list[tuple[tuple[int, int], int, int]]:
    """The SR launches of an unsharded manager, one per tensor of every trainable group: (ids, offset, n)."""
    return [((g.index, t), 0, seg.numel) for g in layout.trainable_groups() for t, seg in enumerate(g.segments)]


def _with_key_table(fp: Footprint, layout: FlatLayout) -> Footprint:
    return Footprint({**fp.parts, "sr_key_table": KeyTable.nbytes(len(_key_recipes(layout)))}, fp.host_keys)
