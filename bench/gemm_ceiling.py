"""Kind `gemm-ceiling`: the GEMM ceiling of a training step: how many tokens/s a model could reach if its step did
nothing but the block and LM-head GEMMs (forward, dgrad, wgrad) at the rate cuBLAS gives for its shapes.

Per micro-batch of M tokens and per block matrix of each layer (the family's `matmuls`: for a Llama block QKV, O,
gate+up, down; for an MoE block also the router and the expert stacks; Qwen3.5's linear-attention projections) it
times, as autograd issues them,
  fwd  y = x @ W^T (M, N)     dgrad  dX = dY @ W (M, K)     wgrad  dW = dY^T @ x (N, K)
and the LM head the same way (in `lmhead_chunks` row chunks, as qtrain runs it). An expert stack is one grouped GEMM
of each kind (`kernels/grouped_gemm.py`, as the MoE layer calls it) with the tokens' k rows spread evenly over the
experts (the balanced routing the auxiliary loss drives towards; an imbalanced one is slower). The ceiling is
M / (sum over layers of their GEMM time + head GEMM time); the gap between it and a measured step is everything else
(attention, norms, SwiGLU, routing and permutation, gradient accumulation, the update). `mfu` is the MFU a step of
only those GEMMs would reach (qtrain's `model_flops_per_token` at `seq`: attention's FLOPs counted, its time not),
where the device's bf16 peak is known: what bounds a measured MFU from above.

With matmul_dtype "e4m3" the block linears' GEMMs are FP8 (`torch._scaled_mm` through qtrain's `scaled_mm`, in
the layouts and accumulation modes `numerics.fp8` uses: fast accumulation in the forward only; operands already
quantized, since quantization is not GEMM time) and the LM head, the router and the expert stacks stay bf16, as
qtrain trains them by default.

Parameters: model (preset or directory), layers (the model cut to its first N, bench/shapes.py), tokens (M per
micro-batch: one number or a list), lmhead_chunks (4), samples (10), matmul_dtype ("" = bf16, or "e4m3"), seq
(1024: the MFU's attention FLOPs). One token count puts its row's numbers in the result (tokens, gemm_ms, tflops,
ceiling_tps, mfu); every count's row is in `rows`.
"""
from __future__ import annotations

import json
from collections.abc import Callable

import torch

from bench.compat import model_config
from bench.dry import tiny_model_dir
from bench.shapes import model_arg
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


def block_matmuls(cfg) -> list[dict]:
    """Each layer's block matrices (the family's `matmuls`): per layer {name: MatmulSpec}."""
    from qtrain.model.registry import family_of
    family = family_of(cfg)
    return [family.matmuls(cfg, layer) for layer in range(cfg.num_hidden_layers)]


def linear_ms(M: int, K: int, N: int, *, samples: int, dev: str = "cuda") -> dict[str, float]:
    """Milliseconds of the three GEMMs of one bf16 linear with M rows, K inputs, N outputs."""
    fns = linear_gemms(*linear_operands(M, K, N, dev))
    return {k: time_ms(fn, samples=samples, warmup=3, device=dev) for k, fn in fns.items()}


def fp8_linear_ms(M: int, K: int, N: int, *, samples: int, dev: str = "cuda") -> dict[str, float]:
    """Milliseconds of the three e4m3 GEMMs of one block linear (`numerics.fp8._Fp8Linear`'s calls)."""
    fns = fp8_linear_gemms(*linear_operands(M, K, N, dev))
    return {k: time_ms(fn, samples=samples, warmup=3, device=dev) for k, fn in fns.items()}


