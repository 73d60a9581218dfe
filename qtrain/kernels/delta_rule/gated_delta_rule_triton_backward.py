"""The chunked gated delta rule's backward in Triton: `chunk_core_backward` (gated_delta_rule_backward.py, the
specification, whose notation this follows) with every per-chunk product in a kernel, chunks of 64, fp32 accumulation.

After the forward's transform and states are recomputed (gated_delta_rule_triton.py), per chunk:

- `_bwd_reads_kernel` (looping over dv tiles): dHs = q_dec^T dO and the corrections' read dV' = P^T dO, the reverse
  recurrence's inputs; then `_states_bwd_kernel` runs it (dH, dU, dS0);
- `_bwd_dq_kernel` (looping over dv tiles): dq_dec = dO Hs^T, dP = dO V'^T;
- `_bwd_dw_kernel` (looping over dv tiles): dW = -dU Hs^T, dk_dec = V' dH^T, dAi's part dU vb^T, dlast, and dv, dbeta's
  part from vb = beta v through U = Ai vb;
- `_bwd_dk_kernel` (two passes over dk tiles): the rest, through Ai = (I + A)^-1, A, P and the decays to dq, dk,
  dbeta and G's gradient (whose reverse cumulative sum, g's gradient, torch takes).

As in the forward, the inputs q, k, v, beta and dO are read through their strides (`_strided`).
"""
from __future__ import annotations

import torch

from qtrain.kernels.delta_rule.gated_delta_rule import chunk_decays
from qtrain.kernels.delta_rule.gated_delta_rule_triton import (TUNED, Launch, _at, _bk, _c, _docs, _launch, _rows,
                                                               _strided, _tile, chunk_intra_triton,
                                                               chunk_states_reverse_triton, chunk_states_triton,
                                                               decayed_keys)
from qtrain.kernels.dispatch import jit, tl

__all__ = ["chunk_core_backward_triton"]


