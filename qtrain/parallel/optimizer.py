"""AdamW with optimizer state sharded across ranks (ZeRO-1), on the flat group layout; optionally streamed
through host memory (offloaded m, v and, with sharded weights, the master weights).

Each rank owns the slice [r*n/W, (r+1)*n/W) of every group buffer (see `layout.py`): it keeps Adam's m
and v only for that slice and updates the weights of that slice from its gradient shard. Two weight modes:
  * replicated weights (`params=`, full group buffers): the shard is a slice of the full buffer, and after
    a group's update the full weights are re-assembled with one all-gather per group (ZeRO-1/2);
  * sharded weights (`shards=`, the rank's shards, `weights.ShardedWeights`): the shard is updated in place
    and nothing is gathered -- the next forward gathers what it needs (ZeRO-3).
With one rank this is plain fused AdamW.

Weight decay is decided per tensor (`weights.is_decayed`), so the update walks the *pieces* of a shard
(the parts of tensors it contains) and runs the fused kernel once per piece. The stochastic-rounding
counter of an element is its index inside its tensor and the key names (seed, step, group, tensor), so
an update gives the same bits whatever the number of ranks -- and however a shard is cut into chunks.

Offload (llm.q `LLamaModel::update`, reference/llmq.md §4.4). `offload_m` / `offload_v` keep m / v shards in
host memory (pinned when CUDA is available; plain memory otherwise); `offload_params` says the weight
shards handed in live there (sharded weights with --offload-master: qtrain has no separate master copy, the
model-dtype weights *are* the master, so offloading the master means offloading the weight shard). The
update still runs on the compute device: the step walks *work items* (a group's shard, or a chunk of it --
the big embedding / LM-head shards are cut into chunks of the largest block shard) and streams them through
two device staging slots: the host->device copies of item i+1 run on a side stream while item i updates,
then item i's results go back device->host on the same side stream (which is what makes reusing a slot two
items later safe). Gradient shards that live in host memory (--offload-gradients) are staged the same way
(read only). The compute stream waits for the last copy-back at the end of the step (no host sync); host
code that reads the offloaded state (checkpoints) calls `synchronize()` first.

`zero_copy` skips the staging: the update reads and writes the host tensors directly. That is only
meaningful where the compute device can address host memory; on a CPU device it is the same memory, so
the update runs in place. On CUDA it is refused (`ZERO_COPY_CUDA`): `adamw_update_` takes all operands on
one device (the Triton launcher itself could take pinned host pointers through UVA, but that path is not
wired or tested).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

import torch

from ..kernels.rng import rng_key
from ..model.weights import is_decayed
from ..numerics.adamw import AdamWHyper, adamw_update_
from .layout import FlatLayout, Group

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

OFFLOAD_MASTER_NEEDS_SHARDED = (
    "--offload-master needs sharded weights (--shard-weights or --zero-level 3): qtrain keeps no separate "
    "master copy (the model-dtype weights are the master), and replicated weights must stay on the device "
    "for the forward")
ZERO_COPY_CUDA = (
    "--use-zero-copy is not supported on CUDA: the AdamW update takes all operands on the compute device, so "
    "offloaded state is streamed through device staging buffers instead (leave --use-zero-copy off; it only "
    "means something on a CPU device, where host memory is the compute memory)")


class GradShards(Protocol):
    def grad_shard(self, group_key: str) -> torch.Tensor: ...


@dataclass(frozen=True)
class _Item:
    """A unit of the streamed update: elements [lo, hi) of `group`'s shard."""
    group: Group
    lo: int
    hi: int
    last_of_group: bool


