"""Fused cross-entropy forward + backward over one chunk of LM-head logits, writing d(logits) IN PLACE.

Same contract as ``chunk_loss_and_dlogits`` below (the specification, which CPU runs), except that with
``need_grad`` the returned d(logits) IS the ``logits`` buffer, overwritten::

    loss_sum, lse, dlogits = cross_entropy_fwd_bwd_inplace_(logits, targets, z_loss=z, need_grad=True)
    # logits now holds dlogits (dlogits is logits); do not read the logits afterwards

Per row r of ``logits`` (n, V) in the model dtype (fp32, bf16 or fp16), all arithmetic in fp32:

    pass 1 (read the row once):  m, s = online max / sum of exp(x - m) over V in blocks;  lse = m + log(s)
                                 loss_r = (lse - x[t]) + z * lse^2  if t != -100 else 0
    pass 2 (read, write back):   d = exp(x - lse) * (1 + 2 z lse) - [col == t]   (all zero if t == -100)
                                 stored in the model dtype over x (bf16 by round-to-nearest-even)

``lse`` is returned for every row (ignored ones included), as the specification does; ``loss_sum`` is the
sum of the per-row fp32 losses. This is llm.q's fused classifier kernel (one program per row); it replaces
the ~10 elementwise passes over fp32 copies of the logits that the plain-torch specification makes. The LM head
(`head.py`) runs it for CUDA logits: on the H200 it was faster than the torch.compile'd specification (a Qwen2.5-0.5B
step from 124.2k to 130.8k tokens/s) and smaller (peak memory from 24.4 to 20.9 GiB).

With ``need_grad=False`` the kernel only runs pass 1 and leaves ``logits`` untouched.

The plain-torch twin (``cross_entropy_fwd_bwd_inplace_twin``) runs the specification and copies its
d(logits) into ``logits``, so both paths have the same aliasing. Dispatch: ``qtrain.kernels.dispatch``.
"""

from __future__ import annotations

import torch

from qtrain.kernels.dispatch import jit, tl, use_triton
from qtrain.kernels.stochastic_rounding import KINDS, store_f32

__all__ = [
    "BLOCK_V",
    "IGNORE_INDEX",
    "NUM_WARPS",
    "chunk_loss_and_dlogits",
    "cross_entropy_fwd_bwd_inplace_",
    "cross_entropy_fwd_bwd_inplace_triton",
    "cross_entropy_fwd_bwd_inplace_twin",
    "dlogits_f32",
]

IGNORE_INDEX = -100
# Elements of a row per loop iteration and warps per program: 4096 fp32 lanes over 8 warps, 16 elements per
# thread, a conventional memory-bound shape. Not swept: on the H200 one 4096 x 151936 bf16 chunk takes
# 1.1-1.2 ms (~3 TB/s for its read, read and write), 1.7% of a Qwen2.5-1.5B step.
BLOCK_V = 4096
NUM_WARPS = 8


