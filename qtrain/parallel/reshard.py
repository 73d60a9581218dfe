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


def _gather(src: FlatLayout, key: str, lo: int, hi: int, read: ShardReader, dtype: torch.dtype,
            fill: Callable[[int, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Elements [lo, hi) of group `key`'s buffer, assembled from the shards of layout `src` (zeros past the
    content). `fill(q, shard)` maps old rank q's shard to the values wanted (default: the shard itself)."""
    g = src.by_key[key]
    out = torch.zeros(hi - lo, dtype=dtype)
    size, end = g.shard_size(src.world), min(hi, content_numel(g))
    for q in range(lo // size, -(-end // size)) if lo < end else ():
        shard = read(q)
        if shard.numel() != size:
            raise ValueError(f"shard {q} of {key} has {shard.numel()} elements, a world of {src.world} gives it {size}")
        vals = fill(q, shard) if fill is not None else shard
        a, b = max(lo, q * size), min(end, (q + 1) * size)
        out[a - lo:b - lo] = vals[a - q * size:b - q * size]
    return out


def reshard_flat(src: FlatLayout, dst: FlatLayout, key: str, rank: int, read: ShardReader,
                 dtype: torch.dtype) -> torch.Tensor:
    """Rank `rank`'s shard in layout `dst` of a plain group (weights, fp32/bf16 moment) whose shards in
    layout `src` `read` returns: exact."""
    lo, hi = dst.by_key[key].shard_range(rank, dst.world)
    return _gather(src, key, lo, hi, read, dtype)


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
    """Rank `rank`'s (codes, scales) in layout `dst` of an e4m3 m group (module docstring: blocks whose extent
    is unchanged are copied, the others dequantized and requantized)."""
    g_old, g = src.by_key[key], dst.by_key[key]
    lo, hi = g.shard_range(rank, dst.world)
    out_scales = torch.zeros(group_m_scales(g, dst.world), dtype=torch.float32)
    codes_u8 = _gather(src, key, lo, hi, lambda q: read_codes(q).view(torch.uint8), torch.uint8)
    n = min(hi, content_numel(g)) - lo
    if n <= 0:
        return codes_u8.view(torch.float8_e4m3fn), out_scales

    def old_scale(q: int, _: torch.Tensor) -> torch.Tensor:
        idx, scales = scale_index(g_old, q, src.world), read_scales(q)
        return torch.where(idx >= 0, scales[idx.clamp_min(0)], torch.zeros((), dtype=torch.float32))

    scale_old = _gather(src, key, lo, hi, read_codes, torch.float32, fill=old_scale)[:n]
    codes_old = codes_u8[:n]
    x = codes_old.view(torch.float8_e4m3fn).float() * scale_old  # the update's read of m
    pos = torch.arange(lo, lo + n)
    a_old, b_old = block_extent(g_old, pos, g_old.shard_size(src.world))
    a_new, b_new = block_extent(g, pos, g.shard_size(dst.world))
    same = (a_old == a_new) & (b_old == b_new)
    idx = scale_index(g, rank, dst.world)[:n]
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
