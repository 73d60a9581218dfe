"""Kind `swiglu-fp8`: times the FP8-MLP kernels at Qwen2.5-1.5B shapes (M = 16384 tokens, F = 8960) on the GPU,
over launch tiles (the launchers' parameters), against a device copy of the same bytes: how the tiles in
qtrain/kernels/swiglu/activation.py, swiglu/fp8.py and fp8_quant.py were chosen.

Parameters: M, F, onepass (time `kernels/swiglu/fp8_onepass.py` instead: the forward and backward straight to
e4m3 with a right and a missed scale hint, against the two-pass pipelines they replace, over tiles, every tile
checked bit for bit against the two-pass kernels' values quantized with the same power-of-two scale). Prints one
line per variant: ms per call and the bytes it must move / time; the result has them as `rows`.
"""
from __future__ import annotations

import torch

from bench.kinds import Skip

E4M3 = torch.float8_e4m3fn

# launch tiles tried, (block_m, block_f or block_n, num_warps); the first of each is the launcher's default
BWD_TILES = ((16, 256, 4), (8, 512, 4))
FWD_TILES = ((16, 256, 4), (32, 256, 8), (8, 512, 4), (16, 512, 8), (32, 128, 4))
QUANT_TILES = ((64, 256, 8), (64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 8), (32, 128, 4), (128, 128, 4))
FWD_ONEPASS_TILES = ((64, 128, 8), (64, 64, 4), (64, 256, 8), (32, 128, 4), (32, 128, 8), (64, 128, 4), (128, 64, 8))
BWD_ONEPASS_TILES = ((32, 128, 8), (64, 64, 8), (32, 128, 4), (32, 256, 8), (16, 256, 4), (32, 64, 4), (64, 128, 8),
                     (32, 128, 16))

ROWS: list[dict] = []


def ms(fn) -> float:
    import triton
    return triton.testing.do_bench(fn, warmup=10, rep=60)


def line(name: str, t: float, nbytes: float) -> None:
    print(f"{name:48s} {t:7.3f} ms  {nbytes / t / 1e9:6.2f} TB/s", flush=True)
    ROWS.append(dict(kernel=name, ms=round(t, 4), tbs=round(nbytes / t / 1e9, 2)))


def tile_kwargs(tile: tuple[int, int, int], columns: str = "block_f") -> dict[str, int]:
    bm, bc, warps = tile
    return {"block_m": bm, columns: bc, "num_warps": warps}


def run(M: int = 16384, F: int = 8960, onepass: bool = False) -> dict:
    from qtrain.kernels.fp8_quant import fp8_quantize_torch, fp8_quantize_triton
    from qtrain.kernels.swiglu import activation as sw
    from qtrain.kernels.swiglu.fp8 import swiglu_forward_amax_triton, swiglu_fp8_triton
    ROWS.clear()
    u = (torch.randn(M, 2 * F, device="cuda") * 3).bfloat16()
    d = torch.randn(M, F, device="cuda").bfloat16()
    if onepass:
        return run_onepass(u, d)
    ub = u.numel() * 2
    dst = torch.empty_like(u)
    line("copy u (read+write 2 x M*2F bf16)", ms(lambda: dst.copy_(u)), 2 * ub)
    line("swiglu_backward", ms(lambda: sw.swiglu_backward_triton(d, u)), 2 * ub + d.numel() * 2)
    for tile in BWD_TILES:
        kw = tile_kwargs(tile)
        line(f"swiglu_backward + amax tile {'x'.join(map(str, tile[:2]))} w{tile[2]}",
             ms(lambda: sw.swiglu_backward_triton(d, u, amax=True, **kw)), 2 * ub + d.numel() * 2)
    line("swiglu forward + amax (pass 1)", ms(lambda: swiglu_forward_amax_triton(u)), ub + M * F * 2)
    line("swiglu_fp8 (both passes)", ms(lambda: swiglu_fp8_triton(u, E4M3)), ub + 2 * M * F * 2 + 2 * M * F)
    for tile in FWD_TILES:
        kw = tile_kwargs(tile)
        line(f"swiglu forward + amax tile {'x'.join(map(str, tile[:2]))} w{tile[2]}",
             ms(lambda: swiglu_forward_amax_triton(u, **kw)), ub + M * F * 2)
    amax = u.float().abs().max()
    want = [t.view(torch.uint8) for t in fp8_quantize_torch(u, E4M3, amax, transpose=True)[:2]]
    for tile in QUANT_TILES:  # the tile changes no number: each variant is checked against the twin
        kw = tile_kwargs(tile, "block_n")
        got = [t.view(torch.uint8) for t in fp8_quantize_triton(u, E4M3, amax, transpose=True, **kw)[:2]]
        ok = all(torch.equal(g, r) for g, r in zip(got, want))
        line(f"fp8_quantize_triton(du, amax, transpose) {'x'.join(map(str, tile[:2]))} w{tile[2]}"
             f"{'' if ok else ' WRONG'}", ms(lambda: fp8_quantize_triton(u, E4M3, amax, transpose=True, **kw)),
             ub + u.numel() * 2)
    return {"rows": list(ROWS), "summary": f"{len(ROWS)} kernels timed"}


