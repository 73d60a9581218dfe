"""The model-dtype MLP after the second norm, down(SwiGLU(up(h))), as one op pair whose two large GEMMs carry the
SwiGLU in their epilogues (issue 48: quack-kernels' Hopper GEMMs, the `[hopper]` extra; `--swiglu-epilogue`):

    forward    preact, out = gemm_act(h, W_up)          out = silu(gate) * up, written by the up/gate GEMM
               y = out @ W_down^T                       (cuBLAS)
    backward   dpreact, out = gemm_dact(dy, W_down, preact)   d(out) = dy @ W_down in the GEMM, then SwiGLU's
                                                              backward in its epilogue; out rewritten for dW_down
               dW_down = dy^T out, dh = dpreact W_up, dW_up = dpreact^T h   (cuBLAS)

The three-step path writes the up/gate output u, reads it for SwiGLU, writes the SwiGLU output and keeps both; its
backward writes d(out), reads it with u for SwiGLU's backward. Here u is kept and the SwiGLU output never is
(the plan's `swiglu` term is zero): measured on an H100 at the Qwen2.5 0.5B-7B shapes the up/gate GEMM + SwiGLU ran
1.09-1.41x and the down input-gradient GEMM + SwiGLU backward 0.97-1.25x faster than cuBLAS + qtrain's kernels
(`hopper` suite, session 34).

Layout: quack's gated epilogue reads gate and up as interleaved columns (gate_0, up_0, gate_1, ...) of one GEMM
output; qtrain's fused weight has rows [up; gate] (model/llama/tensors.py). So each call interleaves the weight's
rows (a copy of 2F x C: ~5 us at 0.5B against a ~1 ms GEMM), `preact` is kept interleaved, and the up/gate weight's
gradient is made interleaved and put back in [up; gate] order.

The plain-torch twin (`gated_mlp_fwd_twin`, `gated_mlp_bwd_twin`) is the specification, on the same interleaved
layout: the SwiGLU output and d(preact) are computed in fp32 from the GEMMs' fp32 results (as the epilogues do from
their accumulators) and rounded once. The op pair runs quack for bf16 CUDA tensors where it imports (kernels/
hopper.py) and the twin elsewhere (`dispatch.BACKEND = "twin"` forces it); a torch.compile'd block calls it as one
opaque op each way.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from qtrain.kernels import dispatch
from qtrain.kernels.hopper import quack

__all__ = ["backward_weight_temporaries", "deinterleave_rows", "gated_mlp", "gated_mlp_bwd", "gated_mlp_bwd_twin",
           "gated_mlp_fwd", "gated_mlp_fwd_twin", "interleave_rows", "quack_runs"]


def interleave_rows(w_up: torch.Tensor) -> torch.Tensor:
    """Rows [up; gate] (2F, C) -> (gate_0, up_0, gate_1, up_1, ...), contiguous."""
    up, gate = w_up.chunk(2, dim=0)
    return torch.stack([gate, up], dim=1).reshape(w_up.shape)


def deinterleave_rows(g: torch.Tensor) -> torch.Tensor:
    """The inverse of `interleave_rows`: interleaved rows (2F, C) -> [up; gate]."""
    pairs = g.view(g.shape[0] // 2, 2, *g.shape[1:])
    return torch.cat([pairs[:, 1], pairs[:, 0]], dim=0)


def _check(h: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> None:
    if h.dim() != 2 or w_up.dim() != 2 or w_down.dim() != 2 or w_up.shape[0] % 2 or h.shape[1] != w_up.shape[1] \
            or w_down.shape != (h.shape[1], w_up.shape[0] // 2):
        raise ValueError(f"gated_mlp: need h (M, C), w_up (2F, C), w_down (C, F); got {tuple(h.shape)}, "
                         f"{tuple(w_up.shape)}, {tuple(w_down.shape)}")


def backward_weight_temporaries(hidden: int, intermediate: int, dtype_bytes: int) -> int:
    """Bytes the backward holds beside the three-step path's: the up/gate weight's gradient made interleaved and its
    [up; gate] copy exist together (2F x C), once per layer's backward, whatever the token count."""
    return 2 * intermediate * hidden * dtype_bytes


def quack_runs(t: torch.Tensor) -> bool:
    """Whether a call on `t` runs quack's kernels: a bf16 CUDA tensor, quack importable, the twin not forced."""
    return dispatch.BACKEND != "twin" and t.is_cuda and t.dtype == torch.bfloat16 and quack() is not None


