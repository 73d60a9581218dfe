"""Benchmark: the all-to-all gradient manager's reduction of one block on one rank, as it was (an fp32 copy of
the shard built by W passes over the received slices, then one SR pass per tensor piece) against `sr_sum_`
(one fused pass per piece), at the Qwen2.5 block shapes and world sizes 2, 4, 8; both on the first micro-step
(no old shard) and a later one (old shard added). Also checks the two give the same bits.

    python -m bench.bench_a2a_reduce                  # Qwen2.5-1.5B and 7B
    python -m bench.bench_a2a_reduce --models Qwen2.5-14B --worlds 2 4
"""
from __future__ import annotations

import argparse
import sys

import torch

from bench.bench_fp8_gemm import time_ms
from qtrain.kernels.stochastic_rounding import sr_copy_, sr_sum_
from qtrain.model.config import preset
from qtrain.parallel.layout import FlatLayout


def old_reduce(work, parts, pieces, first, scale):
    """The reduction as the manager ran it until session 5 (fixed order, one fp32 buffer)."""
    acc = parts[0].to(torch.float32, copy=True) if first else work.float() + parts[0].float()
    for j in range(1, parts.shape[0]):
        acc += parts[j].float()
    for t, p in pieces:
        sl = slice(p.shard_offset, p.shard_offset + p.numel)
        sr_copy_(work[sl], acc[sl], key=t + 1, scale=scale, offset=p.tensor_offset)


def new_reduce(work, parts, pieces, first, scale):
    for t, p in pieces:
        sl = slice(p.shard_offset, p.shard_offset + p.numel)
        sr_sum_(work[sl], parts[:, sl], key=t + 1, scale=scale, offset=p.tensor_offset, add=not first)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["Qwen2.5-1.5B", "Qwen2.5-7B"])
    ap.add_argument("--worlds", nargs="+", type=int, default=[2, 4, 8])
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_a2a_reduce needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"{'model':14s} {'W':>2s} {'first':5s} {'shard MB':>8s} {'old ms':>7s} {'new ms':>7s} {'speedup':>7s} same")
    for name in args.models:
        cfg = preset(name)
        for world in args.worlds:
            g = FlatLayout(cfg, world).block(0)
            s = g.shard_size(world)
            index = {seg.name: t for t, seg in enumerate(g.segments)}
            pieces = [(index[p.segment.name], p) for p in g.shard_pieces(0, world)]
            recv = torch.randn(world * s, device="cuda").to(torch.bfloat16)
            parts = recv.view(world, -1)
            shard = torch.randn(s, device="cuda").to(torch.bfloat16)
            for first in (True, False):
                a, b = shard.clone(), shard.clone()
                old_reduce(a, parts, pieces, first, 1 / world)
                new_reduce(b, parts, pieces, first, 1 / world)
                n = pieces[-1][1].shard_offset + pieces[-1][1].numel
                same = torch.equal(a[:n].view(torch.int16), b[:n].view(torch.int16))
                w = shard.clone()
                t_old = time_ms(lambda: old_reduce(w, parts, pieces, first, 1.0), samples=5, warmup=2)
                t_new = time_ms(lambda: new_reduce(w, parts, pieces, first, 1.0), samples=5, warmup=2)
                print(f"{name:14s} {world:2d} {str(first):5s} {s * 2 / 1e6:8.1f} {t_old:7.3f} {t_new:7.3f} "
                      f"{t_old / t_new:6.2f}x {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
