"""FP8 (e4m3) grouped GEMMs for the experts, row-wise scaled: the --fp8-experts path of the MoE layer's expert stacks.

The bf16 products are `kernels/grouped_gemm.py`'s (rows sorted by expert, `offsets` the int32 cumulative row ends);
here the forward and the input-gradient GEMM multiply e4m3 operands::

    forward   y_g  = (Qr(x)_g  @ Qr(w_g)^T)  * sx[rows of g, None] * sw[g][None, :]      -> (M, N), x's dtype
    dgrad     dx_g = (Qr(dy)_g @ Qr(w_g^T)^T) * sdy[rows of g, None] * swt[g][None, :]  -> (M, K), x's dtype
    wgrad     dw_g = dy_g^T @ x^_g   in the model dtype (`grouped_gemm.grouped_weight_grad`), x^ = Qr(x) * sx

Qr is row-wise current scaling (`fp8_quant.quantize_fp8_rowwise`: qtrain's per-tensor recipe, FMAX / max(amax,
floor) with a saturating cast, one scale per row of the contraction): each token row of x and dy gets its own
scale, and each expert's weight one scale per output column -- per row of w_g (N, K) over K for the forward, per
row of w_g^T (K, N) over N for the input gradient (a second quantization of the weight, since the contraction
changes sides). A scale constant along the contraction is what lets the GEMM apply it in its epilogue. Per-tensor
scales (the dense FP8 linears') would let one outlier token or expert flatten every other expert's rows.

Why the weight gradient stays in the model dtype: its contraction runs over each expert's own tokens, so row-wise
scales for it are per expert and per column (a segmented abs-max over each group's rows of dy and x), and
torch._scaled_grouped_mm's k-grouped form wants each group's slice 16-byte aligned along the contraction, i.e.
every expert's token count a multiple of 16: dropless routing gives any count (torchtitan/torchao pad each group
to 16 rows for it). It reads the dequantized saved input, so what the layer keeps is the e4m3 copy plus its scales.

The GEMM (`fp8_grouped_linear`, a custom op, opaque to torch.compile like `grouped_linear`): on Hopper (compute
capability 9.x) `torch._scaled_grouped_mm` (torch 2.11: aten/src/ATen/native/cuda/GroupedBlas.cpp
`_scaled_grouped_mm_cuda`, ScaledGroupMM.cu's CUTLASS sm90 kernel; the meta rules in torch/_meta_registrations.py
`_meta_grouped_mm_common`) in its 2-D x 3-D form: mat_a (M, K) e4m3 row-major, mat_b (G, K, N) e4m3 column-major
per group (the view w_q.transpose(-2, -1) of a contiguous (G, N, K) w_q), K and N multiples of 16, scale_a fp32
(M,) contiguous, scale_b fp32 (G, N) with unit last stride, offs int32 (G,) cumulative row ends, fewer than 1024
groups, bf16 output (cast for another dtype), no bias; any group size, empty groups included (mat_a row-major).
Elsewhere (the CPU, other GPUs, dispatch.BACKEND 'twin') the twin: per expert, the e4m3 operands' product in fp32
(exact products, fp32 sums) scaled as the epilogue scales it, cast once. The shape rules are checked on every device, so
CPU CI fails where the GPU would.

`fp8_expert_linear` is the autograd entry (`model/moe._expert_gemm` with --fp8-experts). It keeps for backward the
e4m3 input (1 byte per element) and its row scales (4 bytes per row) where the weight needs a gradient, and the
weight itself (a reference) where the input does; nothing else.
"""
from __future__ import annotations

import torch
from torch import Tensor

from qtrain.kernels import dispatch
from qtrain.kernels.fp8_quant import E4M3, quantize_fp8_rowwise
from qtrain.kernels.grouped_gemm import group_bounds, grouped_weight_grad

__all__ = ["FP8_MULTIPLE", "fp8_expert_linear", "fp8_grouped_linear", "fp8_grouped_linear_twin"]

