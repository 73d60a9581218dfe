"""Kind `rope`: times the RoPE backward kernel (qtrain/kernels/rope.py, which also assembles d(qkv)) at a model's
head layout on the GPU against torch.compile's code for its twin (what the block would run without the kernel) and
a device copy of the same bytes, each checked bit for bit against the twin.

Parameters: model (a preset: its head layout and RoPE tables; Qwen2.5-1.5B), B, T (64 x 1024). Prints one line per
variant: ms per call and the bytes it must move / time; the result has them as `rows`.
"""
from __future__ import annotations

import torch

from bench.kinds import Skip


def run(model: str = "Qwen2.5-1.5B", B: int = 64, T: int = 1024) -> dict:
    import triton

    from qtrain.kernels import rope
    from bench.compat import preset
    from qtrain.kernels.rope import rope_tables
    cfg = preset(model)
    nh, nkv, hs = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(torch.bfloat16)

    dq, dk, dv = randn(B, T, nh, hs), randn(B, T, nkv, hs), randn(B, T, nkv, hs)
    cos, sin = rope_tables(cfg, T, "cuda", torch.bfloat16)
    args = (dq, dk, dv, cos, sin)
    want = rope.rope_qkv_backward_twin(*args)
    nbytes = 2 * want.numel() * want.element_size()  # d(qkv) read as dq, dk, dv and written once
    rows = []

    def line(name, fn, check=True):
        same = torch.equal(fn(), want) if check else None
        t = triton.testing.do_bench(fn, warmup=10, rep=60)
        print(f"{name:44s} {t:7.3f} ms  {nbytes / t / 1e9:6.2f} TB/s{'  WRONG' if same is False else ''}", flush=True)
        rows.append(dict(kernel=name, ms=round(t, 4), tbs=round(nbytes / t / 1e9, 2), same=same))

    line("kernel", lambda: rope.rope_qkv_backward_triton(*args))
    compiled = torch.compile(rope.rope_qkv_backward_twin, dynamic=False)
    line("torch.compile of the twin", lambda: compiled(*args))
    dst = torch.empty_like(want)
    line("device copy of d(qkv)'s bytes", lambda: dst.copy_(want), check=False)
    return {"rows": rows, "summary": f"{len(rows)} variants timed"}


def dry_run(params: dict) -> dict:
    raise Skip("times a Triton kernel on the GPU (the CPU has only its interpreter): needs a CUDA GPU")
