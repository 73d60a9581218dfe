"""Sharded weights (ZeRO-3 / FSDP): each rank keeps only its shard of every group, full tensors exist just
in time, one or two blocks at a time.

Seed: llm.q `WeightsMgrSharded` (`src/models/llama_weights.{h,cpp}`, reference/llmq.md §4.3). This is the
model's `WeightSource` for `--shard-weights` / `--zero-level 3`:

  persistent, per rank         the shard [r*n/W, (r+1)*n/W) of every group buffer (layout.py), in the model
                               dtype: the master weights; on the device, or in (pinned) host memory with
                               --offload-master
  block buffers                two block slots, layer l in slot l % 2 (double buffering), each as large as
                               the largest layer: a layer's groups (its own, and those its tensors name: an
                               MoE layer's experts, a LoRA layer's adapters) gathered back to back, so layers
                               that differ (a hybrid model's) share the slots; with --persistent-quants each
                               slot is a 1-byte e4m3 code buffer + the rest of a layer in the model dtype
  e4m3 shards                  --persistent-quants: the shard of every group holding FP8 block matrices, in e4m3
                               (device, or pinned host memory with --offload-quants), made once per weights version
  non-block buffers            one full buffer per non-block group (embed, norm[, lm_head])

Protocol, as the model drives it (transformer.py): `block(l)` makes sure buffer l % 2 holds layer l at the
current weights version (all-gather of the shards, skipped when it already does), starts the gather of the
*next* layer into the other buffer (one-block prefetch: l+1 while the forward goes up, l-1 while the
backward comes down), waits for layer l's gather and returns its tensors: views into the buffer that are
autograd leaves (requiring grad unless their group is frozen), made once per layer, so the backward's `block(l)`
returns exactly the tensors the forward differentiated. `release_block(l)` is a no-op: the
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
at `block(l)`; CPU: gloo async work, the host waits there); an expert-parallel group's over the ranks holding
the same experts (`ExpertParallel.comm_of`). With offloaded shards on CUDA the rank's shard is first copied
host->device into its own slice of the target buffer (on the compute stream, ordered before the collective) and
gathered in place. `wait_all()` must run before anything writes the shards
(the optimizer), because an in-flight gather may still read them.

Frozen groups (a LoRA run's base) keep their shards in the compute dtype: they have no master.

Persistent quants (`--persistent-quants`, `quantized=` the block matrices the FP8 policy names; llm.q's quantized
shards): each rank keeps an e4m3 copy of its shard of every group that holds such matrices
(`persistent_quants.PersistentQuants`, which says which they are, per layer, and how they are made and scaled).
Layers may differ: each layer's parts have their own places in the slot (`_QuantSlots`, sized for the largest layer
buffer by buffer). A layer's gather then moves, for each of its groups holding quantized matrices,
  - the e4m3 shards, as uint8 (neither gloo nor our communicator take float8), into the slot's 1-byte-per-element
    code buffer with the group's flat layout, so every matrix's codes are a contiguous (N, K) view:
    half the bytes of the bf16 gather; with `offload_quants` the shards live in (pinned) host memory and
    are copied into the rank's own slice of that buffer first, then gathered in place (as --offload-master);
  - the group's small tensors (ln1, ln2, qkv_bias, q_norm / k_norm, a router, a shared expert ...) in the model
    dtype: each rank copies the small-tensor elements its shard holds (a few contiguous pieces) into its own slot
    of an exchange buffer (slot = the most any rank holds, `Group.max_shard_numel`), one all-gather, and one
    index_select (chained after the collective) puts them back to back in the slot's compute buffer, whose
    views are handed out;
and each of its other groups (an MoE layer's expert stacks, a LoRA layer's adapters) whole, in the model dtype, into
the compute buffer, as without the option. The bf16 matrices are not gathered at all. The model still needs leaves
of the right shape and dtype to differentiate against, so each layer hands out, per matrix, a zero-stride tensor
over one zero element (`torch.empty_strided(shape, 0-strides)`): an autograd leaf that holds no values, so nothing
can read stale or wrong weights from it -- `fp8_linear` / `fp8_swiglu_mlp` use the weight only for shape, dtype
and as the gradient's target when an FP8 copy is passed, and a reader of the values would see zeros (the bitwise
tests against the unquantized-gather path would fail). The block dict adds `FP8_WEIGHT.format(m)` (the codes
view) and `FP8_INV_SCALE.format(m)` (a 0-dim fp32 tensor of the current version). Saved e4m3 weights are
views into the rotating code buffers, so `saving()` treats those (and the compute buffers) exactly like
the bf16 block buffers. Export, checkpoints and `gather_full` read the model-dtype shards, never the buffers.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch

from qtrain import host_memory
from qtrain.kernels.fp8_quant import E4M3
from qtrain.model.weight_source import FP8_INV_SCALE, FP8_WEIGHT
from qtrain.parallel.comm import Communicator, Handle
from qtrain.parallel.experts import ExpertParallel
from qtrain.parallel.footprint import Footprint
from qtrain.parallel.layout import FlatLayout, Group
from qtrain.parallel.weights.layer_walk import LayerWalk
from qtrain.parallel.weights.persistent_quants import PersistentQuants, quantized_groups, small_sizes

__all__ = ["ShardedWeights"]


@dataclass
class _Buffer:
    """A full-size gather target (and a non-block group's views, by full name). With persistent quants (block slots
    only) `buf` holds e4m3 codes as uint8, and `compute` the rest of a layer in the compute dtype: the groups
    gathered as they are, then the small tensors (gathered through `exchange`)."""
    buf: torch.Tensor
    views: dict[str, torch.Tensor]
    key: str | None = None  # group it holds (or is being gathered into it)
    version: int = -1
    pending: list[Handle] = field(default_factory=list)
    storages: frozenset[int] = frozenset()  # what autograd may save from this slot (see `saving`)
    compute: torch.Tensor | None = None
    exchange: torch.Tensor | None = None
    layer: int | None = None  # the layer of `key` (block slots)


@dataclass(frozen=True)
class _QuantPart:
    """Where one of a layer's groups goes in a persistent-quants block slot. A group holding quantized `matrices`:
    its codes at `codes` of the code buffer, its small tensors at `offset` of the compute buffer, its exchange at
    `exchange` of the exchange buffer (world slots of `slot` elements); any other group (no `matrices`: an MoE
    layer's experts, a LoRA layer's adapters) whole at `offset` of the compute buffer, gathered as without quants."""
    group: Group
    matrices: tuple[str, ...]
    offset: int
    codes: int = 0
    exchange: int = 0
    slot: int = 0


@dataclass(frozen=True)
class _QuantSlots:
    """Each layer's parts in a persistent-quants block slot, and the slot's three buffers' sizes (elements): the
    largest layer's, each on its own. The compute buffer holds a layer's plain groups first (each padded, so each
    gather target stays aligned), then the quantized groups' small tensors."""
    layers: tuple[tuple[_QuantPart, ...], ...]
    codes: int
    compute: int
    exchange: int

    @classmethod
    def of(cls, layout: FlatLayout, names: tuple[str, ...]) -> _QuantSlots:
        layers, sizes = [], []  # sizes: per layer, (codes, compute, exchange) elements
        for layer, row in enumerate(quantized_groups(layout, names)):
            quantized = {g.key for g, _ in row}
            parts, off = [], 0
            for g in layout.layer_groups(layer):
                if g.key not in quantized:
                    parts.append(_QuantPart(g, (), off))
                    off += g.padded_numel
            codes = exchange = 0
            for g, mats in row:
                small, slot = small_sizes(g, mats, layout.world)
                parts.append(_QuantPart(g, mats, off, codes, exchange, slot))
                off, codes, exchange = off + small, codes + g.padded_numel, exchange + layout.world * slot
            layers.append(tuple(parts))
            sizes.append((codes, off, exchange))
        return cls(tuple(layers), *(max(col, default=0) for col in zip(*sizes)))

    def leaves(self) -> int:
        """The matrices' value-less leaves, one element each, per layer (every layer hands out its own)."""
        return sum(len(p.matrices) for parts in self.layers for p in parts)


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
                 device: torch.device | str, offload: bool = False, quantized: tuple[str, ...] = (),
                 offload_quants: bool = False, compute_dtype: torch.dtype | None = None,
                 experts: ExpertParallel | None = None):
        """dtype: the trainable shards' (the master); compute_dtype: the gathered weights' and the frozen groups'
        shards (None: the same; bf16 under fp32 master shards, which each gather casts into the rank's own slice of
        the buffer first); experts: expert parallelism (an expert group's shards gathered over its replicas);
        quantized: block matrices kept as persistent e4m3 shards (--persistent-quants: those the FP8 policy names);
        offload_quants: those shards in (pinned) host memory."""
        if layout.world != comm.world:
            raise ValueError(f"layout was built for world {layout.world}, communicator has world {comm.world}")
        if offload_quants and not quantized:
            raise ValueError("offload_quants needs quantized block matrices "
                             "(--offload-quants needs --persistent-quants)")
        self.layout, self.comm, self.dtype = layout, comm, dtype
        self.compute_dtype = compute_dtype or dtype
        if self.compute_dtype != dtype and offload:
            raise ValueError("offloaded master shards are gathered in their own dtype: offload needs compute_dtype "
                             "== dtype")
        self.device = torch.device(device)
        self.rank, self.world = comm.rank, comm.world
        self.num_layers = layout.cfg.num_hidden_layers
        self.offload = offload
        self.experts = experts
        pin = offload and torch.cuda.is_available()
        shard_device = torch.device("cpu") if offload else self.device
        self.shards: dict[str, torch.Tensor] = {
            g.key: host_memory.zeros(g.shard_size(self.world), dtype if g.trainable else self.compute_dtype,
                                     shard_device, pin=pin)
            for g in layout.groups}
        self.quants = (PersistentQuants(layout, tuple(quantized), rank=self.rank, world=self.world,
                                         dtype=self.compute_dtype,
                                         device=self.device, offload=offload_quants)
                       if quantized and self.num_layers else None)
        self.offload_quants = offload_quants
        self._parts = self.layer_parts(layout)
        slots = min(2, self.num_layers)
        self._fp8: list[dict[str, torch.Tensor]] = []  # persistent quants: per layer, its matrices' code views
        if self.quants:
            self._qslots = _QuantSlots.of(layout, self.quants.names)
            self._blocks = [self._quant_buffer() for _ in range(slots)]
            self._views, self._fp8 = zip(*(self._quant_views(self._blocks[i % slots], i)
                                           for i in range(self.num_layers)))
        else:
            n = self.slot_numel(layout)
            self._blocks = [_Buffer(b, {}, storages=frozenset({b.untyped_storage().data_ptr()}))
                            for b in (torch.zeros(n, dtype=self.compute_dtype, device=self.device)
                                      for _ in range(slots))]
            self._views = [self._layer_views(self._blocks[i % slots].buf, i) for i in range(self.num_layers)]
        self._non_block = {g.key: self._buffer(g.padded_numel, g) for g in layout.non_block_groups()}
        # host shards (master with `offload` on a GPU, e4m3 codes with `offload_quants`) are copied into the rank's
        # own slice of the target buffer before the gather (`_stage`)
        self._staged = offload and self.device.type != "cpu"
        self.version = 0
        self.gathers = 0  # block / group gathers issued: what the skip logic saves
        self.gathered_bytes = {"block": 0, "block_fp8": 0, "block_small": 0, "non_block": 0}  # all-gather outputs
        self._walk = LayerWalk(self.num_layers)  # which layer to prefetch
        self._saving = 0

    @staticmethod
    def layer_parts(layout: FlatLayout) -> list[list[tuple[Group, int]]]:
        """Per layer, its groups and where each starts in a block slot (back to back, in `layer_groups` order)."""
        out = []
        for layer in range(layout.cfg.num_hidden_layers):
            parts, off = [], 0
            for g in layout.layer_groups(layer):
                parts.append((g, off))
                off += g.padded_numel
            out.append(parts)
        return out

    @classmethod
    def slot_numel(cls, layout: FlatLayout) -> int:
        """Elements of one block slot: the largest layer's groups, back to back."""
        return max((sum(g.padded_numel for g, _ in parts) for parts in cls.layer_parts(layout)), default=0)

    def _layer_views(self, buf: torch.Tensor, layer: int) -> dict[str, torch.Tensor]:
        """Layer `layer`'s tensors as leaf views into a block slot (short name -> view), made once."""
        views = {}
        for g, off in self._parts[layer]:
            for s in g.segments:
                a = off + s.start
                views[s.short] = buf[a:a + s.numel].view(s.shape).requires_grad_(g.trainable)
        return views

    def _comm(self, group: Group) -> Communicator:
        """The communicator of `group`'s gathers: the expert replicas' for an expert-parallel group."""
        return self.experts.comm_of(group, self.comm) if self.experts is not None else self.comm

    def _buffer(self, n: int, group: Group) -> _Buffer:
        """A non-block group's gather target (views by full name)."""
        buf = torch.zeros(n, dtype=self.compute_dtype, device=self.device)
        views = {}
        for s in group.segments:
            views[s.name] = buf[s.start:s.start + s.numel].view(s.shape).requires_grad_(group.trainable)
        return _Buffer(buf, views, storages=frozenset({buf.untyped_storage().data_ptr()}))

    def _quant_buffer(self) -> _Buffer:
        """A block slot for persistent quants (`_QuantSlots`): e4m3 codes, the compute-dtype rest, the exchange."""
        sizes = self._qslots
        codes = torch.zeros(sizes.codes, dtype=torch.uint8, device=self.device)
        compute = torch.zeros(sizes.compute, dtype=self.compute_dtype, device=self.device)
        exchange = torch.zeros(sizes.exchange, dtype=self.compute_dtype, device=self.device)
        storages = frozenset(t.untyped_storage().data_ptr() for t in (codes, compute))
        return _Buffer(codes, {}, storages=storages, compute=compute, exchange=exchange)

    def _quant_views(self, b: _Buffer, layer: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Layer `layer`'s leaves in persistent-quants slot `b`, and its matrices' code views (short name -> tensor),
        made once: tensors as views into the compute buffer, and for each quantized matrix a zero-stride leaf over
        one zero element (the gradient's target; it holds no weights) with an e4m3 view of its codes."""
        views, fp8 = {}, {}
        for p in self._qslots.layers[layer]:
            g = p.group
            small = self.quants.plan_of[g.key].small_offsets if p.matrices else None
            for s in g.segments:
                if s.short in p.matrices:
                    views[s.short] = torch.empty_strided(s.shape, (0,) * len(s.shape), dtype=self.compute_dtype,
                                                         device=self.device).zero_().requires_grad_(g.trainable)
                    a = p.codes + s.start
                    fp8[s.short] = b.buf[a:a + s.numel].view(E4M3).view(s.shape)
                else:
                    a = p.offset + (small[s.short] if small is not None else s.start)
                    views[s.short] = b.compute[a:a + s.numel].view(s.shape).requires_grad_(g.trainable)
        return views, fp8

    # ---- gathers ----
    def _gather(self, b: _Buffer, key: str, parts: list[tuple[Group, int]], layer: int | None = None) -> None:
        """Start gathering the groups `parts` (group, offset in `b`), together `key` (a non-block group's key, or
        layer `layer`'s 'block.l'), into `b` unless it already holds them at the current version."""
        if b.key == key and b.version == self.version:
            return
        self._wait(b)  # a gather of another group into this buffer may still be in flight
        with torch.no_grad():
            if self.quants is not None and layer is not None:
                self._gather_quantized(b, self._qslots.layers[layer])
            else:
                for group, off in parts:
                    self._gather_group(b, b.buf[off:off + group.padded_numel], group)
        b.key, b.version = key, self.version
        self.gathers += 1

    def _gather_group(self, b: _Buffer, target: torch.Tensor, group: Group) -> None:
        """Start gathering `group`'s shards, as they are (cast to the compute dtype), into `target`."""
        shard = self.shards[group.key]
        lo, hi = group.shard_range(self.rank, self.world)
        if self._staged:
            shard = self._stage(target[lo:hi], shard)
        elif shard.dtype != target.dtype:  # fp32 master: cast into the rank's own slice, gather in place
            shard = target[lo:hi].copy_(shard)
        b.pending.append(self._comm(group).all_gather(target, shard))
        self.gathered_bytes["block" if group.layer is not None else "non_block"] += _nbytes(target)

    def _gather_quantized(self, b: _Buffer, parts: tuple[_QuantPart, ...]) -> None:
        """Persistent quants: gather a layer's groups into slot `b`, those holding quantized matrices as their e4m3
        shards and packed small tensors, the others as they are (module doc)."""
        q = self.quants
        if q.version != self.version:  # the first block gather of this weights version quantizes all layers
            for other in self._blocks:
                self._wait(other)  # (none can be reading the codes, but be explicit)
            q.refresh(self.shards, self.version, self.comm)
        for p in parts:
            group = p.group
            if not p.matrices:
                self._gather_group(b, b.compute[p.offset:p.offset + group.padded_numel], group)
                continue
            target = b.buf[p.codes:p.codes + group.padded_numel]
            codes = q.codes[group.key]
            if q.staged:
                lo, hi = group.shard_range(self.rank, self.world)
                codes = self._stage(target[lo:hi], codes)
            b.pending.append(self.comm.all_gather(target, codes))
            plan = q.plan_of[group.key]
            exchange = b.exchange[p.exchange:p.exchange + self.world * p.slot]
            own_slot = exchange[self.rank * p.slot:(self.rank + 1) * p.slot]
            shard = self.shards[group.key]
            for a, pos, n in plan.pack:  # a few contiguous pieces: stream-ordered copies, from host or device shards
                own_slot[pos:pos + n].copy_(shard[a:a + n], non_blocking=True)
            gathered = self.comm.all_gather(exchange, own_slot)
            small = b.compute[p.offset:p.offset + plan.small_numel]
            b.pending.append(self.comm.then(gathered, lambda s=small, x=exchange, i=plan.recv_idx:
                                            _index_select_into(s, x, i)))
            self.gathered_bytes["block_fp8"] += _nbytes(target)
            self.gathered_bytes["block_small"] += _nbytes(exchange)

    @staticmethod
    def _stage(own: torch.Tensor, host_shard: torch.Tensor) -> torch.Tensor:
        """Copy an offloaded (host) shard into this rank's own slice `own` of its gather buffer (stream-ordered,
        before the collective) and return that slice: the all-gather then runs in place, from device memory."""
        return own.copy_(host_shard, non_blocking=True)

    @staticmethod
    def _wait(b: _Buffer) -> None:
        pending, b.pending = b.pending, []
        for h in pending:
            h.wait()

    def wait_all(self) -> None:
        """Wait for every gather in flight (before anything writes the shards)."""
        for b in self._blocks + list(self._non_block.values()):
            self._wait(b)

    def invalidate(self, *, prefetch: bool = True) -> None:
        """The shards changed (optimizer update, checkpoint load): every gathered buffer is stale (and so are the
        persistent e4m3 shards, re-made at the next block gather). With `prefetch`, start gathering the
        non-block groups and block 0 right away (they come first)."""
        self.wait_all()
        self.version += 1
        if prefetch:
            for g in self.layout.non_block_groups():
                self._gather(self._non_block[g.key], g.key, [(g, 0)])
            if self.num_layers:
                self._gather_block(0)

    # ---- WeightSource ----
    def block(self, layer: int) -> dict[str, torch.Tensor]:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"block({layer}): the model has {self.num_layers} layers")
        if torch.is_grad_enabled() and not self._saving:
            raise RuntimeError("ShardedWeights.block(): run the forward/backward inside `with weights.saving():` "
                               "-- gathered weights are reused buffers, and autograd must not keep them")
        nxt = self._walk.step(layer)
        b = self._gather_block(layer)
        if nxt is not None and nxt % len(self._blocks) != layer % len(self._blocks):
            self._gather_block(nxt)
        self._wait(b)
        if self.quants is None:
            return self._views[layer]
        out, fp8 = dict(self._views[layer]), self._fp8[layer]
        for n, inv in zip(self.quants.matrices[layer], self.quants.inv_scales[layer]):
            out[FP8_WEIGHT.format(n)], out[FP8_INV_SCALE.format(n)] = fp8[n], inv
        return out

    def _gather_block(self, layer: int) -> _Buffer:
        """Start gathering layer `layer` into its slot (unless there already); the slot."""
        b = self._blocks[layer % len(self._blocks)]
        self._gather(b, self.layout.block(layer).key, self._parts[layer], layer)
        b.layer = layer
        return b

    def layer_holding(self, t: torch.Tensor) -> int | None:
        """The layer whose weights the block slot holding `t` holds now (None: not in a slot): what a user of a
        layer's tensors that tells layers apart by memory (LoRA dropout's key) must ask, since layers share slots."""
        ptr = t.untyped_storage().data_ptr()
        return next((b.layer for b in self._blocks if ptr in b.storages), None)

    def non_block(self) -> dict[str, torch.Tensor]:
        groups = self.layout.non_block_groups()
        for g in groups:
            self._gather(self._non_block[g.key], g.key, [(g, 0)])
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
        """Run a forward/backward under this: tensors autograd saves from a block buffer (bf16 weights, or the
        e4m3 codes and small tensors with persistent quants) are kept as (buffer, layer, version) handles and
        checked when the backward unpacks them (see the module doc)."""
        slots = {p: i for i, b in enumerate(self._blocks) for p in b.storages}

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
    def gather_full(self, groups: list[Group] | None = None, *, keep: bool = True) -> dict[str, torch.Tensor]:
        """Full parameters (internal name -> tensor in host memory), gathered group by group from the model-dtype
        shards (never from the block buffers): of every group, or of `groups` (a LoRA adapter's export: the
        trainable ones, not a frozen base of many GB on every rank). A collective: every rank must call it with the
        same groups; a rank that only takes part (`keep` False: the export's writer is rank 0) drops each gathered
        group at once and gets {}, so the model is copied into one rank's host memory, not every rank's. Peak device
        memory: one group."""
        self.wait_all()
        groups = self.layout.groups if groups is None else groups
        buffers = {}
        for g in groups:
            shard = self.shards[g.key]
            full = torch.empty(g.padded_numel, dtype=shard.dtype, device=self.device)
            self._comm(g).all_gather(full, shard.to(self.device)).wait()
            if keep:
                buffers[g.key] = full.cpu()
        return self.layout.views(buffers, groups) if keep else {}

    # ---- memory ----
    @staticmethod
    def footprint_of(layout: FlatLayout, *, dtype: torch.dtype, offload: bool = False,
                     quantized: tuple[str, ...] = (), offload_quants: bool = False,
                     compute_dtype: torch.dtype | None = None) -> Footprint:
        """Bytes of persistent weight state per rank, by buffer kind, without allocating it: the `shards` (the master,
        frozen groups' in the compute dtype; host with `offload`), two `block_buffers` slots and the
        `non_block_buffers`. With
        persistent quants (`quantized`) the block buffers are only what is not a quantized matrix (`_QuantSlots`:
        the small tensors, their exchange slots, a layer's groups without such matrices) and every layer's
        one-element matrix leaves (+ the int64 `small_index` maps that unpack the exchange); `quant_buffers` are the
        two e4m3 code buffers, `quant_shards` the e4m3 shards (host with `offload_quants`), `quant_scales` their
        inverse scales. The shards are in `dtype`, every buffer in `compute_dtype` (None: the
        same)."""
        E, world, L = (compute_dtype or dtype).itemsize, layout.world, layout.cfg.num_hidden_layers
        slots = min(2, L)
        parts = {"shards": sum(g.shard_size(world) * (dtype if g.trainable else compute_dtype or dtype).itemsize
                               for g in layout.groups),
                 "non_block_buffers": sum(g.padded_numel for g in layout.non_block_groups()) * E}
        host = {"shards"} if offload else set()
        if quantized and L:
            sizes = _QuantSlots.of(layout, quantized)
            parts["block_buffers"] = (slots * (sizes.compute + sizes.exchange) + sizes.leaves()) * E
            # where each small-tensor element sits in the gathered exchange: one map per distinct group layout
            parts["small_index"] = 8 * PersistentQuants.index_numel(layout, quantized)
            parts["quant_buffers"] = slots * sizes.codes
            q = PersistentQuants.footprint_of(layout, quantized, offload=offload_quants)
            parts.update(q.parts)
            host |= q.host_keys
        else:
            parts["block_buffers"] = slots * ShardedWeights.slot_numel(layout) * E
        return Footprint(parts, frozenset(host))

    def footprint(self) -> Footprint:
        return self.footprint_of(self.layout, dtype=self.dtype, offload=self.offload,
                                 quantized=self.quants.names if self.quants else (), offload_quants=self.offload_quants,
                                 compute_dtype=self.compute_dtype)

    def memory(self) -> dict[str, int]:
        """Bytes of persistent weight state on this rank, by buffer kind (`footprint_of`)."""
        return dict(self.footprint().parts)

    def host_memory_keys(self) -> set[str]:
        return set(self.footprint().host_keys)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _index_select_into(out: torch.Tensor, src: torch.Tensor, index: torch.Tensor) -> None:
    """out <- src[index], in place (the small tensors from the gathered exchange buffer)."""
    with torch.no_grad():
        torch.index_select(src, 0, index, out=out)
