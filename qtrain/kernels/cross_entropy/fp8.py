"""Fused cross-entropy whose d(logits) goes straight to FP8: e5m2 codes in place over the logits, and their transpose.

What `--fp8-head-backward` needs (`head.py`): the LM head's two backward GEMMs, d(h) = G W and d(W) = G^T h, run
as FP8 GEMMs, and cuBLASLt multiplies FP8 only row-major by column-major, so it needs G (n, V) and G^T (V, n) both as
row-major FP8 matrices. This kernel writes them from the tile that computes G, instead of a bf16 G plus an abs-max
pass plus a quantize pass (each a full pass over n x V values, the largest tensor of a step).

Per row r of ``logits`` (n, V), arithmetic in fp32 (as ``inplace.chunk_loss_and_dlogits``, the specification):

    pass 1 (read the row):       lse = logsumexp(x);  loss_r = (lse - x[t]) + z lse^2  (0 if t == -100)
    pass 2 (read, write codes):  d = exp(x - lse) (1 + 2 z lse) - [col == t]           (0 if t == -100)
                                 q = cast_rn(clamp(d * 2^G_SCALE_EXP, +-57344)) to e5m2

The scale is fixed, no abs-max needed: |d| <= max(1, 1 + 2 z lse), which 2^15 maps below e5m2's largest value 57344
(1.75 * 2^15) for any z lse < 0.375; beyond that the clamp saturates. e5m2 and not e4m3: d spans the softmax's
range (probabilities down to ~1e-9 matter summed over a 152k vocabulary), and e5m2's subnormals reach 2^-16, i.e.
|d| down to 2^-31 ~ 4.7e-10 here, where e4m3 at its own scale would flush everything below 2^-17 ~ 7.6e-6 to zero.

Layouts: q^T is a new (V, n) e5m2 matrix; q is written over the logits' own bytes, row r's codes in the first V
bytes of row r (a view ``fp8_grad_view(logits)``, rows padded to the logits' row stride in bytes), so the head needs
no memory for q. The logits are not readable afterwards. Three launches: pass 1 is the bf16 kernel's own
(`inplace.py`, without its gradient pass), one program per row; pass 2 a 2-D grid of BLOCK_M rows x
COLS columns that writes q^T only (BLOCK_M-byte runs); a byte transpose then writes q from q^T over the logits,
which pass 2 has read by then. Why not q from pass 2 directly: over the logits' bytes a code lands on a logit of
another column range, so only a program that owns whole rows and walks them in order could write it, and those
programs are too few to keep HBM busy (on the H200 at 16384 x 151936 bf16, one program per 32 rows took 10.05 ms,
~1 TB/s, against 5.33 ms this way). One more byte per logit moved buys that, and costs no memory.

The plain-torch twin (``cross_entropy_fp8_grads_twin``) is the specification and the CPU path; the Triton kernel
agrees with it on loss and lse to fp32 rounding and on the codes exactly, except where exp's approximation puts d
across a rounding boundary of e5m2 (one code). Dispatch: ``qtrain.kernels.dispatch``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from qtrain.kernels.cross_entropy.inplace import (chunk_loss_and_dlogits, cross_entropy_fwd_bwd_inplace_triton,
                                                  dlogits_f32)
from qtrain.kernels.dispatch import INTERPRET, jit, tl, triton, use_triton
from qtrain.kernels.fp8_transpose import T_BLOCK, T_WARPS, transpose_u8_kernel
from qtrain.kernels.stochastic_rounding import KINDS, load_f32

__all__ = ["G_DTYPE", "G_SCALE_EXP", "cross_entropy_fp8_grads", "cross_entropy_fp8_grads_triton",
           "cross_entropy_fp8_grads_twin", "fp8_grad_view"]

G_DTYPE = torch.float8_e5m2
G_SCALE_EXP = 15  # d(logits) is quantized as d * 2^15: the inverse scale the GEMMs take is 2^-15
_FMAX = 57344.0  # torch.finfo(torch.float8_e5m2).max
# Pass 2's tile (BLOCK_M rows x BLOCK_V columns per loop iteration, COLS columns per program) and the byte
# transpose's square tile; `cross_entropy_fp8_grads_triton` takes others as parameters. On the H200 at 16384 x 151936
# bf16, all three launches: 32 x 128 / 4 warps / 2048 columns with a 128 x 128 transpose tile take 5.33 ms (a 64
# transpose tile 5.59, 32: 6.05; 1024 or 4096 columns, 64 x 128 / 8 warps, 32 x 256, or transposing the e5m2 or fp32
# tile instead of its bytes: 5.57-5.78); 8192 rows 2.73 ms; the bf16 kernel 4.00 and 2.13 ms. A q in its own buffer
# instead of the transpose (5.33-5.57 ms) would cost a byte per logit of memory.
BLOCK_M, BLOCK_V, NUM_WARPS, COLS = 32, 128, 4, 2048

FP8Grads = tuple[Tensor, Tensor, Tensor, Tensor]  # (loss_sum, lse, q (n, V) over the logits, q^T (V, n))


def fp8_grad_view(logits: Tensor) -> Tensor:
    """The (n, V) e5m2 view of the first V bytes of each row of ``logits``: where the codes of d(logits) go."""
    return logits.view(torch.uint8).view(G_DTYPE)[:, :logits.shape[1]]


def _check(logits: Tensor, targets: Tensor) -> None:
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"logits must be (n, V) and targets (n,), got {tuple(logits.shape)} and "
                         f"{tuple(targets.shape)}")
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
def _dlogits_fp8_t_kernel(x_ptr, qt_ptr, targets_ptr, lse_ptr, N, V, stride_x, z_loss, LOAD_KIND: tl.constexpr,
                          SCALE: tl.constexpr, FMAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
                          COLS: tl.constexpr):
    """Pass 2 for BLOCK_M rows and COLS columns (a 2-D grid), given the rows' lse: the codes of d, written transposed
    into q^T only (q comes from q^T by `transpose_u8_kernel`, kernels/fp8_transpose.py, once every logit has been
    read). Offsets are int32 within a tile and int64 only in the per-program and per-iteration base pointers (q^T's
    reach V * N, past 2^31 at 16k rows of a 152k vocabulary). The tile is transposed as bytes (the codes as uint8)."""
    row0 = (tl.program_id(0) * BLOCK_M).to(tl.int64)
    col0 = tl.program_id(1) * COLS
    col_end = tl.minimum(col0 + COLS, V)
    lr = tl.arange(0, BLOCK_M)
    rmask = row0 + lr < N
    tgt = tl.load(targets_ptr + row0 + lr, mask=rmask, other=-100).to(tl.int32)
    valid = tgt != -100
    lse = tl.load(lse_ptr + row0 + lr, mask=rmask, other=0.0)
    coef = tl.where(valid, 1.0 + 2.0 * z_loss * lse, 0.0)
    x_rows = x_ptr + row0 * stride_x + lr[:, None] * stride_x
    cols = tl.arange(0, BLOCK_V)
    qt_cols = qt_ptr + row0 + col0.to(tl.int64) * N  # advanced by BLOCK_V rows of q^T per iteration: 64-bit
    for start in range(col0, col_end, BLOCK_V):
        offs = start + cols
        x = load_f32(x_rows + offs[None, :], rmask[:, None] & (offs[None, :] < col_end), LOAD_KIND)
        d = tl.exp(x - lse[:, None]) * coef[:, None]
        d = tl.where(valid[:, None] & (offs[None, :] == tgt[:, None]), d - 1.0, d)
        y = tl.minimum(tl.maximum(d * SCALE, -FMAX), FMAX)
        qt_tile = qt_cols + cols[:, None] * N + lr[None, :]
        qt_cols += BLOCK_V * N
        qt_mask = (offs[:, None] < col_end) & rmask[None, :]
        q = y.to(qt_ptr.dtype.element_ty).to(tl.uint8, bitcast=True)
        tl.store(qt_tile.to(tl.pointer_type(tl.uint8)), tl.trans(q), mask=qt_mask)


def cross_entropy_fp8_grads_triton(logits: Tensor, targets: Tensor, *, z_loss: float, block_m: int = BLOCK_M,
                                   block_v: int = BLOCK_V, num_warps: int = NUM_WARPS, cols: int = COLS,
                                   t_block: int = T_BLOCK) -> FP8Grads:
    """The twin's contract in three launches: pass 1 is the bf16 cross-entropy kernel without its gradient pass (loss
    and lse, one program per row), pass 2 `_dlogits_fp8_t_kernel` (q^T) on `block_m` x `block_v` tiles of `cols`
    columns per program, then `transpose_u8_kernel` (q) on `t_block` squares; the tiles change no code. On the GPU
    the logits are read natively (Triton 3.6 wrote wrong transposed FP8 codes from integer-bit bf16 loads on the
    H200); under the interpreter, whose bf16 conversions are not the GPU's, through their bits."""
    _check(logits, targets)
    n, v = logits.shape
    targets = targets.contiguous()
    loss_sum, lse, _ = cross_entropy_fwd_bwd_inplace_triton(logits, targets, z_loss=z_loss, need_grad=False)
    load_kind = 0 if not INTERPRET else KINDS[logits.dtype]
    x = logits.view(torch.int16) if load_kind == 1 else logits
    q = fp8_grad_view(logits)
    qt = torch.empty((v, n), dtype=G_DTYPE, device=logits.device)
    if n:
        _dlogits_fp8_t_kernel[(triton.cdiv(n, block_m), triton.cdiv(v, cols))](
            x, qt, targets, lse, n, v, logits.stride(0), float(z_loss), LOAD_KIND=load_kind,
            SCALE=float(2.0 ** G_SCALE_EXP), FMAX=_FMAX, BLOCK_M=block_m, BLOCK_V=block_v, COLS=cols,
            num_warps=num_warps)
        qb, qtb = q.view(torch.uint8), qt.view(torch.uint8)
        transpose_u8_kernel[(triton.cdiv(v, t_block), triton.cdiv(n, t_block))](
            qtb, qb, v, n, qtb.stride(0), qb.stride(0), BLOCK_R=t_block, BLOCK_C=t_block, num_warps=T_WARPS)
    return loss_sum, lse, q, qt


def cross_entropy_fp8_grads(logits: Tensor, targets: Tensor, *, z_loss: float) -> FP8Grads:
    """(loss_sum fp32, lse (n,) fp32, q (n, V) e5m2 over ``logits``, q^T (V, n) e5m2) with q * 2^-G_SCALE_EXP =
    d(loss_sum)/d(logits); the logits are overwritten. Triton or twin per ``qtrain.kernels.dispatch``."""
    if use_triton(logits):
        return cross_entropy_fp8_grads_triton(logits, targets, z_loss=z_loss)
    return cross_entropy_fp8_grads_twin(logits, targets, z_loss=z_loss)
