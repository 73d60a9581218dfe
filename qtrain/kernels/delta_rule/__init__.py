"""Gated DeltaNet's sequence mixing: the gated delta rule (`gated_delta_rule.py`: the recurrent specification and the
chunked form) and the causal depthwise convolution before it (`causal_conv1d.py`). The model calls the two entries
here; each runs its plain-torch form today. The Triton kernels (the chunked forward and backward, the convolution)
are still to be written beside their twins, dispatched through `qtrain.kernels.dispatch` like every other op.

`LIMITS` states what the kernels serve, so a config they cannot serve is refused before the model is built
(model/qwen3_5/config.py reads it).
"""
from __future__ import annotations

import torch

from qtrain.kernels.delta_rule.causal_conv1d import causal_conv1d_silu_twin
from qtrain.kernels.delta_rule.gated_delta_rule import (CHUNK, gated_delta_rule_chunked, gated_delta_rule_recurrent,
                                                        l2_normalize)

__all__ = ["CHUNK", "LIMITS", "causal_conv1d_silu", "gated_delta_rule", "gated_delta_rule_chunked",
           "gated_delta_rule_recurrent", "l2_normalize"]

# what the delta-rule and convolution kernels serve (fla-core's limits, which a Triton port keeps): head dims up to
# 256 in multiples of 16 (one tile of the state per program), convolution widths 2..4
LIMITS = {"head_dim_max": 256, "head_dim_multiple": 16, "conv_min": 2, "conv_max": 4}


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor) -> torch.Tensor:
    """o (B, T, H, dv) of the gated delta rule with L2-normalised q, k from a zero state (gated_delta_rule.py)."""
    return gated_delta_rule_chunked(q, k, v, g, beta, l2norm=True)[0]


def causal_conv1d_silu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """silu(causal depthwise conv(x (B, T, D), w (D, K))) (causal_conv1d.py)."""
    return causal_conv1d_silu_twin(x, w)
