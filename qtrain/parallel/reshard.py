"""Resharding: the per-rank shards of a group written by N ranks -> one rank's shard for M ranks.

Why it is exact for weights and fp32/bf16 moments: a group's content (its tensors back to back) sits at the
same offsets in the flat buffer whatever the world size (`layout.py`); only the zero padding at the end (to a
multiple of W * ALIGN elements) depends on W. So rank r of M holds elements [r*S', (r+1)*S') of the content
(zeros past its end), and those are read from the old shards that overlap them, bit for bit.

e4m3 m is codes plus one fp32 scale per *block*: a 128-element run of a tensor intersected with a shard
(`optimizer.py`). A block whose extent is the same in both layouts (no shard boundary of either world size cuts
its tensor block) keeps its codes and its scale bit for bit. A block whose extent changes (cut by an old or a
new boundary: it is part of an old block, or joins parts of several) is dequantized to fp32 exactly
(`code * scale`, as the update reads it) and requantized once with the update's scale rule (the block's
abs-max maps to 448) and round-to-nearest-even: each element then differs from the value saved by at most
half an e4m3 step at the new scale, i.e. |dm| <= 2^-4 |m| where |m| * 448 / amax >= 2^-6 (e4m3 normals),
and |dm| <= 2^-10 * amax / 448 below (subnormals) -- `e4m3_requant_bound`.
Stochastic rounding is not used here: it is keyed by (step, tensor, element), and requantizing is no step.

Experts (`--expert-parallel`, parallel/experts.py): an expert group of an ep-way layout holds, on expert rank e, experts
[e E/ep, (e+1) E/ep) of each stack (a contiguous run of the whole stack), sharded over the world / ep ranks d ep + e.
Resharding goes through the whole tensors: an element of the new shard is (tensor, offset in the whole stack), which
names the old expert rank (offset // its run), the place in that rank's buffer and so the old shard and rank holding
it (`_runs`). Another --expert-parallel, another world, or both, are thus exact too; a dense group is the case
ep = 1 on both sides. For an e4m3 m a block is "unchanged" when the new block holds exactly the elements of one old
block (the same extent in the whole tensor); those keep codes and scale, the others are requantized as above.
"""
from __future__ import annotations

from typing import Callable

import torch

from qtrain.kernels.adamw import E4M3_MAX, M_BLOCK
from qtrain.parallel.layout import FlatLayout, Group
from qtrain.parallel.optimizer import SCALES_SUFFIX, group_m_scales, piece_blocks

ShardReader = Callable[[int], torch.Tensor]  # old rank -> its shard of one group (read on demand)
_TINY = 2.0 ** -100  # the update's floor for a block abs-max (kernels/adamw.py _TINY_BITS)


def content_numel(group: Group) -> int:
    """Elements of a group's tensors (its buffer before the padding that depends on the world size)."""
    return group.content_numel


Run = tuple[int, int, int, int]  # (offset in the new shard, old rank, offset in its shard, elements)


def _runs(src: FlatLayout, dst: FlatLayout, key: str, rank: int) -> list[Run]:
    """Where the content of rank `rank`'s shard of group `key` in layout `dst` lies in the shards of layout `src`:
    runs in new-shard order (module docstring: through the offsets in the whole tensors, so that an expert group may
    be split over another number of expert-parallel ranks)."""
    g_new, g_old = dst.by_key[key], src.by_key[key]
    lo, hi = g_new.shard_range(rank, dst.world)
    e_new, size_old = rank % g_new.ep, g_old.shard_size(src.world)
    old_seg = {s.name: s for s in g_old.segments}
    out: list[Run] = []
    for p in g_new.pieces(lo, hi):
        s_old = old_seg[p.segment.name]
        span = s_old.numel  # the part of the whole tensor that one old expert rank holds (all of it: no experts)
        t, o = e_new * p.segment.numel + p.tensor_offset, p.shard_offset  # offset in the whole tensor
        t_end = t + p.numel
        while t < t_end:
            e_old = t // span
            stop = min(t_end, (e_old + 1) * span)
            pos, end = s_old.start + t - e_old * span, s_old.start + stop - e_old * span
            while pos < end:
                d = pos // size_old
                b = min(end, (d + 1) * size_old)
                out.append((o, d * g_old.ep + e_old, pos - d * size_old, b - pos))
                o, pos = o + b - pos, b
            t = stop
    return out


