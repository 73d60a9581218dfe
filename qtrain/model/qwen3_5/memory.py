"""What a Qwen3.5 block keeps for backward (eager, the CPU and the twins), per token and layer kind: the memory
plan's statements (model/activations.py sums them), op by op. tests/model/test_qwen3_5.py checks the sum against what
autograd saves (saved-tensor hooks) for a full fine-tune, tests/plan/test_lora_activations.py over a frozen base
(LoRA: `ActivationSettings.frozen_base`: the norms' frozen gains keep no normalized value, a frozen linear keeps its
input only for an adapter that reads it, `adapter_inputs`), fp32 and bf16, at sequence lengths that are multiples of
the delta rule's chunk (a padded last chunk keeps its padding too). The recompute switches drop the terms of the steps
they rerun. The GPU check against allocations waits for the Triton delta rule, whose chunk buffers differ from the
twin's.

The zero-centred RMSNorms (`layers.rms_norm_zero_centered`) keep the fp32 copy of a bf16 input (in fp32 the input
itself: the block input, or the residual after the mixer), rstd, the normalized fp32 value where the gain learns, and
per layer the fp32 gain 1 + w. In fp32 several ops keep views of one tensor, counted once: the full-attention
projection's output (q, k normalized from it, v given to SDPA), the linear-attention projection's (z for the gate's
SiLU) and the convolution's output (v in the delta rule).

Gated DeltaNet's delta rule (the twin's chunked form, `kernels/delta_rule/gated_delta_rule.py`, C = 64, n = T / C
chunks; H value heads of dv, Hk key heads of dk, in fp32), per token: q and k repeated to the H heads and normalized
(input and rstd each), the bmm copies of q, k^T (twice) and k beta, k normalized, q scaled, k beta, W (ten (H, dk)),
v, U and the chunks' v_new (three (H, dv)), five (C, C) per head (q k^T, k beta k^T, the decay D, A and QK), the
decays (G, the tail decay, beta: H each, and each chunk's last), the chunk states S_0 .. S_{n-1} (H dk dv per C
tokens), and for every chunk but the first of a sequence the copies of q decayed and of k decayed transposed; per
layer the (C, C) causal mask. A fused kernel keeps far less (fla-core keeps q, k, v, g, beta and the chunk states,
recomputing the rest).
With --document-masking a linear-attention layer also keeps its documents' masks (`document_terms`): C bytes a token
for the chunks' (C, C) same-document masks, 2 for two bool per-position masks, 8 H for the two masked fp32 decays,
K - 1 for the convolution's.
"""
from __future__ import annotations

from qtrain.kernels.delta_rule import CHUNK
from qtrain.kernels.swiglu.activation import saved_bytes_per_token as swiglu_saved_bytes
from qtrain.model.family import DTYPE_BYTES, ActivationSettings, ActTerm
from qtrain.model.qwen3_5.config import Qwen35Config
from qtrain.model.recompute import resolve_flags


def _norm(C: int, E: int, s: ActivationSettings, *, copies: bool = True) -> tuple[int, int]:
    """A zero-centred RMSNorm over C: (per token: its fp32 copy of a bf16 input when `copies`, rstd, the normalized
    value where its gain learns; per layer: the fp32 gain 1 + w)."""
    return (4 * C if copies and E != 4 else 0) + 4 + (0 if s.frozen_base else 4 * C), 4 * C


def activation_terms(cfg: Qwen35Config, layer: int, s: ActivationSettings) -> list[ActTerm]:
    E, C, rc = DTYPE_BYTES[s.model_dtype], cfg.hidden_size, resolve_flags(s.recompute)
    blk, learns = "block" not in rc, not s.frozen_base
    mixer_in = "in_proj" if cfg.is_linear(layer) else "qkv"
    ln1, ln1_layer = _norm(C, E, s)
    kept_in = E if ("qkv" in rc or s.lin_of(mixer_in)) else 0  # the mixer's input: its linear's or its step's
    terms = [ActTerm("input", E * C, True, "block input (residual stream)"),
             ActTerm("ln1", ln1 + kept_in * C, "norm" not in rc and "att" not in rc,
                     "RMSNorm-1 state + output (the mixer's input)", per_layer=ln1_layer)]
    terms += linear_attention_terms(cfg, s) if cfg.is_linear(layer) else full_attention_terms(cfg, s)
    if s.documents and cfg.is_linear(layer):
        terms += document_terms(cfg, rc)
    dropped = "norm" in rc or "ffn" in rc
    ln2, ln2_layer = _norm(C, E, s, copies=False)
    res = E * C if (dropped or E == 4) else 4 * C  # RMSNorm-2's fp32 input (a bf16 residual's fp32 copy)
    terms += [ActTerm("res_att", res, blk, "residual after the mixer (as RMSNorm-2's fp32 input)")]
    if cfg.is_moe_layer(layer):
        terms += [ActTerm("ln2", ln2 + (E * C if learns else 0), not dropped,
                          "RMSNorm-2 state + output (the router's and the shared expert's input)", per_layer=ln2_layer),
                  *moe_terms(cfg, s, blk)]
    else:
        F = cfg.intermediate_size
        terms += [ActTerm("ln2", ln2 + (E * C if s.lin_of("up") else 0), not dropped,
                          "RMSNorm-2 state + output (the MLP input)", per_layer=ln2_layer),
                  ActTerm("mlp_up", 2 * F * E, "ffn" not in rc, "fused up/gate output"),
                  ActTerm("swiglu", swiglu_saved_bytes(F, E, "autograd") + (E * F if s.lin_of("down") else 0),
                          "swiglu" not in rc, "silu(gate), SwiGLU output (the down projection's input)")]
    return terms


