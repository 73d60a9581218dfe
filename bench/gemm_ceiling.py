"""Kind `gemm-ceiling`: the GEMM ceiling of a training step: how many tokens/s a model could reach if its step did
nothing but the block and LM-head GEMMs (forward, dgrad, wgrad) at the rate cuBLAS gives for its shapes.

Per micro-batch of M tokens and per block linear (QKV, O, gate+up, down) it times, as autograd issues them,
  fwd  y = x @ W^T (M, N)     dgrad  dX = dY @ W (M, K)     wgrad  dW = dY^T @ x (N, K)
and the LM head the same way (in `lmhead_chunks` row chunks, as qtrain runs it). The ceiling is
M / (layers * block GEMM time + head GEMM time); the gap between it and a measured step is everything else
(attention, norms, SwiGLU, gradient accumulation, the update).

With matmul_dtype "e4m3" the block linears' GEMMs are FP8 (`torch._scaled_mm` through qtrain's `scaled_mm`, in
the layouts and accumulation modes `numerics.fp8` uses: fast accumulation in the forward only; operands already
quantized, since quantization is not GEMM time) and the LM head stays bf16, as qtrain trains it.

Parameters: model (preset or directory), tokens (M per micro-batch: one number or a list), lmhead_chunks (4),
samples (10), matmul_dtype ("" = bf16, or "e4m3"). One token count puts its row's numbers in the result (tokens,
gemm_ms, tflops, ceiling_tps); every count's row is in `rows`.
"""
from __future__ import annotations

import json
from collections.abc import Callable

import torch

from bench.compat import model_config
from bench.dry import tiny_model_dir
from bench.timing import time_ms


def linear_gemms(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """The three bf16 GEMMs of one linear, as autograd issues them: x (M, K), w (N, K), dy (M, N)."""
    return {"fwd": lambda: x @ w.t(), "dgrad": lambda: dy @ w, "wgrad": lambda: dy.t() @ x}


def fp8_linear_gemms(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """The three e4m3 GEMMs of one block linear (`numerics.fp8._Fp8Linear`'s calls) on operands quantized here
    (quantization is not GEMM time)."""
    from qtrain.kernels.fp8_quant import quantize_fp8
    from qtrain.kernels.scaled_mm import scaled_mm
    (xq, xi), (wq, wi), (dq, di) = quantize_fp8(x), quantize_fp8(w), quantize_fp8(dy)
    xqt, wqt, dqt = xq.t().contiguous(), wq.t().contiguous(), dq.t().contiguous()
    bf16 = torch.bfloat16
    return {"fwd": lambda: scaled_mm(xq, wq.t(), xi, wi, out_dtype=bf16, use_fast_accum=True),
            "dgrad": lambda: scaled_mm(dq, wqt.t(), di, wi, out_dtype=bf16),
            "wgrad": lambda: scaled_mm(dqt, xqt.t(), di, xi, out_dtype=bf16)}


def linear_operands(M: int, K: int, N: int, dev: str = "cuda") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random bf16 x (M, K), w (N, K) scaled by K^-1/2, dy (M, N), the same every call (seed 0)."""
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=g)
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16, generator=g) * K ** -0.5
    dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16, generator=g)
    return x, w, dy


def block_linear_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(K inputs, N outputs) of the four block linears of a model config."""
    C, F_, H, KV, D = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                       cfg.num_key_value_heads, cfg.head_dim)
    return {"qkv": (C, (H + 2 * KV) * D), "o": (H * D, C), "up": (C, 2 * F_), "down": (F_, C)}


def linear_ms(M: int, K: int, N: int, *, samples: int, dev: str = "cuda") -> dict[str, float]:
    """Milliseconds of the three GEMMs of one bf16 linear with M rows, K inputs, N outputs."""
    fns = linear_gemms(*linear_operands(M, K, N, dev))
    return {k: time_ms(fn, samples=samples, warmup=3, device=dev) for k, fn in fns.items()}


def fp8_linear_ms(M: int, K: int, N: int, *, samples: int, dev: str = "cuda") -> dict[str, float]:
    """Milliseconds of the three e4m3 GEMMs of one block linear (`numerics.fp8._Fp8Linear`'s calls)."""
    fns = fp8_linear_gemms(*linear_operands(M, K, N, dev))
    return {k: time_ms(fn, samples=samples, warmup=3, device=dev) for k, fn in fns.items()}


def run(model: str, tokens: int | list[int] = (2048, 4096, 8192, 16384), lmhead_chunks: int = 4, samples: int = 10,
        device: str = "cuda", matmul_dtype: str = "") -> dict:
    cfg = model_config(model)
    C = cfg.hidden_size
    linears = block_linear_shapes(cfg)
    if matmul_dtype not in ("", "bf16", "e4m3"):
        raise ValueError(f"gemm-ceiling: matmul_dtype must be '', 'bf16' or 'e4m3', got {matmul_dtype!r}")
    block_linear_ms = fp8_linear_ms if matmul_dtype == "e4m3" else linear_ms
    name = torch.cuda.get_device_name() if device == "cuda" else device
    print(name, torch.__version__, model, f"block linears {matmul_dtype or 'bf16'}, LM head bf16", flush=True)
    rows = []
    for M in ([tokens] if isinstance(tokens, int) else list(tokens)):
        block_ms, flops = 0.0, 0.0
        parts = {}
        for lin, (K, N) in linears.items():
            t = block_linear_ms(M, K, N, samples=samples, dev=device)
            parts[lin] = round(sum(t.values()), 3)
            block_ms += sum(t.values())
            flops += 6 * M * K * N
        rows_per_chunk = -(-M // lmhead_chunks)
        head = linear_ms(rows_per_chunk, C, cfg.vocab_size, samples=samples, dev=device)
        head_ms = sum(head.values()) * lmhead_chunks
        step_ms = cfg.num_hidden_layers * block_ms + head_ms
        tflops = (cfg.num_hidden_layers * flops + 6 * M * C * cfg.vocab_size) / step_ms / 1e9
        row = dict(tokens=M, block_ms=round(block_ms, 3), parts=parts, head_ms=round(head_ms, 2),
                   gemm_ms=round(step_ms, 1), tflops=round(tflops), ceiling_tps=round(M / step_ms * 1e3))
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"{'tokens':>7} {'block ms':>9} {'head ms':>8} {'GEMM TFLOP/s':>12} {'ceiling tok/s':>13}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['block_ms']:>9} {r['head_ms']:>8} {r['tflops']:>12} {r['ceiling_tps']:>13}")
    out: dict = {"rows": rows, "summary": " ".join(f"{r['tokens']}:{r['ceiling_tps']}" for r in rows) + " tok/s"}
    if len(rows) == 1:
        out.update({k: v for k, v in rows[0].items() if k != "parts"})
    return out


def dry_run(params: dict) -> dict:
    """The model's family at the tiny shape, 64 tokens, on the CPU."""
    return {**params, "model": tiny_model_dir(params["model"]), "tokens": 64, "samples": 2, "device": "cpu"}