def _gather(src: FlatLayout, dst: FlatLayout, key: str, rank: int, read: ShardReader, dtype: torch.dtype,
            fill: Callable[[int, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Rank `rank`'s shard of group `key` in layout `dst`, assembled from the shards of layout `src` (zeros past
    the content). `fill(q, shard)` maps old rank q's shard to the values wanted (default: the shard itself)."""
    g_new, g_old = dst.by_key[key], src.by_key[key]
    out = torch.zeros(g_new.shard_size(dst.world), dtype=dtype)
    size, vals = g_old.shard_size(src.world), {}
    for o, q, a, n in _runs(src, dst, key, rank):
        if q not in vals:
            shard = read(q)
            if shard.numel() != size:
                raise ValueError(f"shard {q} of {key} has {shard.numel()} elements, a world of {src.world} gives it "
                                 f"{size}")
            vals[q] = fill(q, shard) if fill is not None else shard
        out[o:o + n] = vals[q][a:a + n]
    return out


def reshard_flat(src: FlatLayout, dst: FlatLayout, key: str, rank: int, read: ShardReader,
                 dtype: torch.dtype) -> torch.Tensor:
    """Rank `rank`'s shard in layout `dst` of a plain group (weights, fp32/bf16 moment) whose shards in
    layout `src` `read` returns: exact."""
    return _gather(src, dst, key, rank, read, dtype)


def scale_index(group: Group, rank: int, world: int) -> torch.Tensor:
    """For each element of rank `rank`'s shard (`group` of a `world`-rank layout), the index of its e4m3 m
    scale (-1 in the padding): the numbering `ShardedAdamW` uses (a piece's blocks in order, pieces in shard
    order)."""
    idx = torch.full((group.shard_size(world),), -1, dtype=torch.int64)
    s_off = 0
    for p in group.shard_pieces(rank, world):
        t = torch.arange(p.tensor_offset, p.tensor_offset + p.numel)
        idx[p.shard_offset:p.shard_offset + p.numel] = s_off + t // M_BLOCK - p.tensor_offset // M_BLOCK
        s_off += piece_blocks(p)
    return idx


def block_extent(group: Group, pos: torch.Tensor, shard: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, end) in the group buffer of the e4m3 block holding each content position `pos`, for shards of
    `shard` elements: the element's 128-run of its tensor intersected with its shard."""
    starts = torch.tensor([s.start for s in group.segments])
    ends = torch.tensor([s.start + s.numel for s in group.segments])
    seg = torch.searchsorted(starts, pos, right=True) - 1
    t0 = starts[seg] + (pos - starts[seg]) // M_BLOCK * M_BLOCK
    s0 = pos // shard * shard
    return torch.maximum(t0, s0), torch.minimum(torch.minimum(t0 + M_BLOCK, ends[seg]), s0 + shard)


def reshard_e4m3_m(src: FlatLayout, dst: FlatLayout, key: str, rank: int, read_codes: ShardReader,
                   read_scales: ShardReader) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s (codes, scales) in layout `dst` of an e4m3 m group (module docstring: blocks that hold the same
    elements in both layouts are copied, the others dequantized and requantized)."""
    g_old, g = src.by_key[key], dst.by_key[key]
    lo, hi = g.shard_range(rank, dst.world)
    out_scales = torch.zeros(group_m_scales(g, dst.world), dtype=torch.float32)
    codes_u8 = _gather(src, dst, key, rank, lambda q: read_codes(q).view(torch.uint8), torch.uint8)
    n = min(hi, content_numel(g)) - lo
    if n <= 0:
        return codes_u8.view(torch.float8_e4m3fn), out_scales
    old_idx: dict[int, torch.Tensor] = {}

    def index_of(q: int) -> torch.Tensor:
        if q not in old_idx:
            old_idx[q] = scale_index(g_old, q, src.world)
        return old_idx[q]

    def old_scale(q: int, _: torch.Tensor) -> torch.Tensor:
        idx, scales = index_of(q), read_scales(q)
        return torch.where(idx >= 0, scales[idx.clamp_min(0)], torch.zeros((), dtype=torch.float32))

    def old_block(q: int, _: torch.Tensor) -> torch.Tensor:  # a number for each old block, unique over the ranks
        return torch.where(index_of(q) >= 0, q * (g_old.shard_size(src.world) + 1) + index_of(q), -1)

    def old_block_size(q: int, _: torch.Tensor) -> torch.Tensor:
        idx = index_of(q)
        sizes = torch.bincount(idx[idx >= 0], minlength=1)
        return torch.where(idx >= 0, sizes[idx.clamp_min(0)], 0)

    scale_old = _gather(src, dst, key, rank, read_codes, torch.float32, fill=old_scale)[:n]
    block_old = _gather(src, dst, key, rank, read_codes, torch.int64, fill=old_block)[:n]
    size_old = _gather(src, dst, key, rank, read_codes, torch.int64, fill=old_block_size)[:n]
    codes_old = codes_u8[:n]
    x = codes_old.view(torch.float8_e4m3fn).float() * scale_old  # the update's read of m
    idx = scale_index(g, rank, dst.world)[:n]
    nb = out_scales.numel()
    first = torch.full((nb,), -1, dtype=torch.int64).scatter_reduce(0, idx, block_old, "amin", include_self=False)
    last = torch.full((nb,), -1, dtype=torch.int64).scatter_reduce(0, idx, block_old, "amax", include_self=False)
    size_new = torch.bincount(idx, minlength=nb)
    same = (first[idx] == last[idx]) & (size_new[idx] == size_old)  # the new block is one whole old block
    amax = torch.zeros_like(out_scales).scatter_reduce(0, idx, x.abs(), "amax").clamp_min(_TINY)
    requant = (x * (E4M3_MAX / amax)[idx]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    out_scales.copy_(amax / E4M3_MAX)
    out_scales[idx[same]] = scale_old[same]  # unchanged blocks: their own scale
    used = torch.zeros_like(out_scales, dtype=torch.bool)
    used[idx] = True
    out_scales[~used] = 0  # scales no element uses stay zero, as the optimizer allocates them
    codes_u8[:n] = torch.where(same, codes_old, requant)
    return codes_u8.view(torch.float8_e4m3fn), out_scales


def e4m3_requant_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The most a requantized element may differ from its value `x`, given its new block `scale`
    (= amax / 448): half an e4m3 step, 2^-4 of |x| for normals, 2^-10 * scale for subnormals."""
    return torch.maximum(x.abs() * 2.0 ** -4, scale * 2.0 ** -10)


StateReader = Callable[[str, int, str], torch.Tensor]  # (file kind, old rank, group key) -> that old shard


def reshard_state(src: FlatLayout, dst: FlatLayout, rank: int, kinds: tuple[str, ...],
                  read: StateReader) -> dict[str, dict[str, torch.Tensor]]:
    """Rank `rank`'s state in layout `dst` (kind -> group key -> shard, the form of `Trainer.state_tensors`)
    from the shards of layout `src` that `read` returns. A kind whose shards are float8_e4m3fn is an e4m3 m:
    its scales are read and written under `<group>.scales`. Each old shard is read at most once per key."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for kind in kinds:
        out[kind] = {}
        for g in dst.trainable_groups():  # frozen groups have no state (nor weights in checkpoints)
            cache: dict[tuple[int, str], torch.Tensor] = {}

            def one(q: int, key: str, kind: str = kind, cache: dict = cache) -> torch.Tensor:
                if (q, key) not in cache:
                    cache[q, key] = read(kind, q, key)
                return cache[q, key]

            dtype = one(0, g.key).dtype
            if dtype == torch.float8_e4m3fn:
                scales_key = g.key + SCALES_SUFFIX
                out[kind][g.key], out[kind][scales_key] = reshard_e4m3_m(
                    src, dst, g.key, rank, lambda q: one(q, g.key), lambda q: one(q, scales_key))
            else:
                out[kind][g.key] = reshard_flat(src, dst, g.key, rank, lambda q: one(q, g.key), dtype)
    return out
