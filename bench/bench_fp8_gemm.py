"""Kind `fp8-gemm`: bf16 torch.matmul vs FP8 scaled_mm for the Qwen2.5 block linears, forward and both backward GEMMs.

For each model and each block linear (QKV: K=C, N=qkv_dim; O: K=C, N=C; up: K=C, N=2F; down: K=F, N=C)
at M = B*T tokens:
  fwd    y  (M, N) = x  (M, K) @ W^T      dgrad  dX (M, K) = dY (M, N) @ W      wgrad  dW (N, K) = dY^T @ x
Columns: bf16 torch.matmul; FP8 GEMM alone on operands already quantized in the layouts cuBLASLt needs
(split accumulator, and with use_fast_accum); FP8 including the quantization each GEMM needs from bf16
(abs-max, cast, transposed copies; the weight's e4m3 copy is cached, its transposed copy is not); and the
whole layer, fp8_linear forward+backward (cached weight) vs F.linear forward+backward in bf16, which is what
training pays, both eagerly (host launch overhead included: small layers are host-bound) and replayed from
a CUDA graph (GPU time only). Timing: torch.cuda.Event around `reps` back-to-back calls, median of
`samples` samples, after warmup. TFLOP/s = 2*M*N*K / time (x3 for a layer's forward+backward).

Needs CUDA, sm89+. Parameters: models (presets; 0.5B, 1.5B, 7B), tokens (M = B*T per micro-batch, 16384),
grad_dtype (e4m3 | e5m2), samples (20), warmup (5). Result: `rows` (one per GEMM and layer, as printed).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from bench.kinds import Skip
from bench.timing import graphed_ms, time_ms
from qtrain.kernels.fp8_quant import E4M3, E5M2, fp8_quantize
from bench.compat import preset
from qtrain.kernels.scaled_mm import scaled_mm
from qtrain.numerics.fp8 import Fp8WeightCache, fp8_linear


def block_linears(model: str) -> list[tuple[str, int, int, bool]]:
    """(name, K, N, has_bias) of the four FP8 block linears, from the model preset."""
    c = preset(model)
    C, F_ = c.hidden_size, c.intermediate_size
    return [("qkv", C, c.qkv_dim, c.attention_bias), ("o", c.q_dim, C, False),
            ("up", C, 2 * F_, False), ("down", F_, C, False)]


@dataclass
class Row:
    model: str
    layer: str
    gemm: str  # fwd | dgrad | wgrad | layer (fwd+bwd)
    M: int
    K: int
    N: int
    bf16_ms: float
    fp8_ms: float  # GEMM only (layer: fp8_linear fwd+bwd, everything included)
    fp8_fast_ms: float  # GEMM only, use_fast_accum=True (nan for the layer row)
    fp8_quant_ms: float  # GEMM + the quantization it needs (same as fp8_ms for the layer row)
    rel_err: float  # ||fp8 - bf16|| / ||bf16|| of this GEMM's output (layer: of dX)
    bf16_graph_ms: float = float("nan")  # layer rows: the same work replayed from a CUDA graph
    fp8_graph_ms: float = float("nan")

    def tflops(self, ms: float) -> float:
        flops = 2 * self.M * self.N * self.K * (3 if self.gemm == "layer" else 1)
        return flops / (ms * 1e-3) / 1e12


def bench_layer(model: str, layer: str, M: int, K: int, N: int, has_bias: bool, grad_dtype: torch.dtype,
                samples: int, warmup: int) -> list[Row]:
    dev = "cuda"
    torch.manual_seed(0)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * K**-0.5
    dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    b = torch.randn(N, device=dev, dtype=torch.bfloat16) if has_bias else None
    # Operands pre-quantized in the layouts each GEMM needs (row-major mat1, column-major mat2).
    xq, xqt, sx = fp8_quantize(x, E4M3, transpose=True)
    wq, _, sw = fp8_quantize(w, E4M3)
    wqt = wq.t().contiguous()
    dyq, dyqt, sdy = fp8_quantize(dy, grad_dtype, transpose=True)
    t = lambda fn: time_ms(fn, samples=samples, warmup=warmup)  # noqa: E731

    def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
        return ((a.float() - ref.float()).norm() / ref.float().norm()).item()

    gemms = {
        "fwd": (lambda: x @ w.t(),
                lambda fast: scaled_mm(xq, wq.t(), sx, sw, use_fast_accum=fast),
                lambda: _fwd_with_quant(x, wq, sw)),
        "dgrad": (lambda: dy @ w,
                  lambda fast: scaled_mm(dyq, wqt.t(), sdy, sw, use_fast_accum=fast),
                  lambda: _dgrad_with_quant(dy, wq, sw, grad_dtype)),
        "wgrad": (lambda: dy.t() @ x,
                  lambda fast: scaled_mm(dyqt, xqt.t(), sdy, sx, use_fast_accum=fast),
                  lambda: _wgrad_with_quant(dy, x, grad_dtype)),
    }
    rows = []
    for name, (bf16_fn, fp8_fn, fp8_q_fn) in gemms.items():
        k_inner = {"fwd": K, "dgrad": N, "wgrad": M}[name]
        m_out, n_out = {"fwd": (M, N), "dgrad": (M, K), "wgrad": (N, K)}[name]
        rows.append(Row(model, layer, name, m_out, k_inner, n_out, t(bf16_fn), t(lambda: fp8_fn(False)),
                        t(lambda: fp8_fn(True)), t(fp8_q_fn), rel(fp8_fn(False), bf16_fn())))

    # The whole layer as training runs it: forward + backward (dX, dW, db), cached e4m3 weight.
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    bg = b.clone().requires_grad_() if b is not None else None
    inputs = (xg, wg) if bg is None else (xg, wg, bg)
    cache = Fp8WeightCache()

    def bf16_layer():
        return torch.autograd.grad(F.linear(xg, wg, bg), inputs, dy)

    def fp8_layer():
        return torch.autograd.grad(fp8_linear(xg, wg, bg, grad_dtype=grad_dtype, weight_fp8=cache.get(wg)),
                                   inputs, dy)

    bf16_ms, fp8_ms = t(bf16_layer), t(fp8_layer)
    g = lambda fn: graphed_ms(fn, samples=samples, warmup=warmup)  # noqa: E731
    rows.append(Row(model, layer, "layer", M, K, N, bf16_ms, fp8_ms, float("nan"), fp8_ms,
                    rel(fp8_layer()[0], bf16_layer()[0]), g(bf16_layer), g(fp8_layer)))
    return rows


def _fwd_with_quant(x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    xq, _, sx = fp8_quantize(x, E4M3)
    return scaled_mm(xq, wq.t(), sx, sw)


def _dgrad_with_quant(dy: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, grad_dtype: torch.dtype) -> torch.Tensor:
    dyq, _, sdy = fp8_quantize(dy, grad_dtype)
    return scaled_mm(dyq, wq.t().contiguous().t(), sdy, sw)


def _wgrad_with_quant(dy: torch.Tensor, x: torch.Tensor, grad_dtype: torch.dtype) -> torch.Tensor:
    _, dyqt, sdy = fp8_quantize(dy, grad_dtype, transpose=True)
    _, xqt, sx = fp8_quantize(x, E4M3, transpose=True)
    return scaled_mm(dyqt, xqt.t(), sdy, sx)


def print_tables(rows: list[Row]) -> None:
    print("\nPer GEMM (TFLOP/s; speedup vs bf16 for FP8 alone and FP8 incl. quantization; err = rel. L2 vs bf16)")
    hdr = (f"{'model':<13} {'layer':<5} {'gemm':<6} {'M':>6} {'K':>6} {'N':>6} | {'bf16':>6} {'fp8':>6} "
           f"{'fp8fa':>6} {'fp8+q':>6} | {'x fp8':>6} {'x +q':>6} | {'err':>6}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        fa = f"{r.tflops(r.fp8_fast_ms):6.0f}" if r.fp8_fast_ms == r.fp8_fast_ms else f"{'-':>6}"
        print(f"{r.model:<13} {r.layer:<5} {r.gemm:<6} {r.M:>6} {r.K:>6} {r.N:>6} | {r.tflops(r.bf16_ms):6.0f} "
              f"{r.tflops(r.fp8_ms):6.0f} {fa} {r.tflops(r.fp8_quant_ms):6.0f} | {r.bf16_ms / r.fp8_ms:6.2f} "
              f"{r.bf16_ms / r.fp8_quant_ms:6.2f} | {r.rel_err:6.3f}")
    print("\nLayer rows, CUDA-graph replay (GPU time only, ms): bf16 / fp8 / speedup")
    for r in rows:
        if r.gemm == "layer":
            print(f"  {r.model:<13} {r.layer:<5} {r.bf16_graph_ms:8.3f} {r.fp8_graph_ms:8.3f} "
                  f"{r.bf16_graph_ms / r.fp8_graph_ms:6.2f}")
    print("\nSummary: the four block linears, forward + backward for M tokens (fp8_linear vs F.linear), ms")
    print(f"{'model':<13} {'bf16':>8} {'fp8':>8} {'speedup':>8} | {'bf16 grph':>9} {'fp8 grph':>9} {'speedup':>8} "
          f"| {'GEMM-only speedup':>17}")
    for model in dict.fromkeys(r.model for r in rows):
        layer = [r for r in rows if r.model == model and r.gemm == "layer"]
        gemm = [r for r in rows if r.model == model and r.gemm != "layer"]
        bf, fp = sum(r.bf16_ms for r in layer), sum(r.fp8_ms for r in layer)
        bfg, fpg = sum(r.bf16_graph_ms for r in layer), sum(r.fp8_graph_ms for r in layer)
        gbf, gfp = sum(r.bf16_ms for r in gemm), sum(r.fp8_ms for r in gemm)
        print(f"{model:<13} {bf:8.3f} {fp:8.3f} {bf / fp:8.2f} | {bfg:9.3f} {fpg:9.3f} {bfg / fpg:8.2f} "
              f"| {gbf / gfp:17.2f}")


def run(models: list[str] = ("Qwen2.5-0.5B", "Qwen2.5-1.5B", "Qwen2.5-7B"), tokens: int = 16384,
        grad_dtype: str = "e4m3", samples: int = 20, warmup: int = 5) -> dict:
    if grad_dtype not in ("e4m3", "e5m2"):
        raise ValueError(f"grad_dtype={grad_dtype!r}: must be e4m3 or e5m2")
    gd = E4M3 if grad_dtype == "e4m3" else E5M2
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  cuda {torch.version.cuda}  "
          f"tokens {tokens}  grad {grad_dtype}")
    rows: list[Row] = []
    for model in models:
        for layer, K, N, has_bias in block_linears(model):
            new = bench_layer(model, layer, tokens, K, N, has_bias, gd, samples, warmup)
            for r in new:
                print(f"  {model} {layer} {r.gemm}: bf16 {r.bf16_ms:.3f} ms, fp8 {r.fp8_ms:.3f} ms, "
                      f"fp8+quant {r.fp8_quant_ms:.3f} ms, err {r.rel_err:.3f}", flush=True)
            rows += new
            torch.cuda.empty_cache()
    print_tables(rows)
    layer = {m: sum(r.bf16_ms for r in rows if r.model == m and r.gemm == "layer")
             / sum(r.fp8_ms for r in rows if r.model == m and r.gemm == "layer") for m in models}
    return {"rows": [asdict(r) for r in rows],
            "summary": "layer fp8 speedup " + " ".join(f"{m.split('-')[-1]} {x:.2f}x" for m, x in layer.items())}


def dry_run(params: dict) -> dict:
    raise Skip("times cuBLASLt FP8 GEMMs (sm89+) with CUDA events and graphs: needs a CUDA GPU")
