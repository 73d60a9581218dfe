"""RoPE backward fused with the assembly of the QKV projection's output gradient, in one pass.

The block splits its fused QKV projection output (B, T, q + 2 kv) into q, k, v, rotates q and k
(``qtrain.model.layers.apply_rope``, HF's rotate-half: y[d] = x[d] cos[d] + r[d] sin[d] with r[d] = -x[d + h]
for d < h, x[d - h] otherwise, h = hs / 2) and hands them to attention. The backward of that, per
position t and column d of a head, all in fp32 from the stored values, one rounding at the end::

    dx[d] = dy[d] * cos[t, d] + dy[d + h] * sin[t, d + h]     (d < h)
    dx[d] = dy[d] * cos[t, d] - dy[d - h] * sin[t, d - h]     (d >= h)

for q and k, and dv unchanged, written as d(qkv) (B, T, q + 2 kv) in the gradients' dtype. Why a kernel:
torch.compile writes this as one pointwise kernel (the rotations' slice backwards and the concatenation);
on the H200 at Qwen2.5-0.5B shapes (64 x 1024 tokens, 14 + 2 + 2 heads of 64) it moved 0.30 GB in 0.63 ms
(0.48 TB/s): 30 ms of an 862 ms step (BENCHMARKS.md, 2026-12-02), 1.6-2.1 TB/s at the larger sizes.

The plain-torch twin (``rope_qkv_backward_twin``) is the specification. ``rope_qkv_backward`` is the custom
op ``qtrain::rope_qkv_backward`` so that a torch.compile'd block calls it as an opaque kernel (Triton on
CUDA, the twin elsewhere, per ``qtrain.kernels.dispatch``). The kernel runs without FMA contraction, so it
and the twin agree bit for bit.
"""
from __future__ import annotations

import torch

from qtrain.kernels.dispatch import jit, tl, triton, use_triton
from qtrain.kernels.stochastic_rounding import load_f32, store_f32

__all__ = ["rope_qkv_backward", "rope_qkv_backward_triton", "rope_qkv_backward_twin"]

_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
ROWS, BLOCK_C, NUM_WARPS = 4, 256, 4  # a streaming tile: 4 tokens x 256 columns of d(qkv) per program