# ---------------------------------------------------------------------------------------------- twin
def chunk_loss_and_dlogits(logits: torch.Tensor, targets: torch.Tensor, *, z_loss: float, need_grad: bool
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The specification of the fused kernel (and what CPU runs): logits (n, V) in model dtype, targets (n,).
    Returns (loss_sum fp32, lse (n,), dlogits or None)."""
    lf = logits.float()
    lse = torch.logsumexp(lf, dim=-1)  # (n,)
    valid = targets != IGNORE_INDEX
    safe_t = torch.where(valid, targets, 0)
    target_logit = lf.gather(1, safe_t[:, None]).squeeze(1)
    per_tok = torch.where(valid, lse - target_logit, 0.0)
    loss_sum = per_tok.sum()
    if z_loss:
        loss_sum = loss_sum + z_loss * torch.where(valid, lse * lse, 0.0).sum()
    if not need_grad:
        return loss_sum, lse, None
    # The caller's `scale` is applied in the two GEMMs (alpha), so it never becomes a compile-time constant here.
    return loss_sum, lse, dlogits_f32(lf, lse, targets, z_loss).to(logits.dtype)


def dlogits_f32(lf: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, z_loss: float) -> torch.Tensor:
    """d(loss_sum)/d(logits) in fp32 from fp32 logits and their lse: softmax * (1 + 2 z lse) - onehot(target), zero
    on ignored rows (the specification's gradient, before it is rounded to the model dtype or quantized)."""
    valid = targets != IGNORE_INDEX
    coef = torch.where(valid, 1.0 + 2.0 * z_loss * lse, 0.0)
    dl = torch.exp(lf - lse[:, None]) * coef[:, None]
    dl.scatter_add_(1, torch.where(valid, targets, 0)[:, None], torch.where(valid, -1.0, 0.0)[:, None])
    return dl


def cross_entropy_fwd_bwd_inplace_twin(logits: torch.Tensor, targets: torch.Tensor, *, z_loss: float,
                                       need_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The specification (`chunk_loss_and_dlogits`), with its d(logits) copied into ``logits`` (returned as
    d(logits)) so that the twin overwrites its input like the kernel does."""
    loss_sum, lse, dl = chunk_loss_and_dlogits(logits, targets, z_loss=z_loss, need_grad=need_grad)
    if dl is None:
        return loss_sum, lse, None
    logits.copy_(dl)
    return loss_sum, lse, logits


# -------------------------------------------------------------------------------------------- triton
@jit
def _load_row_f32(ptr, mask, KIND: tl.constexpr):
    """Load as fp32 (masked lanes -inf). KIND 0 fp32; 1 bf16 through an int16 pointer (bits << 16); 2 fp16."""
    if KIND == 1:
        h = tl.load(ptr, mask=mask, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
        x = (h << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    return tl.where(mask, x, float("-inf"))


@jit
def _ce_fwd_bwd_kernel(logits_ptr, targets_ptr, loss_ptr, lse_ptr, V, stride_row, z_loss,
                       KIND: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row  # int64: n * V passes 2**31 for big chunks of a 152k vocabulary
    cols = tl.arange(0, BLOCK)
    tgt = tl.load(targets_ptr + row).to(tl.int64)
    valid = tgt != -100

    # pass 1: online max and sum-exp (scalar carries; masked lanes are -inf so contribute exp(-inf) = 0)
    m = float("-inf")
    s = 0.0
    for start in range(0, V, BLOCK):
        offs = start + cols
        x = _load_row_f32(base + offs, offs < V, KIND)
        m_new = tl.maximum(m, tl.max(x, axis=0))  # finite after the first block (it has a real column)
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    safe_t = tl.where(valid, tgt, 0)
    x_t = _load_row_f32(base + safe_t, valid, KIND)  # -inf on ignored rows, masked out below
    loss = tl.where(valid, (lse - x_t) + z_loss * (lse * lse), 0.0)
    tl.store(loss_ptr + row, loss)
    tl.store(lse_ptr + row, lse)

    if WRITE_GRAD:
        # pass 2: d = softmax * (1 + 2 z lse) - onehot(target), zero on ignored rows; written over the logits
        coef = tl.where(valid, 1.0 + 2.0 * z_loss * lse, 0.0)
        for start in range(0, V, BLOCK):
            offs = start + cols
            mask = offs < V
            x = _load_row_f32(base + offs, mask, KIND)
            d = tl.exp(x - lse) * coef
            d = tl.where(valid & (offs == tgt), d - 1.0, d)
            store_f32(base + offs, d, mask, KIND)


def cross_entropy_fwd_bwd_inplace_triton(logits: torch.Tensor, targets: torch.Tensor, *, z_loss: float,
                                         need_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Launch the fused kernel (see module docstring); d(logits) overwrites ``logits`` and is returned."""
    return _launch(logits, targets, z_loss=z_loss, need_grad=need_grad, block=BLOCK_V, num_warps=NUM_WARPS)


def _launch(logits, targets, *, z_loss, need_grad, block, num_warps):
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"logits must be (n, V) and targets (n,), got {tuple(logits.shape)} and "
                         f"{tuple(targets.shape)}")
    if logits.dtype not in KINDS:
        raise TypeError(f"logits dtype must be one of {list(KINDS)}, got {logits.dtype}")
    if logits.stride(1) != 1:
        raise ValueError("logits rows must be contiguous (stride(1) == 1): d(logits) is written in place")
    n, v = logits.shape
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    kind = KINDS[logits.dtype]
    buf = logits.view(torch.int16) if kind == 1 else logits
    if n:
        _ce_fwd_bwd_kernel[(n,)](buf, targets.contiguous(), loss, lse, v, logits.stride(0), float(z_loss),
                                 KIND=kind, WRITE_GRAD=bool(need_grad), BLOCK=block, num_warps=num_warps)
    return loss.sum(), lse, (logits if need_grad else None)


def cross_entropy_fwd_bwd_inplace_(logits: torch.Tensor, targets: torch.Tensor, *, z_loss: float,
                                   need_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(loss_sum fp32, lse (n,) fp32, dlogits or None) for ``logits`` (n, V) and ``targets`` (n,); with
    ``need_grad`` the d(logits) OVERWRITES ``logits`` (and is that same tensor). Triton or twin per
    ``qtrain.kernels.dispatch``."""
    if use_triton(logits):
        return cross_entropy_fwd_bwd_inplace_triton(logits, targets, z_loss=z_loss, need_grad=need_grad)
    return cross_entropy_fwd_bwd_inplace_twin(logits, targets, z_loss=z_loss, need_grad=need_grad)