def linear_attention_terms(cfg: Qwen35Config, s: ActivationSettings) -> list[ActTerm]:
    """Gated DeltaNet (linear_attention.py): step qkv (projection, convolution, gates), step attention (the delta
    rule: module docstring), then the gated RMSNorm and the output projection."""
    E, rc, learns = DTYPE_BYTES[s.model_dtype], resolve_flags(s.recompute), not s.frozen_base
    H, Hk, dk, dv = cfg.linear_num_value_heads, cfg.linear_num_key_heads, cfg.linear_key_head_dim, \
        cfg.linear_value_head_dim
    vd, cd, K, T = cfg.linear_value_dim, cfg.conv_dim, cfg.linear_conv_kernel_dim, s.seq_len
    # the convolution: SiLU's fp32 input; its fp32 padded input where its weight learns (K - 1 zero rows a sequence)
    conv = 4 * cd + (4 * cd * (1 + (K - 1) / T if T else 1) if learns else 0)
    gates = E * H + 4 * H + (4 * H if learns else 0)  # sigmoid(b), softplus's input (and output, for A_log)
    qkv = ActTerm("in_proj", conv + gates, "qkv" not in rc,
                  "convolution (fp32), gates b, a" + (", the convolution's fp32 input" if learns else ""),
                  per_layer=(4 * cd * K if E != 4 else 0) + 4 * H * (2 if learns else 1))
    f32 = E == 4  # fp32: q, k (with H == Hk) and v are views of the convolution's output, beta of sigmoid(b)'s
    dk_bufs = 10 * 4 * H * dk - (2 * 4 * H * dk if f32 and H == Hk else 0)
    later_chunks = 1 - CHUNK / T if T else 1  # every chunk but a sequence's first keeps q, k decayed copies
    delta = (dk_bufs + 2 * 4 * H * dk * later_chunks + (4 * cd if f32 else 4 * H * dv) + 2 * 4 * H * dv
             + 5 * 4 * H * CHUNK + (4 + (0 if f32 else 1)) * 4 * H + 4 * H / CHUNK + 4 * H * dk * dv / CHUNK)
    gate_in = 4 * cfg.in_proj_dim if f32 else 4 * vd  # silu(z)'s input: z itself in fp32, a view of the projection
    gated = 4 * vd + 4 * H + (E * vd if learns else 0) + E * vd + 4 * vd + gate_in + (E * vd if s.lin_of("out") else 0)
    return [qkv,
            ActTerm("delta_rule", delta, "att" not in rc, "delta rule (twin): module docstring",
                    per_layer=CHUNK * CHUNK),
            ActTerm("gated_norm", gated, "block" not in rc, "gated RMSNorm (fp32 o, rstd, gate) + output projection "
                    "input")]


def full_attention_terms(cfg: Qwen35Config, s: ActivationSettings) -> list[ActTerm]:
    """Gated full attention (block.py): step qkv (projection, q/k norms, RoPE), step attention (SDPA), the gate and
    the output projection."""
    E, rc = DTYPE_BYTES[s.model_dtype], resolve_flags(s.recompute)
    q, kv, nh, nkv, hs = cfg.q_dim, cfg.kv_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    norms = (4 * (q + kv) if E != 4 else 0) + 4 * (nh + nkv) + (0 if s.frozen_base else 4 * (q + kv))
    return [ActTerm("qkv", E * cfg.attn_qkv_dim + norms + E * (q + kv), "qkv" not in rc,
                    "fused projection output (v's, SDPA's), q/k norm state, q, k after RoPE", per_layer=2 * 4 * hs),
            ActTerm("attention", E * q + 4 * nh, "att" not in rc, "SDPA output + log-sum-exp"),
            ActTerm("gate", E * q + (E * q if s.lin_of("o") else 0), "block" not in rc,
                    "sigmoid(gate), gated output (o projection input)")]


def moe_terms(cfg: Qwen35Config, s: ActivationSettings, blk: bool) -> list[ActTerm]:
    """The routed experts (model/moe.py; as `moe_block.MoeBlock.saved_by_moe` states them, one step here) and the
    gated shared expert. Frozen experts keep no GEMM input (`grouped_gemm.expert_linear`)."""
    E, C, learns = DTYPE_BYTES[s.model_dtype], cfg.hidden_size, not s.frozen_base
    k, F, X, Fs = cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.num_experts, \
        cfg.shared_expert_intermediate_size
    weights = 8 * k + 4 if cfg.norm_topk_prob else 4 * k
    Ex = E if learns else 0
    routed = 4 * X + 8 * k + weights + 4 + 16 * k + E * k * (2 * F + C) + Ex * k * (C + F)
    shared = 2 * Fs * E + swiglu_saved_bytes(Fs, E, "autograd") + Ex * Fs + E + E * C
    return [ActTerm("moe", routed, blk, "routing, permutation, experts' up/gate and outputs (+ their inputs where "
                    "they learn)", per_layer=4 * X),
            ActTerm("shared_expert", shared, blk, "shared expert's up/gate, silu(gate), (down input), gate, output")]


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
