"""Kind `hopper-gemm` (issue 48): quack-kernels' GEMMs with fused epilogues (Dao-AILab's CuTe-DSL kernels, sm90)
against what qtrain's compiled bf16 block runs now, at a Qwen2.5 size's MLP and norm shapes, M = the tokens of one
micro-step. It answers whether fusing the memory passes into GEMM epilogues beats cuBLAS + qtrain's own kernels before
anything is integrated.

Each op is timed on both sides from the same bf16 inputs; the outputs must agree to bf16 rounding (relative error in
norm under 1e-2: each side rounds each output once or twice, 2^-8 each, from different accumulation orders):

  op                qtrain now                                         quack
  up_swiglu         F.linear (cuBLAS) + SwiGLU forward (one inductor   gemm_act(activation="swiglu"): preact and
                    kernel, as the compiled block)                     SwiGLU out from the GEMM's epilogue
  up_swiglu_concat  the same                                           the same with concat_layout=("B",)
  down_residual     x + F.linear(s, W_down), compiled                  gemm_add(s, W_down^T, C=x)
  down_dswiglu      dout @ W_down (cuBLAS) + qtrain::swiglu_backward   gemm_dgated: d(preact) in the dgrad GEMM's
                    (Triton)                                           epilogue (and SwiGLU out recomputed, for dW_down)
  rmsnorm           RMSNorm forward, compiled                          quack.rmsnorm.rmsnorm_fwd
  add_rmsnorm       x + a and its RMSNorm, compiled (one kernel)       rmsnorm_fwd(a, residual=x)
  add_rmsnorm_bwd   that forward + backward (d a, d x, d gain)         quack.rmsnorm.rmsnorm(prenorm=True) + backward
  norm_chain        o-proj (cuBLAS), residual add + RMSNorm (inductor), gemm_rms (o-proj + residual + sum of squares +
                    up/gate (cuBLAS), SwiGLU (inductor)                gain) then gemm_norm_act (up/gate, row scale
                                                                       1/rms, SwiGLU): the norm never written
  cross_entropy     the LM head's in-place cross-entropy (Triton: one   cross_entropy_fwd(return_dx, inplace_backward):
                    program per row, the row read twice), z-loss 0     the row held in a cluster's shared memory, read
                                                                       once (llm.q's way; 7.4 ms of a 0.5B step apart)

The cross-entropy runs on one LM-head chunk: CE_ROWS_DIVISOR of M rows (a quarter) by the vocabulary, bf16 logits
whose d(logits) overwrites them on both sides; repeated calls run on the buffer as the last call left it (the time
does not depend on the values); the first calls, compared, start from the same logits.

Weight layouts: qtrain's fused up/gate weight has rows [up; gate] (model/llama/tensors.py); quack's gated epilogues
read gate and up as interleaved columns (gate_0, up_0, gate_1, ...) of one GEMM output, so its weight is re-laid once
(rows interleaved; `up_swiglu_concat`: rows [gate; up], quack's concat layout), and its preact and d(preact) come out
interleaved (compared after de-interleaving). quack's dgated epilogue takes only the interleaved preact, so a
training integration keeps that layout end to end (quack's own `mlp_func` does: its dgrad of the up/gate GEMM and its
weight gradient read and write the same layout).

Timing: `bench.timing.time_ms` (CUDA events around back-to-back calls, median) eagerly, host launches included, and
replayed from a CUDA graph (GPU time only); qtrain, quack, qtrain, quack, each side's best. The first call of each
side is timed apart (`*_first_s`): quack's includes its CuTe-DSL compile (cold the first time on a machine; its .o
cache, `quack.cache`, makes later processes load it), qtrain's inductor's compile. `speedup` = qtrain ms / quack ms
(> 1: quack faster).

Parameters: models (Qwen2.5 presets), tokens (M for every model; default per model: TOKENS, the `sizes` suite's
micro-batches), ops (OPS), tuned (quack's autotuner on its first call: a config sweep, its time in quack_first_s;
default its heuristic config), samples, warmup, graphs. Needs a Hopper GPU and quack-kernels importable (install:
bench/hopper_wheels.sh; skipped with the reason otherwise). Result: `rows` (one per model and op) and the table's
columns: mlp_speedup (the three MLP ops' qtrain ms / quack ms, summed), chain_speedup (norm_chain), ce_speedup
(cross_entropy), compile_s (quack's first calls), import_s (import quack), max_rel_err.
"""
from __future__ import annotations

