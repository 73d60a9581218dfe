"""The gated delta rule (Gated DeltaNet, Yang, Kautz and Hatamizadeh 2024, arXiv:2412.06464), in two plain-torch
forms: the recurrent one, token by token, which is the specification, and the chunked one (the WY / UT-transform
form of the DeltaNet paper, arXiv:2406.06484, as fla-core's `chunk_gated_delta_rule` and transformers'
`torch_chunk_gated_delta_rule` compute it), which equals it up to fp32 rounding and is what the model runs on the CPU.

Per value head h (H = num_value_heads; each query/key head serves H / Hk consecutive value heads), with a matrix
state S (dk, dv) that starts at zero (or `initial_state`), q and k L2-normalised (q also scaled by dk^-1/2), for
t = 1..T::

    S   <- exp(g_t) S                                  (g_t <= 0: the gate, a decay in log space)
    S   <- S + beta_t k_t (v_t - S^T k_t)^T            (the delta rule: write the error of S's prediction of v_t)
    o_t  = S^T q_t

All of it runs in fp32 whatever the inputs' dtype (as fla-core and transformers do; fp64 inputs stay fp64, for
tests); o comes back in q's dtype, the final state in the accumulation dtype.

The chunked form, per chunk of C tokens (positions i, j inside it; G_i = g_1 + ... + g_i, the cumulative log
decay; D_ij = exp(G_i - G_j) for j <= i, 0 above the diagonal)::

    A     = strictly_lower((beta k) k^T * D)           (C, C)
    U     = (I + A)^-1 (beta v)                        the chunk's delta-rule values before the old state
    W     = (I + A)^-1 (beta k exp(G))                 how the old state's read-out enters them
    V'    = U - W S                                    (C, dv) the corrections written into the state
    o     = (q exp(G)) S + ((q k^T) * D) V'            the old state's read plus the chunk's own writes
    S     <- exp(G_C) S + (k exp(G_C - G))^T V'

Two triangular solves and a few (C, C) / (C, d) products per chunk instead of T rank-one updates: the recurrence
over chunks is what stays sequential.

Documents (`resets` (B, T) bool, True at a document's first token: --document-masking): the state is zero before
such a token is written, S <- 0 in place of the decay, so each document runs as if alone. In the chunked form, with
d_i the number of resets at or before position i within the chunk: D_ij = 0 unless d_i = d_j (so A, hence both
solves, and the chunk's own read are block-diagonal by document), the old state's read and its entry into the
corrections (q exp(G), beta k exp(G)) only where d_i = 0, the state update only from the chunk's last document
(d_i = d_C) and the old state kept only where d_C = 0. The cumulative G need not restart: every product it enters
then spans one document only. Both forms differentiate with autograd; on the GPU the chunked form's work on the
chunks (`chunk_core`) runs as an op pair (gated_delta_rule_op.py) of Triton kernels, whose backward is written out
in gated_delta_rule_backward.py.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["CHUNK", "chunk_core", "chunk_decays", "chunk_pair_decays", "chunk_states", "chunked_form",
           "gated_delta_rule_chunked", "gated_delta_rule_recurrent",
           "l2_normalize"]

CHUNK = 64  # fla-core's and transformers' chunk size
L2_EPS = 1e-6  # fla-core's l2norm epsilon (transformers' `l2norm` matches it)


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension, as fla-core and transformers compute it."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           resets: torch.Tensor | None = None) -> None:
    B, T, Hk, dk = q.shape
    H = v.shape[2] if v.dim() == 4 else -1
    if k.shape != q.shape or v.dim() != 4 or v.shape[:2] != (B, T) or g.shape != (B, T, H) \
            or beta.shape != (B, T, H) or H % Hk:
        raise ValueError(f"gated_delta_rule: expected q, k (B, T, Hk, dk), v (B, T, H, dv) with H a multiple of Hk, "
                         f"g and beta (B, T, H); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, "
                         f"{tuple(g.shape)}, {tuple(beta.shape)}")
    if resets is not None and (resets.shape != (B, T) or resets.dtype != torch.bool):
        raise ValueError(f"gated_delta_rule: resets must be (B, T) bool, got {tuple(resets.shape)} {resets.dtype}")


def _prepare(q, k, v, g, beta, l2norm: bool):
    """fp32, heads first (B, H, T, d), q and k repeated to the value heads, normalised, q scaled by dk^-1/2."""
    H, Hk = v.shape[2], q.shape[2]
    if H != Hk:  # grouped value heads: key head i serves value heads i*H/Hk .. (i+1)*H/Hk - 1
        q, k = q.repeat_interleave(H // Hk, dim=2), k.repeat_interleave(H // Hk, dim=2)
    acc = torch.promote_types(v.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs (tests)
    q, k, v, g, beta = (x.transpose(1, 2).to(acc) for x in (q, k, v, g, beta))
    if l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def gated_delta_rule_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, *, l2norm: bool = True, initial_state: torch.Tensor | None = None,
                               resets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The specification (module docstring): q, k (B, T, Hk, dk), v (B, T, H, dv), g, beta (B, T, H) ->
    (o (B, T, H, dv) in q's dtype, final state (B, H, dk, dv) fp32). `resets` (B, T) bool: the state is zero before
    each token marked (a document's first)."""
    _check(q, k, v, g, beta, resets)
    dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, l2norm)
    B, H, T, dk = k.shape
    S = (torch.zeros(B, H, dk, v.shape[-1], dtype=v.dtype, device=v.device) if initial_state is None
         else initial_state.to(v.dtype))
    out = []
    keep = None if resets is None else (~resets).to(v.dtype)  # (B, T): 0 where the state restarts
    for t in range(T):
        decay = g[:, :, t].exp()  # (B, H)
        S = S * (decay if keep is None else decay * keep[:, t, None])[..., None, None]
        kt = k[:, :, t]  # (B, H, dk)
        delta = (v[:, :, t] - (S * kt[..., None]).sum(-2)) * beta[:, :, t, None]  # (B, H, dv)
        S = S + kt[..., None] * delta[..., None, :]
        out.append((S * q[:, :, t, :, None]).sum(-2))
    o = torch.stack(out, dim=2) if out else v.new_zeros(v.shape)
    return o.transpose(1, 2).to(dtype), S


