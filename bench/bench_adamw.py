"""Kind `adamw`: qtrain's fused AdamW kernel against ``torch._fused_adamw_`` on one CUDA GPU.

Parameters: numel (elements per tensor, 1.5e9), sweep (false; true: also time other (ROWS, num_warps)
launch shapes). Every configuration updates one flat tensor of ``--numel`` elements. "bytes" counts what one step must
move: read param, grad, m, v and write param, m, v (+ the e4m3 m scales, 4 bytes per 128 elements each
way); GB/s = bytes / median time. A device-to-device copy of a similar size is printed first as the
achievable bandwidth. ``torch._fused_adamw_`` needs param/m/v of one dtype, so mixed rows show only ours.
torch's bf16 row rounds to nearest (no SR); ours rounds stochastically. Results go to BENCHMARKS.md by hand.
Result: `rows` (one per configuration), `sweep_rows`, and each configuration's ms as `<key>_ms` (fp32, bf16,
bf16mix, e4m3: the scalars a suite's ratios and the harness table use, e.g. suite adamw-vs-base).
The timing goes through `adamw_update_` (and, for the sweep, `adamw_step_triton`'s keywords), which older
checkouts have too, so the same code times the kernel of another checkout (`bench.run --baseline`).
"""

from __future__ import annotations

import torch

from bench.kinds import Skip
from qtrain.kernels import adamw as kadamw
from qtrain.numerics.adamw import AdamWHyper, adamw_update_, m_scales_numel

F32, BF16, E4M3 = torch.float32, torch.bfloat16, torch.float8_e4m3fn
CONFIGS = [  # name, param, grad, m, v
    ("fp32 p,g,m,v", F32, F32, F32, F32),
    ("bf16 p,g,m,v (SR)", BF16, BF16, BF16, BF16),
    ("bf16 p,g + fp32 m,v", BF16, BF16, F32, F32),
    ("bf16 p,g,v + e4m3 m", BF16, BF16, E4M3, BF16),
]
KEYS = ("fp32", "bf16", "bf16mix", "e4m3")  # CONFIGS' result keys (`<key>_ms`), in order


def bytes_per_step(n: int, p, g, m, v) -> int:
    size = lambda dt: torch.empty(0, dtype=dt).element_size()  # noqa: E731
    b = n * (2 * size(p) + size(g) + 2 * size(m) + 2 * size(v))
    if m == E4M3:
        b += 2 * 4 * m_scales_numel(n)
    return b


def time_ms(fn, warmup: int = 3, iters: int = 10) -> float:
    """Median of ``iters`` CUDA-event timings, each of one call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def make(n: int, p_dt, g_dt, m_dt, v_dt):
    dev = "cuda"
    p = torch.randn(n, device=dev).to(p_dt)
    g = (torch.randn(n, device=dev) * 1e-2).to(g_dt)
    m = (torch.randn(n, device=dev) * 1e-3).to(m_dt)
    v = (torch.rand(n, device=dev) * 1e-4).to(v_dt)
    s = torch.full((m_scales_numel(n),), 1e-5, device=dev) if m_dt == E4M3 else None
    return p, g, m, v, s


def bench_ours(n: int, cfg, launch: dict | None = None) -> float:
    """ms of qtrain's update: `adamw_update_` as training calls it, or with `launch` (rows, num_warps) the kernel's
    launcher at that launch shape (the same step's scalars, passed directly)."""
    p, g, m, v, s = make(n, *cfg)
    hp = AdamWHyper(lr=1e-4, step=10, weight_decay=0.1)
    if launch is None:
        return time_ms(lambda: adamw_update_(p, g, m, v, hp=hp, decay=True, key=1, m_scales=s))
    scalars = dict(lr=hp.lr, beta1=hp.beta1, one_minus_beta1=1.0 - hp.beta1, beta2=hp.beta2,
                   one_minus_beta2=1.0 - hp.beta2, bias_corr1=1.0 - hp.beta1 ** hp.step,
                   bias_corr2=1.0 - hp.beta2 ** hp.step, eps=hp.eps, weight_decay=hp.weight_decay,
                   grad_scale=hp.grad_scale, key_param=1, key_m=2, key_v=3, offset=0)
    return time_ms(lambda: kadamw.adamw_step_triton(p, g, m, v, s, **scalars, **launch))


def bench_torch(n: int, cfg) -> float | None:
    p_dt, g_dt, m_dt, v_dt = cfg
    if not p_dt == g_dt == m_dt == v_dt:
        return None
    p, g, m, v, _ = make(n, *cfg)
    step = torch.tensor(10.0, device="cuda")

    def fused():
        torch._fused_adamw_([p], [g], [m], [v], [], [step], lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1,
                            eps=1e-8, amsgrad=False, maximize=False)

    return time_ms(fused)


def copy_bandwidth(nbytes: int) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6  # read + write, GB/s


def run(numel: float = 1.5e9, sweep: bool = False) -> dict:
    n = int(numel)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  numel {n:,}")
    copy = copy_bandwidth(8 * 2**30)
    print(f"device-to-device copy: {copy:.0f} GB/s (8 GiB read + written)")
    print(f"launch shape: ROWS={kadamw.ROWS} (x128 elements per program), num_warps={kadamw.NUM_WARPS}\n")
    print("| config | bytes/step | qtrain ms | qtrain GB/s | torch fused ms | torch GB/s | torch/qtrain |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    rows, sweep_rows, by_key = [], [], {}
    for key, (name, *cfg) in zip(KEYS, CONFIGS):
        nb = bytes_per_step(n, *cfg)
        ours = bench_ours(n, cfg)
        ref = bench_torch(n, cfg)
        torch.cuda.empty_cache()
        ref_cols = f"{ref:.2f} | {nb / ref / 1e6:.0f} | {ref / ours:.2f}" if ref else "- | - | -"
        print(f"| {name} | {nb / 1e9:.1f} GB | {ours:.2f} | {nb / ours / 1e6:.0f} | {ref_cols} |")
        rows.append(dict(config=name, bytes=nb, qtrain_ms=round(ours, 3), qtrain_gbs=round(nb / ours / 1e6),
                         torch_ms=round(ref, 3) if ref else None))
        by_key[f"{key}_ms"] = round(ours, 3)
    if sweep:
        print("\n| config | ROWS | num_warps | ms | GB/s |\n|---|---:|---:|---:|---:|")
        for name, *cfg in CONFIGS[:2] + CONFIGS[3:]:
            nb = bytes_per_step(n, *cfg)
            for rows_ in (4, 8, 16, 32):
                for warps in (4, 8):
                    ms = bench_ours(n, cfg, dict(rows=rows_, num_warps=warps))
                    print(f"| {name} | {rows_} | {warps} | {ms:.2f} | {nb / ms / 1e6:.0f} |")
                    sweep_rows.append(dict(config=name, rows=rows_, num_warps=warps, ms=round(ms, 3)))
            torch.cuda.empty_cache()
    return {"copy_gbs": round(copy), "rows": rows, "sweep_rows": sweep_rows, **by_key,
            "summary": " ".join(f"{r['config'].split(' (')[0]} {r['qtrain_ms']} ms" for r in rows)}


def dry_run(params: dict) -> dict:
    raise Skip("times a Triton kernel against torch's fused AdamW with CUDA events: needs a CUDA GPU")
