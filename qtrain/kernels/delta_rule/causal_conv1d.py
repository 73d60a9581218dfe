"""The causal depthwise convolution of a Gated DeltaNet layer, followed by SiLU: the plain-torch twin (the
specification, what CPU runs) of a Triton kernel still to come (fla-core's `causal_conv1d` is the reference).

For channel c, kernel width K, weight w (D, K), input x (B, T, D), with x[t] = 0 for t < 0::

    y[t, c] = silu( sum_{j=0..K-1} w[c, j] x[t - K + 1 + j, c] )

in fp32, rounded once to x's dtype (transformers' `causal_conv1d_fn` runs F.conv1d in the weight's dtype and casts
back: the same values in fp32). Each output reads the K - 1 tokens before it, so a sequence's first tokens see zeros.

Documents (`resets` (B, T) bool, True at a document's first token: --document-masking): the tokens before a
document's first one read as zeros for its outputs too, x[t - s] counting only where no reset lies in (t - s, t],
so each document is convolved as if alone (the convolution's state restarts at each boundary).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d_silu_twin"]


def causal_conv1d_silu_twin(x: torch.Tensor, w: torch.Tensor, resets: torch.Tensor | None = None) -> torch.Tensor:
    """x (B, T, D), w (D, K) -> silu(causal depthwise conv) (B, T, D) in x's dtype; `resets` (B, T) bool: documents
    (module docstring)."""
    if x.dim() != 3 or w.dim() != 2 or w.shape[0] != x.shape[-1]:
        raise ValueError(f"causal_conv1d: expected x (B, T, D) and w (D, K), got {tuple(x.shape)}, {tuple(w.shape)}")
    if resets is not None and (resets.shape != x.shape[:2] or resets.dtype != torch.bool):
        raise ValueError(f"causal_conv1d: resets must be (B, T) bool, got {tuple(resets.shape)} {resets.dtype}")
    K, T = w.shape[1], x.shape[1]
    acc = torch.promote_types(x.dtype, torch.float32)  # fp32 (fp64 inputs stay fp64, for tests)
    xf = F.pad(x.to(acc), (0, 0, K - 1, 0))  # (B, K - 1 + T, D): zeros before the first token
    wf = w.to(acc)
    seen = {}  # shift s -> (B, T, 1): no reset in (t - s, t] (documents)
    if resets is not None:
        for s in range(1, K):
            r = ~F.pad(resets, (s - 1, 0))[:, :T, None]  # no reset at t - s + 1
            seen[s] = r if s == 1 else seen[s - 1] & r
    y = 0
    for j in range(K):  # the oldest tap first, as the plain sum runs
        term = wf[:, j] * xf[:, j:j + T]
        s = K - 1 - j
        y = y + (term * seen[s] if s in seen else term)
    return F.silu(y).to(x.dtype)
