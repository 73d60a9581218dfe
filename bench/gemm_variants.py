"""Kind `gemm-variants`: can the 14B step's bf16 GEMMs run faster than cuBLAS's default choice? And do they hold their rate under
sustained load (clocks, power)?

For the largest block linears of a model (gate+up: K=C, N=2F; down: K=F, N=C) at M tokens, each of the three
training GEMMs (fwd x @ W^T, dgrad dY @ W, wgrad dY^T @ x) through
  cublas     torch's default BLAS path
  cublaslt   torch.backends.cuda.preferred_blas_library("cublaslt")
  autotune   torch.compile(mode="max-autotune-no-cudagraphs"): inductor times its Triton GEMM templates
             against aten's and keeps the fastest (slow to compile: a few shapes only)
then one GEMM repeated for `--sustain` seconds, printing TFLOP/s, SM clock and power once a second.

Parameters: model (preset), tokens (M, 8192), sustain (seconds, 10), autotune (true). Result: `rows`, one per
GEMM with TFLOP/s per library, and `sustained` (TFLOP/s and the nvidia-smi reading, once a second).
"""
from __future__ import annotations

import subprocess
import time

import torch

from bench.kinds import Skip
from bench.timing import time_ms
from bench.compat import preset


def smi(gpu: int) -> str:
    try:
        return subprocess.run(["nvidia-smi", "-i", str(gpu), "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=5).stdout.strip()
    except Exception as e:  # noqa: BLE001 - a reading, not a result
        return repr(e)[:40]


def run(model: str = "Qwen2.5-14B", tokens: int = 8192, sustain: float = 10.0, autotune: bool = True) -> dict:
    cfg = preset(model)
    C, F_, M = cfg.hidden_size, cfg.intermediate_size, tokens
    dev = torch.device("cuda")
    gpu = torch.cuda.current_device()
    print(torch.cuda.get_device_name(), torch.__version__, model, f"M={M}", smi(gpu), flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for name, (K, N) in {"up": (C, 2 * F_), "down": (F_, C)}.items():
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=g)
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16, generator=g) * K ** -0.5
        dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16, generator=g)
        gemms = {"fwd": (lambda a_, b_: a_ @ b_.t(), x, w), "dgrad": (lambda a_, b_: a_ @ b_, dy, w),
                 "wgrad": (lambda a_, b_: a_.t() @ b_, dy, x)}
        for gname, (fn, u, v) in gemms.items():
            tf = lambda ms: 2 * M * K * N / ms / 1e9  # noqa: E731
            res = {}
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                res[lib] = tf(time_ms(lambda: fn(u, v), samples=10, warmup=3))
            torch.backends.cuda.preferred_blas_library("cublas")
            if autotune and name == "up":
                torch._dynamo.reset()
                cf = torch.compile(fn, mode="max-autotune-no-cudagraphs", dynamic=False)
                t0 = time.perf_counter()
                cf(u, v)
                res["autotune"] = tf(time_ms(lambda: cf(u, v), samples=10, warmup=3))
                res["compile_s"] = time.perf_counter() - t0
            rows.append((f"{name}.{gname}", res))
            print(f"{name}.{gname}", {k: round(v_) for k, v_ in res.items()}, flush=True)
        del x, w, dy

    # sustained: the gate+up forward GEMM back to back
    K, N = C, 2 * F_
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=g)
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16, generator=g) * K ** -0.5
    flop = 2 * M * K * N
    t_end = time.perf_counter() + sustain
    sustained = []
    print("sustained up.fwd: TFLOP/s per second, then 'SM MHz, W, C'", flush=True)
    while time.perf_counter() < t_end:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        n = 0
        t1 = time.perf_counter()
        while time.perf_counter() - t1 < 1.0:
            for _ in range(20):
                x @ w.t()
            n += 20
            torch.cuda.synchronize()
        e.record()
        e.synchronize()
        sustained.append((round(n * flop / s.elapsed_time(e) / 1e9), smi(gpu)))
        print(f"  {sustained[-1][0]:6.0f}  {sustained[-1][1]}", flush=True)

    print(f"{'gemm':12s} {'cublas':>7} {'cublaslt':>8} {'autotune':>8}  (TFLOP/s, M={M})")
    for n_, r in rows:
        print(f"{n_:12s} {r['cublas']:7.0f} {r['cublaslt']:8.0f} {r.get('autotune', float('nan')):8.0f}")
    return {"rows": [dict(gemm=n_, **{k: round(v, 1) for k, v in r.items()}) for n_, r in rows],
            "sustained": sustained,
            "summary": " ".join(f"{n_} {r['cublas']:.0f}/{r['cublaslt']:.0f}" for n_, r in rows) + " TFLOP/s"}


def dry_run(params: dict) -> dict:
    raise Skip("times cuBLAS / cuBLASLt / inductor GEMMs and reads nvidia-smi: needs a CUDA GPU")
