"""OLMoE's block: the MoE block (model/moe_block.py) whose attention norms q and k over the whole projection (one
RMSNorm of q_dim and one of kv_dim per token, before the heads are split: transformers' `OlmoeAttention`) instead of
per head, and optionally clamps q, k and v to [-clip_qkv, clip_qkv] after the norms; the rest is the Llama block's.
"""
from __future__ import annotations

import torch

from qtrain.model.family import ActTerm
from qtrain.kernels.rope import apply_rope
from qtrain.model.layers import rms_norm
from qtrain.model.llama.block import Prenorm, _Saved
from qtrain.model.moe_block import MoeBlock
from qtrain.model.olmoe.config import OlmoeConfig


class OlmoeBlock(MoeBlock):
    """`MoeBlock` with OLMoE's q/k norms and clamp (module docstring)."""

    def __init__(self, cfg: OlmoeConfig, o):
        super().__init__(cfg, o)
        self.kv_dim, self.clip = cfg.kv_dim, cfg.clip_qkv

    # ---- 2) fused QKV projection, whole-projection qk-norm, clamp, RoPE ----
    def qkv_rope(self, h: torch.Tensor, w: dict[str, torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                 prenorm: Prenorm | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fused QKV projection -> RMSNorm of q (B, T, q_dim) and k (B, T, kv_dim) -> (clamp) -> RoPE:
        (B, T, C) -> q (B, nh, T, hs), k, v (B, nkv, T, hs)."""
        nh, nkv, hs = self.nh, self.nkv, self.hs
        qkv = self.project(h, w, "qkv", "qkv_bias", prenorm)  # (B, T, q_dim + 2 kv_dim)
        B, T, _ = qkv.shape
        q, k, v = qkv.split([self.q_dim, self.kv_dim, self.kv_dim], dim=-1)
        q, k = rms_norm(q, w["q_norm"], self.eps), rms_norm(k, w["k_norm"], self.eps)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        else:
            v = v.contiguous()  # out of the fused buffer, which SDPA would otherwise keep (layers.split_qkv)
        q, k, v = q.view(B, T, nh, hs), k.view(B, T, nkv, hs), v.view(B, T, nkv, hs)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (T, 1, hs), or (B, T, 1, hs) with document positions
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, nh|nkv, T, hs)

    @staticmethod
    def saved_by_qkv(a: _Saved) -> list[ActTerm]:
        """As the Llama block's with qk-norm (`LlamaBlock.saved_by_qkv`), with one rstd per token for each of q and k
        (not one per head); eager in fp32 the norms keep views of the fused buffer, and so does the clamp of v. The
        clamp keeps its inputs, the norms' outputs (q, k) and v; the clamped v replaces v's copy. Compiled (measured on
        the CPU with AOTAutograd's partitioner): the fused buffer, the two rstd and, with the clamp, v's clamp mask."""
        cfg, E, rc, up = a.cfg, a.E, a.rc, a.up
        q, kv, qkv = cfg.q_dim, cfg.kv_dim, cfg.qkv_dim
        clip = cfg.clip_qkv is not None
        fused = up == 0 or a.s.compiled or clip
        what = "fused QKV output + v copied out of it" if fused else "v, copied out of the fused QKV output"
        f8_in = a.f8_norm_out if a.s.compiled else a.f8_in
        terms = [ActTerm("qkv", E * ((qkv if fused else 0) + kv) + f8_in * cfg.hidden_size, "qkv" not in rc,
                         what + (" + e4m3 copy of the QKV input" if f8_in else ""))]
        if a.s.compiled:  # the partitioner keeps the v clamp's mask (1 byte per element), rebuilds q's and k's
            terms.append(ActTerm("qk_norm", 8 + (kv if clip else 0), "qkv" not in rc,
                                 "q/k RMSNorm rstd" + (" + v's clamp mask" if clip else "")))
        else:
            terms.append(ActTerm("qk_norm", up * (q + kv) + 8 + a.gain * (q + kv) + (E * (q + kv) if clip else 0),
                                 "qkv" not in rc, "q/k RMSNorm state" + (" + the clamp's inputs" if clip else "")))
        kept = a.blk and "qkv" not in rc if a.s.compiled else "qkv" not in rc
        return terms + [ActTerm("rope", E * (q + kv), kept, "q, k after RoPE (SDPA inputs)")]
