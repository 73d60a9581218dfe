"""SwiGLU in the model dtype: ``out = up * silu(gate)`` from ``u = [up | gate]`` (M, 2F), the output of the fused
up/gate GEMM, and its backward in one pass. `swiglu(u, mode)` is the entry the blocks call (the FP8 MLP around it is
`mlp.py`'s).

The forward is plain torch in `transformers`' order of operations (silu(gate) rounded first, then the product), so
fp32 results agree with HF to rounding and bf16 results round at the same places; a compiled block fuses it. The
backward, per element, all in fp32 from the stored values, one rounding at the end::

    s      = sigmoid(gate)
    d_up   = dout * gate * s
    d_gate = dout * up * s * (1 + gate * (1 - s))

written as ``du = [d_up | d_gate]`` (M, 2F) in u's dtype. Why a kernel: torch.compile writes this
backward as one pointwise kernel over du whose every element works out which half it is in and loads
its partners at a column offset; measured on the H200 at Qwen2.5-1.5B shapes (16384 x 2 x 8960 bf16) it
moved 1.47 GB in 0.71 ms (2.1 TB/s, half the copy bandwidth): 40 ms of a 590 ms training step. This
kernel walks (row, column) tiles of the F columns and writes both halves from one load of each input.

The plain-torch twin (``swiglu_backward_twin``) is the specification. ``swiglu_backward`` is registered as
the custom op ``qtrain::swiglu_backward`` so that a torch.compile'd block calls it as an opaque kernel
(Triton on CUDA, the twin elsewhere, per ``qtrain.kernels.dispatch``) instead of tracing it.

``swiglu_backward_amax`` (op ``qtrain::swiglu_backward_amax``) also returns ``max |du|`` of the stored
(rounded) values, reduced inside the same kernel (llm.q fuses it the same way): the FP8 MLP quantizes du
as the up-projection's output gradient, and a separate abs-max pass over the (M, 2F) du cost 0.18 ms per
call at Qwen2.5-1.5B shapes (10 ms of a 500 ms step). Each program writes its tile's max to a buffer that
one small reduction finishes: 36k programs doing an atomic max on one address made the kernel 60% slower.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from qtrain.kernels.dispatch import jit, tl, triton, use_triton
from qtrain.kernels.stochastic_rounding import KINDS, load_f32, round_f32, store_f32

__all__ = ["MODES", "saved_bytes_per_token", "swiglu", "swiglu_backward", "swiglu_backward_amax",
           "swiglu_backward_triton", "swiglu_backward_twin"]

# Tile: 16 rows x 256 columns (4096 elements of each half per program, 4 warps): a streaming shape; at
# F = 8960 a row is 35 tiles, so rows of a program stay within a few KB of each other. `swiglu_backward_triton`
# takes others as parameters.
BLOCK_M, BLOCK_F, NUM_WARPS = 16, 256, 4


def _check(dout: torch.Tensor, u: torch.Tensor) -> None:
    if u.shape[-1] % 2 or dout.shape[:-1] != u.shape[:-1] or dout.shape[-1] * 2 != u.shape[-1]:
        raise ValueError(f"swiglu_backward: u must be (..., 2F) and dout (..., F), got {tuple(u.shape)} and "
                         f"{tuple(dout.shape)}")
    if u.dtype not in KINDS or dout.dtype != u.dtype:
        raise TypeError(f"swiglu_backward: u and dout must share a dtype among {list(KINDS)}, got {u.dtype} "
                        f"and {dout.dtype}")


# ---------------------------------------------------------------------------------------------- twin
def swiglu_backward_twin(dout: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The specification: du (..., 2F) in u's dtype (see module docstring)."""
    _check(dout, u)
    up, gate = u.float().chunk(2, dim=-1)
    d = dout.float()
    s = torch.sigmoid(gate)
    return torch.cat([d * gate * s, d * up * s * (1 + gate * (1 - s))], dim=-1).to(u.dtype)


