"""The Gated DeltaNet token mixer of a Qwen3.5 linear-attention layer, as transformers' `Qwen3_5GatedDeltaNet`
computes it (fp32 where it does), in the two steps the block's recompute policy names:

    "qkv":       h (B, T, C) -> one fused projection [qkv; z; b; a] -> causal depthwise conv + SiLU over [q; k; v]
                 -> q, k (B, T, Hk, dk), v (B, T, H, dv); z (B, T, H, dv) the output gate;
                 beta = sigmoid(b) (B, T, H); g = -exp(A_log) softplus(a + dt_bias) (B, T, H), fp32, <= 0
    "attention": the gated delta rule over q, k, v, g, beta (kernels/delta_rule: L2-normalised q, k, fp32 state;
                 on the GPU its products at --delta-rule-precision) -> o (B, T, H, dv)

then, outside the steps, the gated RMSNorm per value head, y = w * rmsnorm(o) * silu(z) (its gain plain w, starting
at 1, unlike the block's (1 + w) norms), and the output projection (B, T, H dv) -> (B, T, C).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from qtrain.kernels.delta_rule import causal_conv1d_silu, gated_delta_rule
from qtrain.model.qwen3_5.config import Qwen35Config

Project = Callable[..., torch.Tensor]  # (h, w, name) -> h @ w[name]^T (the block's linear, FP8 when configured)


class GatedDeltaNet:
    """The mixer's sizes, the block's linear and the delta rule's precision bound (a plain object: torch.compile
    reads its attributes as constants)."""

    def __init__(self, cfg: Qwen35Config, project: Project, precision: str = "fp32"):
        self.Hk, self.H = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim, self.conv_dim = cfg.linear_key_dim, cfg.linear_value_dim, cfg.conv_dim
        self.eps, self.project = cfg.rms_norm_eps, project
        self.precision = precision  # --delta-rule-precision: the Triton delta rule's products (CUDA)

    def qkv(self, h: torch.Tensor, w: dict[str, torch.Tensor], resets: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, ...]:
        """Step "qkv" (module docstring): (q, k, v, z, g, beta); `resets` (B, T) bool: documents' first tokens, where
        the convolution restarts."""
        B, T, _ = h.shape
        p = self.project(h, w, "in_proj")  # (B, T, conv_dim + value_dim + 2H) = [qkv | z | b | a]
        mixed, z, b, a = p.split([self.conv_dim, self.value_dim, self.H, self.H], dim=-1)
        mixed = causal_conv1d_silu(mixed, w["conv"].squeeze(1), resets)  # (B, T, conv_dim); conv (conv_dim, 1, K)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        beta = b.sigmoid()  # (B, T, H)
        g = -w["A_log"].float().exp() * F.softplus(a.float() + w["dt_bias"])  # (B, T, H) fp32
        return (q.reshape(B, T, self.Hk, self.dk), k.reshape(B, T, self.Hk, self.dk),
                v.reshape(B, T, self.H, self.dv), z.reshape(B, T, self.H, self.dv), g, beta)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, resets: torch.Tensor | None = None) -> torch.Tensor:
        """Step "attention": the gated delta rule, o (B, T, H, dv) in q's dtype, its state restarting at `resets`."""
        return gated_delta_rule(q, k, v, g, beta, resets, self.precision)

    def output(self, o: torch.Tensor, z: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        """Gated RMSNorm per value head, then the output projection: (B, T, H, dv) -> (B, T, C)."""
        B, T = o.shape[:2]
        of = o.float()
        y = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.eps)
        y = (w["gnorm"] * y.to(o.dtype)) * F.silu(z.float())  # transformers' order: gain in o's dtype, gate in fp32
        return self.project(y.to(o.dtype).reshape(B, T, self.value_dim), w, "out")
