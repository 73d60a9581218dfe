"""Kind `head-gemms`: the LM head's three bf16 GEMMs (`model.loss.lm_head_loss_and_grads`) by chunk size and by
formulation: can they run nearer cuBLAS's block-GEMM rate than the ~700 TFLOP/s the 1.5B profiles show?

Per chunk of n rows (hidden h (n, C), head W (V, C), d(logits) dl (n, V)), each GEMM as qtrain issues it now and in
other forms cuBLAS may tile better:
  fwd  logits = h @ W^T           now: mm                      T: (W @ h^T), the logits transposed
  dh   d(h) = dl @ W              now: addmm beta 0 into d(h)   mm: plain mm; T: (W^T @ dl^T), d(h) transposed
  dw   d(W) += dl^T @ h           now: addmm beta 1 into d(W)   b0: beta 0; T: d(W)^T += h^T @ dl (W kept as (C, V))
each also through cuBLASLt (`lt`), and with the vocabulary padded to a multiple of 256 (`pad`: Qwen2's 151,936 is
a multiple of 128 only). The forms that transpose an output would need the cross-entropy or the update to read
that layout: measured first, built only if one pays.

Parameters: model (preset), rows (chunk sizes n), samples (10). Result: `rows` (TFLOP/s per GEMM and variant), and
`head_ms` (ms of the three GEMMs as issued now, per 65,536 tokens, per chunk size).
"""
from __future__ import annotations

import torch

from bench.kinds import Skip
from bench.timing import time_ms
from bench.compat import preset


def _variants(h: torch.Tensor, w: torch.Tensor, dl: torch.Tensor, dh: torch.Tensor, dw: torch.Tensor,
              dwt: torch.Tensor) -> dict[str, dict[str, object]]:
    return {
        "fwd": {"now": lambda: h @ w.t(), "T": lambda: w @ h.t()},
        "dh": {"now": lambda: torch.addmm(dh, dl, w, beta=0, alpha=0.5, out=dh), "mm": lambda: dl @ w,
               "T": lambda: w.t() @ dl.t()},
        "dw": {"now": lambda: torch.addmm(dw, dl.t(), h, beta=1, alpha=0.5, out=dw),
               "b0": lambda: torch.addmm(dw, dl.t(), h, beta=0, alpha=0.5, out=dw),
               "T": lambda: torch.addmm(dwt, h.t(), dl, beta=1, alpha=0.5, out=dwt)},
    }


def run(model: str = "Qwen2.5-1.5B", rows: tuple[int, ...] = (8192, 16384, 32768), samples: int = 10) -> dict:
    cfg = preset(model)
    C, V0 = cfg.hidden_size, cfg.vocab_size
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__, model, f"C={C} V={V0}", flush=True)
    out, head_ms = [], {}
    for V in (V0, -(-V0 // 256) * 256):
        w = torch.randn(V, C, device=dev, dtype=torch.bfloat16, generator=g) * C ** -0.5
        dw, dwt = torch.zeros_like(w), torch.zeros(C, V, device=dev, dtype=torch.bfloat16)
        for n in rows:
            h = torch.randn(n, C, device=dev, dtype=torch.bfloat16, generator=g)
            dl = torch.randn(n, V, device=dev, dtype=torch.bfloat16, generator=g) * 1e-3
            dh = torch.empty_like(h)
            tf = lambda ms: 2 * n * C * V / ms / 1e9  # noqa: E731
            now_ms = 0.0
            for gemm, forms in _variants(h, w, dl, dh, dw, dwt).items():
                row = {"V": V, "n": n, "gemm": gemm}
                for form, fn in forms.items():
                    for lib in ("cublas", "cublaslt"):
                        if lib == "cublaslt" and form != "now":
                            continue
                        torch.backends.cuda.preferred_blas_library(lib)
                        ms = time_ms(fn, samples=samples, warmup=2)
                        row[form if lib == "cublas" else "lt"] = round(tf(ms))
                        if form == "now" and lib == "cublas":
                            now_ms += ms
                    torch.backends.cuda.preferred_blas_library("cublas")
                out.append(row)
                print(row, flush=True)
            if V == V0:
                head_ms[n] = round(now_ms * 65536 / n, 2)
            del h, dl, dh
        del w, dw, dwt
        torch.cuda.empty_cache()
    forms = ["now", "lt", "mm", "b0", "T"]
    print(f"{'V':>7} {'n':>6} {'gemm':4s} " + " ".join(f"{f:>5s}" for f in forms) + "  (TFLOP/s)")
    for r in out:
        print(f"{r['V']:7d} {r['n']:6d} {r['gemm']:4s} " + " ".join(f"{r.get(f, ''):>5}" for f in forms))
    print("the three GEMMs as issued now, ms per 65,536 tokens, by chunk rows:", head_ms)
    return {"rows": out, "head_ms": head_ms,
            "summary": " ".join(f"n{n}:{ms}ms" for n, ms in head_ms.items()) + " per 65k tokens"}


def dry_run(params: dict) -> dict:
    raise Skip("times cuBLAS GEMMs at the LM head's shapes: needs a CUDA GPU")