# -------------------------------------------------------------------------------------------- triton
@jit
def _swiglu_bwd_kernel(dout_ptr, u_ptr, du_ptr, amax_ptr, M, F, KIND: tl.constexpr, AMAX: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr):
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]
    rf = (tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)).to(tl.int64)[None, :]
    mask = (rm < M) & (rf < F)
    up_off = rm * (2 * F) + rf  # u and du: (M, 2F) rows, up in the first F columns, gate in the second
    up = load_f32(u_ptr + up_off, mask, KIND)
    gate = load_f32(u_ptr + up_off + F, mask, KIND)
    d = load_f32(dout_ptr + rm * F + rf, mask, KIND)
    s = 1.0 / (1.0 + tl.exp(-gate))
    d_up = d * gate * s
    d_gate = d * up * s * (1.0 + gate * (1.0 - s))
    store_f32(du_ptr + up_off, d_up, mask, KIND)
    store_f32(du_ptr + up_off + F, d_gate, mask, KIND)
    if AMAX:  # one partial max per program, no atomics on one address; masked lanes loaded zeros (|0|).
        # Rounding is monotone and odd, so max |round(x)| = round(max |x|): round the tile max only.
        a = tl.max(tl.max(tl.maximum(tl.abs(d_up), tl.abs(d_gate)), axis=1), axis=0)
        tl.store(amax_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), round_f32(a, KIND))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def swiglu_backward_triton(dout: torch.Tensor, u: torch.Tensor, *, amax: bool = False, block_m: int = BLOCK_M,
                           block_f: int = BLOCK_F, num_warps: int = NUM_WARPS
                           ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher; same contract as the twin (any leading shape; contiguous copies if needed). With
    amax=True also returns max |du| (0-dim fp32), as `swiglu_backward_amax_twin`. The tile (`block_m` rows x
    `block_f` columns, `num_warps`) changes no bit."""
    _check(dout, u)
    u2, d2 = u.reshape(-1, u.shape[-1]).contiguous(), dout.reshape(-1, dout.shape[-1]).contiguous()
    M, F = d2.shape
    du = torch.empty_like(u2)
    grid = (triton.cdiv(M, block_m), triton.cdiv(F, block_f))
    n_partial = grid[0] * grid[1] if amax and u2.numel() else 0
    partial = torch.empty(n_partial, dtype=torch.float32, device=u.device) if n_partial else \
        torch.zeros(1, dtype=torch.float32, device=u.device)
    if u2.numel():
        _swiglu_bwd_kernel[grid](_bits(d2), _bits(u2), _bits(du), partial, M, F, KIND=KINDS[u.dtype], AMAX=amax,
                                 BLOCK_M=block_m, BLOCK_F=block_f, num_warps=num_warps)
    return (du.view(u.shape), partial.amax()) if amax else du.view(u.shape)


def swiglu_backward_amax_twin(dout: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The specification of the fused variant: (du, max |du| as a 0-dim fp32 tensor)."""
    du = swiglu_backward_twin(dout, u)
    amax = torch.linalg.vector_norm(du, float("inf")).float() if du.numel() else du.new_zeros((), dtype=torch.float32)
    return du, amax


# ---------------------------------------------------------------------------------------------- public
@torch.library.custom_op("qtrain::swiglu_backward", mutates_args=())
def swiglu_backward(dout: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """du = d(u * silu-gate product) for d(out) (see module docstring); Triton or twin per dispatch."""
    if use_triton(u):
        return swiglu_backward_triton(dout, u)
    return swiglu_backward_twin(dout, u)


@swiglu_backward.register_fake
def _(dout: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    _check(dout, u)
    return torch.empty_like(u, memory_format=torch.contiguous_format)


@torch.library.custom_op("qtrain::swiglu_backward_amax", mutates_args=())
def swiglu_backward_amax(dout: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(du, max |du|): `swiglu_backward` with the abs-max of its stored output fused in (module docstring)."""
    if use_triton(u):
        return swiglu_backward_triton(dout, u, amax=True)
    return swiglu_backward_amax_twin(dout, u)


@swiglu_backward_amax.register_fake
def _(dout: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check(dout, u)
    return (torch.empty_like(u, memory_format=torch.contiguous_format),
            torch.empty((), dtype=torch.float32, device=u.device))


# ---------------------------------------------------------------------------------------------- the entry
MODES = ("autograd", "kernel")  # how `swiglu` is differentiated (its docstring)


def _forward(u: torch.Tensor) -> torch.Tensor:
    up, gate = u.chunk(2, dim=-1)
    return F.silu(gate) * up


class _SwiGLU(torch.autograd.Function):
    """`_forward` with its backward in one kernel (`qtrain::swiglu_backward`); saves u, as autograd would."""

    @staticmethod
    def forward(ctx, u: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(u)
        return _forward(u)

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> torch.Tensor:
        (u,) = ctx.saved_tensors
        return swiglu_backward(dout.contiguous(), u)


def swiglu(u: torch.Tensor, mode: str = "autograd") -> torch.Tensor:
    """up * silu(gate) for u (..., 2F) with rows [up; gate] of the fused weight. `mode` says how it is differentiated:
    "autograd" (eager blocks, the CPU): autograd's graph of the plain-torch forward; "kernel" (compiled blocks): the
    backward as one kernel (`swiglu_backward`; inductor's own version ran at half the memory bandwidth), computed in
    fp32 from u and rounded once, so it can differ from autograd's (which rounds silu(gate) first) by a unit in the
    last place. The forward is the same in both."""
    if mode == "kernel":
        return _SwiGLU.apply(u)
    if mode != "autograd":
        raise ValueError(f"swiglu: mode must be one of {MODES}, got {mode!r}")
    return _forward(u)


def saved_bytes_per_token(intermediate: int, dtype_bytes: int, mode: str) -> int:
    """What `swiglu` keeps for backward per token beyond its input u (which both modes keep): autograd's graph also
    silu(gate) (`intermediate` = F values of u's dtype); the kernel recomputes it from u."""
    return intermediate * dtype_bytes if mode == "autograd" else 0
