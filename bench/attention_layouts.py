"""Probe: which layouts cuDNN's attention kernels return and how layouts change the backward's time, at the
Qwen2.5-1.5B shape (32 x 1024 tokens, 12 / 2 heads of 128). Prints the strides of the forward's output and
log-sum-exp and of the backward's gradients, then times the backward with out / dout given as BTHD (the
block's layout) or BHTD (contiguous), and qtrain's op pair (kernels/attention.py) eagerly.

    python -m bench.attention_layouts
"""
from __future__ import annotations

import torch

from bench.bench_attention import make_inputs
from bench.bench_fp8_gemm import time_ms
from qtrain.kernels.attention import causal_attention

aten = torch.ops.aten


def main() -> None:
    B, T, nh, nkv, hs = 32, 1024, 12, 2, 128
    q, k, v = (t.detach() for t in make_inputs(B, T, nh, nkv, hs))
    r = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False)
    out, lse = r[0], r[1]
    print("q", q.stride(), "out", out.shape, out.stride(), "lse", lse.shape, lse.stride(), "seed", r[6], r[7])
    dout_bthd = torch.randn(B, T, nh, hs, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    dout_bhtd = dout_bthd.contiguous()
    out_bthd = torch.empty_like(dout_bthd).copy_(out)
    out_bhtd = out.contiguous()

    def bwd(o, do, l=lse, seed=r[6], off=r[7]):
        return aten._scaled_dot_product_cudnn_attention_backward(do, q, k, v, o, l, seed, off, None, r[2], r[3], T, T,
                                                                 0.0, True)
    g = bwd(out, dout_bthd)
    print("dq", g[0].stride(), "dk", g[1].stride(), "dv", g[2].stride())
    rows = {}
    for name, o, do in (("out native, dout BTHD", out, dout_bthd), ("out native, dout BHTD", out, dout_bhtd),
                        ("out BTHD, dout BTHD", out_bthd, dout_bthd), ("out BHTD, dout BHTD", out_bhtd, dout_bhtd),
                        ("out BTHD, dout BHTD", out_bthd, dout_bhtd)):
        rows[name] = time_ms(lambda: bwd(o, do), samples=5, warmup=3)
    zeros = torch.zeros(1, dtype=torch.int64, device="cuda")
    rows["out native, dout BTHD, zero seed, no cum"] = time_ms(
        lambda: aten._scaled_dot_product_cudnn_attention_backward(dout_bthd, q, k, v, out, lse, zeros, zeros, None,
                                                                  None, None, T, T, 0.0, True), samples=5, warmup=3)
    rows["forward (raw)"] = time_ms(lambda: aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True,
                                                                                    False), samples=5, warmup=3)
    qg, kg, vg = make_inputs(B, T, nh, nkv, hs)

    def op_fb():
        torch.autograd.grad(causal_attention(qg, kg, vg), (qg, kg, vg), dout_bthd)
    rows["qtrain op forward+backward"] = time_ms(op_fb, samples=5, warmup=3)
    for name, ms in rows.items():
        print(f"{name:45s} {ms:7.3f} ms")


if __name__ == "__main__":
    main()
