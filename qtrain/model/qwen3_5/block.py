"""One Qwen3.5 decoder block: a token mixer (Gated DeltaNet on 'linear_attention' layers, gated full attention on
'full_attention' ones) and an MLP (dense SwiGLU, or routed experts + a gated shared expert in the MoE variant), each
behind a zero-centred RMSNorm and a residual::

    x -> RMSNorm(1 + w) -> mixer -> + x -> RMSNorm(1 + w) -> MLP -> + (residual)

Full attention (transformers' `Qwen3_5Attention`): one fused projection [q + gate; k; v] (the q projection holds,
per head, hs rows of q then hs rows of its output gate) -> per-head RMSNorm(1 + w) of q and k -> RoPE on the first
`rotary_dim` dims of each head (partial rotary: 64 of 256; text positions, where the multimodal RoPE's three
sections coincide) -> causal SDPA (GQA) -> times sigmoid(gate) -> output projection.

The steps carry the recompute vocabulary (model/recompute_flags.py: ln1, qkv, attention, ln2, up, swiglu) for both
mixers, so every recompute switch means the same as for the Llama family. One block function serves every layer; it
tells the kinds apart by the tensors it receives ('in_proj' only in linear-attention layers, 'router' only in MoE
ones). Dimension letters: B batch, T sequence, C hidden, nh / nkv heads, hs head size, F intermediate.

Documents (--document-masking: the block gets the micro-batch's `DocumentMask`, and cos, sin at each token's position
in its document): full attention stays inside each document (`document_attention`, as the Llama block), and on
linear-attention layers the convolution and the delta rule restart at each document's first token
(`kernels.delta_rule.document_resets`), so a packed row computes what its documents compute alone.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from qtrain.kernels.attention import causal_attention
from qtrain.kernels.delta_rule import document_resets
from qtrain.kernels.document_attention import DocumentMask, document_attention
from qtrain.kernels.rope import apply_rope
from qtrain.kernels.swiglu import swiglu
from qtrain.model.family import BlockFn, BlockOptions
from qtrain.model.layers import rms_norm_zero_centered, sdpa_backends
from qtrain.model.moe import moe_forward
from qtrain.model.moe_router import record_router_stats, with_router_grads
from qtrain.model.qwen3_5.config import Qwen35Config
from qtrain.model.qwen3_5.linear_attention import GatedDeltaNet
from qtrain.model.recompute import MLP_STEPS, CheckpointSteps, Recomputer, run_step
from qtrain.model.weight_source import SCALE_HINT, quantized_weight

# block matrices that may run in FP8 (--matmul-dtype e4m3); the delta rule, the convolution, the norms, the gates and
# the MoE experts stay in the model dtype (the delta rule's state in fp32)
FP8_MATRICES = ("qkv", "o", "in_proj", "out", "up", "down")


class Qwen35Block:
    """The block's steps with its settings bound (`transformer.make_block_fn` documents the options)."""

    def __init__(self, cfg: Qwen35Config, o: BlockOptions):
        self.nh, self.nkv, self.hs, self.rd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, \
            cfg.rotary_dim
        self.eps, self.q_dim, self.kv_dim, self.gqa = cfg.rms_norm_eps, cfg.q_dim, cfg.kv_dim, \
            cfg.num_attention_heads != cfg.num_key_value_heads
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.linear, self.linears, self.swiglu_mode, self.sdpa_backend = o.linear, o.linears, o.swiglu, o.sdpa_backend
        self.fused_mlp = o.mlp if not (MLP_STEPS & o.recompute) else None
        self.delta = GatedDeltaNet(cfg, self.project, o.delta_rule_precision)
        self.adapter = o.adapter  # LoRA's term after the linears (model/lora/adapter.py)
        self.exchange = o.experts  # expert parallelism's token exchange, or None

    # ---- the linears ----
    def project(self, h: torch.Tensor, w: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        """h @ w[name]^T with the source's FP8 copy of the weight when there is one (+ LoRA's s B A h)."""
        if self.linears and name in self.linears:  # a model-dtype linear under the FP8 policy
            y = self.linears[name](h, w[name], None)
        else:
            q = quantized_weight(w, name)
            y = self.linear(h, w[name], None) if q is None else self.linear(h, w[name], None, q)
        return y if self.adapter is None else self.adapter(name, h, w, y)

    def norm(self, x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
        return rms_norm_zero_centered(x, gain, self.eps)

    # ---- gated full attention ----
    def qkv_rope(self, h: torch.Tensor, w: dict[str, torch.Tensor], cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, ...]:
        """Step "qkv" of a full-attention layer: q, k, v (B, nh|nkv, T, hs) and the output gate (B, T, nh hs)."""
        B, T, _ = h.shape
        qkv = self.project(h, w, "qkv")  # (B, T, 2 q_dim + 2 kv_dim)
        qg, k, v = qkv.split([2 * self.q_dim, self.kv_dim, self.kv_dim], dim=-1)
        q, gate = qg.view(B, T, self.nh, 2 * self.hs).chunk(2, dim=-1)  # (B, T, nh, hs) each
        q = self.norm(q, w["q_norm"])
        k = self.norm(k.view(B, T, self.nkv, self.hs), w["k_norm"])
        c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (T, 1, rotary_dim), or (B, T, 1, rotary_dim) with documents
        q = torch.cat((apply_rope(q[..., :self.rd], c, s), q[..., self.rd:]), dim=-1)
        k = torch.cat((apply_rope(k[..., :self.rd], c, s), k[..., self.rd:]), dim=-1)
        v = v.reshape(B, T, self.nkv, self.hs)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), gate.reshape(B, T, self.q_dim)

    def sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: DocumentMask | None = None
             ) -> torch.Tensor:
        """Step "attention" of a full-attention layer: causal SDPA, or inside each document with `docs`; (B, T, q_dim)
        out."""
        B, _, T, _ = q.shape
        if docs is not None:
            return document_attention(q, k, v, docs).reshape(B, T, self.q_dim)
        if self.sdpa_backend == "cudnn":
            att = causal_attention(q, k, v)
        else:
            with sdpa_backends(self.sdpa_backend):
                att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.gqa)
        return att.transpose(1, 2).reshape(B, T, self.q_dim)

    def full_attention(self, h: torch.Tensor, w: dict[str, torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                       step, docs: DocumentMask | None) -> torch.Tensor:
        q, k, v, gate = step("qkv", self.qkv_rope, h, w, cos, sin)
        att = step("attention", self.sdpa, q, k, v, docs)
        return self.project(att * torch.sigmoid(gate), w, "o")

    # ---- Gated DeltaNet ----
    def linear_attention(self, h: torch.Tensor, w: dict[str, torch.Tensor], step,
                         docs: DocumentMask | None) -> torch.Tensor:
        resets = None if docs is None else document_resets(docs, h.shape[0], h.shape[1])  # (B, T) document starts
        q, k, v, z, g, beta = step("qkv", self.delta.qkv, h, w, resets)
        o = step("attention", self.delta.attention, q, k, v, g, beta, resets)
        return self.delta.output(o, z, w)

    # ---- MLP ----
    def dense_mlp(self, h: torch.Tensor, w: dict[str, torch.Tensor], step) -> torch.Tensor:
        """down(SwiGLU(up(h))): one function (the FP8 MLP) where no MLP step is recomputed, else three steps."""
        if self.fused_mlp is not None:
            return self.fused_mlp(h, w["up"], w["down"], quantized_weight(w, "up"), quantized_weight(w, "down"),
                                  w.get(SCALE_HINT))
        u = step("up", self.project, h, w, "up")  # (B, T, 2F) = [up | gate]
        return self.project(step("swiglu", swiglu, u, self.swiglu_mode), w, "down")

    def moe_mlp(self, h: torch.Tensor, w: dict[str, torch.Tensor], step) -> torch.Tensor:
        """Routed experts (model/moe.py: softmax top-k, renormalised) + sigmoid(h W_g^T) x the shared expert's
        SwiGLU MLP (transformers' `Qwen3_5MoeSparseMoeBlock`). The experts' permutation + up/gate GEMM and the shared
        expert's up/gate are 'up' steps, both SwiGLUs 'swiglu' steps, as the dense MLP's. In training the layer
        writes its router statistics beside its weights and its routed output carries the router losses' gradients
        into the backward (the MoE families' machinery, model/moe_router.py: transformers' loss with
        output_router_logits)."""
        moe = moe_forward(h, w["router"], w["experts_up_gate"], w["experts_down"], top_k=self.top_k,
                          norm_topk_prob=self.norm_topk_prob, step=step, exchange=self.exchange,
                          adapter=self.adapter.experts_of(w) if self.adapter is not None else None)
        record_router_stats(moe.stats, w)
        routed = with_router_grads(moe.out, moe.stats, w)
        u = step("up", self.project, h, w, "shared_up")  # (B, T, 2 Fs) = [up | gate]
        shared = self.project(step("swiglu", swiglu, u, self.swiglu_mode), w, "shared_down")
        return routed + torch.sigmoid(F.linear(h, w["shared_gate"])) * shared

    # ---- the whole block ----
    def body(self, x: torch.Tensor, w: dict[str, torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
             step, docs: DocumentMask | None = None) -> torch.Tensor:
        """`step(name, fn, *args)` runs fn(*args), keeping or recomputing its results per the policy; `docs`: the
        micro-batch's documents (module docstring)."""
        # 1) token mixer: norm -> Gated DeltaNet or gated full attention -> residual
        h = step("ln1", self.norm, x, w["ln1"])
        x = x + (self.linear_attention(h, w, step, docs) if "in_proj" in w
                 else self.full_attention(h, w, cos, sin, step, docs))
        # 2) MLP: norm -> dense SwiGLU or MoE -> residual
        h = step("ln2", self.norm, x, w["ln2"])
        return x + (self.moe_mlp(h, w, step) if "router" in w else self.dense_mlp(h, w, step))


def make_block_fn(cfg: Qwen35Config, o: BlockOptions) -> BlockFn:
    """The block as a function of (x, weights, cos, sin[, docs]); `o.recompute` picks the recompute mechanism: none,
    checkpoints (compiled) or `Recomputer` (eager), as for the Llama family. Its MLP runs in one call
    (`resolution.mlp_chunks_refusal`)."""
    if o.mlp_chunks > 1:
        raise ValueError(f"mlp_chunks {o.mlp_chunks}: a Qwen3.5 block runs its MLP in one call")
    body = Qwen35Block(cfg, o).body
    if not o.recompute:
        def block(x, w, cos, sin, docs=None):
            return body(x, w, cos, sin, run_step, docs)
    elif o.compiled:
        policy = CheckpointSteps(o.recompute)

        def block(x, w, cos, sin, docs=None):
            return body(x, w, cos, sin, policy, docs)
    else:
        def block(x, w, cos, sin, docs=None):
            with Recomputer(o.recompute) as rc:
                return body(x, w, cos, sin, rc, docs)
    return block
