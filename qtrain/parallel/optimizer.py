"""AdamW with optimizer state sharded across ranks (ZeRO-1), on the flat group layout; optionally streamed
through host memory (offloaded m, v and, with sharded weights, the master weights).

Each rank owns the slice [r*n/W, (r+1)*n/W) of every group buffer (see `layout.py`): it keeps Adam's m
and v only for that slice and updates the weights of that slice from its gradient shard. Two weight modes:
  * replicated weights (`params=`, full group buffers): the shard is a slice of the full buffer, and after
    a group's update the full weights are re-assembled with one all-gather per group (ZeRO-1/2);
  * sharded weights (`shards=`, the rank's shards, `weights.ShardedWeights`): the shard is updated in place
    and nothing is gathered -- the next forward gathers what it needs (ZeRO-3).
With one rank this is plain fused AdamW.

Weight decay is decided per tensor (its family's statement, `layout.Segment.decay`), so the update walks the
*pieces* of a shard
(the parts of tensors it contains) and runs the fused kernel once per piece. The stochastic-rounding
counter of an element is its index inside its tensor and the key names (seed, step, group, tensor), so
an update gives the same bits whatever the number of ranks -- and however a shard is cut into chunks.

Offload (llm.q `LLamaModel::update`, reference/llmq.md §4.4). `offload_m` / `offload_v` keep m / v shards in
host memory (pinned when CUDA is available; plain memory otherwise); `offload_params` says the weight
shards handed in live there (sharded weights with --offload-master: qtrain has no separate master copy, the
model-dtype weights *are* the master, so offloading the master means offloading the weight shard). The
update still runs on the compute device: the step walks *work items* (a group's shard, or a chunk of it --
the big embedding / LM-head shards are cut into chunks of the largest block shard) and streams them through
`staging.STAGING_SLOTS` (3) device slots of a `staging.StagingRing`: while item i updates, item i+1 comes
host->device on one side stream and item i-1's results go device->host on another. PCIe moves both
directions at once, so a step costs about one direction's traffic, not the sum of both (with two slots,
fetching i+1 into the slot item i-1 is still writing back from serialises them). A slot is refilled only
after the copy-back of the item that used it three items earlier has finished (an event on the
device->host stream). Gradient shards that live in host memory (--offload-gradients) are staged the same
way (read only). The compute stream waits for the last copy-back at the end of the step (no host sync);
host code that reads the offloaded state (checkpoints) calls `synchronize()` first.

Collectives (with `comm`, the `Communicator` the gradient managers and weights use): the all-reduce of the
gradient norm's square, and with replicated weights one all-gather per group after its update.

e4m3 m (`m_dtype="e4m3"`, llm.q's block-scaled FP8 first moment, reference/llmq.md §3.3-3.4): m is kept as
float8_e4m3fn codes plus one fp32 scale per *block*, `m_scales[group]`. The fused kernel takes one scale per
128 elements of a call, so the update decides where calls start. A block is a 128-element run of a *tensor*
(element i of a tensor is in block i // 128) intersected with this rank's shard: calls start at a tensor
position that is a multiple of 128, except the first call of a piece that starts mid-block (a shard that
cuts a tensor off-grid), which covers only the rest of that block. Staging chunks are cut on block
boundaries too. So the result does not depend on how the update is chunked (offload or not, any slot size)
and, with W ranks, equals the one-rank result in every block a shard boundary does not cut; a block that a
shard boundary cuts has one scale per part, so there the bits depend on the world size (and every later step
with them). Every rank allocates the same number of scales per group (the most any rank needs; unused tail
scales stay zero), so checkpoints of one world size have one shape. In checkpoints the scales travel in the
`adam.m` file as `<group>.scales` (see `state_tensors`).

`zero_copy` skips the staging: the update reads and writes the host tensors directly. That is only
meaningful where the compute device can address host memory; on a CPU device it is the same memory, so
the update runs in place. On CUDA it is refused (`ZERO_COPY_CUDA`): `adamw_update_` takes all operands on
one device (the Triton launcher itself could take pinned host pointers through UVA, but that path is not
wired or tested).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from qtrain import host_memory
from qtrain.kernels.adamw import M_BLOCK
from qtrain.kernels.rng import rng_key
from qtrain.numerics.adamw import AdamWHyper, adamw_update_
from qtrain.parallel.comm import Communicator
from qtrain.parallel.experts import ExpertParallel
from qtrain.parallel.footprint import Footprint
from qtrain.parallel.layout import FlatLayout, Group, Piece
from qtrain.parallel.staging import StagingRing

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn}
SCALES_SUFFIX = ".scales"  # key of a group's e4m3 m scales in the `adam.m` state dict / checkpoint file

OFFLOAD_MASTER_NEEDS_SHARDED = (
    "--offload-master needs sharded weights (--shard-weights or --zero-level 3): qtrain keeps no separate "
    "master copy (the model-dtype weights are the master), and replicated weights must stay on the device "
    "for the forward")
ZERO_COPY_CUDA = (
    "--use-zero-copy is not supported on CUDA: the AdamW update takes all operands on the compute device, so "
    "offloaded state is streamed through device staging buffers instead (leave --use-zero-copy off; it only "
    "means something on a CPU device, where host memory is the compute memory)")


E4M3_M_NEEDS_SR = (
    "--opt-m-dtype e4m3 needs stochastic rounding (leave --no-stochastic-rounding off): the round-to-nearest "
    "baseline has no block-scaled e4m3 writer")


def piece_blocks(p: Piece) -> int:
    """e4m3 m blocks (scales) of a piece: the 128-element tensor blocks it touches."""
    return -(-(p.tensor_offset + p.numel) // M_BLOCK) - p.tensor_offset // M_BLOCK


def group_m_scales(group: Group, world: int) -> int:
    """fp32 scales an e4m3 m shard of `group` has on every rank: the most any rank needs."""
    return max(sum(piece_blocks(p) for p in group.shard_pieces(r, world)) for r in range(world))


def staging_capacity(layout: FlatLayout, m_dtype: str = "fp32") -> int:
    """Staging slot size in elements: the largest block shard (whole blocks stream as one item; bigger
    non-block shards are cut into chunks of this size), or the largest shard when there are no blocks; at
    least one e4m3 block with an e4m3 m (chunks are cut on block boundaries)."""
    world = layout.world
    blocks = [g.shard_size(world) for g in layout.trainable_groups(blocks=True)]
    cap = max(blocks) if blocks else max((g.shard_size(world) for g in layout.trainable_groups()), default=0)
    return max(cap, M_BLOCK) if m_dtype == "e4m3" else cap


def scale_slot_numel(layout: FlatLayout, capacity: int) -> int:
    """Scales of a staging slot for an offloaded e4m3 m: a chunk of `capacity` elements touches at most
    ceil(capacity/128) blocks, plus one per tensor it starts in (a tensor's last block may be short), plus
    one for a piece starting mid-block."""
    return -(-capacity // M_BLOCK) + max((len(g.segments) for g in layout.trainable_groups()), default=0) + 1


def _slot_sizes(layout: FlatLayout, capacity: int,
                staged: dict[str, torch.dtype]) -> dict[str, tuple[int, torch.dtype]]:
    """Buffers of a staging slot of `capacity` elements: one per staged kind (kind -> dtype: param, m, v, grad;
    an e4m3 m's scales have `scale_slot_numel`)."""
    return {k: (scale_slot_numel(layout, capacity) if k == "m_scales" else capacity, dt) for k, dt in staged.items()}


class GradShards(Protocol):
    def grad_shard(self, group_key: str) -> torch.Tensor: ...


@dataclass(frozen=True)
class _Call:
    """One kernel call: elements [a, b) of an item, all in one tensor."""
    seg_index: int  # the tensor's index in its group (RNG key)
    decay: bool
    a: int
    b: int
    offset: int  # index of element a in its tensor (SR counter)
    s_lo: int  # e4m3 m: its scales are [s_lo, s_hi) of the group's scale buffer (0, 0 otherwise)
    s_hi: int


@dataclass(frozen=True)
class _Item:
    """A unit of the streamed update: elements [lo, hi) of `group`'s shard (and scales [s_lo, s_hi))."""
    group: Group
    lo: int
    hi: int
    last_of_group: bool
    calls: tuple[_Call, ...] = ()
    s_lo: int = 0
    s_hi: int = 0


class ShardedAdamW:
    def __init__(self, layout: FlatLayout, params: dict[str, torch.Tensor] | None = None, *,
                 shards: dict[str, torch.Tensor] | None = None, rank: int | None = None,
                 comm: Communicator | None = None, device: torch.device | str | None = None, m_dtype: str = "fp32",
                 v_dtype: str = "fp32", seed: int = 0, stochastic_rounding: bool = True,
                 offload_params: bool = False, offload_m: bool = False, offload_v: bool = False,
                 zero_copy: bool = False, experts: ExpertParallel | None = None):
        """`params`: full group buffers (key -> 1-D tensor), updated in place and all-gathered; or `shards`:
        the rank's weight shards (key -> 1-D tensor of `group.shard_size(world)`), updated in place. `comm`:
        the `Communicator` of the layout's world (None: no collectives, e.g. one rank); `rank` defaults to
        its rank (0 without one). `device`: the compute device (default: where the weights are). `experts`:
        expert parallelism (an expert group is sharded over, and gathered from, the replicas holding its experts;
        parallel/experts.py)."""
        if (params is None) == (shards is None):
            raise ValueError("ShardedAdamW: pass exactly one of params (replicated weights) or shards")
        if comm is not None:
            if comm.world != layout.world:
                raise ValueError(f"layout was built for world {layout.world}, communicator has world {comm.world}")
            if rank is not None and rank != comm.rank:
                raise ValueError(f"ShardedAdamW: rank {rank} but the communicator's rank is {comm.rank}")
            rank = comm.rank
        self.layout, self.params, self.rank, self.comm, self.seed = layout, params, rank or 0, comm, seed
        self.experts = experts
        self.stochastic_rounding = stochastic_rounding
        self.world = layout.world
        self.replicated = params is not None
        weights = params if params is not None else shards
        self.device = torch.device(device) if device is not None else next(iter(weights.values())).device
        if self.device.type == "cuda" and self.device.index is None and torch.cuda.is_available():  # == "cuda:0"
            self.device = torch.device("cuda", torch.cuda.current_device())
        if offload_params and self.replicated:
            raise ValueError(OFFLOAD_MASTER_NEEDS_SHARDED)
        if zero_copy and self.device.type == "cuda":
            raise ValueError(ZERO_COPY_CUDA)
        if m_dtype not in DTYPES or v_dtype not in ("fp32", "bf16"):
            raise ValueError(f"ShardedAdamW: m_dtype {m_dtype!r} (fp32, bf16, e4m3), v_dtype {v_dtype!r} (fp32, bf16)")
        self.m_e4m3 = m_dtype == "e4m3"
        if self.m_e4m3 and not stochastic_rounding:
            raise ValueError(E4M3_M_NEEDS_SR)
        if shards is not None:
            for g in layout.groups:
                if shards[g.key].numel() != g.shard_size(self.world):
                    raise ValueError(f"ShardedAdamW: shard of {g.key} has {shards[g.key].numel()} elements, "
                                     f"expected {g.shard_size(self.world)}")
            self.shards = dict(shards)
        else:
            self.shards = {}
            for g in layout.groups:
                if not g.trainable and g.key not in params:  # a frozen group held elsewhere (an e4m3 LoRA base)
                    continue
                lo, hi = g.shard_range(self.rank, self.world)
                self.shards[g.key] = params[g.key][lo:hi]
        pin = torch.cuda.is_available()
        cpu = torch.device("cpu")
        self.trained = layout.trainable_groups()  # what it updates: frozen groups have no state and no update
        self.m = layout.allocate(dtype=DTYPES[m_dtype], device=cpu if offload_m else self.device, shard=True,
                                 pin=offload_m and pin, groups=self.trained)
        self.v = layout.allocate(dtype=DTYPES[v_dtype], device=cpu if offload_v else self.device, shard=True,
                                 pin=offload_v and pin, groups=self.trained)
        # e4m3 m: one fp32 scale per block (module docstring), zero like the codes; they live with m
        self.m_scales: dict[str, torch.Tensor] = {
            g.key: host_memory.zeros(group_m_scales(g, self.world), torch.float32, cpu if offload_m else self.device,
                                     pin=offload_m and pin)
            for g in self.trained} if self.m_e4m3 else {}
        self.offloaded = {"param": offload_params, "m": offload_m, "v": offload_v}
        self.zero_copy = zero_copy
        self.m_dtype, self.v_dtype = m_dtype, v_dtype
        self.param_dtype = (self.shards[self.trained[0].key] if self.trained else next(iter(self.shards.values()))).dtype
        self.grad_dtype: torch.dtype | None = None  # of gradient shards staged from host memory (first such step)
        self._staged = {k: off and not zero_copy for k, off in self.offloaded.items()}
        if self.m_e4m3:
            self._staged["m_scales"] = self._staged["m"]
        self._capacity = self._chunk_capacity() if any(self._staged.values()) else None
        self._item_cache: dict[int | None, list[_Item]] = {}
        # offloaded state streams through device slots (None: nothing is staged, until host gradients are)
        self._staging = (StagingRing(_slot_sizes(layout, self._capacity, self._staged_dtypes(
            self._staged, self.param_dtype, m_dtype, v_dtype)), device=self.device)
                         if self._capacity is not None else None)
        self.step_count = 0  # completed updates; Adam's bias correction uses step_count + 1
        self.streamed_items = 0  # work items the last step streamed through the staging slots (0: none)

    def _chunk_capacity(self) -> int:
        return staging_capacity(self.layout, "e4m3" if self.m_e4m3 else "fp32")

    @staticmethod
    def _staged_dtypes(staged: dict[str, bool], param_dtype: torch.dtype, m_dtype: str, v_dtype: str,
                       grad_dtype: torch.dtype | None = None) -> dict[str, torch.dtype]:
        """The staged kinds (param, m, v, m_scales, grad) with their dtypes, in the order slots hold them."""
        dts = {"param": param_dtype, "m": DTYPES[m_dtype], "v": DTYPES[v_dtype], "m_scales": torch.float32}
        out = {k: dts[k] for k, s in staged.items() if s}
        if grad_dtype is not None:
            out["grad"] = grad_dtype
        return out

    def _items(self, capacity: int | None) -> list[_Item]:
        """Work items (one per group, or chunks of at most `capacity` elements) with their kernel calls.
        With an e4m3 m, chunks end on block boundaries and calls start on them (module docstring)."""
        if capacity in self._item_cache:
            return self._item_cache[capacity]
        items = []
        for g in self.trained:
            n = g.shard_size(self.world)
            pieces = g.shard_pieces(self.rank, self.world)
            starts = [0]
            while capacity and starts[-1] + capacity < n:
                cut = starts[-1] + capacity
                starts.append(self._block_floor(pieces, cut) if self.m_e4m3 else cut)
            bounds = starts + [n]
            for i in range(len(starts)):
                items.append(self._item(g, pieces, bounds[i], bounds[i + 1], i == len(starts) - 1))
        if capacity is not None and self.m_e4m3:
            slot = scale_slot_numel(self.layout, capacity)
            assert all(it.s_hi - it.s_lo <= slot for it in items), "e4m3 m scales exceed the staging slot"
        self._item_cache[capacity] = items
        return items

    @staticmethod
    def _block_floor(pieces: list[Piece], pos: int) -> int:
        """The last e4m3 block boundary at or before shard position `pos` (> pos - 128)."""
        for p in pieces:
            if p.shard_offset <= pos < p.shard_offset + p.numel:
                t = p.tensor_offset + pos - p.shard_offset
                return max(p.shard_offset, pos - t % M_BLOCK)
        return pos  # padding: no tensor is cut

    def _item(self, g: Group, pieces: list[Piece], lo: int, hi: int, last: bool) -> _Item:
        calls, s_off = [], 0
        for p in pieces:
            nblk = piece_blocks(p) if self.m_e4m3 else 0
            a, b = max(p.shard_offset, lo), min(p.shard_offset + p.numel, hi)
            if a < b:
                cuts = [a, b]
                if self.m_e4m3:  # a piece starting mid-block: its first call ends at the block's end
                    nxt = a + (-(p.tensor_offset + a - p.shard_offset)) % M_BLOCK
                    if a < nxt < b:
                        cuts = [a, nxt, b]
                seg_index = g.segments.index(p.segment)
                for x, y in zip(cuts, cuts[1:]):
                    t = p.tensor_offset + x - p.shard_offset
                    s = s_off + t // M_BLOCK - p.tensor_offset // M_BLOCK if self.m_e4m3 else 0
                    ns = -(-(y - x) // M_BLOCK) if self.m_e4m3 else 0
                    calls.append(_Call(seg_index, p.segment.decay, x - lo, y - lo, t, s, s + ns))
            s_off += nblk
        s_lo, s_hi = (calls[0].s_lo, calls[-1].s_hi) if calls else (0, 0)
        return _Item(g, lo, hi, last, tuple(calls), s_lo, s_hi)

    def param_shard(self, key: str) -> torch.Tensor:
        return self.shards[key]

    @torch.no_grad()
    def grad_norm(self, grads: GradShards) -> torch.Tensor:
        """Global L2 norm of the gradient (fp32 device scalar): sum of squares of this rank's shards,
        summed over ranks. Padding is zero, so it does not count."""
        shards = [grads.grad_shard(g.key) for g in self.trained]
        sq = torch.stack([torch.linalg.vector_norm(s, dtype=torch.float32).to(self.device)
                          for s in shards]).pow(2).sum()
        if self.comm is not None and self.world > 1:
            self.comm.all_reduce(sq, op="sum").wait()
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
        gshards = {g.key: grads.grad_shard(g.key) for g in self.trained}
        stage_grads = any(s.device != self.device for s in gshards.values())
        capacity = self._capacity
        if stage_grads and capacity is None:
            capacity = self._chunk_capacity()
        if stage_grads and (self._staging is None or "grad" not in self._staging):
            self.grad_dtype = next(iter(gshards.values())).dtype
            if self._staging is None:
                self._staging = StagingRing({}, device=self.device)
            self._staging.add("grad", capacity, self.grad_dtype)
        sources = {"param": self.shards, "m": self.m, "v": self.v, "grad": gshards}
        if self.m_e4m3:
            sources["m_scales"] = self.m_scales
        staged = dict(self._staged, grad=stage_grads)
        items = self._items(capacity if any(staged.values()) else None)
        ring = self._staging

        def span(k: str, it: _Item) -> tuple[int, int]:  # what item `it` covers of source k
            return (it.s_lo, it.s_hi) if k == "m_scales" else (it.lo, it.hi)

        def part(k: str, it: _Item) -> torch.Tensor:  # item `it`'s part of host (or device) source k
            lo, hi = span(k, it)
            return sources[k][it.group.key][lo:hi]

        def fetch(i: int) -> None:  # host -> staging slot (host->device stream on CUDA)
            ring.fetch(i, {k: part(k, items[i]) for k in sources if staged[k]})

        streaming = any(staged.values())
        self.streamed_items = len(items) if streaming else 0
        if streaming:
            ring.begin()  # after the gradients / gathers queued so far
            if items:
                fetch(0)
        amaxes = []
        update = adamw_update_ if self.stochastic_rounding else _adamw_update_nearest_
        for i, it in enumerate(items):
            ops = {k: part(k, it) for k in sources}  # host parts are replaced by their staged copies
            if streaming:
                if i + 1 < len(items):
                    fetch(i + 1)  # overlaps item i's update and item i-1's copy-back
                slot = ring.acquire(i)
                ops.update({k: slot[k][:ops[k].numel()] for k in sources if staged[k]})
            g = it.group
            for c in it.calls:
                sl = slice(c.a, c.b)
                kw = {"m_scales": ops["m_scales"][c.s_lo - it.s_lo:c.s_hi - it.s_lo]} if self.m_e4m3 else {}
                amaxes.append(update(ops["param"][sl], ops["grad"][sl], ops["m"][sl], ops["v"][sl], hp=hp,
                                     decay=c.decay, key=rng_key(self.seed, t, g.index, c.seg_index),
                                     offset=c.offset, **kw))
            if streaming:  # staging slot -> host, after the update (device->host stream on CUDA)
                ring.write_back(i, {k: part(k, it) for k in ("param", "m", "v", "m_scales") if staged.get(k)})
            if it.last_of_group and self.replicated and self.comm is not None and self.world > 1:
                comm = self.comm if self.experts is None else self.experts.comm_of(g, self.comm)
                comm.all_gather(self.params[g.key], self.shards[g.key]).wait()
        if streaming:
            ring.end()  # later compute (gathers) sees the results
        self.step_count = t
        return torch.stack([a.to(self.device) for a in amaxes]).max() if amaxes else torch.zeros(())

    def unstep(self) -> None:
        """The last step was skipped on the device (NaN grad_scale): do not count it in the bias correction."""
        self.step_count -= 1

    def synchronize(self) -> None:
        """Block the host until the last step's copies to host memory are done (before reading the state)."""
        if self._staging is not None:
            self._staging.synchronize()

    # ---- checkpoints: this rank's shards ----
    def state_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """This rank's moments by group key (views, not copies). An e4m3 m also has its scales in
        `adam.m`, under `<group>.scales` (codes and scales are one state: one is meaningless without the
        other)."""
        self.synchronize()
        m = dict(self.m)
        m.update({k + SCALES_SUFFIX: s for k, s in self.m_scales.items()})
        return {"adam.m": m, "adam.v": dict(self.v)}

    def load_state_tensors(self, state: dict[str, dict[str, torch.Tensor]], step_count: int) -> None:
        self.synchronize()
        scales = {k + SCALES_SUFFIX: s for k, s in self.m_scales.items()}
        extra = set(state["adam.m"]) - set(self.m) - set(scales)
        if extra:
            raise ValueError(f"checkpoint adam.m has unexpected tensors {sorted(extra)[:4]} (e4m3 scales in a "
                             f"checkpoint for m {next(iter(self.m.values())).dtype}?)")
        for name, bufs in (("adam.m", self.m), ("adam.m", scales), ("adam.v", self.v)):
            for k, t in bufs.items():
                if k not in state[name]:
                    raise ValueError(f"checkpoint {name} has no {k!r}" + (
                        " (this run keeps m in e4m3 with block scales: was the checkpoint written with another "
                        "--opt-m-dtype?)" if k.endswith(SCALES_SUFFIX) else ""))
                src = state[name][k]
                if src.shape != t.shape:
                    raise ValueError(f"checkpoint {name}[{k}]: shape {tuple(src.shape)} != {tuple(t.shape)} "
                                     f"(was it written with another world size?)")
                if (src.dtype == torch.float8_e4m3fn) != (t.dtype == torch.float8_e4m3fn):
                    raise ValueError(f"checkpoint {name}[{k}]: dtype {src.dtype}, this run keeps {t.dtype} "
                                     f"(--opt-m-dtype differs)")
                t.copy_(src)
        self.step_count = step_count

    # ---- memory ----
    @classmethod
    def footprint_of(cls, layout: FlatLayout, *, param_dtype: torch.dtype, m_dtype: str = "fp32",
                     v_dtype: str = "fp32", offload_params: bool = False, offload_m: bool = False,
                     offload_v: bool = False, zero_copy: bool = False, grad_dtype: torch.dtype | None = None,
                     capacity: int | None = None) -> Footprint:
        """Bytes of persistent optimizer state per rank, without allocating it: 'adam.m' (codes, and an e4m3
        m's scales: per group the most any rank needs), 'adam.v' (host with offload_m / offload_v) and
        'staging', the device slots offloaded state streams through (`grad_dtype`: host gradient shards are
        staged too; `capacity`: slot elements, default `staging_capacity`). The weight shards belong to the
        weights, not here. Frozen groups have none."""
        world = layout.world
        numel = sum(g.shard_size(world) for g in layout.trainable_groups())
        m = numel * DTYPES[m_dtype].itemsize
        if m_dtype == "e4m3":
            m += 4 * sum(group_m_scales(g, world) for g in layout.trainable_groups())
        staged = {k: off and not zero_copy for k, off in (("param", offload_params), ("m", offload_m),
                                                          ("v", offload_v))}
        if m_dtype == "e4m3":
            staged["m_scales"] = staged["m"]
        capacity = capacity or staging_capacity(layout, m_dtype)
        sizes = _slot_sizes(layout, capacity, cls._staged_dtypes(staged, param_dtype, m_dtype, v_dtype, grad_dtype))
        parts = {"adam.m": m, "adam.v": numel * DTYPES[v_dtype].itemsize,
                 "staging": StagingRing.bytes(sizes) if sizes else 0}
        return Footprint(parts, frozenset(k for k, off in (("adam.m", offload_m), ("adam.v", offload_v)) if off))

    def footprint(self) -> Footprint:
        return self.footprint_of(self.layout, param_dtype=self.param_dtype, m_dtype=self.m_dtype,
                                 v_dtype=self.v_dtype, offload_params=self.offloaded["param"],
                                 offload_m=self.offloaded["m"], offload_v=self.offloaded["v"],
                                 zero_copy=self.zero_copy, grad_dtype=self.grad_dtype,
                                 capacity=self._chunk_capacity())

    def state_nbytes(self) -> int:
        """Adam moments of this rank (device and host; e4m3 m with its scales), in bytes."""
        mem = self.memory()
        return mem["adam.m"] + mem["adam.v"]

    def memory(self) -> dict[str, int]:
        """Bytes of persistent optimizer state on this rank, by kind (`footprint_of`)."""
        return dict(self.footprint().parts)

    def host_memory_keys(self) -> set[str]:
        return set(self.footprint().host_keys)


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
