"""Resharding group shards from N ranks to M (qtrain/parallel/reshard.py), without processes.

* weights and fp32/bf16 moments: the M shards, concatenated, are the group buffer of an M-rank layout (same
  content, zero padding), bit for bit, for 2->1, 1->2, 2->4, 4->2 and 3->2 (shards that cut tensors);
* e4m3 m (codes + block scales) made by real `ShardedAdamW` updates on simulated ranks: N -> N is the
  identity; blocks whose extent is unchanged keep codes and scale bit for bit; every other element is within
  half an e4m3 step (at its new block's scale) of the value saved, the new scales follow the update's rule
  (block abs-max / 448), and both kinds of block occur (so each check can fail); the result loads into an
  M-rank `ShardedAdamW` and steps.
"""
from __future__ import annotations

import pytest
import torch

from qtrain.kernels.adamw import E4M3_MAX
from qtrain.parallel.layout import FlatLayout
from qtrain.parallel.optimizer import SCALES_SUFFIX, ShardedAdamW
from qtrain.parallel.reshard import (block_extent, content_numel, e4m3_requant_bound, reshard_e4m3_m, reshard_flat,
                                     scale_index)
from tests.parallel.test_optimizer_e4m3 import CFG, HP, SEED, Grads, full_buffers, grads_of, shards_of