def gated_delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, *, l2norm: bool = True, initial_state: torch.Tensor | None = None,
                             chunk: int = CHUNK, resets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked form (module docstring), same contract as `gated_delta_rule_recurrent`. The sequence is padded
    to a multiple of `chunk` with g = 0, beta = 0 (tokens that neither decay nor write the state)."""
    return chunked_form(q, k, v, g, beta, chunk_core, l2norm=l2norm, initial_state=initial_state, chunk=chunk,
                        resets=resets)


def chunk_states(U: torch.Tensor, W: torch.Tensor, k_dec: torch.Tensor, last: torch.Tensor,
                 S0: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The one sequential part of the chunked form, the state's recurrence over chunks: U, V' (B, H, n, C, dv), W,
    k_dec (B, H, n, C, dk), last (B, H, n) (the state's decay across a chunk), S0 (B, H, dk, dv) or None (zeros) ->
    (Hs (B, H, n, dk, dv): the state entering each chunk, V' = U - W S per chunk, the final state)::

        V'_c = U_c - W_c S_c,   S_(c+1) = last_c S_c + k_dec_c^T V'_c

    A loop over chunks here; a Triton kernel on the GPU (gated_delta_rule_triton.py)."""
    B, H, n, _, dv = U.shape
    S = U.new_zeros(B, H, W.shape[-1], dv) if S0 is None else S0.to(U.dtype)
    states, corrections = [], []
    for c in range(n):
        v_new = U[:, :, c] - W[:, :, c] @ S  # (B, H, C, dv)
        states.append(S)
        corrections.append(v_new)
        S = S * last[:, :, c, None, None] + k_dec[:, :, c].transpose(-1, -2) @ v_new
    return torch.stack(states, dim=2), torch.stack(corrections, dim=2), S


CoreFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None",
                   "torch.Tensor | None"], tuple[torch.Tensor, torch.Tensor]]


