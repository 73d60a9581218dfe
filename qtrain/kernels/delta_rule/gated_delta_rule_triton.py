"""The gated delta rule on the GPU: the chunked form (gated_delta_rule.py's `chunked_form`) with its one sequential
part, the state's recurrence over chunks, as a Triton op pair (forward and backward kernels), so no Python loop over
chunks remains; every other step of the chunked form is a batched product over all chunks at once (cuBLAS matmuls and
triangular solves), differentiated by autograd.

The recurrence (`chunk_states`, the forward twin), per (batch, value head), chunk c = 0 .. n - 1::

    Hs_c = S_c,   V'_c = U_c - W_c S_c,   S_(c+1) = last_c S_c + k_dec_c^T V'_c

and its backward (`chunk_states_backward_twin`), with dS the gradient of the state leaving chunk c, from the final
state's gradient down::

    dH_c = dS,   dU_c = dV'_c + k_dec_c dS,   dS <- dHs_c + last_c dS - W_c^T dU_c   (then dS0 = dS)
    dW_c = -dU_c S_c^T,   dk_dec_c = V'_c dH_c^T,   dlast_c = sum(S_c * dH_c)

The kernels run the two loops, one program per (batch x head, dv tile of BV columns), the state tile (dk, BV) in
fp32 registers, the products in full fp32 (`input_precision="ieee"`); the backward recomputes the states Hs with the
forward kernel (kept only during the backward) and takes dW, dk_dec, dlast as batched products over chunks.
"""
from __future__ import annotations

import torch

from qtrain.kernels.delta_rule.gated_delta_rule import CHUNK, chunk_states, chunked_form
from qtrain.kernels.dispatch import jit, tl, triton, use_triton

__all__ = ["chunk_states_backward_triton", "chunk_states_backward_twin", "chunk_states_op", "chunk_states_triton",
           "gated_delta_rule_triton"]


