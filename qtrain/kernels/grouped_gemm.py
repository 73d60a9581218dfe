"""Grouped GEMMs for the experts: one call multiplies each expert's rows by that expert's weight.

The MoE layer sorts its (token, choice) rows by expert (`qtrain.kernels.moe_permute`), so expert g owns rows
offsets[g-1]:offsets[g] (offsets: cumulative row ends, int32, `offsets[-1]` = all rows). Three products::

    grouped_linear(x, w, offsets)          y_g  = x_g @ w_g^T        x (M, K), w (G, N, K)  -> (M, N)
    grouped_linear(dy, w^T, offsets)       dx_g = dy_g @ w_g         the data gradient: the same op on w.mT
    grouped_weight_grad(dy, x, offsets)    dw_g = dy_g^T @ x_g       -> (G, N, K); 0 for an expert with no row

Why one grouped call instead of a loop over experts: a loop launches G GEMMs (128 for Qwen3-30B-A3B) and reads
the offsets on the host (a device sync per layer); with top-8 of 128 experts and a few thousand tokens each
GEMM is small. On CUDA (compute capability 9.x and up) with bf16 operands, `torch._grouped_mm` runs all groups in
one CUTLASS kernel from the offsets on the device; elsewhere the twins below loop over the groups with torch.mm
(they are also the specification, and the CPU path in fp32).

`torch._grouped_mm`'s rules (torch 2.13: torch/_meta_registrations.py `_meta_grouped_mm_common`, the docstring of
torch/nn/functional.py `grouped_mm`; the CUDA side in aten/src/ATen/native/cuda/GroupMM.cu and GroupMMCommon.cuh
`prepare_grouped_gemm_data`): bf16 operands, bf16 output accumulated in fp32; `offs` 1-D int32 cumulative ends;
fewer than 1024 groups. 2-D x 3-D: mat_a (M, K) sliced by rows, mat_b (G, K, N). 2-D x 2-D: both sliced along
the contraction (mat_a (N, M), mat_b (M, K) -> (G, N, K)): the "k-grouped" form, which is the weight gradient
here. Each operand may be row- or column-major in its last two dims, with the other stride a multiple of 16
bytes (8 bf16 elements), and the output's last dim is padded to 16 bytes: so K and N must be multiples of 8
(`_fast_path_ok` checks; otherwise the twin runs). M and the group sizes need not be: the kernel asks a group's
row count to be a multiple of 8 only for layouts not used here (2-D x 3-D with mat_a column-major; 2-D x 2-D
with mat_a row-major or mat_b column-major, which also refuses empty groups). The weight gradient passes dy^T
as a column-major view and x row-major: the layout that takes empty groups and any group size. Rows beyond
offs[-1] are not written (none here), and a contraction of length 0 in all groups is refused
(pytorch/pytorch#192497), so M = 0 returns zeros without a call. Empty groups get a zero weight gradient on
Hopper; on Blackwell `_grouped_mm` left them non-zero (pytorch/pytorch#172439), so there they are zeroed
explicitly.

The public ops are custom ops (`qtrain::grouped_linear`, `qtrain::grouped_weight_grad`), opaque to torch.compile
(the twin's host loop would break a graph). `expert_linear` is the autograd entry the MoE layer calls.
"""
from __future__ import annotations

import torch

from qtrain.kernels import dispatch

__all__ = ["expert_linear", "grouped_linear", "grouped_linear_twin", "grouped_weight_grad",
           "grouped_weight_grad_twin"]

_ALIGN = 8  # 16 bytes of bf16: torch._grouped_mm's stride rule
_MAX_GROUPS = 1024  # GroupMM.cu: "Can't process more than 1024 groups" (it needs fewer)


def _check_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> None:
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2] or x.dtype != w.dtype:
        raise ValueError(f"grouped_linear: x (M, K) and w (G, N, K) of one dtype, got {tuple(x.shape)} {x.dtype} "
                         f"and {tuple(w.shape)} {w.dtype}")
    _check_offsets("grouped_linear", offsets, w.shape[0])


