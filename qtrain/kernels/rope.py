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
(0.48 TB/s): 30 ms of an 862 ms step; 1.6-2.1 TB/s at the larger sizes.

The plain-torch twin (``rope_qkv_backward_twin``) is the specification. ``rope_qkv_backward`` is the custom
op ``qtrain::rope_qkv_backward`` so that a torch.compile'd block calls it as an opaque kernel (Triton on
CUDA, the twin elsewhere, per ``qtrain.kernels.dispatch``). The kernel runs without FMA contraction, so it
and the twin agree bit for bit.
"""
from __future__ import annotations

import torch

from qtrain.kernels.dispatch import INTERPRET, jit, tl, triton, use_triton
from qtrain.kernels.stochastic_rounding import KINDS, load_f32, store_f32

__all__ = ["rope_qkv_backward", "rope_qkv_backward_triton", "rope_qkv_backward_twin"]

ROWS, NUM_WARPS = 16, 4  # a program: 16 tokens of one head


def _check(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if dq.dim() != 4 or dk.shape != dv.shape or dq.shape[:2] != dk.shape[:2] or dq.shape[3] != dk.shape[3] \
            or dq.shape[3] % 2 or cos.shape != sin.shape or cos.shape != (dq.shape[1], dq.shape[3]):
        raise ValueError(f"rope_qkv_backward: dq must be (B, T, nh, hs), dk and dv (B, T, nkv, hs) and cos, sin "
                         f"(T, hs) with hs even, got {tuple(dq.shape)}, {tuple(dk.shape)}, {tuple(dv.shape)}, "
                         f"{tuple(cos.shape)}, {tuple(sin.shape)}")
    if dq.dtype not in KINDS or dk.dtype != dq.dtype or dv.dtype != dq.dtype:
        raise TypeError(f"rope_qkv_backward: dq, dk, dv must share a dtype among {list(KINDS)}, got {dq.dtype}, "
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
                         NH: tl.constexpr, NKV: tl.constexpr, HS: tl.constexpr, KIND: tl.constexpr,
                         TAB_KIND: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr, EVEN: tl.constexpr):
    """ROWS tokens of one head of d(qkv) (rows, (NH + 2 NKV) HS): head program_id(1) is a q head, a k head or a v
    head, a branch per program, and its two halves are two [ROWS, BLOCK_H] tiles, so each output element is two
    products and a sum with no gathers or per-element selects: 3.3-3.7 TB/s on the H200, where a kernel working per
    element of the whole row ran at 0.86 TB/s dividing an int64 flat index per element and at ~2 TB/s in 2-D tiles
    of 256 columns, bound by the per-element head arithmetic and the partner gathers."""
    HALF: tl.constexpr = HS // 2
    W: tl.constexpr = (NH + 2 * NKV) * HS
    head = tl.program_id(1)
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]  # [ROWS, 1]
    j = tl.arange(0, BLOCK_H)[None, :]  # [1, BLOCK_H]: a column within a half
    mask = (row < rows) & (j < HALF)
    row64 = row.to(tl.int64)  # row offsets can pass 2^31 elements; columns within a row cannot
    out = out_ptr + row64 * W + head * HS + j
    if head < NH + NKV:
        if head < NH:
            src = dq_ptr + row64 * (NH * HS) + head * HS + j
        else:
            src = dk_ptr + row64 * (NKV * HS) + (head - NH) * HS + j
        x1 = load_f32(src, mask, KIND, EVEN)
        x2 = load_f32(src + HALF, mask, KIND, EVEN)
        tab = (row % T) * HS + j
        c1 = load_f32(cos_ptr + tab, mask, TAB_KIND, EVEN)
        c2 = load_f32(cos_ptr + tab + HALF, mask, TAB_KIND, EVEN)
        s1 = load_f32(sin_ptr + tab, mask, TAB_KIND, EVEN)
        s2 = load_f32(sin_ptr + tab + HALF, mask, TAB_KIND, EVEN)
        store_f32(out, x1 * c1 + x2 * s2, mask, KIND, EVEN)  # d < h: dy[d] cos[d] + dy[d + h] sin[d + h]
        store_f32(out + HALF, x2 * c2 - x1 * s1, mask, KIND, EVEN)  # d >= h: dy[d] cos[d] - dy[d - h] sin[d - h]
    else:
        src = dv_ptr + row64 * (NKV * HS) + (head - NH - NKV) * HS + j
        store_f32(out, load_f32(src, mask, KIND, EVEN), mask, KIND, EVEN)
        store_f32(out + HALF, load_f32(src + HALF, mask, KIND, EVEN), mask, KIND, EVEN)


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
    rows = B * T
    if out.numel():
        block_h = triton.next_power_of_2(hs // 2)
        # On the GPU native loads and the hardware's rounding (the same values); the interpreter, whose bf16
        # conversions are not the GPU's, runs the integer-bit ones on int16 views of bf16 tensors
        native = not INTERPRET
        ins = (dq, dk, dv, cos, sin, out) if native else tuple(_bits(t) for t in (dq, dk, dv, cos, sin, out))
        # KIND 0 reads and writes any dtype natively (`load_f32` / `store_f32`). EVEN: no masks where the tiles
        # divide the shape (fewer instructions, the same bits)
        grid = (triton.cdiv(rows, ROWS), nh + 2 * nkv)
        _rope_qkv_bwd_kernel[grid](
            *ins, rows, T=T, NH=nh, NKV=nkv, HS=hs, KIND=0 if native else KINDS[dq.dtype],
            TAB_KIND=0 if native else KINDS[cos.dtype], ROWS=ROWS, BLOCK_H=block_h,
            EVEN=rows % ROWS == 0 and block_h == hs // 2, num_warps=NUM_WARPS,
            enable_fp_fusion=False)
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
