"""The bf16 GEMM ceiling of a training step: how many tokens/s a model could reach if its step did nothing but
the block and LM-head GEMMs (forward, dgrad, wgrad) at the rate cuBLAS gives for its shapes.

Per micro-batch of M tokens and per block linear (QKV, O, gate+up, down) it times, as autograd issues them,
  fwd  y = x @ W^T (M, N)     dgrad  dX = dY @ W (M, K)     wgrad  dW = dY^T @ x (N, K)
and the LM head the same way (in `--lmhead-chunks` row chunks, as qtrain runs it). The ceiling is
M / (layers * block GEMM time + head GEMM time); the gap between it and a measured step is everything else
(attention, norms, SwiGLU, gradient accumulation, the update).

    python -m bench.gemm_ceiling --model Qwen2.5-14B --tokens 2048,4096,8192,16384
"""
from __future__ import annotations

import argparse
import json

import torch

from bench.bench_fp8_gemm import time_ms
from qtrain.model.config import preset


def linear_ms(M: int, K: int, N: int, *, samples: int, dev: str = "cuda") -> dict[str, float]:
    """Milliseconds of the three GEMMs of one bf16 linear with M rows, K inputs, N outputs."""
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=g)
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16, generator=g) * K ** -0.5
    dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16, generator=g)
    out = {"fwd": time_ms(lambda: x @ w.t(), samples=samples, warmup=3),
           "dgrad": time_ms(lambda: dy @ w, samples=samples, warmup=3),
           "wgrad": time_ms(lambda: dy.t() @ x, samples=samples, warmup=3)}
    del x, w, dy
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Qwen2.5-14B")
    p.add_argument("--tokens", default="2048,4096,8192,16384")
    p.add_argument("--lmhead-chunks", type=int, default=4)
    p.add_argument("--samples", type=int, default=10)
    a = p.parse_args()
    cfg = preset(a.model)
    C, F_, H, KV, D = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                       cfg.num_key_value_heads, cfg.head_dim)
    linears = {"qkv": (C, (H + 2 * KV) * D), "o": (H * D, C), "up": (C, 2 * F_), "down": (F_, C)}
    print(torch.cuda.get_device_name(), torch.__version__, a.model, flush=True)
    rows = []
    for M in (int(t) for t in a.tokens.split(",")):
        block_ms, flops = 0.0, 0.0
        parts = {}
        for name, (K, N) in linears.items():
            t = linear_ms(M, K, N, samples=a.samples)
            parts[name] = round(sum(t.values()), 3)
            block_ms += sum(t.values())
            flops += 6 * M * K * N
        rows_per_chunk = -(-M // a.lmhead_chunks)
        head = linear_ms(rows_per_chunk, C, cfg.vocab_size, samples=a.samples)
        head_ms = sum(head.values()) * a.lmhead_chunks
        step_ms = cfg.num_hidden_layers * block_ms + head_ms
        tflops = (cfg.num_hidden_layers * flops + 6 * M * C * cfg.vocab_size) / step_ms / 1e9
        row = dict(model=a.model, tokens=M, block_ms=round(block_ms, 3), parts=parts, head_ms=round(head_ms, 2),
                   gemm_ms=round(step_ms, 1), tflops=round(tflops), ceiling_tps=round(M / step_ms * 1e3))
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"{'tokens':>7} {'block ms':>9} {'head ms':>8} {'GEMM TFLOP/s':>12} {'ceiling tok/s':>13}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['block_ms']:>9} {r['head_ms']:>8} {r['tflops']:>12} {r['ceiling_tps']:>13}")


if __name__ == "__main__":
    main()
