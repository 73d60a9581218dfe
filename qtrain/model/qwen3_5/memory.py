"""What a Qwen3.5 block keeps for backward (eager, the CPU and the twins), per token and layer kind: the memory
plan's statements (model/activations.py sums them). tests/model/test_qwen3_5.py checks the sum against what
autograd saves (saved-tensor hooks) for fp32 and bf16 without recompute; the recompute switches drop the terms of
the steps they rerun. The GPU check against allocations waits for the Triton delta rule, whose chunk buffers differ
from the twin's. Over a frozen base (LoRA: `ActivationSettings.frozen_base`) these terms are an upper bound: the
frozen gains and linears keep less (measured on a tiny CPU block, T = 128: a full-attention layer keeps ~60% of the
stated bytes, a linear-attention one ~92%); the Llama family's statements follow it exactly.

Gated DeltaNet terms (the twin's chunked form, C = 64, H value heads of dv, Hk key heads of dk, all fp32):
  the state S (B, H, dk, dv) per chunk boundary, T / C of them    -> 4 H dk dv / C per token
  per chunk: D, A, QK (C, C) per head; U, V' (C, dv); W, q, k, kb, q_dec, k_dec (C, dk); G, beta, g  -> per token
  4 H (3 C + 2 dv + 8 dk + 4), plus q, k L2-normalised and repeated to the H value heads.
A fused kernel keeps far less (fla-core keeps q, k, v, g, beta and the chunk states, recomputing the rest).
With --document-masking a linear-attention layer also keeps its documents' masks (`document_terms`): C bytes a token
for the chunks' (C, C) same-document masks, 2 for two bool per-position masks, 8 H for the two masked fp32 decays,
K - 1 for the convolution's.
"""
from __future__ import annotations

from qtrain.kernels.delta_rule import CHUNK
from qtrain.model.family import DTYPE_BYTES, ActivationSettings, ActTerm
from qtrain.model.qwen3_5.config import Qwen35Config
from qtrain.model.recompute import resolve_flags


def _norm_bytes(C: int, E: int) -> int:
    """A zero-centred RMSNorm (eager): its fp32 copy of a bf16 input, rstd, the normalised fp32 value."""
    return (4 * C if E != 4 else 0) + 4 + 4 * C


def activation_terms(cfg: Qwen35Config, layer: int, s: ActivationSettings) -> list[ActTerm]:
    E, C, rc = DTYPE_BYTES[s.model_dtype], cfg.hidden_size, resolve_flags(s.recompute)
    blk = "block" not in rc
    terms = [ActTerm("input", E * C, True, "block input (residual stream)"),
             ActTerm("ln1", _norm_bytes(C, E) + E * C, "norm" not in rc and "att" not in rc,
                     "RMSNorm-1 state + output (the mixer's input)")]
    if cfg.is_linear(layer):
        H, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        vd, cd = cfg.linear_value_dim, cfg.conv_dim
        terms += [
            ActTerm("in_proj", E * (cfg.in_proj_dim + 4 * cd) + 4 * cd + 12 * H, "qkv" not in rc,
                    "fused projection output, conv input/output, gates b, a (fp32)"),
            ActTerm("delta_rule", 4 * (2 * H * dk + 2 * H * dk + 2 * vd) + 4 * H * (3 * CHUNK + 2 * dv + 8 * dk + 4)
                    + 4 * H * dk * dv // CHUNK, "att" not in rc, "delta rule (twin): q, k normalised + repeated, "
                    "v, chunk buffers, chunk states"),
            ActTerm("gated_norm", E * vd + 4 * vd * 3 + E * vd, blk, "gated RMSNorm state + output projection input"),
        ]
        if s.documents:
            terms += document_terms(cfg, rc)
    else:
        q, kv, nh = cfg.q_dim, cfg.kv_dim, cfg.num_attention_heads
        terms += [
            ActTerm("qkv", E * (cfg.attn_qkv_dim + 2 * (q + kv)) + 4 * (q + kv) * 2, "qkv" not in rc,
                    "fused projection output, q/k norm state, q, k after RoPE"),
            ActTerm("attention", E * q + 4 * nh, "att" not in rc, "SDPA output + log-sum-exp"),
            ActTerm("gate", 2 * E * q, blk, "sigmoid(gate), gated output (o projection input)"),
        ]
    terms += [ActTerm("res_att", E * C, blk, "residual after the mixer"),
              ActTerm("ln2", _norm_bytes(C, E) + E * C, "norm" not in rc and "ffn" not in rc,
                      "RMSNorm-2 state + output (the MLP input)")]
    if cfg.is_moe_layer(layer):
        k, Fm, Fs = cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        terms.append(ActTerm("moe", E * k * (C + 2 * Fm + 2 * Fm + C) + 4 * cfg.num_experts + 16 * k
                             + E * (2 * Fs + 2 * Fs + 2), blk, "MoE (model/moe.py) + shared expert"))
    else:
        F = cfg.intermediate_size
        terms += [ActTerm("mlp_up", 2 * F * E, "ffn" not in rc, "fused up/gate output"),
                  ActTerm("swiglu", 2 * F * E, "swiglu" not in rc, "silu(gate), SwiGLU output")]
    return terms


def document_terms(cfg: Qwen35Config, rc: frozenset[str]) -> list[ActTerm]:
    """What a linear-attention layer keeps besides with --document-masking (module docstring), per token: the
    convolution's K - 1 'no reset within the tap' masks (bool, step qkv); the delta rule's same-document mask of each
    chunk (C x C bool per C tokens: C bytes a token, broadcast over the heads), its two per-position masks (which
    document reads the old state, which writes the next: bool) and the two per-head fp32 decays those masks multiply
    (kept because the product needs them), step attention."""
    H = cfg.linear_num_value_heads
    return [ActTerm("conv_documents", cfg.linear_conv_kernel_dim - 1, "qkv" not in rc, "convolution's document masks"),
            ActTerm("delta_rule_documents", CHUNK + 2 + 2 * 4 * H, "att" not in rc,
                    "delta rule's per-chunk document masks and masked decays")]


def backward_temporaries(cfg: Qwen35Config, layer: int, tokens: int, s: ActivationSettings) -> int:
    """The largest saved tensors come back as gradients: the MLP's and the mixer's widest, in the model dtype, plus the
    delta rule's fp32 chunk gradients (as large as its kept buffers) on linear-attention layers."""
    E = DTYPE_BYTES[s.model_dtype]
    mlp = 2 * (cfg.moe_intermediate_size * cfg.num_experts_per_tok if cfg.is_moe_layer(layer) else
               cfg.intermediate_size)
    mixer = cfg.in_proj_dim if cfg.is_linear(layer) else cfg.attn_qkv_dim
    delta = 0
    if cfg.is_linear(layer):
        delta = next(t.per_token for t in activation_terms(cfg, layer, s) if t.name == "delta_rule")
    return int(tokens * (E * (mlp + mixer + 2 * cfg.hidden_size) + delta))