def run_onepass(u: torch.Tensor, d: torch.Tensor) -> dict:
    """The one-pass kernels: per call with the hint right (pass 1; pass 2's programs branch off) and missed (both
    passes), next to the two-pass pipelines they replace (SwiGLU kernel + quantize kernel), over tiles."""
    from qtrain.kernels.fp8_quant import fp8_quantize_triton
    from qtrain.kernels.swiglu import activation as sw
    from qtrain.kernels.swiglu import fp8_onepass as op
    from qtrain.kernels.swiglu.fp8 import swiglu_forward_amax_triton, swiglu_fp8_triton
    M, F = d.shape
    fwd_bytes, bwd_bytes = u.numel() * 2 + 2 * M * F, u.numel() * 2 + d.numel() * 2 + 2 * u.numel()
    line("two-pass forward: swiglu_fp8", ms(lambda: swiglu_fp8_triton(u, E4M3)), fwd_bytes)

    def two_pass_backward():
        du, amax = sw.swiglu_backward_triton(d, u, amax=True)
        return fp8_quantize_triton(du, E4M3, amax, transpose=True)

    line("two-pass backward: swiglu_backward + amax, quantize", ms(two_pass_backward), bwd_bytes)
    cases = (("forward", op.swiglu_fp8_onepass_triton, (u,), fwd_bytes, FWD_ONEPASS_TILES),
             ("backward", op.swiglu_backward_fp8_onepass_triton, (d, u), bwd_bytes, BWD_ONEPASS_TILES))
    h, _ = swiglu_forward_amax_triton(u)
    du, _ = sw.swiglu_backward_triton(d, u, amax=True)
    for (name, fn, args, nbytes, tiles), x in zip(cases, (h, du)):
        # the reference: the two-pass kernels' values quantized with the power-of-two scale (pow2_scale's 2^e
        # through the exact-scale quantizer given amax = 448 * 2^-e)
        e_true = int(op.pow2_scale(x.float().abs().max(), 448.0)[2])
        ref_amax = torch.tensor(448.0 * 2.0 ** -e_true, device="cuda")
        want = [t.view(torch.uint8) for t in fp8_quantize_triton(x, E4M3, ref_amax, transpose=True)[:2]]
        hint = op.new_scale_hint("cuda", 1)
        for tile in tiles:
            kw = tile_kwargs(tile)
            for label, value in (("hint right", e_true), ("hint missed", e_true + 1)):
                def call():
                    hint.fill_(value)
                    return fn(*args, E4M3, hint, **kw)
                bad = [int((g.view(torch.uint8) != r).sum()) for g, r in zip(call()[:2], want)]
                line(f"one-pass {name} {'x'.join(map(str, tile))}, {label}"
                     f"{'' if not any(bad) else f' WRONG {bad}'}", ms(call), nbytes)
    return {"rows": list(ROWS), "summary": f"{len(ROWS)} kernels timed"}


def dry_run(params: dict) -> dict:
    raise Skip("times Triton kernels on the GPU (the CPU has only their interpreter): needs a CUDA GPU")