FP8_MULTIPLE = 16  # K and N of every FP8 expert GEMM: 16 bytes of e4m3 (the CUDA op's TMA alignment)
_MAX_GROUPS = 1024  # ScaledGroupMM.cu: "Can't process more than 1024 groups"
# How the CUDA path multiplies: "grouped" (one torch._scaled_grouped_mm) or "per-expert" (one row-wise
# torch._scaled_mm per expert with rows, after a host read of the offsets: G launches and a device sync per call).
# The issue asks for whichever measures faster; bench kind `fp8-experts` times both (bench/bench_fp8_experts.py).
GEMM = "grouped"
# "per-expert": a group whose rows are not a multiple of this is multiplied on a zero-padded copy of the next multiple
PER_EXPERT_ROW_MULTIPLE = 16


def _check(xq: Tensor, x_inv: Tensor, wq: Tensor, w_inv: Tensor, offsets: Tensor) -> None:
    """The CUDA op's rules for the 2-D x 3-D form (module docstring), on every device."""
    if xq.dim() != 2 or wq.dim() != 3 or xq.shape[1] != wq.shape[2] or xq.dtype != E4M3 or wq.dtype != E4M3:
        raise ValueError(f"fp8_grouped_linear: xq (M, K) and wq (G, N, K) in e4m3, got {tuple(xq.shape)} {xq.dtype} "
                         f"and {tuple(wq.shape)} {wq.dtype}")
    G, N, K = wq.shape
    if K % FP8_MULTIPLE or N % FP8_MULTIPLE:
        raise ValueError(f"fp8_grouped_linear: K={K} and N={N} must be multiples of {FP8_MULTIPLE} "
                         "(torch._scaled_grouped_mm); qtrain does not pad")
    if not xq.is_contiguous() or not wq.is_contiguous():
        raise ValueError(f"fp8_grouped_linear: xq and wq must be contiguous (row-major), got strides {xq.stride()} "
                         f"and {wq.stride()}")
    if x_inv.dtype != torch.float32 or x_inv.shape != (xq.shape[0],) or not x_inv.is_contiguous():
        raise ValueError(f"fp8_grouped_linear: x_inv must be contiguous fp32 ({xq.shape[0]},), got {x_inv.dtype} "
                         f"{tuple(x_inv.shape)}")
    if w_inv.dtype != torch.float32 or w_inv.shape != (G, N) or w_inv.stride(-1) != 1:
        raise ValueError(f"fp8_grouped_linear: w_inv must be fp32 ({G}, {N}) with unit last stride, got "
                         f"{w_inv.dtype} {tuple(w_inv.shape)}")
    if offsets.dim() != 1 or offsets.dtype != torch.int32 or offsets.numel() != G:
        raise ValueError(f"fp8_grouped_linear: offsets must be int32 ({G},), got {tuple(offsets.shape)} "
                         f"{offsets.dtype}")


def fp8_grouped_linear_twin(xq: Tensor, x_inv: Tensor, wq: Tensor, w_inv: Tensor, offsets: Tensor,
                            out_dtype: torch.dtype) -> Tensor:
    """The specification: y[rows of g] = (xq_g @ wq[g]^T in fp32) * x_inv[rows, None] * w_inv[g][None, :], cast to
    out_dtype once. e4m3 x e4m3 products are exact in fp32 (4 x 4 significant bits), so only the fp32 sums (their
    order) and the final cast round, as in the CUDA kernel, which also scales its fp32 accumulator."""
    _check(xq, x_inv, wq, w_inv, offsets)
    y = torch.zeros(xq.shape[0], wq.shape[1], dtype=out_dtype, device=xq.device)
    for g, (a, b) in enumerate(group_bounds(offsets)):
        if b > a:
            acc = xq[a:b].float() @ wq[g].float().t()
            y[a:b] = (acc * x_inv[a:b, None] * w_inv[g][None, :]).to(out_dtype)
    return y


