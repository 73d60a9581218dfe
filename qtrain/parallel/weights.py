"""Sharded weights (ZeRO-3 / FSDP): each rank keeps only its shard of every group, full tensors exist just
in time, one or two blocks at a time.

Seed: llm.q `WeightsMgrSharded` (`src/models/llama_weights.{h,cpp}`, reference/llmq.md §4.3). This is the
model's `WeightSource` for `--shard-weights` / `--zero-level 3`:

  persistent, per rank         the shard [r*n/W, (r+1)*n/W) of every group buffer (layout.py), in the model
                               dtype: the master weights; on the device, or in (pinned) host memory with
                               --offload-master
  block buffers                two full-size block buffers, layer l in buffer l % 2 (double buffering)
  non-block buffers            one full buffer per non-block group (embed, norm[, lm_head])

Protocol, as the model drives it (transformer.py): `block(l)` makes sure buffer l % 2 holds layer l at the
current weights version (all-gather of the shards, skipped when it already does), starts the gather of the
*next* layer into the other buffer (one-block prefetch: l+1 while the forward goes up, l-1 while the
backward comes down), waits for layer l's gather and returns its tensors: views into the buffer that are
autograd leaves requiring grad, the same objects every time the buffer is handed out (so the backward's
`block(l)` returns exactly the tensors the forward differentiated). `release_block(l)` is a no-op: the
next gather into a buffer is ordered after all compute queued before it (comm.py's ready events).

Versions. Every buffer records (group, version); `invalidate()` bumps the version after an optimizer update
(or a checkpoint load), so stale gathers are redone, and a buffer that already holds (layer, version) skips
the transfer: the last two layers of the forward are still resident when the backward starts, and layers 0
and 1 of the backward when the next micro-step's forward starts. Per micro-step that is about 2L - 4 block
gathers; non-block groups are gathered once per optimizer step (prefetched right after the update).

Saved weights (why the model must run under `saving()`). Without --recompute-block the forward's autograd
graph of layer l keeps references to the weight tensors it used (matmul backward needs W), i.e. to views
into buffer l % 2, which layer l+2 overwrites before the backward. `saving()` installs
`torch.autograd.graph.saved_tensors_hooks`: a saved tensor that lives in a block buffer is packed as a
handle (buffer, layer, version) instead of trusting its memory, and unpacking checks that the buffer holds
that layer again -- which it does, because the backward calls `block(l)` (re-gather) before differentiating
block l. So no weight is held beyond the two buffers, the same contract as FSDP's (llm.q's backward simply
re-gathers before its GEMMs). The hooks also bypass autograd's version-counter check for those tensors (the
gather legitimately rewrote them); every other saved tensor keeps an equivalent check. Trade-off against
requiring --recompute-block: no extra forward compute, but one Python call per saved tensor, and the hooks
must wrap the micro-step (the trainer does; `block()` refuses to hand out weights with grad enabled
outside `saving()`). With --recompute-block the graph of block l is built in the backward right after the
re-gather, and the hooks have nothing to do. The eager step recompute (model/recompute.py, --recompute-att
etc.) installs its own hooks inside a block, which shadow these there: it keeps weight views as they are (and
reruns steps from the weights dict), so it relies on the same re-gather, without the handle check.

Asynchrony: gathers go through the `Communicator` (CUDA: NCCL on its side stream, the compute stream waits
at `block(l)`; CPU: gloo async work, the host waits there). With offloaded shards on CUDA the rank's shard
is first copied host->device into its own slice of the target buffer (on the compute stream, ordered
before the collective) and gathered in place. `wait_all()` must run before anything writes the shards
(the optimizer), because an in-flight gather may still read them.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .comm import Communicator, Handle
from .layout import FlatLayout, Group

__all__ = ["ShardedWeights"]


@dataclass
class _Buffer:
    """A full-size gather target and the leaf views handed to the model."""
    buf: torch.Tensor
    views: dict[str, torch.Tensor]
    key: str | None = None  # group it holds (or is being gathered into it)
    version: int = -1
    pending: Handle | None = None
    storage: int = field(default=0)


@dataclass(frozen=True)
class _SavedWeight:
    """What the saved-tensors hook keeps for a tensor that lives in a block buffer."""
    tensor: torch.Tensor
    slot: int
    key: str
    version: int


@dataclass(frozen=True)
class _Saved:
    tensor: torch.Tensor
    version: int


class ShardedWeights:
    """The rank's weight shards plus the gather buffers; implements the model's `WeightSource`."""

    def __init__(self, layout: FlatLayout, *, comm: Communicator, dtype: torch.dtype,
                 device: torch.device | str, offload: bool = False):
        if layout.world != comm.world:
            raise ValueError(f"layout was built for world {layout.world}, communicator has world {comm.world}")
        self.layout, self.comm, self.dtype = layout, comm, dtype
        self.device = torch.device(device)
        self.rank, self.world = comm.rank, comm.world
        self.num_layers = layout.cfg.num_hidden_layers
        self.offload = offload
        pin = offload and torch.cuda.is_available()
        shard_device = torch.device("cpu") if offload else self.device
        self.shards: dict[str, torch.Tensor] = {
            g.key: torch.zeros(g.shard_size(self.world), dtype=dtype, device=shard_device, pin_memory=pin)
            for g in layout.groups}
        # host shards are copied into the target buffer before the gather when the compute device is a GPU
        self._staged = offload and self.device.type != "cpu"
        self._blocks = [self._buffer(layout.block(0).padded_numel, layout.block(0), block=True)
                        for _ in range(min(2, self.num_layers))]
        self._non_block = {g.key: self._buffer(g.padded_numel, g, block=False) for g in layout.non_block_groups()}
        self.version = 0
        self.gathers = 0  # collectives issued (blocks and non-block groups): what the skip logic saves
        self._prev: int | None = None  # last layer handed out, and the direction of the pass (+1 up, -1 down)
        self._dir = 1
        self._saving = 0

    def _buffer(self, n: int, group: Group, *, block: bool) -> _Buffer:
        buf = torch.zeros(n, dtype=self.dtype, device=self.device)
        views = {}
        for s in group.segments:
            name = s.name.rsplit(".", 1)[1] if block else s.name
            views[name] = buf[s.start:s.start + s.numel].view(s.shape).requires_grad_(True)
        return _Buffer(buf, views, storage=buf.untyped_storage().data_ptr())

    # ---- gathers ----
    def _gather(self, b: _Buffer, group: Group) -> None:
        """Start gathering `group` into `b` unless `b` already holds it at the current version."""
        if b.key == group.key and b.version == self.version:
            return
        self._wait(b)  # a gather of another group into this buffer may still be in flight
        shard = self.shards[group.key]
        with torch.no_grad():
            if self._staged:
                lo, hi = group.shard_range(self.rank, self.world)
                own = b.buf[lo:hi]
                own.copy_(shard, non_blocking=True)
                b.pending = self.comm.all_gather(b.buf, own)
            else:
                b.pending = self.comm.all_gather(b.buf, shard)
        b.key, b.version = group.key, self.version
        self.gathers += 1

    @staticmethod
    def _wait(b: _Buffer) -> None:
        if b.pending is not None:
            b.pending.wait()
            b.pending = None

    def wait_all(self) -> None:
        """Wait for every gather in flight (before anything writes the shards)."""
        for b in self._blocks + list(self._non_block.values()):
            self._wait(b)

    def invalidate(self, *, prefetch: bool = True) -> None:
        """The shards changed (optimizer update, checkpoint load): every gathered buffer is stale. With
        `prefetch`, start gathering the non-block groups and block 0 right away (they come first)."""
        self.wait_all()
        self.version += 1
        if prefetch:
            for g in self.layout.non_block_groups():
                self._gather(self._non_block[g.key], g)
            if self.num_layers:
                self._gather(self._blocks[0], self.layout.block(0))

    # ---- WeightSource ----
    def block(self, layer: int) -> dict[str, torch.Tensor]:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"block({layer}): the model has {self.num_layers} layers")
        if torch.is_grad_enabled() and not self._saving:
            raise RuntimeError("ShardedWeights.block(): run the forward/backward inside `with weights.saving():` "
                               "-- gathered weights are reused buffers, and autograd must not keep them")
        prev, d = self._prev, self._dir
        if prev is None:
            d = 1
        elif layer == prev:  # the pass turned around: forward -> backward at the top, or the next forward
            d = -d
        elif layer > prev:
            d = 1
        else:  # going down, unless a new forward-only pass starts over at layer 0
            d = 1 if (layer == 0 and prev == self.num_layers - 1) else -1
        self._prev, self._dir = layer, d
        b = self._blocks[layer % len(self._blocks)]
        self._gather(b, self.layout.block(layer))
        nxt = layer + d
        if 0 <= nxt < self.num_layers and nxt % len(self._blocks) != layer % len(self._blocks):
            self._gather(self._blocks[nxt % len(self._blocks)], self.layout.block(nxt))
        self._wait(b)
        return b.views

    def non_block(self) -> dict[str, torch.Tensor]:
        groups = self.layout.non_block_groups()
        for g in groups:
            self._gather(self._non_block[g.key], g)
        out = {}
        for g in groups:
            b = self._non_block[g.key]
            self._wait(b)
            out.update(b.views)
        return out

    def release_block(self, layer: int) -> None:
        """Nothing to do: a later gather into the buffer is ordered after the compute queued before it."""

    # ---- saved tensors ----
    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Run a forward/backward under this: tensors autograd saves from a block buffer are kept as
        (buffer, layer, version) handles and checked when the backward unpacks them (see the module doc)."""
        slots = {b.storage: i for i, b in enumerate(self._blocks)}

        def pack(t: torch.Tensor):
            i = slots.get(t.untyped_storage().data_ptr()) if t.layout == torch.strided else None
            # detached (same storage and version counter): a saved *output* that kept its grad_fn would form a
            # cycle (tensor -> node -> packed -> tensor) that only the garbage collector frees
            if i is not None:
                b = self._blocks[i]
                return _SavedWeight(t.detach(), i, b.key, b.version)
            return _Saved(t.detach(), t._version)

        def unpack(s):
            if isinstance(s, _SavedWeight):
                b = self._blocks[s.slot]
                if b.key != s.key or b.version != s.version:
                    raise RuntimeError(
                        f"the backward of {s.key} (weights version {s.version}) needs its gathered weights, but "
                        f"their buffer now holds {b.key} (version {b.version}): call weights.block(l) again "
                        f"before differentiating block l")
                self._wait(b)
                return s.tensor
            if s.tensor._version != s.version:
                raise RuntimeError(
                    f"one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: {tuple(s.tensor.shape)} {s.tensor.dtype} is at version {s.tensor._version}; "
                    f"expected version {s.version} instead")
            return s.tensor

        self._saving += 1
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                yield
        finally:
            self._saving -= 1

    # ---- full weights (export, tests) ----
    @torch.no_grad()
    def gather_full(self) -> dict[str, torch.Tensor]:
        """Full parameters (internal name -> tensor in host memory), gathered group by group. A collective:
        every rank must call it. Peak device memory: one group."""
        self.wait_all()
        buffers = {}
        for g in self.layout.groups:
            full = torch.empty(g.padded_numel, dtype=self.dtype, device=self.device)
            self.comm.all_gather(full, self.shards[g.key].to(self.device)).wait()
            buffers[g.key] = full.cpu()
        return self.layout.views(buffers)

    # ---- memory ----
    def memory(self) -> dict[str, int]:
        """Bytes of persistent weight state on this rank, by buffer kind."""
        nb = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        return {"shards": nb(self.shards.values()), "block_buffers": nb(b.buf for b in self._blocks),
                "non_block_buffers": nb(b.buf for b in self._non_block.values())}

    def host_memory_keys(self) -> set[str]:
        return {"shards"} if self.offload else set()