import importlib
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any

import torch

from bench.kinds import Skip

# tokens of one micro-step in the `sizes` suite's layouts (issue 48's bar is those runs): 0.5B 32 x 1024 (accum 4),
# 1.5B 32 x 1024 (accum 2), 3B 16 x 1024 (accum 2), 7B 4 x 1024 (accum 4)
TOKENS = {"Qwen2.5-0.5B": 32 * 1024, "Qwen2.5-1.5B": 32 * 1024, "Qwen2.5-3B": 16 * 1024, "Qwen2.5-7B": 4 * 1024}
OPS = ("up_swiglu", "up_swiglu_concat", "down_residual", "down_dswiglu", "rmsnorm", "add_rmsnorm", "add_rmsnorm_bwd",
       "norm_chain", "cross_entropy")
MLP_OPS = ("up_swiglu", "down_residual", "down_dswiglu")  # one MLP's GEMMs with the passes fused into them
TOLERANCE = 1e-2  # relative error in norm (module docstring)
CE_ROWS_DIVISOR = 4  # the cross-entropy's rows: M / 4, an LM-head chunk of the suite's layouts


def import_quack() -> tuple[SimpleNamespace | None, str]:
    """(quack's modules the kind calls: .gemm = quack.gemm_interface, .rmsnorm = quack.rmsnorm through qtrain's own
    import of the extra (kernels/hopper.py), .cross_entropy = quack.cross_entropy, which qtrain does not use (the
    exception its import raised, where it fails: that op's row says so); "") or (None, why they do not import)."""
    from qtrain.kernels.hopper import quack, quack_missing
    lib = quack()
    if lib is None:
        return None, quack_missing()
    try:
        ce: object = importlib.import_module("quack.cross_entropy")
    except Exception as e:  # noqa: BLE001 - its row fails with the reason, the GEMM rows still run
        ce = e
    return SimpleNamespace(**vars(lib), cross_entropy=ce), ""


@dataclass(frozen=True)
class Shape:
    model: str
    M: int  # tokens of one micro-step
    C: int  # hidden size
    F: int  # MLP intermediate size
    Q: int  # attention output width (the o-projection's K)
    eps: float
    V: int = 151936  # vocabulary (the cross-entropy's row length)


def shapes(models: list[str], tokens: int | None, ops: list[str]) -> list[Shape]:
    """The cases' shapes from the presets (the dry run checks the parameters here)."""
    from bench.compat import preset
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise ValueError(f"ops: unknown {bad} (known: {', '.join(OPS)})")
    if tokens is not None and tokens <= 0:
        raise ValueError(f"tokens: must be positive, got {tokens}")
    out = []
    for m in models:
        if tokens is None and m not in TOKENS:
            raise ValueError(f"models: {m!r} has no default token count (known: {', '.join(TOKENS)}); give tokens")
        c = preset(m)
        out.append(Shape(m, tokens or TOKENS[m], c.hidden_size, c.intermediate_size, c.q_dim, c.rms_norm_eps,
                         c.vocab_size))
    return out


@dataclass
class Pair:
    """One op on both sides: each callable returns the outputs `compare` lines up as (quack, qtrain) tensor pairs
    in one layout."""
    op: str
    gemm: str  # "M x N x K" of its GEMM(s), or the norm's rows x width
    qtrain: Callable[[], Any]
    quack: Callable[[], Any]
    compare: Callable[[Any, Any], list[tuple[torch.Tensor, torch.Tensor]]]


