"""Resharding expert groups (qtrain/parallel/reshard.py) from (world, --expert-parallel) to another, without processes:
an MoE model's whole tensors are cut into each layout's shards directly (expert rank e = r % ep holds experts
[e E/ep, (e+1) E/ep) of every stack, shard r // ep of them) and the resharded shards must equal those of the new
layout bit for bit (weights, fp32/bf16 moments); an e4m3 m keeps every block that holds the same elements in both
layouts bit for bit and requantizes the rest within half an e4m3 step (the dense rule, test_reshard.py)."""
from __future__ import annotations

import pytest
import torch

from qtrain.kernels.adamw import E4M3_MAX
from qtrain.parallel.layout import FlatLayout
from qtrain.parallel.optimizer import group_m_scales
from qtrain.parallel.reshard import e4m3_requant_bound, reshard_e4m3_m, reshard_flat, scale_index
from tests.parallel.test_moe_layout import CFG

# (world, ep) -> (world, ep): EP to one process, one process to EP, another ep on the same world, another world
PAIRS = [((2, 2), (1, 1)), ((1, 1), (2, 2)), ((2, 2), (2, 1)), ((2, 1), (2, 2)), ((2, 2), (4, 2)), ((4, 4), (2, 2)),
         ((4, 2), (4, 4)), ((4, 4), (1, 1)), ((2, 2), (4, 4))]


def whole_tensors(seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of the model whole (all experts), flat fp32."""
    gen = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.numel, generator=gen) for g in FlatLayout(CFG, 1).groups for s in g.segments}


def shard(layout: FlatLayout, whole: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s shard of every group, cut directly from the whole tensors."""
    out = {}
    for g in layout.groups:
        buf, e = torch.zeros(g.padded_numel, dtype=next(iter(whole.values())).dtype), rank % g.ep
        for s in g.segments:  # an expert rank's stacks: a contiguous run of the whole stack
            buf[s.start:s.start + s.numel] = whole[s.name][e * s.numel:(e + 1) * s.numel]
        lo, hi = g.shard_range(rank, layout.world)
        out[g.key] = buf[lo:hi].clone()
    return out


def whole_of(layout: FlatLayout, shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The inverse of `shard`: the whole tensors from every rank's shards."""
    out = {}
    for g in layout.groups:
        bufs: dict[int, torch.Tensor] = {}
        for r, sh in enumerate(shards):
            lo, hi = g.shard_range(r, layout.world)
            bufs.setdefault(r % g.ep, torch.zeros(g.padded_numel, dtype=sh[g.key].dtype))[lo:hi] = sh[g.key]
        for s in g.segments:
            out[s.name] = torch.cat([bufs[e][s.start:s.start + s.numel] for e in range(g.ep)])
    return out


def _layouts(old, new) -> tuple[FlatLayout, FlatLayout]:
    return FlatLayout(CFG, old[0], expert_parallel=old[1]), FlatLayout(CFG, new[0], expert_parallel=new[1])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("old,new", PAIRS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_expert_reshard_is_exact(old, new, dtype):
    src, dst = _layouts(old, new)
    assert any(g.ep > 1 for g in (src if old[1] > 1 else dst).groups)
    whole = {k: t.to(dtype) for k, t in whole_tensors(3).items()}
    shards = [shard(src, whole, q) for q in range(src.world)]
    for r in range(dst.world):
        want = shard(dst, whole, r)
        for g in dst.groups:
            got = reshard_flat(src, dst, g.key, r, lambda q: shards[q][g.key], dtype)
            assert got.dtype == dtype and torch.equal(_bits(got), _bits(want[g.key])), (r, g.key)


def quantize(layout: FlatLayout, vals: dict[str, torch.Tensor], rank: int) -> tuple[dict, dict]:
    """An e4m3 m of rank `rank` for fp32 shard values `vals`, by the update's rule (block abs-max -> 448)."""
    codes, scales = {}, {}
    for g in layout.groups:
        idx, x = scale_index(g, rank, layout.world), vals[g.key]
        nb = group_m_scales(g, layout.world)
        used = idx >= 0
        amax = torch.zeros(nb).scatter_reduce(0, idx[used], x[used].abs(), "amax").clamp_min(2.0 ** -100)
        c = torch.where(used, x * (E4M3_MAX / amax)[idx.clamp_min(0)], torch.zeros(()))
        codes[g.key], scales[g.key] = c.to(torch.float8_e4m3fn), amax / E4M3_MAX * torch.bincount(idx[used],
                                                                                              minlength=nb).clamp_max(1)
    return codes, scales


def _dequant(layout: FlatLayout, key: str, codes: torch.Tensor, scales: torch.Tensor, rank: int) -> torch.Tensor:
    idx = scale_index(layout.by_key[key], rank, layout.world)
    return torch.where(idx >= 0, codes.float() * scales[idx.clamp_min(0)], torch.zeros(()))


@pytest.mark.parametrize("old,new", PAIRS + [((2, 2), (2, 2))], ids=str)
def test_expert_e4m3_m_reshard_keeps_whole_blocks_and_bounds_the_rest(old, new):
    src, dst = _layouts(old, new)
    whole = whole_tensors(4)
    whole[next(iter(whole))][::37] *= 50  # block maxima that vary
    saved = [quantize(src, shard(src, whole, q), q) for q in range(src.world)]
    deq_old = whole_of(src, [{k: _dequant(src, k, c[k], s[k], q) for k in c} for q, (c, s) in enumerate(saved)])
    codes_old = whole_of(src, [{k: c[k].view(torch.uint8) for k in c} for c, _ in saved])
    out = [{g.key: reshard_e4m3_m(src, dst, g.key, r, lambda q: saved[q][0][g.key], lambda q: saved[q][1][g.key])
            for g in dst.groups} for r in range(dst.world)]
    deq_new = whole_of(dst, [{k: _dequant(dst, k, c, s, r) for k, (c, s) in o.items()} for r, o in enumerate(out)])
    codes_new = whole_of(dst, [{k: c.view(torch.uint8) for k, (c, _) in o.items()} for o in out])
    scale_new = whole_of(dst, [{k: torch.where(scale_index(dst.by_key[k], r, dst.world) >= 0,
                                                s[scale_index(dst.by_key[k], r, dst.world).clamp_min(0)], 0.0)
                                for k, (_, s) in o.items()} for r, o in enumerate(out)])
    same = changed = 0
    for name in deq_old:
        kept = torch.equal(codes_new[name], codes_old[name]) and torch.equal(_bits(deq_new[name]), _bits(deq_old[name]))
        err = (deq_new[name] - deq_old[name]).abs()
        assert (err <= e4m3_requant_bound(deq_old[name], scale_new[name]) * (1 + 2 ** -20)).all(), name
        eq = _bits(deq_new[name]) == _bits(deq_old[name])
        same, changed = same + int(eq.sum()), changed + int((~eq).sum())
        if old == new:
            assert kept, name
    assert same > 0
    if old[0] != new[0]:  # other shard boundaries: some blocks are requantized (so the bound above is tested)
        assert changed > 0
    elif old != new and {old[1], new[1]} == {2, 4}:  # expert ranks regrouped whole: every block kept
        assert changed == 0
