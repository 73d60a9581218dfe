"""The gated delta rule's GPU path: the chunked form (gated_delta_rule.py's `chunked_form`: the inputs prepared,
padded and cut into chunks by torch, differentiated by autograd) around one op pair over the chunks, `chunk_core_op`:
on CUDA its forward and backward are Triton's (gated_delta_rule_triton.py, gated_delta_rule_triton_backward.py),
elsewhere the twins (`chunk_core`, `chunk_core_backward`). The op keeps only its inputs for the backward, which
recomputes the chunks' transform and states; it is opaque to torch.compile. Both ops take the run's
--delta-rule-precision as a string argument (a constant of a compiled block's graph), whose launch tuning
(`launch_for`) the Triton launchers get; the twins compute in the inputs' dtype whatever it says.
"""
from __future__ import annotations

import torch

from qtrain.kernels.delta_rule.gated_delta_rule import CHUNK, chunk_core, chunked_form
from qtrain.kernels.delta_rule.gated_delta_rule_backward import chunk_core_backward
from qtrain.kernels.delta_rule.gated_delta_rule_triton import DEFAULT_PRECISION, chunk_core_triton, launch_for
from qtrain.kernels.delta_rule.gated_delta_rule_triton_backward import chunk_core_backward_triton
from qtrain.kernels.dispatch import use_triton

__all__ = ["chunk_core_op", "gated_delta_rule_triton"]


@torch.library.custom_op("qtrain::gated_delta_rule_chunks_fwd", mutates_args=())
def _core_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              d: torch.Tensor | None, S0: torch.Tensor | None, precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    tune = launch_for(precision)  # a bad value fails here on every device
    if use_triton(q):
        return chunk_core_triton(q, k, v, g, beta, d, S0, tune)
    o, S = chunk_core(q, k, v, g, beta, d, S0)
    return o, S.clone()  # a fresh tensor also without chunks (an op's output may not alias its input S0)


@_core_fwd.register_fake
def _(q, k, v, g, beta, d, S0, precision):
    B, H, n, C, dk = k.shape
    return v.new_empty(v.shape), v.new_empty(B, H, dk, v.shape[-1])


@torch.library.custom_op("qtrain::gated_delta_rule_chunks_bwd", mutates_args=())
def _core_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              d: torch.Tensor | None, S0: torch.Tensor | None, do: torch.Tensor, dSf: torch.Tensor, precision: str
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    tune = launch_for(precision)
    if use_triton(q):
        out = chunk_core_backward_triton(q, k, v, g, beta, d, S0, do, dSf, tune)
    else:
        out = chunk_core_backward(q, k, v, g, beta, d, S0, do, dSf)
    return tuple(t.contiguous() for t in out[:5]) + (out[5].clone(),)  # dS0 may be dSf itself without chunks


@_core_bwd.register_fake
def _(q, k, v, g, beta, d, S0, do, dSf, precision):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape),
            beta.new_empty(beta.shape), dSf.new_empty(dSf.shape))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:7])  # the tensors only: the backward recomputes the chunks' terms and states
    ctx.precision = inputs[7]


def _backward(ctx, do, dSf):
    q, k, v, g, beta, d, S0 = ctx.saved_tensors
    do = torch.zeros_like(v) if do is None else do
    dSf = v.new_zeros(k.shape[:2] + (k.shape[-1], v.shape[-1])) if dSf is None else dSf
    dq, dk, dv, dg, dbeta, dS0 = _core_bwd(q, k, v, g, beta, d, S0, do, dSf, ctx.precision)
    return dq, dk, dv, dg, dbeta, None, (dS0.to(S0.dtype) if S0 is not None else None), None


_core_fwd.register_autograd(_backward, setup_context=_setup_context)


def chunk_core_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  d: torch.Tensor | None, S0: torch.Tensor | None, precision: str = DEFAULT_PRECISION
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunk_core` as a differentiable op pair (Triton on CUDA, the twins elsewhere), opaque to torch.compile; it
    keeps its inputs for the backward, nothing else. `precision`: --delta-rule-precision, for both kernels."""
    return _core_fwd(q, k, v, g, beta, d, S0, precision)


def gated_delta_rule_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            *, l2norm: bool = True, initial_state: torch.Tensor | None = None,
                            resets: torch.Tensor | None = None, precision: str = DEFAULT_PRECISION
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_delta_rule_chunked`'s contract (chunks of 64) through `chunk_core_op` at `precision`."""
    def core(*chunks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return chunk_core_op(*chunks, precision=precision)

    return chunked_form(q, k, v, g, beta, core, l2norm=l2norm, initial_state=initial_state, chunk=CHUNK,
                        resets=resets)