CPU = torch.device("cpu")
PAIRS = [(2, 1), (1, 2), (2, 4), (4, 2), (3, 2)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("old,new", PAIRS, ids=lambda x: str(x))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_flat_reshard_is_exact(old, new, dtype):
    src, dst = FlatLayout(CFG, old), FlatLayout(CFG, new)
    full_old = {k: t.to(dtype) for k, t in full_buffers(src, SEED, 0.05).items()}
    full_new = {k: t.to(dtype) for k, t in full_buffers(dst, SEED, 0.05).items()}
    shards = [shards_of(src, full_old, q) for q in range(old)]
    for g in dst.groups:
        got = torch.cat([reshard_flat(src, dst, g.key, r, lambda q: shards[q][g.key], dtype) for r in range(new)])
        assert got.dtype == dtype and torch.equal(_bits(got), _bits(full_new[g.key])), g.key


def _e4m3_states(world: int, steps: int = 2) -> list[ShardedAdamW]:
    """`world` simulated ranks of an e4m3-m optimizer after `steps` real updates (the same global gradients)."""
    layout = FlatLayout(CFG, world)
    params = full_buffers(layout, SEED, 0.05)
    opts = [ShardedAdamW(layout, shards=shards_of(layout, params, r), rank=r, device=CPU, m_dtype="e4m3",
                         v_dtype="bf16", seed=SEED) for r in range(world)]
    for s in range(steps):
        g = grads_of(layout, s)
        for r, o in enumerate(opts):
            o.step(Grads(layout, g, r), grad_scale=0.7, **HP)
    return opts


def _dequant(layout: FlatLayout, key: str, codes: torch.Tensor, scales: torch.Tensor, rank: int) -> torch.Tensor:
    idx = scale_index(layout.by_key[key], rank, layout.world)
    return torch.where(idx >= 0, codes.float() * scales[idx.clamp_min(0)], torch.zeros(()))


@pytest.mark.parametrize("old,new", [(2, 1), (1, 2), (2, 4), (4, 2), (3, 2), (2, 2)], ids=lambda x: str(x))
def test_e4m3_m_reshard_keeps_unchanged_blocks_and_bounds_the_rest(old, new):
    src, dst = FlatLayout(CFG, old), FlatLayout(CFG, new)
    opts = _e4m3_states(old)
    counts = {"same": 0, "requantized": 0}
    for g in dst.groups:
        n = content_numel(g)
        full_old = torch.cat([_dequant(src, g.key, o.m[g.key], o.m_scales[g.key], q) for q, o in enumerate(opts)])[:n]
        codes_old = torch.cat([o.m[g.key].view(torch.uint8) for o in opts])[:n]
        new_codes, new_vals, new_scale_of = [], [], []
        for r in range(new):
            codes, scales = reshard_e4m3_m(src, dst, g.key, r, lambda q: opts[q].m[g.key], lambda q: opts[q].m_scales[g.key])
            ref = ShardedAdamW(dst, shards=dst.allocate(dtype=torch.bfloat16, device=CPU, shard=True), rank=r,
                               m_dtype="e4m3", v_dtype="bf16")
            assert codes.dtype == torch.float8_e4m3fn and codes.shape == ref.m[g.key].shape
            assert scales.shape == ref.m_scales[g.key].shape
            idx = scale_index(g, r, new)
            used = idx[idx >= 0]
            assert not scales[int(used.max()) + 1 if used.numel() else 0:].any(), "unused tail scales are zero"
            new_codes.append(codes.view(torch.uint8))
            new_vals.append(_dequant(dst, g.key, codes, scales, r))
            new_scale_of.append(torch.where(idx >= 0, scales[idx.clamp_min(0)], torch.zeros(())))
        codes_new, vals, scale_new = (torch.cat(x)[:n] for x in (new_codes, new_vals, new_scale_of))
        assert not torch.cat(new_codes)[n:].any(), "padding codes are zero"
        pos = torch.arange(n)
        g_old = src.by_key[g.key]
        ext_old = torch.stack(block_extent(g_old, pos, g_old.shard_size(old)))
        ext_new = torch.stack(block_extent(g, pos, g.shard_size(new)))
        same = (ext_old == ext_new).all(dim=0)
        counts["same"] += int(same.sum())
        counts["requantized"] += int((~same).sum())
        # unchanged blocks: the codes and the values (code * own scale) bit for bit
        assert torch.equal(codes_new[same], codes_old[same]), g.key
        assert torch.equal(_bits(vals[same]), _bits(full_old[same])), g.key
        # changed blocks: within half an e4m3 step of the saved value, scale = block abs-max / 448
        err = (vals[~same] - full_old[~same]).abs()
        assert (err <= e4m3_requant_bound(full_old[~same], scale_new[~same]) * (1 + 2 ** -20)).all(), g.key
        for a in ext_new[0][~same].unique():
            blk = (ext_new[0] == a) & ~same
            amax = full_old[blk].abs().max().clamp_min(2.0 ** -100)
            assert scale_new[blk][0] == amax / E4M3_MAX, (g.key, int(a))
    if old == new:
        assert counts["requantized"] == 0
    else:
        assert counts["same"] > 0 and counts["requantized"] > 0, counts


def test_resharded_e4m3_state_loads_and_steps():
    """2 -> 1: the state loads into a 1-rank optimizer (shapes, dtypes, scales key) and the next update runs."""
    old = _e4m3_states(2)
    src, dst = FlatLayout(CFG, 2), FlatLayout(CFG, 1)
    m, v = {}, {}
    for g in dst.groups:
        m[g.key], m[g.key + SCALES_SUFFIX] = reshard_e4m3_m(src, dst, g.key, 0, lambda q: old[q].m[g.key],
                                                            lambda q: old[q].m_scales[g.key])
        v[g.key] = reshard_flat(src, dst, g.key, 0, lambda q: old[q].v[g.key], torch.bfloat16)
    params = {g.key: reshard_flat(src, dst, g.key, 0, lambda q: old[q].shards[g.key], torch.bfloat16) for g in dst.groups}
    opt = ShardedAdamW(dst, shards=params, device=CPU, m_dtype="e4m3", v_dtype="bf16", seed=SEED)
    opt.load_state_tensors({"adam.m": m, "adam.v": v}, 2)
    before = {k: t.clone() for k, t in params.items()}
    opt.step(Grads(dst, grads_of(dst, 2), 0), grad_scale=0.7, **HP)
    assert opt.step_count == 3 and all(not torch.equal(before[k], params[k]) for k in params)