class ShardedAdamW:
    def __init__(self, layout: FlatLayout, params: dict[str, torch.Tensor] | None = None, *,
                 shards: dict[str, torch.Tensor] | None = None, rank: int = 0, comm=None,
                 device: torch.device | str | None = None, m_dtype: str = "fp32", v_dtype: str = "fp32",
                 seed: int = 0, stochastic_rounding: bool = True, offload_params: bool = False,
                 offload_m: bool = False, offload_v: bool = False, zero_copy: bool = False):
        """`params`: full group buffers (key -> 1-D tensor), updated in place and all-gathered; or `shards`:
        the rank's weight shards (key -> 1-D tensor of `group.shard_size(world)`), updated in place. `comm`:
        an object with `all_gather_into_tensor(out, inp)` and `all_reduce_sum(t)` (None when world == 1).
        `device`: the compute device (default: where the weights are)."""
        if (params is None) == (shards is None):
            raise ValueError("ShardedAdamW: pass exactly one of params (replicated weights) or shards")
        self.layout, self.params, self.rank, self.comm, self.seed = layout, params, rank, comm, seed
        self.stochastic_rounding = stochastic_rounding
        self.world = layout.world
        self.replicated = params is not None
        weights = params if params is not None else shards
        self.device = torch.device(device) if device is not None else next(iter(weights.values())).device
        if offload_params and self.replicated:
            raise ValueError(OFFLOAD_MASTER_NEEDS_SHARDED)
        if zero_copy and self.device.type == "cuda":
            raise ValueError(ZERO_COPY_CUDA)
        if shards is not None:
            for g in layout.groups:
                if shards[g.key].numel() != g.shard_size(self.world):
                    raise ValueError(f"ShardedAdamW: shard of {g.key} has {shards[g.key].numel()} elements, "
                                     f"expected {g.shard_size(self.world)}")
            self.shards = dict(shards)
        else:
            self.shards = {}
            for g in layout.groups:
                lo, hi = g.shard_range(rank, self.world)
                self.shards[g.key] = params[g.key][lo:hi]
        pin = torch.cuda.is_available()
        cpu = torch.device("cpu")
        self.m = layout.allocate(dtype=DTYPES[m_dtype], device=cpu if offload_m else self.device, shard=True,
                                 pin_memory=offload_m and pin)
        self.v = layout.allocate(dtype=DTYPES[v_dtype], device=cpu if offload_v else self.device, shard=True,
                                 pin_memory=offload_v and pin)
        self.offloaded = {"param": offload_params, "m": offload_m, "v": offload_v}
        self.zero_copy = zero_copy
        self._staged = {k: off and not zero_copy for k, off in self.offloaded.items()}
        self._capacity = self._chunk_capacity() if any(self._staged.values()) else None
        self._slots: list[dict[str, torch.Tensor]] = []
        if self._capacity is not None:
            dts = {"param": next(iter(self.shards.values())).dtype, "m": DTYPES[m_dtype], "v": DTYPES[v_dtype]}
            self._slots = [{k: torch.empty(self._capacity, dtype=dts[k], device=self.device)
                            for k, s in self._staged.items() if s} for _ in range(2)]
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._copies_done: torch.cuda.Event | None = None
        self.step_count = 0  # completed updates; Adam's bias correction uses step_count + 1
        self.streamed_items = 0  # work items the last step streamed through the staging slots (0: none)

    def _chunk_capacity(self) -> int:
        """Staging slot size: the largest block shard (whole blocks stream as one item; bigger non-block
        shards are cut into chunks of this size), or the largest shard when there are no blocks."""
        blocks = [g.shard_size(self.world) for g in self.layout.groups if g.layer is not None]
        return max(blocks) if blocks else max(g.shard_size(self.world) for g in self.layout.groups)

    def _items(self, capacity: int | None) -> list[_Item]:
        items = []
        for g in self.layout.groups:
            n = g.shard_size(self.world)
            step = capacity or n
            starts = list(range(0, n, step)) or [0]
            for i, lo in enumerate(starts):
                items.append(_Item(g, lo, min(n, lo + step), i == len(starts) - 1))
        return items

    def param_shard(self, key: str) -> torch.Tensor:
        return self.shards[key]

    @torch.no_grad()
    def grad_norm(self, grads: GradShards) -> torch.Tensor:
        """Global L2 norm of the gradient (fp32 device scalar): sum of squares of this rank's shards,
        summed over ranks. Padding is zero, so it does not count."""
        shards = [grads.grad_shard(g.key) for g in self.layout.groups]
        sq = torch.stack([torch.linalg.vector_norm(s, dtype=torch.float32).to(self.device)
                          for s in shards]).pow(2).sum()
        if self.comm is not None and self.world > 1:
            self.comm.all_reduce_sum(sq)
        return sq.sqrt()

    @torch.no_grad()
    def step(self, grads: GradShards, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
             grad_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
        """One AdamW update of this rank's shards (then, with replicated weights, all-gather of the weights).
        `grad_scale` may be a device scalar (`clip_scale`), NaN meaning skip: the step is then queued but
        writes nothing, and the caller calls `unstep()` once it knows. Returns the abs-max of the updated
        weights on this rank (fp32 device scalar), for FP8 weight scaling."""
        t = self.step_count + 1
        hp = AdamWHyper(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=t,
                        grad_scale=grad_scale)
        gshards = {g.key: grads.grad_shard(g.key) for g in self.layout.groups}
        stage_grads = any(s.device != self.device for s in gshards.values())
        capacity = self._capacity
        if stage_grads and capacity is None:
            capacity = self._chunk_capacity()
        if stage_grads and not any(("grad" in s) for s in self._slots):
            dt = next(iter(gshards.values())).dtype
            if not self._slots:
                self._slots = [{}, {}]
            for s in self._slots:
                s["grad"] = torch.empty(capacity, dtype=dt, device=self.device)
        sources = {"param": self.shards, "m": self.m, "v": self.v, "grad": gshards}
        staged = dict(self._staged, grad=stage_grads)
        items = self._items(capacity if any(staged.values()) else None)
        cs = self._copy_stream
        ready: list[torch.cuda.Event | None] = [None] * len(items)

        def fetch(i: int) -> None:  # host -> staging slot i % 2 (side stream on CUDA)
            it, slot = items[i], self._slots[i % 2]
            ctx = torch.cuda.stream(cs) if cs is not None else contextlib.nullcontext()
            with ctx:
                for k, src in sources.items():
                    if staged[k]:
                        slot[k][:it.hi - it.lo].copy_(src[it.group.key][it.lo:it.hi], non_blocking=True)
                if cs is not None:
                    ready[i] = torch.cuda.Event()
                    ready[i].record(cs)

        def operands(i: int) -> dict[str, torch.Tensor]:
            it, slot = items[i], self._slots[i % 2] if self._slots else {}
            return {k: slot[k][:it.hi - it.lo] if staged[k] else src[it.group.key][it.lo:it.hi]
                    for k, src in sources.items()}

        def write_back(i: int) -> None:  # staging slot -> host, after the update (side stream on CUDA)
            it, slot = items[i], self._slots[i % 2]
            if cs is not None:
                cs.wait_stream(torch.cuda.current_stream(self.device))
            ctx = torch.cuda.stream(cs) if cs is not None else contextlib.nullcontext()
            with ctx:
                for k in ("param", "m", "v"):
                    if staged[k]:
                        sources[k][it.group.key][it.lo:it.hi].copy_(slot[k][:it.hi - it.lo], non_blocking=True)

        streaming = any(staged.values())
        self.streamed_items = len(items) if streaming else 0
        if streaming and cs is not None:
            cs.wait_stream(torch.cuda.current_stream(self.device))  # gradients / gathers queued so far
        if streaming and items:
            fetch(0)
        amaxes = []
        update = adamw_update_ if self.stochastic_rounding else _adamw_update_nearest_
        for i, it in enumerate(items):
            if streaming:
                if i + 1 < len(items):
                    fetch(i + 1)  # overlaps item i's update; its slot was last read by item i-1's copy-back
                if ready[i] is not None:
                    torch.cuda.current_stream(self.device).wait_event(ready[i])
            ops = operands(i)
            g = it.group
            for piece in g.shard_pieces(self.rank, self.world):
                a, b = max(piece.shard_offset, it.lo), min(piece.shard_offset + piece.numel, it.hi)
                if a >= b:
                    continue
                sl = slice(a - it.lo, b - it.lo)
                seg_index = g.segments.index(piece.segment)
                amaxes.append(update(ops["param"][sl], ops["grad"][sl], ops["m"][sl], ops["v"][sl], hp=hp,
                                     decay=is_decayed(piece.segment.name),
                                     key=rng_key(self.seed, t, g.index, seg_index),
                                     offset=piece.tensor_offset + (a - piece.shard_offset)))
            if streaming:
                write_back(i)
            if it.last_of_group and self.replicated and self.comm is not None and self.world > 1:
                self.comm.all_gather_into_tensor(self.params[g.key], self.shards[g.key])
        if cs is not None and streaming:
            torch.cuda.current_stream(self.device).wait_stream(cs)  # later compute (gathers) sees the results
            self._copies_done = torch.cuda.Event()
            self._copies_done.record(cs)
        self.step_count = t
        return torch.stack([a.to(self.device) for a in amaxes]).max() if amaxes else torch.zeros(())

    def unstep(self) -> None:
        """The last step was skipped on the device (NaN grad_scale): do not count it in the bias correction."""
        self.step_count -= 1

    def synchronize(self) -> None:
        """Block the host until the last step's copies to host memory are done (before reading the state)."""
        if self._copies_done is not None:
            self._copies_done.synchronize()

    # ---- checkpoints: this rank's shards ----
    def state_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        self.synchronize()
        return {"adam.m": dict(self.m), "adam.v": dict(self.v)}

    def load_state_tensors(self, state: dict[str, dict[str, torch.Tensor]], step_count: int) -> None:
        self.synchronize()
        for name, bufs in (("adam.m", self.m), ("adam.v", self.v)):
            for k, t in bufs.items():
                src = state[name][k]
                if src.shape != t.shape:
                    raise ValueError(f"checkpoint {name}[{k}]: shape {tuple(src.shape)} != {tuple(t.shape)} "
                                     f"(was it written with another world size?)")
                t.copy_(src)
        self.step_count = step_count

    # ---- memory ----
    def state_nbytes(self) -> int:
        """Adam moments of this rank (device and host), in bytes."""
        return sum(t.numel() * t.element_size() for d in (self.m, self.v) for t in d.values())

    def memory(self) -> dict[str, int]:
        """Bytes of persistent optimizer state on this rank, by kind ('staging': the device slots used to
        stream offloaded state; the weight shards belong to the weights, not here)."""
        nb = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        return {"adam.m": nb(self.m.values()), "adam.v": nb(self.v.values()),
                "staging": nb(t for s in self._slots for t in s.values())}

    def host_memory_keys(self) -> set[str]:
        return {k for k, off in (("adam.m", self.offloaded["m"]), ("adam.v", self.offloaded["v"])) if off}


def _adamw_update_nearest_(param, grad, m, v, **kw) -> torch.Tensor:
    """The same update computed in fp32, with low-precision states written back by round-to-nearest:
    the baseline that shows what stochastic rounding buys (slow: extra fp32 copies; experiments only)."""
    p32, m32, v32 = param.float(), m.float(), v.float()
    amax = adamw_update_(p32, grad, m32, v32, **kw)
    param.copy_(p32), m.copy_(m32), v.copy_(v32)
    return amax


def clip_scale(norm: torch.Tensor, clip: float) -> torch.Tensor:
    """Clipping by global norm, as a device scalar for `step(grad_scale=...)`: clip / norm when norm > clip,
    else 1 (clip <= 0: no clipping); NaN (skip the update) when the norm is not finite. On the device, so
    the update is queued before the host has read the norm. (llm.q compares the squared norm with the
    threshold [quirk]; this is the standard rule.)"""
    one = torch.ones((), dtype=torch.float32, device=norm.device)
    norm = norm.float()
    scale = torch.where(norm > clip, clip / norm, one) if clip > 0 else one
    return torch.where(torch.isfinite(norm), scale, torch.full_like(one, float("nan")))