# ------------------------------------------------------------------------------------------ backward twin
def chunk_states_backward_twin(U: torch.Tensor, W: torch.Tensor, k_dec: torch.Tensor, last: torch.Tensor,
                               S0: torch.Tensor | None, dHs: torch.Tensor, dV: torch.Tensor, dSf: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The specification of the backward (module docstring): the gradients of (Hs, V', S_final) -> (dU, dW, dk_dec,
    dlast, dS0), a loop over chunks in U's dtype, the states recomputed."""
    Hs, V, _ = chunk_states(U, W, k_dec, last, S0)
    n = U.shape[2]
    dS = dSf.to(U.dtype)
    dH, dU = [None] * n, [None] * n
    for c in reversed(range(n)):
        dH[c] = dS
        dU[c] = dV[:, :, c] + k_dec[:, :, c] @ dS
        dS = dHs[:, :, c] + last[:, :, c, None, None] * dS - W[:, :, c].transpose(-1, -2) @ dU[c]
    return _products(Hs, V, torch.stack(dH, dim=2), torch.stack(dU, dim=2), dS)


def _products(Hs, V, dH, dU, dS0):
    """The gradients that need no loop, from the states and the loop's dH, dU (batched over chunks)."""
    dW = -dU @ Hs.transpose(-1, -2)
    dk_dec = V @ dH.transpose(-1, -2)
    dlast = (Hs * dH).sum((-1, -2))
    return dU, dW, dk_dec, dlast, dS0


# -------------------------------------------------------------------------------------------- triton
BV, NUM_WARPS = 32, 4  # a program: the state's dk rows x 32 of its dv columns


@jit
def _states_fwd_kernel(u_ptr, w_ptr, kd_ptr, last_ptr, s0_ptr, hs_ptr, v_ptr, sf_ptr, n, DK, DV,
                       HAS_S0: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """The forward loop over chunks for one (batch x head, dv tile): rows of U, W, k_dec, V' are (bh n C + token),
    the states (bh n + c, dk, dv)."""
    bh = tl.program_id(1).to(tl.int64)
    rk = tl.arange(0, BK)
    rv = tl.program_id(0) * BV + tl.arange(0, BV)
    rc = tl.arange(0, C)
    kmask, vmask = rk < DK, rv < DV
    s_at = rk[:, None] * DV + rv[None, :]
    s_mask = kmask[:, None] & vmask[None, :]
    if HAS_S0:
        S = tl.load(s0_ptr + bh * DK * DV + s_at, mask=s_mask, other=0.0).to(tl.float32)
    else:
        S = tl.zeros([BK, BV], tl.float32)
    for c in range(n):
        row = (bh * n + c) * C + rc
        tl.store(hs_ptr + (bh * n + c) * DK * DV + s_at, S, mask=s_mask)
        w = tl.load(w_ptr + row[:, None] * DK + rk[None, :], mask=kmask[None, :], other=0.0)
        u = tl.load(u_ptr + row[:, None] * DV + rv[None, :], mask=vmask[None, :], other=0.0)
        v = u - tl.dot(w, S, input_precision="ieee")
        tl.store(v_ptr + row[:, None] * DV + rv[None, :], v, mask=vmask[None, :])
        kd = tl.load(kd_ptr + row[:, None] * DK + rk[None, :], mask=kmask[None, :], other=0.0)
        S = S * tl.load(last_ptr + bh * n + c) + tl.dot(tl.trans(kd), v, input_precision="ieee")
    tl.store(sf_ptr + bh * DK * DV + s_at, S, mask=s_mask)


@jit
def _states_bwd_kernel(w_ptr, kd_ptr, last_ptr, dhs_ptr, dv_ptr, dsf_ptr, dh_ptr, du_ptr, ds0_ptr, n, DK, DV,
                       C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """The backward loop over chunks, last to first, for one (batch x head, dv tile): dH_c (the gradient of the
    state leaving chunk c), dU_c, and at the end dS0."""
    bh = tl.program_id(1).to(tl.int64)
    rk = tl.arange(0, BK)
    rv = tl.program_id(0) * BV + tl.arange(0, BV)
    rc = tl.arange(0, C)
    kmask, vmask = rk < DK, rv < DV
    s_at = rk[:, None] * DV + rv[None, :]
    s_mask = kmask[:, None] & vmask[None, :]
    dS = tl.load(dsf_ptr + bh * DK * DV + s_at, mask=s_mask, other=0.0).to(tl.float32)
    for i in range(n):
        c = n - 1 - i
        row = (bh * n + c) * C + rc
        tl.store(dh_ptr + (bh * n + c) * DK * DV + s_at, dS, mask=s_mask)
        kd = tl.load(kd_ptr + row[:, None] * DK + rk[None, :], mask=kmask[None, :], other=0.0)
        du = tl.load(dv_ptr + row[:, None] * DV + rv[None, :], mask=vmask[None, :], other=0.0).to(tl.float32)
        du = du + tl.dot(kd, dS, input_precision="ieee")
        tl.store(du_ptr + row[:, None] * DV + rv[None, :], du, mask=vmask[None, :])
        w = tl.load(w_ptr + row[:, None] * DK + rk[None, :], mask=kmask[None, :], other=0.0)
        dhs = tl.load(dhs_ptr + (bh * n + c) * DK * DV + s_at, mask=s_mask, other=0.0).to(tl.float32)
        dS = dhs + dS * tl.load(last_ptr + bh * n + c) - tl.dot(tl.trans(w), du, input_precision="ieee")
    tl.store(ds0_ptr + bh * DK * DV + s_at, dS, mask=s_mask)


def _check(U: torch.Tensor, W: torch.Tensor, k_dec: torch.Tensor, last: torch.Tensor) -> None:
    B, H, n, C, dv = U.shape
    if W.shape[:4] != (B, H, n, C) or k_dec.shape != W.shape or last.shape != (B, H, n) \
            or not all(t.dtype == torch.float32 for t in (U, W, k_dec, last)):
        raise ValueError(f"chunk_states: expected fp32 U (B, H, n, C, dv), W and k_dec (B, H, n, C, dk), last "
                         f"(B, H, n); got {tuple(U.shape)}, {tuple(W.shape)}, {tuple(k_dec.shape)}, "
                         f"{tuple(last.shape)}, {U.dtype}")


def _meta(U: torch.Tensor, W: torch.Tensor):
    B, H, n, C, dv = U.shape
    dk = W.shape[-1]
    return dict(C=C, BK=max(16, triton.next_power_of_2(dk)), BV=BV), (triton.cdiv(dv, BV), B * H), n, dk, dv


def chunk_states_triton(U: torch.Tensor, W: torch.Tensor, k_dec: torch.Tensor, last: torch.Tensor,
                        S0: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton forward; `chunk_states`' contract, fp32."""
    _check(U, W, k_dec, last)
    meta, grid, n, dk, dv = _meta(U, W)
    B, H = U.shape[:2]
    Hs = U.new_empty(B, H, n, dk, dv)
    V = torch.empty_like(U, memory_format=torch.contiguous_format)
    Sf = U.new_empty(B, H, dk, dv)
    if U.numel() and n:
        s0 = S0.float().contiguous() if S0 is not None else Sf
        _states_fwd_kernel[grid](U.contiguous(), W.contiguous(), k_dec.contiguous(), last.contiguous(), s0, Hs, V, Sf,
                                 n, dk, dv, HAS_S0=S0 is not None, **meta, num_warps=NUM_WARPS)
    else:
        Sf.copy_(S0 if S0 is not None else Sf.zero_())
    return Hs, V, Sf


def chunk_states_backward_triton(U: torch.Tensor, W: torch.Tensor, k_dec: torch.Tensor, last: torch.Tensor,
                                 S0: torch.Tensor | None, dHs: torch.Tensor, dV: torch.Tensor, dSf: torch.Tensor
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton backward; `chunk_states_backward_twin`'s contract: the forward kernel recomputes the states, the
    backward kernel runs the loop, torch the batched products."""
    Hs, V, _ = chunk_states_triton(U, W, k_dec, last, S0)
    meta, grid, n, dk, dv = _meta(U, W)
    dH = torch.empty_like(Hs)
    dU = torch.empty_like(V)
    dS0 = torch.empty_like(dSf, dtype=torch.float32, memory_format=torch.contiguous_format)
    if U.numel() and n:
        _states_bwd_kernel[grid](W.contiguous(), k_dec.contiguous(), last.contiguous(), dHs.contiguous(),
                                 dV.contiguous(), dSf.contiguous(), dH, dU, dS0, n, dk, dv, **meta,
                                 num_warps=NUM_WARPS)
    else:
        dS0.copy_(dSf)
    return _products(Hs, V, dH, dU, dS0)


# ---------------------------------------------------------------------------------------------- ops
@torch.library.custom_op("qtrain::gdr_chunk_states_fwd", mutates_args=())
def _states_fwd(U: torch.Tensor, W: torch.Tensor, k_dec: torch.Tensor, last: torch.Tensor,
                S0: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if use_triton(U):
        return chunk_states_triton(U, W, k_dec, last, S0)
    Hs, V, Sf = chunk_states(U, W, k_dec, last, S0)
    return Hs, V, Sf.clone()  # a fresh tensor also without chunks (an op's output may not alias its input S0)


@_states_fwd.register_fake
def _(U, W, k_dec, last, S0):
    B, H, n, _, dv = U.shape
    dk = W.shape[-1]
    return U.new_empty(B, H, n, dk, dv), torch.empty_like(U, memory_format=torch.contiguous_format), \
        U.new_empty(B, H, dk, dv)


@torch.library.custom_op("qtrain::gdr_chunk_states_bwd", mutates_args=())
def _states_bwd(U: torch.Tensor, W: torch.Tensor, k_dec: torch.Tensor, last: torch.Tensor, S0: torch.Tensor | None,
                dHs: torch.Tensor, dV: torch.Tensor, dSf: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if use_triton(U):
        out = chunk_states_backward_triton(U, W, k_dec, last, S0, dHs, dV, dSf)
    else:
        out = chunk_states_backward_twin(U, W, k_dec, last, S0, dHs, dV, dSf)
    return (*out[:4], out[4].clone())  # dS0 is dSf itself without chunks: an op's output may not alias an input


@_states_bwd.register_fake
def _(U, W, k_dec, last, S0, dHs, dV, dSf):
    return (torch.empty_like(U, memory_format=torch.contiguous_format),
            torch.empty_like(W, memory_format=torch.contiguous_format),
            torch.empty_like(k_dec, memory_format=torch.contiguous_format),
            torch.empty_like(last, memory_format=torch.contiguous_format),
            U.new_empty(dSf.shape))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:4], inputs[4])  # the inputs, not the states: the backward recomputes them


def _backward(ctx, dHs, dV, dSf):
    U, W, k_dec, last, S0 = ctx.saved_tensors
    B, H, n, _, dv = U.shape
    dk = W.shape[-1]
    dHs = U.new_zeros(B, H, n, dk, dv) if dHs is None else dHs
    dV = torch.zeros_like(U) if dV is None else dV
    dSf = U.new_zeros(B, H, dk, dv) if dSf is None else dSf
    dU, dW, dk_dec, dlast, dS0 = _states_bwd(U, W, k_dec, last, S0, dHs, dV, dSf)
    return dU, dW, dk_dec, dlast, (dS0.to(S0.dtype) if S0 is not None else None)


_states_fwd.register_autograd(_backward, setup_context=_setup_context)


def chunk_states_op(U: torch.Tensor, W: torch.Tensor, k_dec: torch.Tensor, last: torch.Tensor,
                    S0: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The recurrence over chunks as a differentiable op pair (Triton on CUDA, the twins elsewhere); `chunk_states`'
    contract. It keeps its inputs for the backward, not the states."""
    return _states_fwd(U, W, k_dec, last, S0)


def gated_delta_rule_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            *, l2norm: bool = True, initial_state: torch.Tensor | None = None,
                            resets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_delta_rule_chunked`'s contract (chunks of 64), the recurrence over chunks through `chunk_states_op`."""
    return chunked_form(q, k, v, g, beta, chunk_states_op, l2norm=l2norm, initial_state=initial_state, chunk=CHUNK,
                        resets=resets)
