"""Kind `cross-entropy`: the fused cross-entropy kernel (kernels/cross_entropy.py) by launch shape.

Each row is read twice (pass 1: log-sum-exp; pass 2: d(logits), written over the row), so a row's second read
comes from HBM unless it is still in L2 (50 MB on the H200): with one program per row, ~1000 rows of 304 KB
(Qwen2's 151,936-entry vocabulary in bf16) are in flight. Bounding the programs (each looping over rows) so
that they fit in L2 was measured slower twice and removed: 2026-12-02, 8.1 ms at one program per row against
8.9-24.8 ms at 1056 down to 132 programs; 2026-12-03 (session 20), with the loads of the next block issued before
the current one is folded, L2 eviction hints (keep the row in pass 1, drop it in pass 2), 1 or 2 programs per SM,
blocks of 8192-32768 and 8-32 warps: 9.9-23.4 ms against the default's 8.0 (BENCHMARKS.md). llm.q reads each row
once (a cluster of 8 blocks holds it in shared memory), which Triton cannot express. A one-read kernel without
clusters (session 21: the row split over 5-19 programs that hold their parts in registers and exchange (max,
sum-exp) through memory, release/acquire on a per-row counter) was slower at all 9 shapes: 8.70-19.05 ms against
8.02 (git show 7c020f0); its short programs wait on their partners instead of streaming. Variants vary block and
warps. GB/s counts one read and one write per element (the floor); whether a variant's output equals the default
launch's bit for bit is shown (another block size sums the row in another order).

Parameters: rows (32768), vocab (151936), blocks, warps, samples (10).
Result: `rows` (ms, GB/s per variant), `best`.
"""
from __future__ import annotations

import itertools

import torch

from bench.kinds import Skip
from bench.timing import time_ms
from qtrain.kernels import cross_entropy as ce


def run(rows: int = 32768, vocab: int = 151936, blocks: tuple[int, ...] = (4096, 8192),
        warps: tuple[int, ...] = (8, 16), samples: int = 10) -> dict:
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    x = (torch.randn(rows, vocab, device=dev, generator=g) * 2).to(torch.bfloat16)
    t = torch.randint(0, vocab, (rows,), device=dev, generator=g)
    check = x[:2048].clone()
    ref = ce._launch(check.clone(), t[:2048], z_loss=1e-4, need_grad=True, block=ce.BLOCK_V,
                     num_warps=ce.NUM_WARPS)
    floor_gb = 2 * x.numel() * x.element_size() / 1e9
    out = []
    print(f"{torch.cuda.get_device_name()} rows {rows} vocab {vocab}: {floor_gb:.1f} GB read+write per call")
    print(f"{'block':>6s} {'warps':>5s} {'ms':>8s} {'GB/s':>7s}  same bits")
    for b, w in itertools.product(blocks, warps):
        got = ce._launch(check.clone(), t[:2048], z_loss=1e-4, need_grad=True, block=b, num_warps=w)
        same = all(torch.equal(a, c) for a, c in zip(ref, got))
        ms = time_ms(lambda: ce._launch(x, t, z_loss=1e-4, need_grad=True, block=b, num_warps=w),
                     samples=samples, warmup=2, target_ms=1.0)
        row = dict(block=b, warps=w, ms=round(ms, 3), gbps=round(floor_gb / ms * 1e3), same_bits=same)
        out.append(row)
        print(f"{b:6d} {w:5d} {ms:8.3f} {row['gbps']:7d}  {same}", flush=True)
    default = next(r for r in out if (r["block"], r["warps"]) == (ce.BLOCK_V, ce.NUM_WARPS))
    best = min(out, key=lambda r: r["ms"])
    return {"rows": out, "best": best, "default": default,
            "summary": f"default {default['ms']} ms, best {best['ms']} ms (block {best['block']}, warps {best['warps']})"}


def dry_run(params: dict) -> dict:
    raise Skip("the cross-entropy launch shapes are a GPU measurement (the interpreter tests their bits)")
