"""Kind `cross-entropy`: the fused cross-entropy kernel (kernels/cross_entropy/inplace.py) by launch shape.

Each row is read twice (pass 1: log-sum-exp; pass 2: d(logits), written over the row), so a row's second read
comes from HBM unless it is still in L2 (50 MB on the H200): with one program per row, ~1000 rows of 304 KB
(Qwen2's 151,936-entry vocabulary in bf16) are in flight. Bounding the programs (each looping over rows) so
that they fit in L2 was slower on the H200 in every form tried: 8.9-24.8 ms at 1056 down to 132 programs against
8.1 ms at one program per row; with the loads of the next block issued before the current one is folded, L2
eviction hints (keep the row in pass 1, drop it in pass 2), 1 or 2 programs per SM, blocks of 8192-32768 and 8-32
warps: 9.9-23.4 ms against the default's 8.0. llm.q reads each row once (a cluster of 8 blocks holds it in shared
memory), which Triton cannot express. A one-read kernel without clusters (the row split over 5-19 programs that
hold their parts in registers and exchange (max, sum-exp) through memory, release/acquire on a per-row counter;
git show 7c020f0) was slower at all 9 shapes: 8.70-19.05 ms against 8.02; its short programs wait on their
partners instead of streaming. Variants vary block and warps. GB/s counts one read and one write per element (the
floor); whether a variant's output equals the default launch's bit for bit is shown (another block size sums the
row in another order).

Parameters: rows (32768), vocab (151936), blocks, warps, samples (10); `fp8` times instead the FP8-gradient kernel
(kernels/cross_entropy/fp8.py, --fp8-head-backward) by pass 2's tile and column range and the transpose's tile
(`tiles`: block_m x block_v x warps x cols x t_block, the launcher's parameters, the first its default) beside the
default bf16 kernel, and counts its codes that differ from the twin's (e5m2 codes; the twin computes exp exactly).
Result: `rows` (ms, GB/s per variant), `best`.
"""
from __future__ import annotations

import itertools

import torch

from bench.kinds import Skip
from bench.timing import time_ms
from qtrain.kernels.cross_entropy import inplace as ce


def run(rows: int = 32768, vocab: int = 151936, blocks: tuple[int, ...] = (4096, 8192),
        warps: tuple[int, ...] = (8, 16), samples: int = 10, fp8: bool = False,
        tiles: tuple[tuple[int, int, int, int, int], ...] = (
            (32, 128, 4, 2048, 128), (32, 128, 4, 2048, 64), (32, 128, 4, 1024, 128), (32, 128, 4, 4096, 128),
            (64, 128, 8, 2048, 128), (32, 256, 4, 2048, 128))) -> dict:
    if fp8:
        return run_fp8(rows, vocab, tiles, samples)
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
            "summary": f"default {default['ms']} ms, best {best['ms']} ms (block {best['block']}, "
                       f"warps {best['warps']})"}


def run_fp8(rows: int, vocab: int, tiles, samples: int) -> dict:
    """The FP8-gradient kernel by tile against the bf16 kernel's default launch, same logits."""
    from qtrain.kernels.cross_entropy import fp8 as cf
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    x = (torch.randn(rows, vocab, device=dev, generator=g) * 2).to(torch.bfloat16)
    t = torch.randint(0, vocab, (rows,), device=dev, generator=g)
    t[1::7] = ce.IGNORE_INDEX
    check, tc = x[:1024].clone(), t[:1024]
    ref = cf.cross_entropy_fp8_grads_twin(check.clone(), tc, z_loss=1e-4)
    floor_gb = x.numel() * (x.element_size() + 2) / 1e9  # one read, two one-byte writes (the floor of any layout)
    bf16_ms = time_ms(lambda: ce._launch(x, t, z_loss=1e-4, need_grad=True, block=ce.BLOCK_V,
                                         num_warps=ce.NUM_WARPS), samples=samples, warmup=2, target_ms=1.0)
    print(f"{torch.cuda.get_device_name()} rows {rows} vocab {vocab}: bf16 kernel {bf16_ms:.3f} ms; FP8 kernel:")
    print(f"{'tile':>28s} {'ms':>8s} {'GB/s':>7s} {'codes off':>9s} {'q^T = q.t()':>11s}")
    out = []
    for bm, bv, w, cols, tb in tiles:
        launch = dict(block_m=bm, block_v=bv, num_warps=w, cols=cols, t_block=tb)
        got = cf.cross_entropy_fp8_grads_triton(check.clone(), tc, z_loss=1e-4, **launch)
        off = int((got[2].view(torch.uint8) != ref[2].view(torch.uint8)).sum())
        same_t = torch.equal(got[3].view(torch.uint8), got[2].view(torch.uint8).t())
        ms = time_ms(lambda: cf.cross_entropy_fp8_grads_triton(x, t, z_loss=1e-4, **launch), samples=samples,
                     warmup=2, target_ms=1.0)
        name = f"{bm}x{bv}/{w} c{cols} t{tb}"
        row = dict(tile=name, ms=round(ms, 3), gbps=round(floor_gb / ms * 1e3), codes_off=off,
                   loss_rel=float((got[0] - ref[0]).abs() / ref[0].abs()), transpose_ok=same_t)
        out.append(row)
        print(f"{row['tile']:>28s} {ms:8.3f} {row['gbps']:7d} {off:9d} {str(same_t):>11s}", flush=True)
    best = min(out, key=lambda r: r["ms"])
    return {"rows": out, "best": best, "bf16_ms": round(bf16_ms, 3),
            "summary": f"bf16 {bf16_ms:.3f} ms; FP8 default {out[0]['ms']} ms, best {best['ms']} ms ({best['tile']})"}


def dry_run(params: dict) -> dict:
    raise Skip("the cross-entropy launch shapes are a GPU measurement (the interpreter tests their bits)")
