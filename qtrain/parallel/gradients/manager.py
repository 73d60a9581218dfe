"""The gradient manager's protocol and bookkeeping (`GradientManager`: buffers, keys, accumulation, the protocol
`qtrain.parallel.gradients` describes) and the unsharded manager (ZeRO-1)."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from qtrain import host_memory
from qtrain.kernels.rng import KeySlot, KeyTable, rng_key
from qtrain.kernels.stochastic_rounding import sr_add_, sr_copy_
from qtrain.parallel.comm import Communicator, Handle
from qtrain.parallel.experts import ExpertParallel
from qtrain.parallel.footprint import Footprint
from qtrain.parallel.layout import FlatLayout, Group

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
        return host_memory.zeros(n, self.dtype, device or self.device, pin=pin)

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


def _non_block_bytes(layout: FlatLayout, dtype: torch.dtype) -> int:
    return sum(g.padded_numel for g in layout.trainable_groups(blocks=False)) * dtype.itemsize


def _stages(offload: bool, device: torch.device | str) -> bool:
    """Offloaded shards go through a device copy unless the compute device is the CPU (where host is device)."""
    return offload and torch.device(device).type != "cpu"


def _key_recipes(layout: FlatLayout) -> list[tuple[tuple[int, int], int, int]]:
    """The SR launches of an unsharded manager, one per tensor of every trainable group: (ids, offset, n)."""
    return [((g.index, t), 0, seg.numel) for g in layout.trainable_groups() for t, seg in enumerate(g.segments)]


def _with_key_table(fp: Footprint, layout: FlatLayout) -> Footprint:
    return Footprint({**fp.parts, "sr_key_table": KeyTable.nbytes(len(_key_recipes(layout)))}, fp.host_keys)