def _check_weight_grad(dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> None:
    if dy.dim() != 2 or x.dim() != 2 or dy.shape[0] != x.shape[0] or dy.dtype != x.dtype:
        raise ValueError(f"grouped_weight_grad: dy (M, N) and x (M, K) of one dtype, got {tuple(dy.shape)} "
                         f"{dy.dtype} and {tuple(x.shape)} {x.dtype}")
    _check_offsets("grouped_weight_grad", offsets, offsets.shape[0] if offsets.dim() == 1 else -1)


def _check_offsets(name: str, offsets: torch.Tensor, groups: int) -> None:
    if offsets.dim() != 1 or offsets.dtype != torch.int32 or offsets.numel() != groups:
        raise ValueError(f"{name}: offsets must be int32 ({groups},), got {tuple(offsets.shape)} {offsets.dtype}")


def group_bounds(offsets: torch.Tensor) -> list[tuple[int, int]]:
    """(first row, end row) of each group from the int32 row ends, on the host (the twins loop over them)."""
    ends = offsets.tolist()  # a host sync on CUDA: the twin's price
    return list(zip([0] + ends[:-1], ends))


# ---------------------------------------------------------------------------------------------- twins
def grouped_linear_twin(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The specification: y[rows of g] = x[rows of g] @ w[g]^T, (M, N) in x's dtype; w may be any strided view."""
    _check_linear(x, w, offsets)
    y = x.new_empty(x.shape[0], w.shape[1])
    for g, (a, b) in enumerate(group_bounds(offsets)):
        torch.mm(x[a:b], w[g].t(), out=y[a:b])
    return y


def grouped_weight_grad_twin(dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The specification: dw[g] = dy[rows of g]^T @ x[rows of g], (G, N, K) in x's dtype; zeros for an empty g."""
    _check_weight_grad(dy, x, offsets)
    dw = x.new_zeros(offsets.numel(), dy.shape[1], x.shape[1])
    for g, (a, b) in enumerate(group_bounds(offsets)):
        if b > a:
            torch.mm(dy[a:b].t(), x[a:b], out=dw[g])
    return dw


# ------------------------------------------------------------------------------------------ fast path
def _aligned(t: torch.Tensor) -> bool:
    """Row- or column-major in the last two dims, 16-byte aligned, and every dim that becomes a stride (the
    last dim of a 2-D operand, the last two of a 3-D one) a multiple of 8 elements."""
    major = t.stride(-1) == 1 or t.stride(-2) == 1
    dims = t.shape[-2:] if t.dim() == 3 else t.shape[-1:]
    return major and t.data_ptr() % 16 == 0 and all(d % _ALIGN == 0 for d in dims)


def _fast_path_ok(*ts: torch.Tensor) -> bool:
    """torch._grouped_mm applies: CUDA tensors of compute capability 9.x or newer, bf16, fewer than 1024 groups,
    aligned (`_aligned`; module docstring); dispatch.BACKEND 'twin' forces the loop."""
    if dispatch.BACKEND == "twin" or not hasattr(torch, "_grouped_mm"):
        return False
    if not all(t.is_cuda and t.dtype == torch.bfloat16 for t in ts):
        return False
    if torch.cuda.get_device_capability(ts[0].device)[0] < 9:
        return False
    return all(_aligned(t) for t in ts)


def _zeroes_empty_groups(device: torch.device) -> bool:
    """Whether `torch._grouped_mm`'s k-grouped product is known to write zeros for empty groups (Hopper)."""
    return torch.cuda.get_device_capability(device)[0] == 9


def _grouped_mm_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`grouped_linear` as one torch._grouped_mm call: mat_b = w^T per group, (G, K, N), a view."""
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)


def _grouped_mm_weight_grad(dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`grouped_weight_grad` as one k-grouped torch._grouped_mm call: mat_a = dy^T (N, M) column-major (a view),
    mat_b = x (M, K) row-major, both sliced along M by the offsets."""
    return torch._grouped_mm(dy.t(), x, offs=offsets)


# ---------------------------------------------------------------------------------------------- public ops
@torch.library.custom_op("qtrain::grouped_linear", mutates_args=())
def grouped_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """y_g = x_g @ w_g^T over the row groups of `offsets` (module docstring): torch._grouped_mm or the twin."""
    _check_linear(x, w, offsets)
    if x.shape[0] == 0:
        return x.new_zeros(0, w.shape[1])
    if w.shape[0] < _MAX_GROUPS and _fast_path_ok(x, w):
        return _grouped_mm_linear(x, w, offsets)
    return grouped_linear_twin(x, w, offsets)


@grouped_linear.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    _check_linear(x, w, offsets)
    return x.new_empty(x.shape[0], w.shape[1])


@torch.library.custom_op("qtrain::grouped_weight_grad", mutates_args=())
def grouped_weight_grad(dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """dw_g = dy_g^T @ x_g (G, N, K), zero for a group without rows: torch._grouped_mm's k-grouped form or the
    twin."""
    _check_weight_grad(dy, x, offsets)
    if x.shape[0] == 0:
        return x.new_zeros(offsets.numel(), dy.shape[1], x.shape[1])
    if offsets.numel() < _MAX_GROUPS and _fast_path_ok(dy, x):
        dw = _grouped_mm_weight_grad(dy, x, offsets)
        if not _zeroes_empty_groups(dw.device):
            empty = torch.diff(offsets, prepend=offsets.new_zeros(1)) == 0
            dw.masked_fill_(empty[:, None, None], 0)
        return dw
    return grouped_weight_grad_twin(dy, x, offsets)


@grouped_weight_grad.register_fake
def _(dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    _check_weight_grad(dy, x, offsets)
    return x.new_empty(offsets.numel(), dy.shape[1], x.shape[1])


# ------------------------------------------------------------------------------------------- autograd
class _ExpertLinear(torch.autograd.Function):
    """y = grouped_linear(x, w); saves what a dense linear saves: x only for w's gradient (none for frozen experts,
    LoRA), w only for x's, so each path (torch._grouped_mm or the twin) keeps the same."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, w if ctx.needs_input_grad[0] else None, offsets)
        return grouped_linear(x, w, offsets)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w, offsets = ctx.saved_tensors
        dy = dy.contiguous()
        dx = grouped_linear(dy, w.transpose(-2, -1), offsets) if ctx.needs_input_grad[0] else None
        dw = grouped_weight_grad(dy, x, offsets) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def expert_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x (M, K) with rows grouped by expert (`offsets`, int32 cumulative ends), w (G, N, K) the stacked experts'
    weights in nn.Linear layout -> (M, N), differentiable in x and w."""
    return _ExpertLinear.apply(x, w, offsets)
