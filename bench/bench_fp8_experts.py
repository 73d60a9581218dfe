"""Kind `fp8-experts`: the MoE expert GEMMs at a preset's shape (Qwen3-30B-A3B: 128 experts, top-8, C 2048, F 768),
bf16 against e4m3, and the two CUDA forms of the e4m3 GEMM (issue 44: "grouped or one scaled matmul per expert,
whichever measures faster"; `qtrain.kernels.grouped_gemm_fp8.GEMM`).

Rows M = tokens x k, the tokens routed to experts by a random top-k (uneven, as routing is). Per expert stack (up/gate:
K = C, N = 2F; down: K = F, N = C), milliseconds of:
  bf16 fwd / dgrad / wgrad         torch._grouped_mm (kernels/grouped_gemm.py), the GEMMs alone
  e4m3 grouped fwd / dgrad          torch._scaled_grouped_mm on operands quantized beforehand (fwd with fast accum)
  e4m3 per-expert fwd / dgrad       one row-wise torch._scaled_mm per expert (a host read of the offsets each call)
  quantize x / w / w^T, eager and compiled   fp8_quant.quantize_fp8_rowwise (what the layer adds per micro-step)
  layer fwd+bwd, eager and compiled          expert_linear against fp8_expert_linear (grouped, then per-expert)
Timing: bench.timing.time_ms (median of `samples`, CUDA events). The result has the rows and, per stack, the layer's
e4m3 / bf16 speed-up (`summary`).

Parameters: model (a preset with experts), tokens (B x T of a micro-batch: 4096), samples (20), warmup (5).
"""
from __future__ import annotations

import torch

from bench.compat import preset
from bench.kinds import Skip
from bench.timing import time_ms

ROWS: list[dict] = []


def _line(stack: str, what: str, ms: float, flop: float = 0.0) -> None:
    tf = flop / ms / 1e9 if flop and ms == ms else float("nan")
    print(f"{stack:16s} {what:40s} {ms:8.3f} ms  {tf:7.1f} TFLOP/s", flush=True)
    ROWS.append(dict(stack=stack, what=what, ms=round(ms, 4), tflops=round(tf, 1)))


def _offsets(tokens: int, experts: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """int32 row ends of a random top-k routing of `tokens` tokens (each token k distinct experts)."""
    scores = torch.rand(tokens, experts, generator=gen) * torch.rand(experts, generator=gen)  # uneven experts
    ids = scores.topk(k, dim=-1).indices.reshape(-1)
    return torch.bincount(ids, minlength=experts).cumsum(0).to(torch.int32).cuda()


def run(model: str = "Qwen3-30B-A3B", tokens: int = 4096, samples: int = 20, warmup: int = 5) -> dict:
    from qtrain.kernels import grouped_gemm as gg
    from qtrain.kernels import grouped_gemm_fp8 as gf
    from qtrain.kernels.fp8_quant import quantize_fp8_rowwise
    if not torch.cuda.is_available():
        raise Skip("times CUDA GEMMs: needs a Hopper GPU")
    ROWS.clear()
    cfg = preset(model)
    C, F, E, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok
    gen = torch.Generator().manual_seed(0)
    offsets = _offsets(tokens, E, k, gen)
    M = int(offsets[-1])

    def t(fn) -> float:
        return time_ms(fn, samples=samples, warmup=warmup)

    quant = torch.compile(quantize_fp8_rowwise, dynamic=False)
    summary = {}
    for stack, K, N in (("experts_up_gate", C, 2 * F), ("experts_down", F, C)):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(E, N, K, device="cuda") / K**0.5).bfloat16()
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        flop = 2.0 * M * N * K
        _line(stack, "bf16 fwd (grouped_mm)", t(lambda: gg.grouped_linear(x, w, offsets)), flop)
        _line(stack, "bf16 dgrad", t(lambda: gg.grouped_linear(dy, w.transpose(1, 2), offsets)), flop)
        _line(stack, "bf16 wgrad", t(lambda: gg.grouped_weight_grad(dy, x, offsets)), flop)
        xq, x_inv = quantize_fp8_rowwise(x)
        wq, w_inv = quantize_fp8_rowwise(w)
        dyq, dy_inv = quantize_fp8_rowwise(dy)
        wtq, wt_inv = quantize_fp8_rowwise(w.transpose(1, 2))
        _line(stack, "e4m3 grouped fwd (fast accum)", t(lambda: torch._scaled_grouped_mm(
            xq, wq.transpose(1, 2), x_inv, w_inv, offs=offsets, out_dtype=torch.bfloat16, use_fast_accum=True)), flop)
        _line(stack, "e4m3 grouped dgrad", t(lambda: torch._scaled_grouped_mm(
            dyq, wtq.transpose(1, 2), dy_inv, wt_inv, offs=offsets, out_dtype=torch.bfloat16)), flop)
        _line(stack, "e4m3 per-expert fwd (fast accum)",
              t(lambda: gf.per_expert_scaled_mm(xq, x_inv, wq, w_inv, offsets, True)), flop)
        _line(stack, "e4m3 per-expert dgrad", t(lambda: gf.per_expert_scaled_mm(dyq, dy_inv, wtq, wt_inv, offsets,
                                                                                False)), flop)
        for name, fn in (("eager", quantize_fp8_rowwise), ("compiled", quant)):
            _line(stack, f"quantize x ({name})", t(lambda: fn(x)))
            _line(stack, f"quantize w ({name})", t(lambda: fn(w)))
            _line(stack, f"quantize w^T ({name})", t(lambda: fn(w.transpose(1, 2))))
        xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)

        def layer(f):
            return lambda: f(xg, wg, offsets).backward(dy)

        for name, wrap in (("eager", lambda f: f), ("compiled", lambda f: torch.compile(f, dynamic=False))):
            bf16 = t(layer(wrap(gg.expert_linear)))
            _line(stack, f"layer bf16 fwd+bwd ({name})", bf16, 3 * flop)
            for form in ("grouped", "per-expert"):
                gf.GEMM = form
                torch._dynamo.reset() if name == "compiled" else None
                e4m3 = t(layer(wrap(gf.fp8_expert_linear)))
                _line(stack, f"layer e4m3 {form} fwd+bwd ({name})", e4m3, 3 * flop)
                summary[f"{stack} {form} {name}"] = round(bf16 / e4m3, 3)
            gf.GEMM = "grouped"
    print("e4m3 / bf16 speed-up of a stack's fwd+bwd:", summary, flush=True)
    return {"rows": list(ROWS), "summary": summary, "rows_m": M}


def dry_run(params: dict) -> dict:
    raise Skip("times torch._scaled_grouped_mm / torch._scaled_mm on the GPU: needs a Hopper GPU")