def _fast_path_ok(xq: Tensor, groups: int) -> bool:
    """torch._scaled_grouped_mm applies: a Hopper GPU (its CUTLASS sm90 kernel), < 1024 groups; dispatch.BACKEND
    'twin' forces the loop."""
    if dispatch.BACKEND == "twin" or not hasattr(torch, "_scaled_grouped_mm"):
        return False
    if not xq.is_cuda or groups >= _MAX_GROUPS:
        return False
    return torch.cuda.get_device_capability(xq.device)[0] == 9


@torch.library.custom_op("qtrain::fp8_grouped_linear", mutates_args=())
def fp8_grouped_linear(xq: Tensor, x_inv: Tensor, wq: Tensor, w_inv: Tensor, offsets: Tensor,
                       out_dtype: torch.dtype, fast_accum: bool) -> Tensor:
    """y_g = xq_g @ wq_g^T, scaled by x_inv (per row) and w_inv (per expert, per output column), in out_dtype:
    torch._scaled_grouped_mm or the twin (module docstring). `fast_accum`: Hopper's fast FP8 accumulation (the
    forward's; the twin always sums in fp32)."""
    _check(xq, x_inv, wq, w_inv, offsets)
    if xq.shape[0] == 0:
        return xq.new_zeros(0, wq.shape[1], dtype=out_dtype)
    if _fast_path_ok(xq, wq.shape[0]):  # the kernels write bf16 only: another dtype (an fp32 model) is cast from it
        if GEMM == "per-expert":
            y = per_expert_scaled_mm(xq, x_inv, wq, w_inv, offsets, fast_accum)
        else:
            y = torch._scaled_grouped_mm(xq, wq.transpose(-2, -1), x_inv, w_inv, offs=offsets,
                                         out_dtype=torch.bfloat16, use_fast_accum=fast_accum)
        return y if out_dtype == torch.bfloat16 else y.to(out_dtype)
    return fp8_grouped_linear_twin(xq, x_inv, wq, w_inv, offsets, out_dtype)