def _check(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if dq.dim() != 4 or dk.shape != dv.shape or dq.shape[:2] != dk.shape[:2] or dq.shape[3] != dk.shape[3] \
            or dq.shape[3] % 2 or cos.shape != sin.shape or cos.shape != (dq.shape[1], dq.shape[3]):
        raise ValueError(f"rope_qkv_backward: dq must be (B, T, nh, hs), dk and dv (B, T, nkv, hs) and cos, sin "
                         f"(T, hs) with hs even, got {tuple(dq.shape)}, {tuple(dk.shape)}, {tuple(dv.shape)}, "
                         f"{tuple(cos.shape)}, {tuple(sin.shape)}")
    if dq.dtype not in _KINDS or dk.dtype != dq.dtype or dv.dtype != dq.dtype:
        raise TypeError(f"rope_qkv_backward: dq, dk, dv must share a dtype among {list(_KINDS)}, got {dq.dtype}, "
                        f"{dk.dtype}, {dv.dtype}")


# ---------------------------------------------------------------------------------------------- twin
def _rope_backward_f32(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """dx (B, T, heads, hs) in fp32 for dy of the same shape; cos, sin (T, hs)."""
    h = dy.shape[-1] // 2
    g = dy.float()
    c, s = cos.float()[:, None], sin.float()[:, None]  # (T, 1, hs)
    z = g * s
    return g * c + torch.cat((z[..., h:], -z[..., :h]), dim=-1)


def rope_qkv_backward_twin(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor) -> torch.Tensor:
    """The specification: d(qkv) (B, T, q + 2 kv) in dq's dtype (see module docstring)."""
    _check(dq, dk, dv, cos, sin)
    B, T = dq.shape[:2]
    parts = (_rope_backward_f32(dq, cos, sin), _rope_backward_f32(dk, cos, sin), dv.float())
    return torch.cat([p.reshape(B, T, -1) for p in parts], dim=-1).to(dq.dtype)


# -------------------------------------------------------------------------------------------- triton
@jit
def _rope_qkv_bwd_kernel(dq_ptr, dk_ptr, dv_ptr, cos_ptr, sin_ptr, out_ptr, rows, T: tl.constexpr,
                         QD: tl.constexpr, KD: tl.constexpr, HS: tl.constexpr, KIND: tl.constexpr,
                         TAB_KIND: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    """One [ROWS tokens, BLOCK_C columns] tile of d(qkv) (rows, QD + 2 KD). Row and column come from the
    program ids, so no element index is divided (a first version divided an int64 flat index by the row
    width: 0.35 ms per call at 0.5B shapes, 0.86 TB/s)."""
    row = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]  # [ROWS, 1]
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]  # [1, BLOCK_C]
    mask = (row < rows) & (c < QD + 2 * KD)
    in_q = c < QD
    in_k = (c >= QD) & (c < QD + KD)
    in_v = c >= QD + KD
    local = tl.where(in_q, c, c - QD)  # column within q's or k's row
    d = local % HS
    lo = d < HS // 2
    partner = tl.where(lo, local + HS // 2, local - HS // 2)
    pd = tl.where(lo, d + HS // 2, d - HS // 2)
    g = load_f32(dq_ptr + row * QD + local, mask & in_q, KIND) + load_f32(dk_ptr + row * KD + local, mask & in_k, KIND)
    gp = load_f32(dq_ptr + row * QD + partner, mask & in_q, KIND) + \
        load_f32(dk_ptr + row * KD + partner, mask & in_k, KIND)
    t = row % T
    cs = load_f32(cos_ptr + t * HS + d, mask & ~in_v, TAB_KIND)
    sn = load_f32(sin_ptr + t * HS + pd, mask & ~in_v, TAB_KIND)
    z = gp * sn
    dx = g * cs + tl.where(lo, z, -z)
    gv = load_f32(dv_ptr + row * KD + (c - QD - KD), mask & in_v, KIND)
    store_f32(out_ptr + row * (QD + 2 * KD) + c, tl.where(in_v, gv, dx), mask, KIND)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def rope_qkv_backward_triton(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor,
                             sin: torch.Tensor) -> torch.Tensor:
    """Triton launcher; same contract as the twin (contiguous copies of the inputs if needed)."""
    _check(dq, dk, dv, cos, sin)
    B, T, nh, hs = dq.shape
    nkv = dk.shape[2]
    dq, dk, dv, cos, sin = (t.contiguous() for t in (dq, dk, dv, cos, sin))
    out = torch.empty(B, T, (nh + 2 * nkv) * hs, dtype=dq.dtype, device=dq.device)
    rows, width = B * T, out.shape[-1]
    if out.numel():
        grid = (triton.cdiv(rows, ROWS), triton.cdiv(width, BLOCK_C))
        _rope_qkv_bwd_kernel[grid](
            _bits(dq), _bits(dk), _bits(dv), _bits(cos), _bits(sin), _bits(out), rows, T=T, QD=nh * hs,
            KD=nkv * hs, HS=hs, KIND=_KINDS[dq.dtype], TAB_KIND=_KINDS[cos.dtype], ROWS=ROWS, BLOCK_C=BLOCK_C,
            num_warps=NUM_WARPS, enable_fp_fusion=False)
    return out


# ---------------------------------------------------------------------------------------------- public
@torch.library.custom_op("qtrain::rope_qkv_backward", mutates_args=())
def rope_qkv_backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> torch.Tensor:
    """d(qkv) from the gradients of the rotated q, k and of v (see module docstring); Triton or twin."""
    if use_triton(dq):
        return rope_qkv_backward_triton(dq, dk, dv, cos, sin)
    return rope_qkv_backward_twin(dq, dk, dv, cos, sin)


@rope_qkv_backward.register_fake
def _(dq, dk, dv, cos, sin):
    _check(dq, dk, dv, cos, sin)
    B, T, nh, hs = dq.shape
    return dq.new_empty(B, T, (nh + 2 * dk.shape[2]) * hs)
