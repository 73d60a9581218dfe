"""RoPE's one home: the cos/sin tables, the rotation, and its backward fused with the assembly of the QKV
projection's output gradient, in one pass.

The entries: `rope_tables(cfg, T, device, dtype)` (positions 0..T-1, the config's long-context scaling:
`kernels.rope_scaling`; with --document-masking the model gathers them at each token's position in its document,
(B, T, hs) tables) and `qkv_rope(qkv, cos, sin, nh, nkv, hs, mode=..., qk_norm=...)`, which splits the
block's fused QKV projection output (B, T, q + 2 kv) into q, k, v, rotates q and k (`apply_rope`, HF's
rotate-half: y[d] = x[d] cos[d] + r[d] sin[d] with r[d] = -x[d + h] for d < h, x[d - h] otherwise, h = hs / 2)
and hands them to attention. The tables and the rotation follow `transformers`' order of operations, so fp32
results agree with HF to rounding. The backward of the split and rotation, per position t and column d of a head,
all in fp32 from the stored values, one rounding at the end::

    dx[d] = dy[d] * cos[t, d] + dy[d + h] * sin[t, d + h]     (d < h)
    dx[d] = dy[d] * cos[t, d] - dy[d - h] * sin[t, d - h]     (d >= h)

for q and k, and dv unchanged, written as d(qkv) (B, T, q + 2 kv) in the gradients' dtype. Why a kernel:
torch.compile writes this as one pointwise kernel (the rotations' slice backwards and the concatenation);
on the H200 at Qwen2.5-0.5B shapes (64 x 1024 tokens, 14 + 2 + 2 heads of 64) it moved 0.30 GB in 0.63 ms
(0.48 TB/s): 30 ms of an 862 ms step; 1.6-2.1 TB/s at the larger sizes.

The plain-torch twin (``rope_qkv_backward_twin``) is the specification. ``rope_qkv_backward`` is the custom
op ``qtrain::rope_qkv_backward`` so that a torch.compile'd block calls it as an opaque kernel (Triton on
CUDA, the twin elsewhere, per ``qtrain.kernels.dispatch``). The kernel runs without FMA contraction, so it
and the twin agree bit for bit. `qkv_rope(mode="kernel")` differentiates through it (`_QKVRope`).
"""
from __future__ import annotations

from typing import Callable

import torch

from qtrain.kernels.dispatch import INTERPRET, jit, tl, triton, use_triton
from qtrain.kernels.rope_scaling import ScaledRopeConfig, attention_factor, scaled_inv_freq
from qtrain.kernels.stochastic_rounding import KINDS, load_f32, store_f32

__all__ = ["MODES", "RopeConfig", "apply_rope", "qkv_rope", "rope_inv_freq", "rope_qkv_backward",
           "rope_qkv_backward_triton", "rope_qkv_backward_twin", "rope_tables", "split_qkv"]

ROWS, NUM_WARPS = 16, 4  # a program: 16 tokens of one head


