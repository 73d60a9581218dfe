"""Kind `cross-entropy`: the fused cross-entropy kernel (kernels/cross_entropy.py) by launch shape.

Each row is read twice (pass 1: log-sum-exp; pass 2: d(logits), written over the row), so a row's second read
comes from HBM unless it is still in L2 (50 MB on the H200): with one program per row, ~1000 rows of 304 KB
(Qwen2's 151,936-entry vocabulary in bf16) are in flight. llm.q reads each row once (a cluster of 8 blocks
holds it in shared memory, read by TMA): its kernel took 12.0 ms per 65,536 rows under ncu against qtrain's
19.7 (BENCHMARKS.md, 2026-12-03, session 20). The looping-programs kernel (`programs` > 0: programs per SM,
each looping over rows, with `prefetch` two blocks in flight, pass 1 asking L2 to keep the row) bounds the rows in
flight so that pass 2 can find them in L2; a first version without pipelining or hints was slower (2026-12-02:
8.1 ms at one program per row, 8.9-24.8 ms at 1056 down to 132 programs). GB/s counts one read and one write
per element (the floor); whether a variant's output equals the default launch's bit for bit is shown
(the per-row kernel at the same block size: another block sums the row in another order).

Parameters: rows (32768), vocab (151936), blocks, warps, programs (per SM; 0 = one program per row), prefetch,
samples (10). Result: `rows` (ms, GB/s per variant), `best`, `default`.
"""
from __future__ import annotations

import itertools

import torch

from bench.kinds import Skip
from bench.timing import time_ms
from qtrain.kernels import cross_entropy as ce


def run(rows: int = 32768, vocab: int = 151936, blocks: tuple[int, ...] = (4096, 8192),
        warps: tuple[int, ...] = (8, 16), programs: tuple[int, ...] = (0,), prefetch: tuple[bool, ...] = (False,),
        samples: int = 10) -> dict:
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    x = (torch.randn(rows, vocab, device=dev, generator=g) * 2).to(torch.bfloat16)
    t = torch.randint(0, vocab, (rows,), device=dev, generator=g)
    check = x[:2048].clone()
    refs: dict[int, tuple] = {}
    floor_gb = 2 * x.numel() * x.element_size() / 1e9
    out = []
    print(f"{torch.cuda.get_device_name()} rows {rows} vocab {vocab}: {floor_gb:.1f} GB read+write per call")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{'per SM':>6s} {'prefetch':>8s} {'block':>6s} {'warps':>5s} {'ms':>8s} {'GB/s':>7s}  same bits")
    variants = [(0, False, ce.BLOCK_V, ce.NUM_WARPS)]
    variants += [v for v in ((0, False, b, w) for b, w in itertools.product(blocks, warps)) if v not in variants]
    variants += [v for v in itertools.product(programs, prefetch, blocks, warps) if v[0] and v not in variants]
    for per_sm, pf, b, w in variants:
        kw = dict(z_loss=1e-4, need_grad=True, block=b, num_warps=w, programs=per_sm * sms, prefetch=pf)
        got = ce._launch(check.clone(), t[:2048], **kw)
        if b not in refs:  # the per-row kernel at this block: what the looping kernel must equal bit for bit
            refs[b] = ce._launch(check.clone(), t[:2048], z_loss=1e-4, need_grad=True, block=b, num_warps=w)
        same = all(torch.equal(a, c) for a, c in zip(refs[b], got))
        ms = time_ms(lambda: ce._launch(x, t, **kw), samples=samples, warmup=2, target_ms=1.0)
        row = dict(programs=per_sm, prefetch=pf, block=b, warps=w, ms=round(ms, 3), gbps=round(floor_gb / ms * 1e3),
                   same_bits=same)
        out.append(row)
        print(f"{per_sm:6d} {pf!s:>8s} {b:6d} {w:5d} {ms:8.3f} {row['gbps']:7d}  {same}", flush=True)
    default = next(r for r in out if (r["programs"], r["block"], r["warps"]) == (0, ce.BLOCK_V, ce.NUM_WARPS))
    best = min(out, key=lambda r: r["ms"])
    return {"rows": out, "best": best, "default": default,
            "summary": f"default {default['ms']} ms, best {best['ms']} ms (programs {best['programs']}, "
                       f"block {best['block']}, warps {best['warps']})"}


def dry_run(params: dict) -> dict:
    raise Skip("the cross-entropy launch shapes are a GPU measurement (the interpreter tests their bits)")
