"""Fused cross-entropy whose d(logits) goes straight to FP8: e5m2 codes in place over the logits, and their transpose.

What `--fp8-head-backward` needs (model/loss.py): the LM head's two backward GEMMs, d(h) = G W and d(W) = G^T h, run
as FP8 GEMMs, and cuBLASLt multiplies FP8 only row-major by column-major, so it needs G (n, V) and G^T (V, n) both as
row-major FP8 matrices. This kernel writes them from the tile that computes G, instead of a bf16 G plus an abs-max
pass plus a quantize pass (each a full pass over n x V values, the largest tensor of a step).

Per row r of ``logits`` (n, V), arithmetic in fp32 (as ``cross_entropy.chunk_loss_and_dlogits``, the specification):

    pass 1 (read the row):       lse = logsumexp(x);  loss_r = (lse - x[t]) + z lse^2  (0 if t == -100)
    pass 2 (read, write codes):  d = exp(x - lse) (1 + 2 z lse) - [col == t]           (0 if t == -100)
                                 q = cast_rn(clamp(d * 2^G_SCALE_EXP, +-57344)) to e5m2

The scale is fixed, no abs-max needed: |d| <= max(1, 1 + 2 z lse), which 2^15 maps below e5m2's largest value 57344
(1.75 * 2^15) for any z lse < 0.375; beyond that the clamp saturates. e5m2 and not e4m3: d spans the softmax's
range (probabilities down to ~1e-9 matter summed over a 152k vocabulary), and e5m2's subnormals reach 2^-16, i.e.
|d| down to 2^-31 ~ 4.7e-10 here, where e4m3 at its own scale would flush everything below 2^-17 ~ 7.6e-6 to zero.

Layouts: q is written over the logits' own bytes, row r's codes in the first V bytes of row r (a view
``fp8_grad_view(logits)``, rows padded to the logits' row stride in bytes); each program owns whole rows and reads
every element before writing the byte it overlaps, so nothing unread is clobbered. q^T is a new (V, n) e5m2 matrix.
The logits are not readable afterwards. Programs take BLOCK_M rows so that q^T's stores are BLOCK_M-byte runs.

The plain-torch twin (``cross_entropy_fp8_grads_twin``) is the specification and the CPU path; the Triton kernel
agrees with it on loss and lse to fp32 rounding and on the codes exactly, except where exp's approximation puts d
across a rounding boundary of e5m2 (one code). Dispatch: ``qtrain.kernels.dispatch``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from qtrain.kernels.cross_entropy import chunk_loss_and_dlogits, dlogits_f32
from qtrain.kernels.dispatch import INTERPRET, jit, tl, triton, use_triton
from qtrain.kernels.stochastic_rounding import KINDS, load_f32

__all__ = ["G_DTYPE", "G_SCALE_EXP", "cross_entropy_fp8_grads", "cross_entropy_fp8_grads_triton",
           "cross_entropy_fp8_grads_twin", "fp8_grad_view"]

G_DTYPE = torch.float8_e5m2
G_SCALE_EXP = 15  # d(logits) is quantized as d * 2^15: the inverse scale the GEMMs take is 2^-15
_FMAX = 57344.0  # torch.finfo(torch.float8_e5m2).max
# Tile: BLOCK_M rows x BLOCK_V columns per loop iteration, 8 warps (bench kind `cross-entropy` sweeps them).
BLOCK_M, BLOCK_V, NUM_WARPS = 32, 256, 8

FP8Grads = tuple[Tensor, Tensor, Tensor, Tensor]  # (loss_sum, lse, q (n, V) over the logits, q^T (V, n))


def fp8_grad_view(logits: Tensor) -> Tensor:
    """The (n, V) e5m2 view of the first V bytes of each row of ``logits``: where the codes of d(logits) go."""
    n, v = logits.shape
    return logits.view(torch.uint8).view(G_DTYPE)[:, :v]


def _check(logits: Tensor, targets: Tensor) -> None:
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"logits must be (n, V) and targets (n,), got {tuple(logits.shape)} and {tuple(targets.shape)}")
    if logits.dtype not in KINDS:
        raise TypeError(f"logits dtype must be one of {list(KINDS)}, got {logits.dtype}")
    if not logits.is_contiguous():
        raise ValueError("logits must be contiguous: d(logits)'s codes are written over its rows")


def cross_entropy_fp8_grads_twin(logits: Tensor, targets: Tensor, *, z_loss: float) -> FP8Grads:
    """The specification: (loss_sum fp32, lse (n,) fp32, q, q^T) with q written over ``logits`` (module docstring)."""
    _check(logits, targets)
    loss_sum, lse, _ = chunk_loss_and_dlogits(logits, targets, z_loss=z_loss, need_grad=False)
    d = dlogits_f32(logits.float(), lse, targets, z_loss)
    codes = (d * 2.0 ** G_SCALE_EXP).clamp_(-_FMAX, _FMAX).to(G_DTYPE)
    q = fp8_grad_view(logits)
    q.copy_(codes)
    return loss_sum, lse, q, codes.t().contiguous()


@jit
def _ce_fp8_kernel(x_ptr, q_ptr, qt_ptr, targets_ptr, loss_ptr, lse_ptr, N, V, stride_x, stride_q, z_loss,
                   LOAD_KIND: tl.constexpr, SCALE: tl.constexpr, FMAX: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_V: tl.constexpr):
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rmask = rm < N
    tgt = tl.load(targets_ptr + rm, mask=rmask, other=-100).to(tl.int64)
    valid = tgt != -100
    cols = tl.arange(0, BLOCK_V)
    rows = x_ptr + rm[:, None] * stride_x

    # pass 1: online max and sum-exp per row; columns past V are -inf, rows past N read zeros (finite, unused)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_M,), tl.float32)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        cmask = offs[None, :] < V
        x = load_f32(rows + offs[None, :], rmask[:, None] & cmask, LOAD_KIND)
        x = tl.where(cmask, x, float("-inf"))
        m_new = tl.maximum(m, tl.max(x, axis=1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new[:, None]), axis=1)
        m = m_new
    lse = m + tl.log(s)
    x_t = load_f32(x_ptr + rm * stride_x + tl.where(valid, tgt, 0), rmask & valid, LOAD_KIND)
    tl.store(loss_ptr + rm, tl.where(valid, (lse - x_t) + z_loss * (lse * lse), 0.0), mask=rmask)
    tl.store(lse_ptr + rm, lse, mask=rmask)

    # pass 2: the codes of d, over the row's own (already read) bytes, and transposed into q^T
    coef = tl.where(valid, 1.0 + 2.0 * z_loss * lse, 0.0)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        mask = rmask[:, None] & (offs[None, :] < V)
        x = load_f32(rows + offs[None, :], mask, LOAD_KIND)
        d = tl.exp(x - lse[:, None]) * coef[:, None]
        d = tl.where(valid[:, None] & (offs[None, :] == tgt[:, None]), d - 1.0, d)
        y = tl.minimum(tl.maximum(d * SCALE, -FMAX), FMAX)
        q = y.to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + rm[:, None] * stride_q + offs[None, :], q, mask=mask)
        tl.store(qt_ptr + offs[:, None] * N + rm[None, :], tl.trans(q), mask=tl.trans(mask))


def cross_entropy_fp8_grads_triton(logits: Tensor, targets: Tensor, *, z_loss: float) -> FP8Grads:
    """Host launcher of `_ce_fp8_kernel`; the twin's contract. On the GPU the logits are read natively (Triton 3.6
    wrote wrong transposed FP8 codes from integer-bit bf16 loads on the H200, BENCHMARKS.md session 14); under the
    interpreter, whose bf16 conversions are not the GPU's, through their bits."""
    _check(logits, targets)
    n, v = logits.shape
    kind = KINDS[logits.dtype]
    load_kind = 0 if not INTERPRET else kind
    x = logits.view(torch.int16) if load_kind == 1 else logits
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    q = fp8_grad_view(logits)
    qt = torch.empty((v, n), dtype=G_DTYPE, device=logits.device)
    if n:
        _ce_fp8_kernel[(triton.cdiv(n, BLOCK_M),)](
            x, q, qt, targets.contiguous(), loss, lse, n, v, logits.stride(0), q.stride(0), float(z_loss),
            LOAD_KIND=load_kind, SCALE=float(2.0 ** G_SCALE_EXP), FMAX=_FMAX, BLOCK_M=BLOCK_M, BLOCK_V=BLOCK_V,
            num_warps=NUM_WARPS)
    return loss.sum(), lse, q, qt


def cross_entropy_fp8_grads(logits: Tensor, targets: Tensor, *, z_loss: float) -> FP8Grads:
    """(loss_sum fp32, lse (n,) fp32, q (n, V) e5m2 over ``logits``, q^T (V, n) e5m2) with q * 2^-G_SCALE_EXP =
    d(loss_sum)/d(logits); the logits are overwritten. Triton or twin per ``qtrain.kernels.dispatch``."""
    if use_triton(logits):
        return cross_entropy_fp8_grads_triton(logits, targets, z_loss=z_loss)
    return cross_entropy_fp8_grads_twin(logits, targets, z_loss=z_loss)
