"""Kind `cross-entropy`: the fused cross-entropy kernels (kernels/cross_entropy.py) by launch shape.

The two-pass kernel reads each row twice (pass 1: log-sum-exp; pass 2: d(logits), written over the row), so a
row's second read comes from HBM unless it is still in L2 (50 MB on the H200): with one program per row, ~1000
rows of 304 KB (Qwen2's 151,936-entry vocabulary in bf16) are in flight. Bounding the programs (each looping over
rows) so that they fit in L2 was measured slower twice and removed: 2026-12-02, 8.1 ms at one program per row
against 8.9-24.8 ms at 1056 down to 132 programs; 2026-12-03 (session 20), with the loads of the next block issued
before the current one is folded, L2 eviction hints, 1 or 2 programs per SM, blocks of 8192-32768 and 8-32 warps:
9.9-23.4 ms against the default's 8.0 (BENCHMARKS.md). llm.q reads each row once (a cluster of 8 blocks holds it
in shared memory). The one-read kernel (session 21) splits the row over programs that hold their parts in
registers and exchange (max, sum-exp) through memory: variants vary its part size (`chunks`) and warps.

GB/s counts one read and one write per element (the floor). Each variant's output is set against the two-pass
default launch's: `same bits`, else the largest difference in bf16 ulps (another block or part size sums the
row in another order).

Parameters: rows (32768), vocab (151936), blocks, warps (two-pass), chunks, split_warps (one-read), samples (10).
Result: `rows` (kernel, shape, ms, GB/s per variant), `best`, `default` (the launch training uses).
"""
from __future__ import annotations

import itertools

import torch

from bench.kinds import Skip
from bench.timing import time_ms
from qtrain.kernels import cross_entropy as ce


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    ia, ib = (t.view(torch.int16).to(torch.int32) for t in (a, b))
    ia, ib = (torch.where(i < 0, -(i & 0x7FFF), i) for i in (ia, ib))  # sign-magnitude -> monotone
    return int((ia - ib).abs().max())


def run(rows: int = 32768, vocab: int = 151936, blocks: tuple[int, ...] = (4096, 8192),
        warps: tuple[int, ...] = (8, 16), chunks: tuple[int, ...] = (8192, 16384, 32768),
        split_warps: tuple[int, ...] = (4, 8, 16), samples: int = 10) -> dict:
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    x = (torch.randn(rows, vocab, device=dev, generator=g) * 2).to(torch.bfloat16)
    t = torch.randint(0, vocab, (rows,), device=dev, generator=g)
    check = x[:2048].clone()
    ref = ce._launch(check.clone(), t[:2048], z_loss=1e-4, need_grad=True, block=ce.BLOCK_V,
                     num_warps=ce.NUM_WARPS)
    floor_gb = 2 * x.numel() * x.element_size() / 1e9
    variants = [("two-pass", dict(block=b, num_warps=w)) for b, w in itertools.product(blocks, warps)]
    variants += [("one-read", dict(block=ce.BLOCK_V, num_warps=ce.NUM_WARPS, split_chunk=c, split_warps=w))
                 for c, w in itertools.product(chunks, split_warps)]
    out = []
    print(f"{torch.cuda.get_device_name()} rows {rows} vocab {vocab}: {floor_gb:.1f} GB read+write per call")
    print(f"{'kernel':>8s} {'shape':>12s} {'ms':>8s} {'GB/s':>7s}  vs two-pass default")
    for kernel, kw in variants:
        got = ce._launch(check.clone(), t[:2048], z_loss=1e-4, need_grad=True, **kw)
        same = all(torch.equal(a, c) for a, c in zip(ref, got))
        diff = "same bits" if same else (f"d(logits) {_bf16_ulps(got[2], ref[2])} ulp, "
                                         f"lse {float((got[1] - ref[1]).abs().max()):.1e}")
        ms = time_ms(lambda: ce._launch(x, t, z_loss=1e-4, need_grad=True, **kw),
                     samples=samples, warmup=2, target_ms=1.0)
        shape = (f"{kw['split_chunk']} x {kw['split_warps']}w" if kernel == "one-read"
                 else f"{kw['block']} x {kw['num_warps']}w")
        row = dict(kernel=kernel, shape=shape, ms=round(ms, 3), gbps=round(floor_gb / ms * 1e3), vs_default=diff)
        out.append(row)
        print(f"{kernel:>8s} {shape:>12s} {ms:8.3f} {row['gbps']:7d}  {diff}", flush=True)
    default_shape = f"{ce.SPLIT_CHUNK} x {ce.SPLIT_WARPS}w" if ce.SPLIT_CHUNK else f"{ce.BLOCK_V} x {ce.NUM_WARPS}w"
    default = next((r for r in out if r["shape"] == default_shape), None)
    best = min(out, key=lambda r: r["ms"])
    return {"rows": out, "best": best, "default": default,
            "summary": (f"default {default['ms'] if default else '-'} ms, best {best['ms']} ms "
                        f"({best['kernel']} {best['shape']})")}


def dry_run(params: dict) -> dict:
    raise Skip("the cross-entropy launch shapes are a GPU measurement (the interpreter tests their bits)")
