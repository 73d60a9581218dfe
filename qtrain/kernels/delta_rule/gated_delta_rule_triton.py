"""The chunked gated delta rule's forward in Triton (gated_delta_rule.py's `chunk_core`: chunks of 64, fp32
accumulation), and the reverse recurrence its backward runs (gated_delta_rule_triton_backward.py):

- per chunk, the WY/UT transform: `_kkt_kernel` A, `_invert_kernel` its unit-triangular inverse Ai by forward
  substitution (few warps), `_wu_kernel` U = Ai vb, W = Ai kbg;
- `_states_fwd_kernel` per (batch x head, dv tile) looping over the chunks (the state tile in registers: Hs, V');
- `_output_kernel` per chunk (looping over dv tiles): o = q_dec Hs + P V';
- `_states_bwd_kernel` per (batch x head, dv tile) looping over the chunks backwards (dH, dU, dS0).

Each launcher has its twin's contract (`chunk_intra`, `chunk_states`, `chunk_core`, `chunk_states_reverse`). The
products run on the tensor cores in three TF32 passes (`Launch.prec`; in one with --delta-rule-precision tf32:
`PRECISIONS`, `launch_for`); documents (`resets`) enter as d, the resets at or before each position of its chunk,
exactly as the twin masks with it.

The inputs q, k, v and beta are read through their strides (`_strided`: any layout with unit stride along d): what
`chunked_form` hands over are heads-first views of the model's (B, T, H, d) tensors, which a contiguous copy would
move once more per read (25 copies a layer and micro-step, ~52 ms of a Qwen3.5-4B step at 4096 tokens). The
kernels' own buffers (A, U, W, the states) and outputs are contiguous.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from qtrain.kernels.delta_rule.gated_delta_rule import chunk_decays
from qtrain.kernels.dispatch import jit, tl, triton

__all__ = ["DEFAULT_PRECISION", "PRECISIONS", "TUNED", "Launch", "chunk_core_triton", "chunk_intra_triton",
           "chunk_states_reverse_triton", "chunk_states_triton", "launch_for"]

@dataclass(frozen=True)
class Launch:
    """The launchers' tuning (`TUNED` unless a benchmark passes another): bv, the dv columns a program of the loops
    over chunks holds of the state (dk rows x bv); num_warps of every kernel but the inverse's; prec, the products'
    precision."""
    bv: int = 32
    num_warps: int = 4
    prec: str = "tf32x3"


# bv 32 with 4 warps: ptxas (sm_90, dk 128) then spills ~2 KiB a thread in the loops, 8 warps half that (the fp32
# [64, dk] operands and their TF32 halves), yet 4 warps measured fastest at the Qwen3.5-4B shape (one H100, T 4096,
# 32 heads of 128: core forward 1.86 ms, backward 5.44, against 2.39 / 5.58 at 8 warps, 2.06 / 5.94 at bv 16 and 4
# warps, 2.42 / 6.51 at bv 64; kernels case gated-delta-rule-4B-launches). prec: three TF32 tensor-core passes (fp32
# operands split in a high and a low TF32 part: fp32's accuracy to ~1e-6, where "ieee" runs on the CUDA cores and
# "tf32" keeps 10 mantissa bits: 0.57x the time, 1.34 / 2.84 ms, at an error of 1.8e-3 against 4.7e-7; a run chooses
# it with --delta-rule-precision tf32)
TUNED = Launch()
# --delta-rule-precision (model/choices.DELTA_RULE_PRECISIONS) -> the products' input precision: fp32 = TUNED's three
# TF32 passes, tf32 = one pass
PRECISIONS = {"fp32": "tf32x3", "tf32": "tf32"}
DEFAULT_PRECISION = "fp32"  # TUNED's
INVERT_WARPS = 2  # the inverse's loop over rows: 64 x 64 fp32 over 2 warps (ptxas: 168 registers, no spills)


def launch_for(precision: str) -> Launch:
    """The launchers' tuning for a run's --delta-rule-precision: `TUNED` with that precision's products."""
    if precision not in PRECISIONS:
        raise ValueError(f"delta rule precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return dataclasses.replace(TUNED, prec=PRECISIONS[precision])


# ------------------------------------------------------------------------------------------------ kernels
@jit
def _tile(ptr, rows, cols, r0, c0, BR: tl.constexpr, BC: tl.constexpr):
    """A block pointer to the [BR, BC] tile at (r0, c0) of a row-major (rows, cols) matrix at ptr: no per-element
    pointers (a [64, 128] tile of 64-bit addresses would take 64 registers a thread)."""
    return tl.make_block_ptr(ptr, (rows, cols), (cols, 1), (r0, c0), (BR, BC), (1, 0))


@jit
def _at(bh, c, H, s_b, s_h, s_n):
    """The offset of chunk c of (batch x head) bh in a (B, H, n, ...) tensor of strides s_b, s_h, s_n (int64)."""
    return (bh // H) * s_b + (bh % H) * s_h + c.to(tl.int64) * s_n


@jit
def _rows(ptr, cols, s_c, c0, BR: tl.constexpr, BC: tl.constexpr):
    """A block pointer to the [BR, BC] tile at column c0 of a chunk's BR rows at ptr, rows s_c apart, columns unit
    stride (a strided input's chunk: `_strided`)."""
    return tl.make_block_ptr(ptr, (BR, cols), (s_c, 1), (0, c0), (BR, BC), (1, 0))


@jit
def _kkt_kernel(k_ptr, k_b, k_h, k_n, k_c, beta_ptr, b_b, b_h, b_n, b_c, G_ptr, d_ptr, a_ptr, n, H, DK,
                HAS_DOCS: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    """One chunk (program (c, b x h)): A = ((beta k) k^T) D below the diagonal (zero on and above it). The chunk's
    rows are (bh n + c) C + position of (B H n C, d) tensors; k and beta are read through their strides."""
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rc = tl.arange(0, C)
    base = (bh * n + c) * C  # the chunk's first row
    k = tl.load(_rows(k_ptr + _at(bh, c, H, k_b, k_h, k_n), DK, k_c, 0, C, BK), boundary_check=(1,),
                padding_option="zero")
    beta = tl.load(beta_ptr + _at(bh, c, H, b_b, b_h, b_n) + rc * b_c)
    G = tl.load(G_ptr + base + rc)
    see = rc[:, None] > rc[None, :]
    if HAS_DOCS:
        dd = tl.load(d_ptr + ((bh // H) * n + c) * C + rc)
        see = see & (dd[:, None] == dd[None, :])
    A = tl.dot(k * beta[:, None], tl.trans(k), input_precision=PREC)
    A = tl.where(see, A * tl.exp(tl.where(see, G[:, None] - G[None, :], 0.0)), 0.0)
    tl.store(_tile(a_ptr + base * C, C, C, 0, 0, C, C), A)


@jit
def _invert_kernel(a_ptr, n, C: tl.constexpr):
    """One chunk (program (c, b x h)): (I + A)^-1 in place of A, by forward substitution: row i = e_i - A_i Ai (the
    rows before i final, A's row i read from memory). Few warps: the sum over rows stays in a warp or two."""
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rc = tl.arange(0, C)
    at = a_ptr + (bh * n + c) * C * C
    Ai = tl.where(rc[:, None] == rc[None, :], 1.0, 0.0)
    for i in range(1, C):
        a_i = tl.load(at + i * C + rc)  # row i of A, by column j (zero from i on)
        Ai = tl.where(rc[:, None] == i, Ai - tl.sum(a_i[:, None] * Ai, axis=0)[None, :], Ai)
    tl.debug_barrier()  # every row of A read before any is overwritten
    tl.store(_tile(at, C, C, 0, 0, C, C), Ai)


@jit
def _wu_kernel(k_ptr, k_b, k_h, k_n, k_c, v_ptr, v_b, v_h, v_n, v_c, beta_ptr, b_b, b_h, b_n, b_c, G_ptr, d_ptr,
               ai_ptr, u_ptr, w_ptr, n, H, DK, DV, HAS_DOCS: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
               BV: tl.constexpr, PREC: tl.constexpr):
    """One chunk (program (c, b x h)): W = Ai (beta k Gexp) and U = Ai (beta v) by dv tiles (the WY/UT transform)."""
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rc = tl.arange(0, C)
    base = (bh * n + c) * C
    beta = tl.load(beta_ptr + _at(bh, c, H, b_b, b_h, b_n) + rc * b_c)
    Gexp = tl.exp(tl.load(G_ptr + base + rc))
    if HAS_DOCS:
        dd = tl.load(d_ptr + ((bh // H) * n + c) * C + rc)
        Gexp = tl.where(dd == 0, Gexp, 0.0)
    Ai = tl.load(_tile(ai_ptr + base * C, C, C, 0, 0, C, C))
    k = tl.load(_rows(k_ptr + _at(bh, c, H, k_b, k_h, k_n), DK, k_c, 0, C, BK), boundary_check=(1,),
                padding_option="zero")
    w = tl.dot(Ai, k * (beta * Gexp)[:, None], input_precision=PREC)
    tl.store(_tile(w_ptr + base * DK, C, DK, 0, 0, C, BK), w, boundary_check=(1,))
    v_at = v_ptr + _at(bh, c, H, v_b, v_h, v_n)
    for v0 in range(0, DV, BV):
        v = tl.load(_rows(v_at, DV, v_c, v0, C, BV), boundary_check=(1,), padding_option="zero")
        u = tl.dot(Ai, v * beta[:, None], input_precision=PREC)
        tl.store(_tile(u_ptr + base * DV, C, DV, 0, v0, C, BV), u, boundary_check=(1,))


@jit
def _states_fwd_kernel(u_ptr, w_ptr, kd_ptr, last_ptr, s0_ptr, hs_ptr, v_ptr, sf_ptr, n, DK, DV,
                       HAS_S0: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       PREC: tl.constexpr):
    """The forward loop over chunks for one (batch x head, dv tile): V'_c = U_c - W_c S, S <- last_c S +
    k_dec_c^T V'_c, storing each chunk's entering state."""
    v0 = tl.program_id(0) * BV
    bh = tl.program_id(1).to(tl.int64)
    if HAS_S0:
        S = tl.load(_tile(s0_ptr + bh * DK * DV, DK, DV, 0, v0, BK, BV), boundary_check=(0, 1),
                    padding_option="zero").to(tl.float32)
    else:
        S = tl.zeros([BK, BV], tl.float32)
    for c in range(n):
        base = (bh * n + c) * C
        tl.store(_tile(hs_ptr + (bh * n + c) * DK * DV, DK, DV, 0, v0, BK, BV), S, boundary_check=(0, 1))
        w = tl.load(_tile(w_ptr + base * DK, C, DK, 0, 0, C, BK), boundary_check=(1,), padding_option="zero")
        u = tl.load(_tile(u_ptr + base * DV, C, DV, 0, v0, C, BV), boundary_check=(1,), padding_option="zero")
        v = u - tl.dot(w, S, input_precision=PREC)
        tl.store(_tile(v_ptr + base * DV, C, DV, 0, v0, C, BV), v, boundary_check=(1,))
        kd = tl.load(_tile(kd_ptr + base * DK, C, DK, 0, 0, C, BK), boundary_check=(1,), padding_option="zero")
        S = S * tl.load(last_ptr + bh * n + c) + tl.dot(tl.trans(kd), v, input_precision=PREC)
    tl.store(_tile(sf_ptr + bh * DK * DV, DK, DV, 0, v0, BK, BV), S, boundary_check=(0, 1))


@jit
def _output_kernel(q_ptr, q_b, q_h, q_n, q_c, k_ptr, k_b, k_h, k_n, k_c, G_ptr, d_ptr, hs_ptr, v_ptr, o_ptr, n, H,
                   DK, DV, HAS_DOCS: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   PREC: tl.constexpr):
    """One chunk's output (program (c, b x h)), by dv tiles: o = (q Gexp) Hs_c + ((q k^T) D) V'_c."""
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rc = tl.arange(0, C)
    base = (bh * n + c) * C
    q = tl.load(_rows(q_ptr + _at(bh, c, H, q_b, q_h, q_n), DK, q_c, 0, C, BK), boundary_check=(1,),
                padding_option="zero")
    k = tl.load(_rows(k_ptr + _at(bh, c, H, k_b, k_h, k_n), DK, k_c, 0, C, BK), boundary_check=(1,),
                padding_option="zero")
    G = tl.load(G_ptr + base + rc)
    Gexp = tl.exp(G)
    see = rc[:, None] >= rc[None, :]
    if HAS_DOCS:
        dd = tl.load(d_ptr + ((bh // H) * n + c) * C + rc)
        see = see & (dd[:, None] == dd[None, :])
        Gexp = tl.where(dd == 0, Gexp, 0.0)
    P = tl.dot(q, tl.trans(k), input_precision=PREC)
    P = tl.where(see, P * tl.exp(tl.where(see, G[:, None] - G[None, :], 0.0)), 0.0)
    qd = q * Gexp[:, None]
    for v0 in range(0, DV, BV):
        hs = tl.load(_tile(hs_ptr + (bh * n + c) * DK * DV, DK, DV, 0, v0, BK, BV), boundary_check=(0, 1),
                     padding_option="zero")
        v = tl.load(_tile(v_ptr + base * DV, C, DV, 0, v0, C, BV), boundary_check=(1,), padding_option="zero")
        o = tl.dot(qd, hs, input_precision=PREC) + tl.dot(P, v, input_precision=PREC)
        tl.store(_tile(o_ptr + base * DV, C, DV, 0, v0, C, BV), o, boundary_check=(1,))


@jit
def _states_bwd_kernel(w_ptr, kd_ptr, last_ptr, dhs_ptr, dv_ptr, dsf_ptr, dh_ptr, du_ptr, ds0_ptr, n, DK, DV,
                       C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """The backward loop over chunks, last to first, for one (batch x head, dv tile): dH_c = dS, dU_c = dV'_c +
    k_dec_c dS, dS <- dHs_c + last_c dS - W_c^T dU_c; at the end dS0."""
    v0 = tl.program_id(0) * BV
    bh = tl.program_id(1).to(tl.int64)
    dS = tl.load(_tile(dsf_ptr + bh * DK * DV, DK, DV, 0, v0, BK, BV), boundary_check=(0, 1),
                 padding_option="zero").to(tl.float32)
    for i in range(n):
        c = n - 1 - i
        base = (bh * n + c) * C
        tl.store(_tile(dh_ptr + (bh * n + c) * DK * DV, DK, DV, 0, v0, BK, BV), dS, boundary_check=(0, 1))
        kd = tl.load(_tile(kd_ptr + base * DK, C, DK, 0, 0, C, BK), boundary_check=(1,), padding_option="zero")
        du = tl.load(_tile(dv_ptr + base * DV, C, DV, 0, v0, C, BV), boundary_check=(1,),
                     padding_option="zero").to(tl.float32)
        du = du + tl.dot(kd, dS, input_precision=PREC)
        tl.store(_tile(du_ptr + base * DV, C, DV, 0, v0, C, BV), du, boundary_check=(1,))
        w = tl.load(_tile(w_ptr + base * DK, C, DK, 0, 0, C, BK), boundary_check=(1,), padding_option="zero")
        dhs = tl.load(_tile(dhs_ptr + (bh * n + c) * DK * DV, DK, DV, 0, v0, BK, BV), boundary_check=(0, 1),
                      padding_option="zero").to(tl.float32)
        dS = dhs + dS * tl.load(last_ptr + bh * n + c) - tl.dot(tl.trans(w), du, input_precision=PREC)
    tl.store(_tile(ds0_ptr + bh * DK * DV, DK, DV, 0, v0, BK, BV), dS, boundary_check=(0, 1))


# ----------------------------------------------------------------------------------------------- launchers
def _bk(dk: int) -> int:
    return max(16, triton.next_power_of_2(dk))


def loop_stages(dk: int) -> int:
    """Pipeline stages of the loops (over chunks, over dv tiles): the next tiles load while these compute (2 stages:
    104 KiB of shared memory for the states' loops at dk 128); at dk 256 one stage (two would take 200 KiB of the
    H100's 227 for the states, the backward's dv loop 272 KiB at the default three)."""
    return 2 if _bk(dk) <= 128 else 1


def _launch(dk: int, tune: Launch) -> dict[str, int]:
    """Every kernel's launch options."""
    return {"num_warps": tune.num_warps, "num_stages": loop_stages(dk)}


def _c(x: torch.Tensor) -> torch.Tensor:
    """fp32, contiguous: what the kernels read of the buffers they make."""
    return x.float().contiguous()


def _strided(x: torch.Tensor) -> list:
    """An input (B, H, n, C[, d]) as the kernels read it in place: fp32 with unit stride along d (copied only
    where it is not), then its strides along B, H, n and C (`_at`, `_rows`)."""
    x = x.float()
    if x.dim() == 5 and x.stride(-1) != 1:
        x = x.contiguous()
    return [x, *x.stride()[:4]]


def decayed_keys(k: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    """k_dec = k exp(G_C - G) (`chunk_decays`' k_scale), fp32 and contiguous in one pass: the states' loops read it
    as one of their own buffers."""
    out = torch.empty(k.shape, dtype=torch.float32, device=k.device)
    return torch.mul(k.detach(), k_scale.detach()[..., None], out=out)  # the launchers are not differentiated


def _docs(d: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return d.to(torch.int32).contiguous() if d is not None else like.new_zeros(1, dtype=torch.int32)


def chunk_intra_triton(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, G: torch.Tensor, d: torch.Tensor | None,
                       tune: Launch = TUNED) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton `chunk_intra` (gated_delta_rule_backward.py): (Ai, U, W) from k, v (B, H, n, C, d), beta, G
    (B, H, n, C) and the documents d (the twin takes the decays they make), in three launches (A; its inverse;
    W and U)."""
    B, H, n, C, dk = k.shape
    dv = v.shape[-1]
    Ai = k.new_empty(B, H, n, C, C, dtype=torch.float32)
    U = k.new_empty(B, H, n, C, dv, dtype=torch.float32)
    W = k.new_empty(B, H, n, C, dk, dtype=torch.float32)
    if k.numel() and v.numel():
        k, v, beta, G, docs = _strided(k), _strided(v), _strided(beta), _c(G), _docs(d, k)
        meta = dict(HAS_DOCS=d is not None, C=C, BK=_bk(dk), PREC=tune.prec, **_launch(dk, tune))
        _kkt_kernel[(n, B * H)](*k, *beta, G, docs, Ai, n, H, dk, **meta)
        _invert_kernel[(n, B * H)](Ai, n, C=C, num_warps=INVERT_WARPS)
        _wu_kernel[(n, B * H)](*k, *v, *beta, G, docs, Ai, U, W, n, H, dk, dv, BV=tune.bv, **meta)
    return Ai, U, W


def chunk_states_triton(U: torch.Tensor, W: torch.Tensor, k_dec: torch.Tensor, last: torch.Tensor,
                        S0: torch.Tensor | None, tune: Launch = TUNED) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton `chunk_states` (gated_delta_rule.py), fp32."""
    B, H, n, C, dv = U.shape
    dk = W.shape[-1]
    Hs = U.new_empty(B, H, n, dk, dv, dtype=torch.float32)
    V = U.new_empty(B, H, n, C, dv, dtype=torch.float32)
    Sf = U.new_zeros(B, H, dk, dv, dtype=torch.float32) if S0 is None else _c(S0).clone()
    if n and dk and dv:
        _states_fwd_kernel[(triton.cdiv(dv, tune.bv), B * H)](_c(U), _c(W), _c(k_dec), _c(last), Sf, Hs, V, Sf, n,
                                                               dk, dv, HAS_S0=S0 is not None, C=C, BK=_bk(dk),
                                                               BV=tune.bv, PREC=tune.prec, **_launch(dk, tune))
    return Hs, V, Sf


def chunk_states_reverse_triton(W: torch.Tensor, k_dec: torch.Tensor, last: torch.Tensor, dHs: torch.Tensor,
                                dV: torch.Tensor, dSf: torch.Tensor, tune: Launch = TUNED
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton `chunk_states_reverse` (gated_delta_rule_backward.py), fp32."""
    B, H, n, C, dk = W.shape
    dv = dV.shape[-1]
    dH = W.new_empty(B, H, n, dk, dv, dtype=torch.float32)
    dU = W.new_empty(B, H, n, C, dv, dtype=torch.float32)
    dS0 = _c(dSf).clone()
    if n and dk and dv:
        _states_bwd_kernel[(triton.cdiv(dv, tune.bv), B * H)](_c(W), _c(k_dec), _c(last), _c(dHs), _c(dV), dS0, dH,
                                                               dU, dS0, n, dk, dv, C=C, BK=_bk(dk), BV=tune.bv,
                                                               PREC=tune.prec, **_launch(dk, tune))
    return dH, dU, dS0


def chunk_core_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      d: torch.Tensor | None, S0: torch.Tensor | None, tune: Launch = TUNED
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `chunk_core` (gated_delta_rule.py): three kernels (the chunks' transform, the states, the output)."""
    B, H, n, C, dk = k.shape
    dv = v.shape[-1]
    G, _, last, k_scale = chunk_decays(g.float(), d)
    _, U, W = chunk_intra_triton(k, v, beta, G, d, tune)
    Hs, V, Sf = chunk_states_triton(U, W, decayed_keys(k, k_scale), last, S0, tune)
    o = U.new_empty(B, H, n, C, dv)
    if n and dk and dv:
        _output_kernel[(n, B * H)](*_strided(q), *_strided(k), _c(G), _docs(d, k), Hs, V, o, n, H, dk, dv,
                                   HAS_DOCS=d is not None, C=C, BK=_bk(dk), BV=tune.bv, PREC=tune.prec,
                                   **_launch(dk, tune))
    return o, Sf
