"""Gated DeltaNet's sequence mixing: the gated delta rule (`gated_delta_rule.py`: the recurrent specification and the
chunked form) and the causal depthwise convolution before it (`causal_conv1d.py`). The model calls the two entries
here; on CUDA (`qtrain.kernels.dispatch`) both run Triton op pairs, forward and backward (causal_conv1d.py,
gated_delta_rule_op.py: the chunked form's work on the chunks); elsewhere their plain-torch twins.

`LIMITS` states what the kernels serve, so a config they cannot serve is refused before the model is built
(model/qwen3_5/config.py reads it). Both ops take `resets` (B, T) bool, True at each document's first token
(--document-masking: their state restarts there); `document_resets` reads them off the micro-batch's `DocumentMask`.
"""
from __future__ import annotations

import numpy as np
import torch

from qtrain.kernels.document_attention import DocumentMask
from qtrain.kernels.delta_rule.causal_conv1d import causal_conv1d_silu_op, causal_conv1d_silu_twin
from qtrain.kernels import dispatch
from qtrain.kernels.dispatch import use_triton
from qtrain.kernels.delta_rule.gated_delta_rule import (CHUNK, gated_delta_rule_chunked, gated_delta_rule_recurrent,
                                                        l2_normalize)
from qtrain.kernels.delta_rule.gated_delta_rule_op import gated_delta_rule_triton as _gated_delta_rule_triton
from qtrain.kernels.delta_rule.gated_delta_rule_triton import DEFAULT_PRECISION

__all__ = ["CHUNK", "LIMITS", "causal_conv1d_silu", "document_resets", "gated_delta_rule", "gated_delta_rule_chunked",
           "gated_delta_rule_recurrent", "l2_normalize", "op_pairs_on"]

# what the delta-rule and convolution kernels serve (fla-core's limits, which a Triton port keeps): head dims up to
# 256 in multiples of 16 (one tile of the state per program), convolution widths 2..4
LIMITS = {"head_dim_max": 256, "head_dim_multiple": 16, "conv_min": 2, "conv_max": 4}
# the delta rule's Triton op pair runs head dims from 32 (its dv and dk tiles are 32 wide): on an H100 its backward
# (`_bwd_dw_kernel`) read out of bounds at dk = dv = 16, while Qwen3.5's 128 passes the GPU tests; smaller heads
# run the chunked twin
TRITON_HEAD_DIM_MIN = 32


def _triton_serves(dk: int, dv: int) -> bool:
    return min(dk, dv) >= TRITON_HEAD_DIM_MIN


def op_pairs_on(device_type: str, dk: int = 128, dv: int = 128) -> bool:
    """Whether a run on `device_type` ('cuda', 'cpu') with delta-rule heads of dk, dv calls the two entries below as
    their op pairs, which keep their inputs only for the backward (the memory plan states that path:
    `ActivationSettings.delta_rule_kernels`): on CUDA with Triton unless `dispatch.BACKEND` forces the twins, and
    heads the Triton delta rule serves. (A compiled block traces the convolution's twin.)"""
    return (device_type == "cuda" and dispatch.HAS_TRITON and dispatch.BACKEND != "twin"
            and _triton_serves(dk, dv))


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, resets: torch.Tensor | None = None,
                     precision: str = DEFAULT_PRECISION) -> torch.Tensor:
    """o (B, T, H, dv) of the gated delta rule with L2-normalised q, k from a zero state, restarting at `resets`
    (gated_delta_rule.py): on CUDA the chunked form through its Triton op pair, its products at `precision`
    (--delta-rule-precision: gated_delta_rule_triton.PRECISIONS), elsewhere the chunked twin (which ignores it)."""
    if _triton_serves(q.shape[-1], v.shape[-1]) and (
            use_triton(q) or (q.is_cuda and torch.compiler.is_compiling() and dispatch.HAS_TRITON
                              and dispatch.BACKEND != "twin")):
        # inside a torch.compile'd block too: the op stays opaque there and launches its kernels at run time
        # (traced, the twin's loop over chunks would unroll into the graph)
        return _gated_delta_rule_triton(q, k, v, g, beta, l2norm=True, resets=resets, precision=precision)[0]
    return gated_delta_rule_chunked(q, k, v, g, beta, l2norm=True, resets=resets)[0]


def causal_conv1d_silu(x: torch.Tensor, w: torch.Tensor, resets: torch.Tensor | None = None) -> torch.Tensor:
    """silu(causal depthwise conv(x (B, T, D), w (D, K))), each document alone with `resets` (causal_conv1d.py): the
    Triton op pair on CUDA, the twin (through autograd) elsewhere."""
    if use_triton(x):
        return causal_conv1d_silu_op(x, w, resets)
    return causal_conv1d_silu_twin(x, w, resets)


def document_resets(docs: DocumentMask, B: int, T: int) -> torch.Tensor:
    """(B, T) bool on the device, True at each document's first token, from either form of the mask: the masked
    form's token t starts a document when it may not attend to t - 1; the varlen form's `cu_seqlens` list the
    starts (of each attention slice's flattened rows)."""
    if docs.masks:
        starts = [torch.cat([torch.ones_like(m[:, 0, :1, 0]), ~m[:, 0].diagonal(-1, -2, -1)], dim=1)
                  for m in docs.masks]  # m (b, 1, T, T): diagonal -1 = (t, t - 1), (b, T - 1)
    else:  # the slices are torch.tensor_split's of the B rows, as document_mask cut them
        rows = [len(r) for r in np.array_split(np.arange(B), docs.slices)]
        starts = [torch.zeros(b * T, dtype=torch.bool, device=cu.device).index_fill(0, cu[:-1].long(), True)
                  for b, cu in zip((b for b in rows if b), docs.cu_seqlens)]
    return torch.cat(starts).reshape(B, T)