@jit
def _chunk_masks(G_ptr, d_ptr, bh, c, n, H, HAS_DOCS: tl.constexpr, C: tl.constexpr):
    """The chunk's decays as `chunk_decays` and `chunk_pair_decays` make them: (G, Gexp, k_scale, last, D on and
    below the diagonal, D below it)."""
    rc = tl.arange(0, C)
    G = tl.load(G_ptr + (bh * n + c) * C + rc)
    Gl = tl.sum(tl.where(rc == C - 1, G, 0.0), axis=0)
    Gexp = tl.exp(G)
    k_scale = tl.exp(Gl - G)
    last = tl.exp(Gl)
    see = rc[:, None] >= rc[None, :]
    if HAS_DOCS:
        dd = tl.load(d_ptr + ((bh // H) * n + c) * C + rc)
        dl = tl.sum(tl.where(rc == C - 1, dd, 0), axis=0)
        see = see & (dd[:, None] == dd[None, :])
        Gexp = tl.where(dd == 0, Gexp, 0.0)
        k_scale = tl.where(dd == dl, k_scale, 0.0)
        last = tl.where(dl == 0, last, 0.0)
    D = tl.where(see, tl.exp(tl.where(see, G[:, None] - G[None, :], 0.0)), 0.0)
    strict = tl.where(rc[:, None] > rc[None, :], D, 0.0)
    return G, Gexp, k_scale, last, D, strict


@jit
def _bwd_reads_kernel(q_ptr, q_b, q_h, q_n, q_c, k_ptr, k_b, k_h, k_n, k_c, G_ptr, d_ptr, do_ptr, o_b, o_h, o_n,
                      o_c, dhs_ptr, dvo_ptr, n, H, DK, DV, HAS_DOCS: tl.constexpr, C: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """(program (c, b x h)) by dv tiles: dHs_c = (q Gexp)^T dO_c and dV'_c = ((q k^T) D)^T dO_c."""
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    base = (bh * n + c) * C
    G, Gexp, k_scale, last, D, strict = _chunk_masks(G_ptr, d_ptr, bh, c, n, H, HAS_DOCS, C)
    q = tl.load(_rows(q_ptr + _at(bh, c, H, q_b, q_h, q_n), DK, q_c, 0, C, BK), boundary_check=(1,),
                padding_option="zero")
    k = tl.load(_rows(k_ptr + _at(bh, c, H, k_b, k_h, k_n), DK, k_c, 0, C, BK), boundary_check=(1,),
                padding_option="zero")
    P = tl.dot(q, tl.trans(k), input_precision=PREC) * D
    qd = q * Gexp[:, None]
    do_at = do_ptr + _at(bh, c, H, o_b, o_h, o_n)
    for v0 in range(0, DV, BV):
        do = tl.load(_rows(do_at, DV, o_c, v0, C, BV), boundary_check=(1,), padding_option="zero")
        dhs = tl.dot(tl.trans(qd), do, input_precision=PREC)
        tl.store(_tile(dhs_ptr + (bh * n + c) * DK * DV, DK, DV, 0, v0, BK, BV), dhs, boundary_check=(0, 1))
        tl.store(_tile(dvo_ptr + base * DV, C, DV, 0, v0, C, BV), tl.dot(tl.trans(P), do, input_precision=PREC),
                 boundary_check=(1,))


@jit
def _bwd_dq_kernel(do_ptr, o_b, o_h, o_n, o_c, hs_ptr, vn_ptr, dqd_ptr, dp_ptr, n, H, DK, DV,
                   C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """(program (c, b x h)) dq_dec = dO Hs^T and dP = dO V'^T, summed over dv tiles."""
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    base = (bh * n + c) * C
    dqd = tl.zeros([C, BK], tl.float32)
    dp = tl.zeros([C, C], tl.float32)
    do_at = do_ptr + _at(bh, c, H, o_b, o_h, o_n)
    for v0 in range(0, DV, BV):
        do = tl.load(_rows(do_at, DV, o_c, v0, C, BV), boundary_check=(1,), padding_option="zero")
        hs = tl.load(_tile(hs_ptr + (bh * n + c) * DK * DV, DK, DV, 0, v0, BK, BV), boundary_check=(0, 1),
                     padding_option="zero")
        vn = tl.load(_tile(vn_ptr + base * DV, C, DV, 0, v0, C, BV), boundary_check=(1,), padding_option="zero")
        dqd += tl.dot(do, tl.trans(hs), input_precision=PREC)
        dp += tl.dot(do, tl.trans(vn), input_precision=PREC)
    tl.store(_tile(dqd_ptr + base * DK, C, DK, 0, 0, C, BK), dqd, boundary_check=(1,))
    tl.store(_tile(dp_ptr + base * C, C, C, 0, 0, C, C), dp)


@jit
def _bwd_dw_kernel(du_ptr, hs_ptr, dh_ptr, vn_ptr, v_ptr, v_b, v_h, v_n, v_c, beta_ptr, b_b, b_h, b_n, b_c, ai_ptr,
                   dw_ptr, dkd_ptr, dai_ptr, dlast_ptr, dbeta_ptr, dv_ptr, n, H, DK, DV, C: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """(program (c, b x h)) over dv tiles: dW = -dU Hs^T, dk_dec = V' dH^T, dU vb^T (dAi's first part),
    dlast = sum(Hs dH); per tile dvb = Ai^T dU, so dv = beta dvb and dbeta's part sum(dvb v)."""
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    base = (bh * n + c) * C
    rc = tl.arange(0, C)
    beta = tl.load(beta_ptr + _at(bh, c, H, b_b, b_h, b_n) + rc * b_c)
    Ai = tl.load(_tile(ai_ptr + base * C, C, C, 0, 0, C, C))
    v_at = v_ptr + _at(bh, c, H, v_b, v_h, v_n)
    dw = tl.zeros([C, BK], tl.float32)
    dkd = tl.zeros([C, BK], tl.float32)
    dai = tl.zeros([C, C], tl.float32)
    dlast = tl.zeros([BK], tl.float32)
    dbeta = tl.zeros([C], tl.float32)
    for v0 in range(0, DV, BV):
        du = tl.load(_tile(du_ptr + base * DV, C, DV, 0, v0, C, BV), boundary_check=(1,), padding_option="zero")
        hs = tl.load(_tile(hs_ptr + (bh * n + c) * DK * DV, DK, DV, 0, v0, BK, BV), boundary_check=(0, 1),
                     padding_option="zero")
        dh = tl.load(_tile(dh_ptr + (bh * n + c) * DK * DV, DK, DV, 0, v0, BK, BV), boundary_check=(0, 1),
                     padding_option="zero")
        vn = tl.load(_tile(vn_ptr + base * DV, C, DV, 0, v0, C, BV), boundary_check=(1,), padding_option="zero")
        v = tl.load(_rows(v_at, DV, v_c, v0, C, BV), boundary_check=(1,), padding_option="zero")
        dw -= tl.dot(du, tl.trans(hs), input_precision=PREC)
        dkd += tl.dot(vn, tl.trans(dh), input_precision=PREC)
        dai += tl.dot(du, tl.trans(v * beta[:, None]), input_precision=PREC)
        dlast += tl.sum(hs * dh, axis=1)
        dvb = tl.dot(tl.trans(Ai), du, input_precision=PREC)
        tl.store(_tile(dv_ptr + base * DV, C, DV, 0, v0, C, BV), dvb * beta[:, None], boundary_check=(1,))
        dbeta += tl.sum(dvb * v, axis=1)
    tl.store(_tile(dw_ptr + base * DK, C, DK, 0, 0, C, BK), dw, boundary_check=(1,))
    tl.store(_tile(dkd_ptr + base * DK, C, DK, 0, 0, C, BK), dkd, boundary_check=(1,))
    tl.store(_tile(dai_ptr + base * C, C, C, 0, 0, C, C), dai)
    tl.store(dlast_ptr + bh * n + c, tl.sum(dlast, axis=0))
    tl.store(dbeta_ptr + base + rc, dbeta)


@jit
def _bwd_dk_kernel(q_ptr, q_b, q_h, q_n, q_c, k_ptr, k_b, k_h, k_n, k_c, beta_ptr, b_b, b_h, b_n, b_c, G_ptr, d_ptr,
                   ai_ptr, dqd_ptr, dp_ptr, dw_ptr, dkd_ptr, dai_ptr, dlast_ptr, dbeta_ptr, dq_ptr, dk_ptr, dG_ptr, n,
                   H, DK, HAS_DOCS: tl.constexpr, C: tl.constexpr, BKT: tl.constexpr, PREC: tl.constexpr):
    """(program (c, b x h)) the rest of `chunk_core_backward`, in two passes over dk tiles of BKT columns (only
    (C, C) matrices and one tile live at a time): first dAi's second part dW kbg^T and the products kb k^T, q k^T;
    then dA = -Ai^T dAi Ai^T and, through A = (kb k^T) D (below the diagonal), P = (q k^T) D, q_dec, k_dec, kbg and
    the decays, per tile dq and dk, and dbeta (adding to its dv part, in place) and G's gradient."""
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    base = (bh * n + c) * C
    rc = tl.arange(0, C)
    G, Gexp, k_scale, last, D, strict = _chunk_masks(G_ptr, d_ptr, bh, c, n, H, HAS_DOCS, C)
    beta = tl.load(beta_ptr + _at(bh, c, H, b_b, b_h, b_n) + rc * b_c)
    q_at, k_at = q_ptr + _at(bh, c, H, q_b, q_h, q_n), k_ptr + _at(bh, c, H, k_b, k_h, k_n)
    Ai = tl.load(_tile(ai_ptr + base * C, C, C, 0, 0, C, C))
    dai = tl.load(_tile(dai_ptr + base * C, C, C, 0, 0, C, C))
    X = tl.zeros([C, C], tl.float32)
    Y = tl.zeros([C, C], tl.float32)
    for k0 in range(0, DK, BKT):
        q = tl.load(_rows(q_at, DK, q_c, k0, C, BKT), boundary_check=(1,), padding_option="zero")
        k = tl.load(_rows(k_at, DK, k_c, k0, C, BKT), boundary_check=(1,), padding_option="zero")
        dw = tl.load(_tile(dw_ptr + base * DK, C, DK, 0, k0, C, BKT), boundary_check=(1,), padding_option="zero")
        kb = k * beta[:, None]
        dai += tl.dot(dw, tl.trans(kb * Gexp[:, None]), input_precision=PREC)
        X += tl.dot(kb, tl.trans(k), input_precision=PREC)
        Y += tl.dot(q, tl.trans(k), input_precision=PREC)
    dA = -tl.dot(tl.dot(tl.trans(Ai), dai, input_precision=PREC), tl.trans(Ai), input_precision=PREC)
    dX = dA * strict
    dY = tl.load(_tile(dp_ptr + base * C, C, C, 0, 0, C, C)) * D
    E = dX * X + dY * Y  # the decays' share of G's gradient: dD * D
    dG = tl.sum(E, axis=1) - tl.sum(E, axis=0)
    dbeta = tl.load(dbeta_ptr + base + rc)
    t = tl.zeros([C], tl.float32)
    for k0 in range(0, DK, BKT):
        q = tl.load(_rows(q_at, DK, q_c, k0, C, BKT), boundary_check=(1,), padding_option="zero")
        k = tl.load(_rows(k_at, DK, k_c, k0, C, BKT), boundary_check=(1,), padding_option="zero")
        dw = tl.load(_tile(dw_ptr + base * DK, C, DK, 0, k0, C, BKT), boundary_check=(1,), padding_option="zero")
        dqd = tl.load(_tile(dqd_ptr + base * DK, C, DK, 0, k0, C, BKT), boundary_check=(1,), padding_option="zero")
        dkd = tl.load(_tile(dkd_ptr + base * DK, C, DK, 0, k0, C, BKT), boundary_check=(1,), padding_option="zero")
        kb = k * beta[:, None]
        dkbg = tl.dot(tl.trans(Ai), dw, input_precision=PREC)
        dkb = dkbg * Gexp[:, None] + tl.dot(dX, k, input_precision=PREC)
        dq = tl.dot(dY, k, input_precision=PREC) + dqd * Gexp[:, None]
        tl.store(_tile(dq_ptr + base * DK, C, DK, 0, k0, C, BKT), dq, boundary_check=(1,))
        dk = (tl.dot(tl.trans(dX), kb, input_precision=PREC) + tl.dot(tl.trans(dY), q, input_precision=PREC)
              + dkd * k_scale[:, None] + dkb * beta[:, None])
        tl.store(_tile(dk_ptr + base * DK, C, DK, 0, k0, C, BKT), dk, boundary_check=(1,))
        dbeta += tl.sum(dkb * k, axis=1)
        t += tl.sum(dkd * k, axis=1)
        dG += (tl.sum(dkbg * kb, axis=1) + tl.sum(dqd * q, axis=1)) * Gexp  # kbg = kb Gexp, q_dec = q Gexp
    tl.store(dbeta_ptr + base + rc, dbeta)
    t = t * k_scale  # k_dec = k exp(G_C - G): -t to each G_i, sum(t) to G_C
    dlast = tl.load(dlast_ptr + bh * n + c)
    dG += tl.where(rc == C - 1, tl.sum(t, axis=0) + dlast * last, 0.0) - t
    tl.store(dG_ptr + base + rc, dG)


BKT = 32  # the dk tile of `_bwd_dk_kernel`'s passes


def chunk_core_backward_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, d: torch.Tensor | None, S0: torch.Tensor | None, do: torch.Tensor,
                               dSf: torch.Tensor, tune: Launch = TUNED
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                          torch.Tensor]:
    """`chunk_core_backward`'s contract, fp32: the forward's transform and states recomputed by their kernels, then
    the kernels above and the reverse recurrence's."""
    B, H, n, C, dk = k.shape
    dv = v.shape[-1]
    G, _, last, k_scale = chunk_decays(g.float(), d)
    Ai, U, W = chunk_intra_triton(k, v, beta, G, d, tune)
    k_dec = decayed_keys(k, k_scale)
    Hs, V, _ = chunk_states_triton(U, W, k_dec, last, S0, tune)
    q, k, v, beta, G, do, docs = (_strided(q), _strided(k), _strided(v), _strided(beta), _c(G), _strided(do),
                                  _docs(d, k))
    f32 = dict(dtype=torch.float32, device=W.device)
    by_c = torch.empty(B, H, n, C, C, **f32)
    dHs, dVo = torch.empty_like(Hs), torch.empty_like(V)
    dq_dec, dP, dW, dk_dec, dAi = torch.empty_like(W), torch.empty_like(by_c), torch.empty_like(W), \
        torch.empty_like(W), by_c
    dlast, dbeta, dv_, dq, dk_, dG = torch.empty(B, H, n, **f32), torch.empty(B, H, n, C, **f32), \
        torch.empty_like(V), torch.empty_like(W), torch.empty_like(W), torch.empty(B, H, n, C, **f32)
    if not (n and dk and dv):
        return dq.zero_(), dk_.zero_(), dv_.zero_(), dG.zero_(), dbeta.zero_(), _c(dSf).clone()
    meta = dict(C=C, BK=_bk(dk), PREC=tune.prec, **_launch(dk, tune))
    bv = tune.bv
    _bwd_reads_kernel[(n, B * H)](*q, *k, G, docs, *do, dHs, dVo, n, H, dk, dv, HAS_DOCS=d is not None, BV=bv,
                                  **meta)
    dH, dU, dS0 = chunk_states_reverse_triton(W, k_dec, last, dHs, dVo, dSf, tune)
    _bwd_dq_kernel[(n, B * H)](*do, Hs, V, dq_dec, dP, n, H, dk, dv, BV=bv, **meta)
    _bwd_dw_kernel[(n, B * H)](dU, Hs, dH, V, *v, *beta, Ai, dW, dk_dec, dAi, dlast, dbeta, dv_, n, H, dk, dv, BV=bv,
                               **meta)
    _bwd_dk_kernel[(n, B * H)](*q, *k, *beta, G, docs, Ai, dq_dec, dP, dW, dk_dec, dAi, dlast, dbeta, dq, dk_, dG, n,
                               H, dk, HAS_DOCS=d is not None, C=C, BKT=BKT, PREC=tune.prec, **_launch(dk, tune))
    return dq, dk_, dv_, dG.flip(-1).cumsum(-1).flip(-1), dbeta, dS0