def _check(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if dq.dim() != 4 or dk.shape != dv.shape or dq.shape[:2] != dk.shape[:2] or dq.shape[3] != dk.shape[3] \
            or dq.shape[3] % 2 or cos.shape != sin.shape \
            or cos.shape not in ((dq.shape[1], dq.shape[3]), (dq.shape[0], dq.shape[1], dq.shape[3])):
        raise ValueError(f"rope_qkv_backward: dq must be (B, T, nh, hs), dk and dv (B, T, nkv, hs) and cos, sin "
                         f"(T, hs) or (B, T, hs) with hs even, got {tuple(dq.shape)}, {tuple(dk.shape)}, "
                         f"{tuple(dv.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}")
    if dq.dtype not in KINDS or dk.dtype != dq.dtype or dv.dtype != dq.dtype:
        raise TypeError(f"rope_qkv_backward: dq, dk, dv must share a dtype among {list(KINDS)}, got {dq.dtype}, "
                        f"{dk.dtype}, {dv.dtype}")


# ---------------------------------------------------------------------------------------------- twin
def _rope_backward_f32(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """dx (B, T, heads, hs) in fp32 for dy of the same shape; cos, sin (T, hs) or (B, T, hs)."""
    h = dy.shape[-1] // 2
    g = dy.float()
    c, s = cos.float().unsqueeze(-2), sin.float().unsqueeze(-2)  # (T, 1, hs) or (B, T, 1, hs)
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
    table_rows = cos.numel() // hs  # T, or B * T for per-token tables (document positions): row % table_rows
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
            *ins, rows, T=table_rows, NH=nh, NKV=nkv, HS=hs, KIND=0 if native else KINDS[dq.dtype],
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


# ---------------------------------------------------------------------------------------------- tables
RopeConfig = ScaledRopeConfig  # what the tables read of a model config (`model.config.ModelConfig` has it)


def rope_inv_freq(cfg: RopeConfig, seq_len: int = 0) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/hs) (fp32; hs: the rotated dimensions of a head, `rotary_dim`), scaled as the
    config's `rope_scaling` says (`kernels.rope_scaling`); `seq_len` matters only to `dynamic` scaling."""
    return scaled_inv_freq(cfg, seq_len)


def rope_tables(cfg: RopeConfig, seq_len: int, device: torch.device | str, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (T, hs) in the activation dtype; positions 0..T-1 (HF "rotate-half" layout), each times
    the scaling's attention factor (YaRN's; 1 otherwise) in fp32 before the rounding, as HF does."""
    inv_freq = rope_inv_freq(cfg, seq_len).to(device)
    pos = torch.arange(seq_len, device=device, dtype=torch.int64).float()
    freqs = torch.outer(pos, inv_freq)  # (T, hs/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, hs)
    factor = attention_factor(cfg)
    return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)


# ---------------------------------------------------------------------------------------------- the rotation
def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (..., hs) with cos/sin broadcasting to it: (B, nh, T, hs) with (T, hs), or (B, T, nh, hs) with
    (T, 1, hs). Rotates pairs (d, d + hs/2)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def split_qkv(qkv: torch.Tensor, nh: int, nkv: int, hs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused QKV output (B, T, q + 2 kv) -> q, k (views) and v (a copy), each (B, T, heads, hs). v is
    copied out because attention saves it: a view would keep the whole fused buffer (pre-RoPE q and k) alive."""
    B, T, _ = qkv.shape
    q, k, v = qkv.split([nh * hs, nkv * hs, nkv * hs], dim=-1)
    return q.view(B, T, nh, hs), k.view(B, T, nkv, hs), v.contiguous().view(B, T, nkv, hs)


class _QKVRope(torch.autograd.Function):
    """The fused QKV output (B, T, q + 2 kv) -> q, k rotated and v copied out, each (B, T, heads, hs), as
    `apply_rope` computes them; the backward is one kernel that also assembles d(qkv) (`rope_qkv_backward`)."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, nh: int, nkv: int, hs: int):
        q, k, v = split_qkv(qkv, nh, nkv, hs)
        c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (T, 1, hs) or (B, T, 1, hs)
        ctx.save_for_backward(cos, sin)
        return apply_rope(q, c, s), apply_rope(k, c, s), v

    @staticmethod
    def backward(ctx, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor):
        cos, sin = ctx.saved_tensors
        dqkv = rope_qkv_backward(dq.contiguous(), dk.contiguous(), dv.contiguous(), cos, sin)
        return dqkv, None, None, None, None, None


MODES = ("autograd", "kernel")  # how `qkv_rope` is differentiated (its docstring)
QKNorm = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def qkv_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, nh: int, nkv: int, hs: int, *,
             mode: str = "autograd", qk_norm: QKNorm | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) in (B, T, heads, hs) from the fused QKV output (B, T, q + 2 kv): q and k rotated (`apply_rope`, in the
    layout the projection wrote, before the transposes attention takes), v copied out (`split_qkv`); cos, sin (T, hs),
    or (B, T, hs) where each row's positions differ (--document-masking: the tables gathered at the positions).
    `qk_norm`: (q, k) -> (q, k) between the split and the rotation (Qwen3's q/k RMSNorms).

    `mode` says how it is differentiated: "autograd" (eager blocks): autograd's graph; "kernel" (compiled blocks):
    the backward as one kernel that also assembles d(qkv) (`rope_qkv_backward`; inductor's version ran at 0.5-2
    TB/s), computed in fp32 from the stored gradients and rounded once, so it can differ from autograd's by a unit in
    the last place. The kernel starts from the rotation's inputs straight out of the split, so with a `qk_norm` in
    between the backward is autograd's in either mode. The forward is the same in all."""
    if mode not in MODES:
        raise ValueError(f"qkv_rope: mode must be one of {MODES}, got {mode!r}")
    if mode == "kernel" and qk_norm is None:
        return _QKVRope.apply(qkv, cos, sin, nh, nkv, hs)
    q, k, v = split_qkv(qkv, nh, nkv, hs)
    if qk_norm is not None:
        q, k = qk_norm(q, k)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (T, 1, hs) or (B, T, 1, hs)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v