@dataclass
class Row:
    model: str
    op: str
    gemm: str
    qtrain_ms: float = float("nan")
    quack_ms: float = float("nan")
    speedup: float = float("nan")  # qtrain ms / quack ms
    qtrain_graph_ms: float = float("nan")
    quack_graph_ms: float = float("nan")
    graph_speedup: float = float("nan")
    rel_err: float = float("nan")  # the largest over the op's outputs of ||quack - qtrain|| / ||qtrain||
    max_err: float = float("nan")  # the largest |quack - qtrain| over its outputs
    ok: bool = False
    qtrain_first_s: float = float("nan")
    quack_first_s: float = float("nan")
    error: str = ""


def deinterleave(p: torch.Tensor) -> torch.Tensor:
    """quack's gated layout (gate_0, up_0, gate_1, up_1, ...) -> qtrain's [up | gate]."""
    return torch.cat([p[..., 1::2], p[..., 0::2]], dim=-1)


def interleave(u: torch.Tensor) -> torch.Tensor:
    """qtrain's [up | gate] columns (or rows of its weight, dim 0) -> quack's interleaved (gate_0, up_0, ...)."""
    up, gate = u.chunk(2, dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)


def errors(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
    """(relative error in norm, max abs error), the largest over the pairs; row chunks keep the fp32 copies small."""
    rel = mx = 0.0
    for got, want in pairs:
        g2, w2 = got.reshape(-1, got.shape[-1]), want.reshape(-1, want.shape[-1])
        diff = ref = 0.0
        for i in range(0, g2.shape[0], 4096):
            d = g2[i:i + 4096].float() - w2[i:i + 4096].float()
            diff += float(d.square().sum())
            ref += float(w2[i:i + 4096].float().square().sum())
            mx = max(mx, float(d.abs().max()))
        rel = max(rel, (diff / max(ref, 1e-30)) ** 0.5)
    return rel, mx


def first_call_s(fn: Callable[[], Any]) -> tuple[Any, float]:
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t


def compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=False)  # as qtrain compiles its block