def expert_operands(rows: int, count: int, K: int, N: int, dev: str = "cuda"
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """An expert stack's operands with `rows` rows for each of its `count` experts: x (rows count, K), w (count, N,
    K), dy (rows count, N), the int32 offsets (cumulative row ends)."""
    x, _, dy = linear_operands(rows * count, K, N, dev)
    g = torch.Generator(device=dev).manual_seed(1)
    w = torch.randn(count, N, K, device=dev, dtype=torch.bfloat16, generator=g) * K ** -0.5
    offsets = torch.arange(1, count + 1, device=dev, dtype=torch.int32) * rows
    return x, w, dy, offsets


def expert_stack_ms(rows: int, count: int, K: int, N: int, *, samples: int, dev: str = "cuda") -> dict[str, float]:
    """Milliseconds of an expert stack's three grouped GEMMs (`grouped_linear` forward and data gradient,
    `grouped_weight_grad`), `rows` rows per expert."""
    from qtrain.kernels.grouped_gemm import grouped_linear, grouped_weight_grad
    x, w, dy, offs = expert_operands(rows, count, K, N, dev)
    wt = w.mT
    fns = {"fwd": lambda: grouped_linear(x, w, offs), "dgrad": lambda: grouped_linear(dy, wt, offs),
           "wgrad": lambda: grouped_weight_grad(dy, x, offs)}
    return {k: time_ms(fn, samples=samples, warmup=3, device=dev) for k, fn in fns.items()}


def spec_ms(spec, name: str, M: int, *, fp8: bool, samples: int, dev: str) -> float:
    """Milliseconds of one block matrix's three GEMMs at M tokens: an expert stack's grouped ones (bf16), a dense
    matrix's in e4m3 where `fp8` (not the router: qtrain keeps it bf16), else bf16."""
    from qtrain.model.moe_block import ROUTER
    rows, N, K = spec.shape(M)
    if spec.count > 1:
        return sum(expert_stack_ms(rows, spec.count, K, N, samples=samples, dev=dev).values())
    timer = fp8_linear_ms if fp8 and name != ROUTER else linear_ms
    return sum(timer(rows, K, N, samples=samples, dev=dev).values())


def run(model: str, tokens: int | list[int] = (2048, 4096, 8192, 16384), lmhead_chunks: int = 4, samples: int = 10,
        device: str = "cuda", matmul_dtype: str = "", layers: int | None = None, seq: int = 1024) -> dict:
    from qtrain.observe.metrics import model_flops_per_token, peak_tflops
    cfg = model_config(model_arg(model, layers))
    C = cfg.hidden_size
    if matmul_dtype not in ("", "bf16", "e4m3"):
        raise ValueError(f"gemm-ceiling: matmul_dtype must be '', 'bf16' or 'e4m3', got {matmul_dtype!r}")
    per_layer = block_matmuls(cfg)
    name = torch.cuda.get_device_name() if device == "cuda" else device
    peak = peak_tflops(name, "bf16") if device == "cuda" else None
    flops_per_token = model_flops_per_token(cfg, seq)
    print(name, torch.__version__, model, f"{cfg.num_hidden_layers} layers, block linears {matmul_dtype or 'bf16'}, "
          "router, experts and LM head bf16", flush=True)
    rows = []
    for M in ([tokens] if isinstance(tokens, int) else list(tokens)):
        timed: dict[tuple, float] = {}  # one timing per distinct GEMM shape
        parts: dict[str, float] = {}
        block_ms, flops = 0.0, 0.0
        for specs in per_layer:
            for lin, spec in specs.items():
                key = (lin, spec.n, spec.k, spec.rows, spec.count)
                if key not in timed:
                    timed[key] = spec_ms(spec, lin, M, fp8=matmul_dtype == "e4m3", samples=samples, dev=device)
                parts[lin] = parts.get(lin, 0.0) + timed[key] / cfg.num_hidden_layers  # a layer's mean
                block_ms += timed[key]
                flops += 6 * M * spec.weights_per_token
        rows_per_chunk = -(-M // lmhead_chunks)
        head = linear_ms(rows_per_chunk, C, cfg.vocab_size, samples=samples, dev=device)
        head_ms = sum(head.values()) * lmhead_chunks
        step_ms = block_ms + head_ms
        tflops = (flops + 6 * M * C * cfg.vocab_size) / step_ms / 1e9
        ceiling = M / step_ms * 1e3
        row = dict(tokens=M, block_ms=round(block_ms / cfg.num_hidden_layers, 3),
                   parts={k: round(v, 3) for k, v in parts.items()},
                   head_ms=round(head_ms, 2), gemm_ms=round(step_ms, 1), tflops=round(tflops),
                   ceiling_tps=round(ceiling), mfu=round(ceiling * flops_per_token / (peak * 1e12), 3) if peak else None)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"{'tokens':>7} {'block ms':>9} {'head ms':>8} {'GEMM TFLOP/s':>12} {'ceiling tok/s':>13} {'MFU':>6}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['block_ms']:>9} {r['head_ms']:>8} {r['tflops']:>12} {r['ceiling_tps']:>13} "
              f"{r['mfu'] if r['mfu'] is not None else '-':>6}")
    out: dict = {"rows": rows, "summary": " ".join(f"{r['tokens']}:{r['ceiling_tps']}" for r in rows) + " tok/s"}
    if len(rows) == 1:
        out.update({k: v for k, v in rows[0].items() if k != "parts"})
    return out


def dry_run(params: dict) -> dict:
    """The model's family at the tiny shape, 64 tokens, on the CPU."""
    return {**params, "model": tiny_model_dir(params["model"]), "layers": None, "tokens": 64, "samples": 2,
            "device": "cpu"}
