"""Kind `wgrad-split`: do the block linears' weight-gradient GEMMs fill the GPU?

wgrad dW (N, K) = dY^T (N, M) @ X (M, K) has M = tokens (65,536 at 1.5B e4m3) as its reduction dimension and only
N x K outputs: at Qwen2.5-1.5B the O projection's 1536 x 1536 is 72 tiles of 128 x 256 on 132 SMs, the QKV's 2048 x
1536 96. Unless cuBLAS splits the reduction itself, part of the GPU idles through the longest GEMMs of the step.
Here each wgrad runs as qtrain issues it and split in s slices of the reduction (the partial products in fp32,
summed, rounded once to bf16), for bf16 (`torch.bmm(..., out_dtype=float32)` over s contiguous slices) and e4m3
(`scaled_mm` per slice of the transposed operands, fp32 out). fwd and dgrad are timed for reference.

Parameters: model (preset), tokens (M), splits ((2, 4)), dtypes (("bf16", "e4m3")), samples (10). Result: `rows`
(TFLOP/s per linear, dtype and variant) and `best_ms` (per micro-step, the four wgrads as now and at their best
split).
"""
from __future__ import annotations

import torch

from bench.gemm_ceiling import block_linear_shapes, fp8_linear_gemms, linear_gemms, linear_operands
from bench.kinds import Skip
from bench.timing import time_ms
from bench.compat import preset


def _bf16_fns(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, splits) -> dict:
    M, N = dy.shape
    K = x.shape[1]
    gemms = linear_gemms(x, w, dy)
    fns = {"fwd": gemms["fwd"], "dgrad": gemms["dgrad"], "now": gemms["wgrad"]}
    for s in splits:
        a, b = dy.view(s, M // s, N).transpose(1, 2), x.view(s, M // s, K)
        fns[f"s{s}"] = lambda a=a, b=b: torch.bmm(a, b, out_dtype=torch.float32).sum(0).to(torch.bfloat16)
    return fns


def _fp8_fns(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, splits) -> dict:
    from qtrain.numerics.fp8 import scaled_mm
    gemms, ops = fp8_linear_gemms(x, w, dy)
    dqt, xqt, di, xi = ops["dqt"], ops["xqt"], ops["di"], ops["xi"]
    M = dy.shape[0]
    fns = {"fwd": gemms["fwd"], "dgrad": gemms["dgrad"], "now": gemms["wgrad"]}
    for s in splits:
        sl = [slice(M * i // s, M * (i + 1) // s) for i in range(s)]

        def split(sl=sl):
            acc = scaled_mm(dqt[:, sl[0]], xqt[:, sl[0]].t(), di, xi, out_dtype=torch.float32)
            for part in sl[1:]:
                acc += scaled_mm(dqt[:, part], xqt[:, part].t(), di, xi, out_dtype=torch.float32)
            return acc.to(torch.bfloat16)
        fns[f"s{s}"] = split
    return fns


def run(model: str = "Qwen2.5-1.5B", tokens: int = 65536, splits: tuple[int, ...] = (2, 4),
        dtypes: tuple[str, ...] = ("bf16", "e4m3"), samples: int = 10) -> dict:
    linears = block_linear_shapes(preset(model))
    M, dev = tokens, "cuda"
    print(torch.cuda.get_device_name(), torch.__version__, model, f"M={M}", flush=True)
    rows, best_ms = [], {}
    for dtype in dtypes:
        now_total = best_total = 0.0
        for lin, (K, N) in linears.items():
            x, w, dy = linear_operands(M, K, N, dev)
            fns = (_fp8_fns if dtype == "e4m3" else _bf16_fns)(dy, x, w, splits)
            ref = fns["now"]().float()
            row = {"dtype": dtype, "linear": lin, "N": N, "K": K}
            ms = {}
            for name, fn in fns.items():
                if name.startswith("s"):  # a split must give the same product (fp32 sums in another order)
                    err = ((fn().float() - ref).norm() / ref.norm()).item()
                    if err > 1e-2:
                        raise AssertionError(f"{dtype} {lin} {name}: relative error {err:.2e} against one GEMM")
                ms[name] = time_ms(fn, samples=samples, warmup=2)
                row[name] = round(2 * M * N * K / ms[name] / 1e9)
            now_total += ms["now"]
            best_total += min(v for k, v in ms.items() if k == "now" or k.startswith("s"))
            rows.append(row)
            print(row, flush=True)
            del x, w, dy, fns, ref
        best_ms[dtype] = {"now": round(now_total, 3), "best": round(best_total, 3)}
    cols = ["fwd", "dgrad", "now"] + [f"s{s}" for s in splits]
    print(f"{'dtype':5s} {'lin':4s} {'N':>6s} {'K':>6s} " + " ".join(f"{c:>6s}" for c in cols) + "  (TFLOP/s)")
    for r in rows:
        print(f"{r['dtype']:5s} {r['linear']:4s} {r['N']:6d} {r['K']:6d} " + " ".join(f"{r[c]:6d}" for c in cols))
    print("wgrad ms per micro-step and layer, as now and at the best split:", best_ms)
    return {"rows": rows, "best_ms": best_ms,
            "summary": " ".join(f"{d}: {v['now']}->{v['best']} ms" for d, v in best_ms.items())}


def dry_run(params: dict) -> dict:
    raise Skip("times cuBLAS bf16 and FP8 GEMMs: needs a CUDA GPU")