# ---------------------------------------------------------------------------------------------- twin
def _swiglu_of(p: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of fp32 interleaved pre-activations."""
    gate, up = p[:, 0::2], p[:, 1::2]
    return F.silu(gate) * up


def gated_mlp_fwd_twin(h: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The specification of the forward: (y (M, C), preact (M, 2F) interleaved), in h's dtype."""
    _check(h, w_up, w_down)
    acc = h.float() @ interleave_rows(w_up).float().T
    out = _swiglu_of(acc).to(h.dtype)
    return F.linear(out, w_down), acc.to(h.dtype)


def gated_mlp_bwd_twin(dy: torch.Tensor, h: torch.Tensor, preact: torch.Tensor, w_up: torch.Tensor,
                       w_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The specification of the backward: (dh, dW_up in [up; gate] rows, dW_down)."""
    _check(h, w_up, w_down)
    d = dy.float() @ w_down.float()  # d(out), (M, F)
    p = preact.float()
    gate, up = p[:, 0::2], p[:, 1::2]
    s = torch.sigmoid(gate)
    dpre = torch.stack([d * up * s * (1 + gate * (1 - s)), d * gate * s], dim=-1).flatten(-2).to(h.dtype)
    return _remaining_grads(dy, h, dpre, (gate * s * up).to(h.dtype), w_up)


def _remaining_grads(dy: torch.Tensor, h: torch.Tensor, dpre: torch.Tensor, out: torch.Tensor, w_up: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward's three plain GEMMs from d(preact) and the SwiGLU output: (dh, dW_up in [up; gate] rows,
    dW_down); both paths' (cuBLAS on the GPU)."""
    return dpre @ interleave_rows(w_up), deinterleave_rows(dpre.T @ h), dy.T @ out


# -------------------------------------------------------------------------------------------- quack
def _quack_fwd(h: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # tuned=False: quack's heuristic config (its autotuner sweeps configs on each shape's first call, 30-70 s)
    preact, out = quack().gemm.gemm_act(h, interleave_rows(w_up).T, activation="swiglu", store_preact=True,
                                        tuned=False)
    return F.linear(out, w_down), preact


def _quack_bwd(dy: torch.Tensor, h: torch.Tensor, preact: torch.Tensor, w_up: torch.Tensor,
               w_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dpre, out = quack().gemm.gemm_dact(dy, w_down.contiguous(), preact, activation="swiglu", tuned=False)
    return _remaining_grads(dy, h, dpre, out, w_up)


# ---------------------------------------------------------------------------------------------- ops
@torch.library.custom_op("qtrain::gated_mlp_fwd", mutates_args=())
def gated_mlp_fwd(h: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, preact) of h (M, C): quack or the twin (module docstring)."""
    if quack_runs(h):
        return _quack_fwd(h.contiguous(), w_up, w_down)
    return gated_mlp_fwd_twin(h, w_up, w_down)


@gated_mlp_fwd.register_fake
def _(h: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check(h, w_up, w_down)
    return h.new_empty(h.shape[0], w_down.shape[0]), h.new_empty(h.shape[0], w_up.shape[0])


@torch.library.custom_op("qtrain::gated_mlp_bwd", mutates_args=())
def gated_mlp_bwd(dy: torch.Tensor, h: torch.Tensor, preact: torch.Tensor, w_up: torch.Tensor,
                  w_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dh, dW_up, dW_down): quack or the twin (module docstring)."""
    if quack_runs(h):
        return _quack_bwd(dy.contiguous(), h.contiguous(), preact, w_up, w_down)
    return gated_mlp_bwd_twin(dy, h, preact, w_up, w_down)


@gated_mlp_bwd.register_fake
def _(dy: torch.Tensor, h: torch.Tensor, preact: torch.Tensor, w_up: torch.Tensor,
      w_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check(h, w_up, w_down)
    return h.new_empty(h.shape), w_up.new_empty(w_up.shape), w_down.new_empty(w_down.shape)


def _setup_context(ctx, inputs, output) -> None:
    h, w_up, w_down = inputs
    ctx.save_for_backward(h, output[1], w_up, w_down)


def _backward(ctx, dy: torch.Tensor, _dpreact: torch.Tensor | None):
    h, preact, w_up, w_down = ctx.saved_tensors
    return gated_mlp_bwd(dy, h, preact, w_up, w_down)


gated_mlp_fwd.register_autograd(_backward, setup_context=_setup_context)


def gated_mlp(h: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """down(SwiGLU(up(h))) for h (..., C), w_up (2F, C) with rows [up; gate], w_down (C, F): the block's MLP with
    the SwiGLU in the GEMMs' epilogues (module docstring). Keeps h and the (..., 2F) pre-activations for backward."""
    y, _ = gated_mlp_fwd(h.reshape(-1, h.shape[-1]), w_up, w_down)
    return y.view(*h.shape[:-1], y.shape[-1])
