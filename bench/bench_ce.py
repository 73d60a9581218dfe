"""Kind `cross-entropy`: the fused cross-entropy kernel (kernels/cross_entropy.py) by launch shape.

Each row is read twice (pass 1: log-sum-exp; pass 2: d(logits), written over the row), so a row's second read
comes from HBM unless it is still in L2 (50 MB on the H200): with one program per row, ~1000 rows of 304 KB
(Qwen2's 151,936-entry vocabulary in bf16) are in flight. Variants bound the programs (each then loops over
rows) and vary block and warps. GB/s counts one read and one write per element (the floor); every variant's
output is checked bitwise against the default launch first.

Parameters: rows (32768), vocab (151936), programs (list; 0 = one per row), blocks, warps, samples (10).
Result: `rows` (ms, GB/s per variant), `best`.
"""
from __future__ import annotations

import itertools

import torch

from bench.kinds import Skip
from bench.timing import time_ms
from qtrain.kernels import cross_entropy as ce


def run(rows: int = 32768, vocab: int = 151936, programs: tuple[int, ...] = (0, 132, 264, 528, 1056),
        blocks: tuple[int, ...] = (4096, 8192), warps: tuple[int, ...] = (8, 16), samples: int = 10) -> dict:
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    x = (torch.randn(rows, vocab, device=dev, generator=g) * 2).to(torch.bfloat16)
    t = torch.randint(0, vocab, (rows,), device=dev, generator=g)
    check = x[:2048].clone()
    ref = ce._launch(check.clone(), t[:2048], z_loss=1e-4, need_grad=True, block=ce.BLOCK_V,
                     num_warps=ce.NUM_WARPS, programs=ce.PROGRAMS)
    floor_gb = 2 * x.numel() * x.element_size() / 1e9
    out = []
    print(f"{torch.cuda.get_device_name()} rows {rows} vocab {vocab}: {floor_gb:.1f} GB read+write per call")
    print(f"{'programs':>8s} {'block':>6s} {'warps':>5s} {'ms':>8s} {'GB/s':>7s}  same bits")
    for p, b, w in itertools.product(programs, blocks, warps):
        got = ce._launch(check.clone(), t[:2048], z_loss=1e-4, need_grad=True, block=b, num_warps=w, programs=p)
        same = all(torch.equal(a, c) for a, c in zip(ref, got))
        ms = time_ms(lambda: ce._launch(x, t, z_loss=1e-4, need_grad=True, block=b, num_warps=w, programs=p),
                     samples=samples, warmup=2, target_ms=1.0)
        row = dict(programs=p, block=b, warps=w, ms=round(ms, 3), gbps=round(floor_gb / ms * 1e3), same_bits=same)
        out.append(row)
        print(f"{p:8d} {b:6d} {w:5d} {ms:8.3f} {row['gbps']:7d}  {same}", flush=True)
    default = next(r for r in out if (r["programs"], r["block"], r["warps"]) == (ce.PROGRAMS, ce.BLOCK_V, ce.NUM_WARPS))
    best = min((r for r in out if r["same_bits"]), key=lambda r: r["ms"])
    return {"rows": out, "best": best, "default": default,
            "summary": f"default {default['ms']} ms, best {best['ms']} ms (programs {best['programs']}, "
                       f"block {best['block']}, warps {best['warps']})"}


def dry_run(params: dict) -> dict:
    raise Skip("the cross-entropy launch shapes are a GPU measurement (the interpreter tests their bits)")