def per_expert_scaled_mm(xq: Tensor, x_inv: Tensor, wq: Tensor, w_inv: Tensor, offsets: Tensor,
                         fast_accum: bool) -> Tensor:
    """`fp8_grouped_linear` on CUDA as one row-wise torch._scaled_mm per expert with rows (scale_a (m, 1), scale_b
    (1, N), fp32; mat2 = wq[g].t(), column-major; bf16 out): the alternative to the grouped kernel (`GEMM`). A
    group's rows start at a multiple of K bytes, so its operand slices stay 16-byte aligned; its row scales are
    copied when they start off a 16-byte boundary. cuBLASLt refused a 1-row group and a 250-row group starting at
    row 38 (CUBLAS_STATUS_NOT_SUPPORTED, H100, torch 2.11): a group whose rows are not a multiple of
    `PER_EXPERT_ROW_MULTIPLE` runs on a zero-padded copy (padding rows add zero rows to the product, dropped)."""
    y = xq.new_zeros(xq.shape[0], wq.shape[1], dtype=torch.bfloat16)
    for g, (a, b) in enumerate(group_bounds(offsets)):
        m = b - a
        if m == 0:
            continue
        padded = -(-m // PER_EXPERT_ROW_MULTIPLE) * PER_EXPERT_ROW_MULTIPLE
        if padded == m:
            scale_a = x_inv[a:b, None] if a % 4 == 0 else x_inv[a:b, None].clone()  # 16-byte aligned fp32
            torch._scaled_mm(xq[a:b], wq[g].t(), scale_a=scale_a, scale_b=w_inv[g][None, :],
                             out_dtype=torch.bfloat16, use_fast_accum=fast_accum, out=y[a:b])
        else:
            xp = torch.zeros(padded, xq.shape[1], dtype=torch.uint8, device=xq.device).view(E4M3)
            xp[:m] = xq[a:b]
            sp = x_inv.new_ones(padded)
            sp[:m] = x_inv[a:b]
            y[a:b] = torch._scaled_mm(xp, wq[g].t(), scale_a=sp[:, None], scale_b=w_inv[g][None, :],
                                      out_dtype=torch.bfloat16, use_fast_accum=fast_accum)[:m]
    return y


@fp8_grouped_linear.register_fake
def _(xq: Tensor, x_inv: Tensor, wq: Tensor, w_inv: Tensor, offsets: Tensor, out_dtype: torch.dtype,
      fast_accum: bool) -> Tensor:
    _check(xq, x_inv, wq, w_inv, offsets)
    return xq.new_empty(xq.shape[0], wq.shape[1], dtype=out_dtype)


def dequantize_rows(q: Tensor, inv_scale: Tensor, dtype: torch.dtype) -> Tensor:
    """q * inv_scale per row, rounded once to dtype: the operand the model-dtype weight gradient reads."""
    return (q.float() * inv_scale.unsqueeze(-1)).to(dtype)


def _after(dy: Tensor, t: Tensor) -> Tensor:
    """t, made to depend on the output gradient's values (+ 0 x one element of dy): the weight's quantization for the
    input gradient depends on the weight alone, so AOTAutograd's partitioner (torch.compile) otherwise runs it in the
    forward and keeps its e4m3 copy until the backward -- E 2F C + E C F bytes per layer (Qwen3-30B-A3B: 604 MB),
    measured on the CPU with its partitioner -- instead of reading the weight, which is kept anyway. Exact for
    finite dy (a non-finite dy makes the input gradient non-finite either way)."""
    return t + dy.reshape(-1)[:1].sum().float() * 0.0


class _Fp8ExpertLinear(torch.autograd.Function):
    """y = x w_g^T per expert with the forward and input-gradient GEMMs in e4m3 (module docstring); keeps the e4m3 x
    and its row scales for w's gradient, w (a reference) for x's."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
        xq, x_inv = quantize_fp8_rowwise(x)
        wq, w_inv = quantize_fp8_rowwise(w.detach())  # (G, N, K): a scale per expert and output column
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.save_for_backward(xq if need_dw else None, x_inv if need_dw else None, w if need_dx else None, offsets)
        ctx.x_dtype, ctx.w_dtype = x.dtype, w.dtype
        return fp8_grouped_linear(xq, x_inv, wq, w_inv, offsets, x.dtype, True)

    @staticmethod
    def backward(ctx, dy: Tensor):
        xq, x_inv, w, offsets = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dyq, dy_inv = quantize_fp8_rowwise(dy)
            wt = w.detach().transpose(-2, -1)  # (G, K, N): a scale per input column of w
            wtq, wt_inv = quantize_fp8_rowwise(wt, amax=_after(dy, torch.linalg.vector_norm(wt, float("inf"), dim=-1)))
            dx = fp8_grouped_linear(dyq, dy_inv, wtq, wt_inv, offsets, ctx.x_dtype, False)
        if ctx.needs_input_grad[1]:
            dy = dy.contiguous()
            dw = grouped_weight_grad(dy, dequantize_rows(xq, x_inv, dy.dtype), offsets).to(ctx.w_dtype)
        return dx, dw, None


def fp8_expert_linear(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """x (M, K) with rows grouped by expert (`offsets`, int32 cumulative ends), w (G, N, K) the stacked experts'
    weights in nn.Linear layout -> (M, N) in x's dtype, differentiable in x and w, through e4m3 GEMMs (module
    docstring). K and N must be multiples of 16."""
    G, N, K = w.shape
    if x.dim() != 2 or x.shape[1] != K or K % FP8_MULTIPLE or N % FP8_MULTIPLE:
        raise ValueError(f"fp8_expert_linear: x (M, K) and w (G, N, K) with K and N multiples of {FP8_MULTIPLE}, "
                         f"got {tuple(x.shape)} and {tuple(w.shape)}")
    return _Fp8ExpertLinear.apply(x, w, offsets)