def pairs_for(s: Shape, ops: list[str], lib: SimpleNamespace, tuned: bool, device: str = "cuda",
              compile_: Callable[[Callable], Callable] = compiled) -> list[tuple[str, Callable[[], Pair]]]:
    """(op, its Pair's maker) at shape `s`: built one at a time, so one op's tensors live at a time. `lib`: quack's
    modules (import_quack); `device`, `compile_`: the CPU test's, which checks the layouts and pairings here."""
    import torch.nn.functional as F

    from qtrain.kernels.cross_entropy.inplace import cross_entropy_fwd_bwd_inplace_
    from qtrain.kernels.swiglu.activation import swiglu, swiglu_backward
    from qtrain.model.layers import rms_norm

    M, C, Fi, Q, eps = s.M, s.C, s.F, s.Q, s.eps
    gi, qrms = lib.gemm, lib.rmsnorm
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * scale).bfloat16()

    def swiglu_fwd(u: torch.Tensor) -> torch.Tensor:
        return swiglu(u, "autograd")  # the compiled block's forward (its "kernel" mode differs only in backward)

    def add_norm(x: torch.Tensor, a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x2 = x + a
        return x2, rms_norm(x2, g, eps)

    def down_res(sw: torch.Tensor, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x + F.linear(sw, w)

    sw_c, add_norm_c, down_res_c = compile_(swiglu_fwd), compile_(add_norm), compile_(down_res)
    norm_c = compile_(lambda x, g: rms_norm(x, g, eps))
    h, x, a = randn(M, C), randn(M, C, scale=4.0), randn(M, C)  # norm output, residual stream, a branch's output
    g = (1.0 + 0.1 * torch.randn(C, generator=gen, device=device)).bfloat16()  # RMSNorm gain
    w_up = randn(2 * Fi, C, scale=C ** -0.5)  # rows [up; gate], qtrain's layout
    w_il = interleave(w_up.T).T.contiguous()  # rows (gate_0, up_0, gate_1, ...): quack's gated layout
    w_gu = torch.cat([w_up[Fi:], w_up[:Fi]]).contiguous()  # rows [gate; up]: quack's concat layout
    w_down = randn(C, Fi, scale=Fi ** -0.5)
    kw = dict(tuned=tuned)

    def up_swiglu(concat: bool) -> Pair:
        w, extra = (w_gu, dict(concat_layout=("B",))) if concat else (w_il, {})

        def ours():
            u = F.linear(h, w_up)
            return u, sw_c(u)
        return Pair("up_swiglu_concat" if concat else "up_swiglu", f"{M} x {2 * Fi} x {C}", ours,
                    lambda: gi.gemm_act(h, w.T, activation="swiglu", store_preact=True, **extra, **kw),
                    lambda k, q: [(k[1], q[1]), (deinterleave(k[0]), q[0])])

    def down_residual() -> Pair:
        sw = sw_c(F.linear(h, w_up))
        return Pair("down_residual", f"{M} x {C} x {Fi}", lambda: down_res_c(sw, w_down, x),
                    lambda: gi.gemm_add(sw, w_down.T, x, **kw), lambda k, q: [(k, q)])

    def down_dswiglu() -> Pair:
        # qtrain kept the SwiGLU output from the forward (the down linear's input, for dW_down); quack keeps only
        # the preact and its dgated epilogue writes the SwiGLU output again: checked against qtrain's
        u = F.linear(h, w_up)
        u_il, dout, sw = interleave(u).contiguous(), randn(M, C), sw_c(u)
        return Pair("down_dswiglu", f"{M} x {Fi} x {C}", lambda: swiglu_backward(dout @ w_down, u),
                    lambda: gi.gemm_dgated(dout, w_down, u_il, activation="swiglu", **kw),
                    lambda k, q: [(deinterleave(k[0]), q), (k[1], sw)])

    def rmsnorm() -> Pair:
        return Pair("rmsnorm", f"{M} x {C}", lambda: norm_c(x, g), lambda: qrms.rmsnorm_fwd(x, g, eps=eps)[0],
                    lambda k, q: [(k, q)])

    def add_rmsnorm() -> Pair:
        return Pair("add_rmsnorm", f"{M} x {C}", lambda: add_norm_c(x, a, g),
                    lambda: qrms.rmsnorm_fwd(a, g, residual=x, eps=eps)[:2],
                    lambda k, q: [(k[1], q[0]), (k[0], q[1])])

    def add_rmsnorm_bwd() -> Pair:
        xs, as_, gs = (t.detach().clone().requires_grad_(True) for t in (x, a, g))
        dx2, dh = randn(M, C), randn(M, C)

        def ours():
            with torch.enable_grad():
                x2, hh = add_norm_c(xs, as_, gs)
                return torch.autograd.grad((x2, hh), (xs, as_, gs), (dx2, dh))

        def theirs():
            with torch.enable_grad():
                hh, x2 = qrms.rmsnorm(as_, gs, residual=xs, prenorm=True, eps=eps)
                return torch.autograd.grad((x2, hh), (xs, as_, gs), (dx2, dh))
        return Pair("add_rmsnorm_bwd", f"{M} x {C}", ours, theirs, lambda k, q: list(zip(k, q)))

    def norm_chain() -> Pair:
        att, w_o = randn(M, Q), randn(C, Q, scale=Q ** -0.5)

        def ours():
            x2, hh = add_norm_c(x, F.linear(att, w_o), g)
            u = F.linear(hh, w_up)
            return x2, u, sw_c(u)

        def theirs():
            x2 = torch.empty_like(x)
            d, rstd = gi.gemm_rms(att, w_o.T, C=x, norm_weight=g, premult_out=x2, eps=eps, **kw)
            pre, post = gi.gemm_norm_act(d, w_il.T, rstd=rstd, activation="swiglu", store_preact=True, **kw)
            return x2, pre, post
        return Pair("norm_chain", f"{M} x {C} x {Q} + {M} x {2 * Fi} x {C}", ours, theirs,
                    lambda k, q: [(k[0], q[0]), (deinterleave(k[1]), q[1]), (k[2], q[2])])

    def cross_entropy() -> Pair:
        if isinstance(lib.cross_entropy, Exception):
            raise lib.cross_entropy
        n = max(1, M // CE_ROWS_DIVISOR)
        logits = randn(n, s.V, scale=2.0)
        t = torch.randint(0, s.V, (n,), generator=gen, device=device)
        t[::97] = -100  # some ignored rows, as a masked batch has
        ours_buf, theirs_buf = logits.clone(), logits
        return Pair("cross_entropy", f"{n} x {s.V}",
                    lambda: cross_entropy_fwd_bwd_inplace_(ours_buf, t, z_loss=0.0, need_grad=True),
                    lambda: lib.cross_entropy.cross_entropy_fwd(theirs_buf, t, return_lse=True, return_dx=True,
                                                                inplace_backward=True),
                    lambda k, q: [(k[2], q[2]), (k[1], q[1]), (k[0].sum().reshape(1), q[0].reshape(1))])

    makers: dict[str, Callable[[], Pair]] = {
        "up_swiglu": lambda: up_swiglu(False), "up_swiglu_concat": lambda: up_swiglu(True),
        "down_residual": down_residual, "down_dswiglu": down_dswiglu, "rmsnorm": rmsnorm,
        "add_rmsnorm": add_rmsnorm, "add_rmsnorm_bwd": add_rmsnorm_bwd, "norm_chain": norm_chain,
        "cross_entropy": cross_entropy}
    return [(o, makers[o]) for o in ops]


def measure(model: str, make: Callable[[], Pair], *, samples: int, warmup: int, graphs: bool) -> Row:
    """One op: both sides' first calls, their agreement, then eager (and graph-replayed) times, interleaved."""
    from bench.timing import graphed_ms, time_ms
    with torch.no_grad():  # the kernels alone, no autograd graph (add_rmsnorm_bwd builds its own)
        pair = make()
        row = Row(model, pair.op, pair.gemm)
        q_out, row.qtrain_first_s = first_call_s(pair.qtrain)
        k_out, row.quack_first_s = first_call_s(pair.quack)
        row.rel_err, row.max_err = errors(pair.compare(k_out, q_out))
        row.ok = row.rel_err < TOLERANCE
        del q_out, k_out
        eager = {"qtrain": [], "quack": []}
        for _ in range(2):
            for side, fn in (("qtrain", pair.qtrain), ("quack", pair.quack)):
                eager[side].append(time_ms(fn, samples=samples, warmup=warmup))
        row.qtrain_ms, row.quack_ms = min(eager["qtrain"]), min(eager["quack"])
        row.speedup = row.qtrain_ms / row.quack_ms
        if graphs:
            row.qtrain_graph_ms = graphed_ms(pair.qtrain, samples=samples, warmup=warmup)
            row.quack_graph_ms = graphed_ms(pair.quack, samples=samples, warmup=warmup)
            row.graph_speedup = row.qtrain_graph_ms / row.quack_graph_ms
    return row


HEAD = (f"{'model':13s} {'op':17s} {'GEMM M x N x K':42s} {'qtrain ms':>9s} {'quack ms':>9s} {'speedup':>7s} "
        f"{'graph q/k ms':>15s} {'g.speedup':>9s} {'rel err':>8s} {'max err':>8s} {'1st call s q/k':>14s}")


def line(r: Row) -> str:
    if r.error:
        return f"{r.model:13s} {r.op:17s} {r.gemm:42s} failed: {r.error}"
    return (f"{r.model:13s} {r.op:17s} {r.gemm:42s} {r.qtrain_ms:9.3f} {r.quack_ms:9.3f} {r.speedup:7.3f} "
            f"{r.qtrain_graph_ms:7.3f}/{r.quack_graph_ms:<7.3f} {r.graph_speedup:9.3f} {r.rel_err:8.1e} "
            f"{r.max_err:8.1e} {r.qtrain_first_s:6.1f}/{r.quack_first_s:<7.1f}{'' if r.ok else ' DISAGREE'}")


def summarize(rows: list[Row]) -> dict[str, Any]:
    """The table's scalars: the speedups of the MLP ops together and of the norm chain (their ms summed over the
    rows that ran), quack's first calls together, the worst agreement."""
    ok = [r for r in rows if not r.error]
    out: dict[str, Any] = {"compile_s": round(sum(r.quack_first_s for r in ok), 1),
                           "max_rel_err": max((r.rel_err for r in ok), default=None)}
    for key, ops in (("mlp_speedup", MLP_OPS), ("chain_speedup", ("norm_chain",)), ("ce_speedup", ("cross_entropy",))):
        mine = [r for r in ok if r.op in ops]
        if mine:
            out[key] = round(sum(r.qtrain_ms for r in mine) / sum(r.quack_ms for r in mine), 3)
    out["summary"] = "; ".join(f"{r.op} {r.speedup:.2f}x" if not r.error else f"{r.op} failed" for r in rows)
    return out


def run(models: list[str] = ("Qwen2.5-1.5B",), tokens: int | None = None, ops: list[str] = OPS,
        tuned: bool = False, samples: int = 20, warmup: int = 5, graphs: bool = True) -> dict:
    """The ops at each model's shapes (module docstring); a row per (model, op), printed as it is measured."""
    cases = shapes(list(models), tokens, list(ops))
    if not torch.cuda.is_available():
        raise Skip("needs a CUDA GPU")
    cap = torch.cuda.get_device_capability()
    if cap[0] != 9:
        raise Skip(f"quack's fused epilogues are timed as its sm90 kernels: needs a Hopper GPU, this one is sm{cap[0]}"
                   f"{cap[1]}")
    t = time.perf_counter()
    lib, why = import_quack()
    import_s = time.perf_counter() - t
    if lib is None:
        raise Skip(f"quack-kernels does not import ({why}): bench/hopper_wheels.sh installs it (bench/suites/"
                   f"hopper.toml says how)")
    import quack
    from quack.cache.jit import get_cache_path
    kernels_cached = sum(1 for _ in get_cache_path().rglob("*.o"))
    print(f"quack {quack.__version__} from {os.path.dirname(quack.__file__)}, import {import_s:.1f} s; its kernel "
          f"cache {get_cache_path()}: {kernels_cached} kernels before this run; "
          f"{'autotuned' if tuned else 'heuristic'} configs; {torch.cuda.get_device_name()}", flush=True)
    rows: list[Row] = []
    print(HEAD, flush=True)
    for s in cases:
        for op, make in pairs_for(s, list(ops), lib, tuned):
            try:
                row = measure(s.model, make, samples=samples, warmup=warmup, graphs=graphs)
            except Exception as e:  # noqa: BLE001 - one op's failure is its row; the others still run
                traceback.print_exc()
                row = Row(s.model, op, f"M={s.M} C={s.C} F={s.F}", error=f"{type(e).__name__}: {str(e)[:200]}")
            rows.append(row)
            print(line(row), flush=True)
            torch.cuda.empty_cache()
    print(HEAD)
    for r in rows:
        print(line(r))
    result = summarize(rows)
    result.update(import_s=round(import_s, 1), kernels_cached_before=kernels_cached, tuned=tuned,
                  rows=[asdict(r) for r in rows])
    return result


def dry_run(params: dict) -> dict:
    shapes(list(params.get("models", ("Qwen2.5-1.5B",))), params.get("tokens"), list(params.get("ops", OPS)))
    lib, why = import_quack()
    raise Skip("times quack's CuTe-DSL GEMMs (sm90) against cuBLAS + qtrain's kernels: needs a Hopper GPU"
               + ("" if lib is not None else f"; quack-kernels does not import here ({why})"))
