"""Kind `attention`: causal SDPA backends (flash, cuDNN, qtrain's cuDNN op) at the Qwen2.5 attention shapes, forward
and forward+backward, eager and inside torch.compile, and how close each backend's output and gradients are to
flash's (the default). The question it answers: which backend should `--sdpa-backend auto` pick on this GPU.

Shapes: q (B, nh, T, hs), k/v (B, nkv, T, hs) in the layout the block produces (transposed views of a
(B, T, heads, hs) projection). GQA through `enable_gqa`. TFLOP/s counts causal work: forward 2*2*B*nh*T*T*hs/2,
backward 2.5x forward.

Parameters: models (presets; 0.5B, 1.5B, 7B, 14B), tokens (per call, 32768), seq (1024), samples (5).
Result: `rows`, one per model, backend and eager/compiled.
"""
from __future__ import annotations

import torch

from bench.kinds import Skip
from bench.timing import time_ms
from bench.compat import preset
from qtrain.kernels.attention import causal_attention
from qtrain.model.layers import sdpa_backends


def make_inputs(B: int, T: int, nh: int, nkv: int, hs: int) -> tuple[torch.Tensor, ...]:
    """q, k, v as the block makes them: views of a (B, T, heads, hs) tensor, transposed to (B, heads, T, hs)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(B, T, nh + 2 * nkv, hs, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v = qkv.split([nh, nkv, nkv], dim=2)
    return tuple(t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))


def run_case(name: str, B: int, T: int, *, compiled: bool, samples: int) -> list[dict]:
    cfg = preset(name)
    nh, nkv, hs = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q, k, v = make_inputs(B, T, nh, nkv, hs)
    dout = torch.randn(B, T, nh, hs, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    fwd_flop = 2 * 2 * B * nh * T * T * hs / 2
    rows, ref = [], None
    for backend in ("flash", "cudnn", "cudnn-op"):
        def attn(q, k, v, backend=backend):
            if backend == "cudnn-op":  # qtrain's opaque op pair (what --sdpa-backend cudnn runs)
                return causal_attention(q, k, v)
            with sdpa_backends(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nh != nkv)
        fn = torch.compile(attn, dynamic=False) if compiled else attn
        try:
            out = fn(q, k, v)
            grads = torch.autograd.grad(out, (q, k, v), dout)
        except Exception as e:  # a backend that refuses the shape is a result, not a crash
            rows.append(dict(model=name, backend=backend, compiled=compiled, error=str(e).splitlines()[0][:90]))
            continue
        if ref is None:
            ref = (out.float(), [g.float() for g in grads])
        err = max([(out.float() - ref[0]).abs().max().item()]
                  + [(g.float() - r).abs().max().item() / max(r.abs().max().item(), 1e-6)
                     for g, r in zip(grads, ref[1])])
        fwd = time_ms(lambda: fn(q, k, v), samples=samples, warmup=3)
        both = time_ms(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), dout), samples=samples, warmup=3)
        rows.append(dict(model=name, backend=backend, compiled=compiled, fwd_ms=fwd, fwd_bwd_ms=both,
                         fwd_tflops=fwd_flop / fwd / 1e9, bwd_tflops=2.5 * fwd_flop / max(both - fwd, 1e-6) / 1e9,
                         max_rel_err_vs_flash=err))
    return rows


def run(models: list[str] = ("Qwen2.5-0.5B", "Qwen2.5-1.5B", "Qwen2.5-7B", "Qwen2.5-14B"), tokens: int = 32768,
        seq: int = 1024, samples: int = 5) -> dict:
    rows = []
    for name in models:
        for compiled in (False, True):
            rows += run_case(name, max(1, tokens // seq), seq, compiled=compiled, samples=samples)
    print(f"{'model':14s} {'backend':10s} {'comp':5s} {'fwd ms':>8s} {'f+b ms':>8s} {'fwd TF':>7s} {'bwd TF':>7s} "
          f"{'err':>8s}")
    for r in rows:
        head = f"{r['model']:14s} {r['backend']:10s} {str(r['compiled']):5s}"
        if "error" in r:
            print(f"{head} FAILED: {r['error']}")
        else:
            print(f"{head} {r['fwd_ms']:8.2f} {r['fwd_bwd_ms']:8.2f} {r['fwd_tflops']:7.0f} {r['bwd_tflops']:7.0f} "
                  f"{r['max_rel_err_vs_flash']:8.1e}")
    failed = [f"{r['model']} {r['backend']}{' compiled' if r['compiled'] else ''}" for r in rows if "error" in r]
    return {"rows": rows, "summary": f"{len(rows) - len(failed)} timed" + (f"; failed: {', '.join(failed)}" if failed
                                                                          else "")}


def dry_run(params: dict) -> dict:
    raise Skip("times flash / cuDNN attention kernels: needs a CUDA GPU")