def chunked_form(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 core: CoreFn, *, l2norm: bool = True, initial_state: torch.Tensor | None = None,
                 chunk: int = CHUNK, resets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked form around `core` (`chunk_core`'s contract, on the chunks): the inputs prepared (fp32, heads
    first, q and k repeated to the value heads and normalised), padded and cut into chunks, the output put back."""
    _check(q, k, v, g, beta, resets)
    dtype, T = q.dtype, q.shape[1]
    q, k, v, g, beta = _prepare(q, k, v, g, beta, l2norm)
    B, H, _, dk = k.shape
    dv = v.shape[-1]
    pad = (-T) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
        if resets is not None:
            resets = F.pad(resets, (0, pad))
    n = (T + pad) // chunk
    # (B, H, n, C, d): chunk c holds tokens c*C .. c*C + C - 1
    q, k, v = (x.reshape(B, H, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(B, H, n, chunk), beta.reshape(B, H, n, chunk)
    # d: resets at or before each position of its chunk (module docstring), (B, 1, n, C)
    d = None if resets is None else resets.reshape(B, 1, n, chunk).cumsum(-1)
    o, S = core(q, k, v, g, beta, d, initial_state)
    o = o.reshape(B, H, n * chunk, dv)[:, :, :T]
    return o.transpose(1, 2).to(dtype), S


def chunk_decays(g: torch.Tensor, d: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunk's decays (module docstring) from its gates g (B, H, n, C) and documents d (`chunk_core`): G the
    cumulative log decay, Gexp the old state's read-out scale exp(G) (zero after a reset), `last` (B, H, n) the
    state's decay across the chunk, `k_scale` the keys' decay to the chunk's end (zero before its last document)."""
    G = g.cumsum(-1)  # (B, H, n, C): log decay from the chunk's start through position i
    Gexp = G.exp()
    k_scale = (G[..., -1:] - G).exp()
    last = G[..., -1].exp()  # (B, H, n)
    if d is not None:
        Gexp = Gexp * (d == 0)  # only the chunk's first document reads the old state
        k_scale = k_scale * (d == d[..., -1:])  # the state leaving a chunk holds its last document only
        last = last * (d[..., -1] == 0)
    return G, Gexp, last, k_scale


def chunk_pair_decays(G: torch.Tensor, d: torch.Tensor | None) -> torch.Tensor:
    """D (B, H, n, C, C): exp(G_i - G_j) for j <= i in the same document, zero elsewhere."""
    C = G.shape[-1]
    hidden = torch.ones(C, C, dtype=torch.bool, device=G.device).triu(1)
    if d is not None:
        hidden = hidden | (d[..., :, None] != d[..., None, :])  # (B, 1, n, C, C)
    return (G[..., :, None] - G[..., None, :]).masked_fill(hidden, float("-inf")).exp()


def chunk_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               d: torch.Tensor | None, S0: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked form on prepared chunks: q, k (B, H, n, C, dk) (normalised, q scaled), v (B, H, n, C, dv), g,
    beta (B, H, n, C), d (B, 1, n, C) the resets at or before each position of its chunk (None: no documents), S0
    (B, H, dk, dv) or None -> (o (B, H, n, C, dv), the final state); the recurrence over chunks by `chunk_states`,
    every other step a batched product over all chunks at once."""
    G, Gexp, last, k_scale = chunk_decays(g, d)
    D = chunk_pair_decays(G, d)
    kb = k * beta[..., None]
    A = (kb @ k.transpose(-1, -2)) * D  # the diagonal is ignored by the unit-triangular solves
    U = torch.linalg.solve_triangular(A, v * beta[..., None], upper=False, unitriangular=True)  # (B, H, n, C, dv)
    W = torch.linalg.solve_triangular(A, kb * Gexp[..., None], upper=False, unitriangular=True)  # (.., C, dk)
    Hs, v_new, S = chunk_states(U, W, k * k_scale[..., None], last, S0)
    QK = (q @ k.transpose(-1, -2)) * D  # (B, H, n, C, C): the chunk's own causal read
    o = (q * Gexp[..., None]) @ Hs + QK @ v_new  # (B, H, n, C, dv): the old state's read plus the chunk's own writes
    return o, S
