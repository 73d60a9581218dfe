"""The chunked form's gradient written out (gated_delta_rule.py's `chunk_core`), the specification of the GPU path's
backward (gated_delta_rule_triton.py): it keeps only the inputs and recomputes the chunk terms, so no autograd graph
of (C, C) and (C, d) fp32 buffers per chunk lives between the forward and the backward.

Per chunk (notation of gated_delta_rule.py; Ai = (I + A)^-1, kb = beta k, vb = beta v, kbg = kb exp(G) (zero after a
reset), P = (q k^T) * D, q_dec, k_dec, `last` as `chunk_decays` makes them), from the output's gradient dO and the
final state's dS::

    dHs = q_dec^T dO,  dV'(read) = P^T dO                   the chunk's two reads of the states and corrections
    dH, dU, dS0 = the reverse recurrence (`chunk_states_reverse`)
    dq_dec = dO Hs^T,  dP = dO V'^T,  dW = -dU Hs^T,  dk_dec = V' dH^T,  dlast = sum(Hs * dH)
    dvb = Ai^T dU,  dkbg = Ai^T dW,  dA = -Ai^T (dU vb^T + dW kbg^T) Ai^T   (below the diagonal)

and from there through the products and decays to q, k, v, beta and the cumulative G, whose reverse cumulative sum
is g's gradient.
"""
from __future__ import annotations

import torch

from qtrain.kernels.delta_rule.gated_delta_rule import chunk_decays, chunk_pair_decays, chunk_states

__all__ = ["chunk_core_backward", "chunk_intra", "chunk_states_reverse"]

def chunk_states_reverse(W: torch.Tensor, k_dec: torch.Tensor, last: torch.Tensor, dHs: torch.Tensor,
                         dV: torch.Tensor, dSf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The recurrence over chunks backwards (`chunk_states`' gradient loop): from the gradients of the states Hs, of
    the corrections V' (their reads) and of the final state -> (dH (B, H, n, dk, dv) the gradient of the state
    leaving each chunk, dU (B, H, n, C, dv) the corrections' whole gradient, dS0)::

        dH_c = dS,   dU_c = dV'_c + k_dec_c dS,   dS <- dHs_c + last_c dS - W_c^T dU_c

    A loop over chunks here; a Triton kernel on the GPU."""
    n = W.shape[2]
    dS = dSf.to(W.dtype)
    dH, dU = [None] * n, [None] * n
    for c in reversed(range(n)):
        dH[c] = dS
        dU[c] = dV[:, :, c] + k_dec[:, :, c] @ dS
        dS = dHs[:, :, c] + last[:, :, c, None, None] * dS - W[:, :, c].transpose(-1, -2) @ dU[c]
    return torch.stack(dH, dim=2), torch.stack(dU, dim=2), dS


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-1, -2)


def chunk_intra(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, D: torch.Tensor, Gexp: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Ai = (I + A)^-1, U = Ai vb, W = Ai kbg) per chunk: the WY/UT transform of the chunk's own writes."""
    kb = k * beta[..., None]
    A = (kb @ _t(k)) * D  # the diagonal is ignored by the unit-triangular solve
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device).expand_as(A)
    Ai = torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True)
    return Ai, Ai @ (v * beta[..., None]), Ai @ (kb * Gexp[..., None])


def chunk_core_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        d: torch.Tensor | None, S0: torch.Tensor | None, do: torch.Tensor, dSf: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                   torch.Tensor]:
    """`chunk_core`'s gradient (module docstring): (dq, dk, dv, dg, dbeta, dS0) for the output's gradient do
    (B, H, n, C, dv) and the final state's dSf, the forward's terms recomputed."""
    G, Gexp, last, k_scale = chunk_decays(g, d)
    D = chunk_pair_decays(G, d)
    C = g.shape[-1]
    strict = D * (1 - torch.eye(C, dtype=D.dtype, device=D.device))  # A's decays: below the diagonal only
    Ai, U, W = chunk_intra(k, v, beta, D, Gexp)
    kb, vb = k * beta[..., None], v * beta[..., None]
    kbg, k_dec, q_dec = kb * Gexp[..., None], k * k_scale[..., None], q * Gexp[..., None]
    Hs, V, _ = chunk_states(U, W, k_dec, last, S0)
    Y = q @ _t(k)
    P = Y * D
    dH, dU, dS0 = chunk_states_reverse(W, k_dec, last, _t(q_dec) @ do, _t(P) @ do, dSf)
    dq_dec, dP, dW = do @ _t(Hs), do @ _t(V), -dU @ _t(Hs)
    dk_dec, dlast = V @ _t(dH), (Hs * dH).sum((-1, -2))
    dvb, dkbg = _t(Ai) @ dU, _t(Ai) @ dW
    dA = -_t(Ai) @ (dU @ _t(vb) + dW @ _t(kbg)) @ _t(Ai)
    dX = dA * strict  # X = kb k^T, A = X * strict
    dY = dP * D  # Y = q k^T, P = Y * D
    E = dX * (kb @ _t(k)) + dY * Y  # dD * D: the decays' share of G's gradient
    dkb = dkbg * Gexp[..., None] + dX @ k
    dq = dY @ k + dq_dec * Gexp[..., None]
    dk = _t(dX) @ kb + _t(dY) @ q + dk_dec * k_scale[..., None] + dkb * beta[..., None]
    dv = dvb * beta[..., None]
    dbeta = (dvb * v).sum(-1) + (dkb * k).sum(-1)
    t = (dk_dec * k_dec).sum(-1)  # k_dec = k exp(G_C - G): -t to each G_i, + sum(t) to G_C
    dG = (dkbg * kbg).sum(-1) + (dq_dec * q_dec).sum(-1) - t + E.sum(-1) - E.sum(-2)
    dG[..., -1] += t.sum(-1) + dlast * last
    dg = dG.flip(-1).cumsum(-1).flip(-1)  # G = cumsum(g)
    return dq, dk, dv, dg, dbeta, dS0
