"""What a Qwen3.5 block keeps for backward (eager; a compiled block on the GPU's path: compiled_memory.py), per token
and layer kind: the memory plan's statements (model/activations.py sums them), op by op, on the path the run takes:
the twins (the CPU), or on CUDA the convolution and the delta rule as their op pairs
(`ActivationSettings.delta_rule_kernels`, from `kernels.delta_rule.op_pairs_on`).
tests/model/test_qwen3_5.py checks the twins' sum against what autograd saves (saved-tensor hooks) for a full
fine-tune, tests/plan/test_lora_activations.py over a frozen base (LoRA: `ActivationSettings.frozen_base`: the norms'
frozen gains keep no normalized value, a frozen linear keeps its input only for an adapter that reads it,
`adapter_inputs`), tests/model/test_qwen3_5_op_memory.py the op pairs' (forced on the CPU, and against the CUDA
allocator), fp32 and bf16, at sequence lengths that are multiples of the delta rule's chunk (a padded last chunk keeps
its padding too). The recompute switches drop the terms of the steps they rerun.

The zero-centred RMSNorms (`layers.rms_norm_zero_centered`) keep the fp32 copy of a bf16 input (in fp32 the input
itself: the block input, or the residual after the mixer), rstd, the normalized fp32 value where the gain learns, and
per layer the fp32 gain 1 + w. In fp32 several ops keep views of one tensor, counted once: the full-attention
projection's output (q, k normalized from it, v given to SDPA), the linear-attention projection's (z for the gate's
SiLU) and the convolution's output (v in the delta rule).

Gated DeltaNet's delta rule (the twin's chunked form, `kernels/delta_rule/gated_delta_rule.py`: `chunked_form`
around `chunk_core`, C = 64, n = T / C chunks; H value heads of dv, Hk key heads of dk, in fp32), per token: q and k
repeated to the H heads and normalized (input and rstd each), k normalized, q scaled, k beta, W, the bmm copies of
k beta, k^T (twice), q and q decayed (eleven (H, dk)); v, U and the stacked corrections V' (three (H, dv)); five
(C, C) per head (k beta k^T, the decay D, A, q k^T, QK); the decays exp(G) and the keys' decay to the chunk's end
(H each; bf16: beta's fp32 copy too) and each chunk's last; the chunk states S_0 .. S_{n-1} twice (the recurrence's
in `chunk_states` and their stack for the read-out: 2 H dk dv per C tokens); for every chunk but a sequence's last
(whose state update nothing reads) the bmm copy of k decayed transposed and its own V' (H dk + H dv); per layer the
(C, C) causal mask (with documents the chunks' own masks replace it). With documents (--document-masking) a
linear-attention layer also keeps their masks (`document_terms`): C bytes a token for the chunks' (C, C)
same-document masks, 2 for two bool per-position masks, 8 H for the two masked fp32 decays, 1 / C for the chunks' bool
'no reset' flags (and 4 H / C for the masked decay across a chunk in sequences of more than two chunks), K - 1 for the
convolution's tap masks.

The op pairs (gated_delta_rule_op.py, causal_conv1d.py; docs/gated-delta-rule.md) keep only their inputs and
recompute the rest in backward. The convolution's keeps its input, a view of the projection's output (E in_proj_dim
a token; in fp32 z's SiLU keeps that storage already) instead of its fp32 SiLU input, padded input and weight copy.
Around `chunk_core_op` autograd keeps the preparation's saved tensors (q and k repeated to the H heads as the L2 norm's
input, its rstd each) and the op's inputs: q scaled, k normalized, v (fp32: the convolution's output, a view), g,
beta (bf16: its fp32 copy; fp32: sigmoid(b)'s own): four (H, dk) (fp32 with H == Hk: two, the norm's inputs being
views of the convolution's output), one (H, dv), three or four H, no per-layer mask.
With documents the convolution's op keeps the resets (1 byte a token), the delta rule's the per-position document
counts d (int64, 8). The backward's workspace recomputes the twin's chunk buffers: `backward_temporaries` states the
twin's either way.
"""
from __future__ import annotations

from dataclasses import replace

from qtrain.kernels.delta_rule import CHUNK
from qtrain.kernels.gated_mlp import backward_weight_temporaries
from qtrain.kernels.swiglu.activation import saved_bytes_per_token as swiglu_saved_bytes
from qtrain.model.family import DTYPE_BYTES, ActivationSettings, ActTerm
from qtrain.model.moe import EXPERTS_DOWN, EXPERTS_UP_GATE
from qtrain.model.moe_block import expert_rows
from qtrain.model.qwen3_5 import compiled_memory
from qtrain.model.qwen3_5.config import Qwen35Config
from qtrain.model.recompute import resolve_flags


def _norm(C: int, E: int, s: ActivationSettings, *, copies: bool = True) -> tuple[int, int]:
    """A zero-centred RMSNorm over C: (per token: its fp32 copy of a bf16 input when `copies`, rstd, the normalized
    value where its gain learns; per layer: the fp32 gain 1 + w)."""
    return (4 * C if copies and E != 4 else 0) + 4 + (0 if s.frozen_base else 4 * C), 4 * C


def activation_terms(cfg: Qwen35Config, layer: int, s: ActivationSettings) -> list[ActTerm]:
    """The layer's statements: a compiled block's on the GPU's path (compiled_memory.py), else the eager block's."""
    if compiled_memory.states(s) and not (s.fp8 and cfg.is_moe_layer(layer)):
        return compiled_memory.activation_terms(cfg, layer, s)
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
        terms += document_terms(cfg, s)
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
    f32, ops = E == 4, s.delta_rule_kernels  # fp32: q, k (H == Hk) and v are views of the convolution's output
    if ops:  # the convolution's op keeps its input, a view of the projection's output (in fp32 z's SiLU keeps it too)
        conv, conv_layer = (0 if f32 else E * cfg.in_proj_dim), 0
    else:  # SiLU's fp32 input; its fp32 padded input where its weight learns (K - 1 zero rows a sequence)
        conv = 4 * cd + (4 * cd * (1 + (K - 1) / T if T else 1) if learns else 0)
        conv_layer = 4 * cd * K if E != 4 else 0  # the weight's fp32 copy
    gates = E * H + 4 * H + (4 * H if learns else 0)  # sigmoid(b), softplus's input (and output, for A_log)
    qkv = ActTerm("in_proj", conv + gates, "qkv" not in rc,
                  ("convolution's input (the op's)" if ops else "convolution (fp32)") + ", gates b, a"
                  + (", the convolution's fp32 input" if learns and not ops else ""),
                  per_layer=conv_layer + 4 * H * (2 if learns else 1))
    # the prepared q, k, v (fp32) and beta (a view of sigmoid(b)'s in fp32)
    prepared = (4 * cd if f32 else 4 * H * dv) + 4 * 4 * H * dk - (2 * 4 * H * dk if f32 and H == Hk else 0)
    if ops:  # the op pair keeps its inputs (q scaled, k normalized, v, g, beta), the preparation its own
        delta, delta_layer = prepared + (3 + (0 if f32 else 1)) * 4 * H, 0
    else:
        but_last = 1 - CHUNK / T if T else 1  # every chunk but a sequence's last keeps k decayed^T and its V' copies
        delta = (prepared + 7 * 4 * H * dk + 4 * H * (dk + dv) * but_last + 2 * 4 * H * dv + 5 * 4 * H * CHUNK
                 + (4 + (0 if f32 else 1)) * 4 * H + 4 * H / CHUNK + 2 * 4 * H * dk * dv / CHUNK)
        delta_layer = 0 if s.documents else CHUNK * CHUNK  # the causal mask (documents: the chunks' own masks)
    gate_in = 4 * cfg.in_proj_dim if f32 else 4 * vd  # silu(z)'s input: z itself in fp32, a view of the projection
    gated = 4 * vd + 4 * H + (E * vd if learns else 0) + E * vd + 4 * vd + gate_in + (E * vd if s.lin_of("out") else 0)
    return [qkv,
            ActTerm("delta_rule", delta, "att" not in rc,
                    f"delta rule ({'its op pair' if ops else 'twin'}): module docstring", per_layer=delta_layer),
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
    """The routed experts (model/moe.py; as `moe_block.MoeBlock.saved_by_moe` states them) and the gated shared
    expert. Frozen experts keep no GEMM input (`grouped_gemm.expert_linear`). The 'up' steps (--recompute-ffn) drop
    the experts' permuted inputs and up/gate outputs and the shared expert's up/gate output, the 'swiglu' steps
    (--recompute-swiglu) both SwiGLUs' saved tensors, as for a dense MLP; the routing, the permutation and the
    experts' outputs stay (the steps' inputs, the combine's). A compiled block (where these statements stand in for
    compiled_memory.py's) keeps the experts' up/gate output under --recompute-ffn, as `saved_by_moe` measures. With
    expert parallelism the experts' inputs, up/gate and SwiGLU outputs hold the r rows a token its rank received
    (`expert_rows`, the worst case), the exchange keeps two int64 row orders, and the recomputed 'up' step (the local
    GEMM alone) keeps its input, the received rows, to rerun it; the routing and the experts' outputs stay k rows."""
    E, C, rc, learns = DTYPE_BYTES[s.model_dtype], cfg.hidden_size, resolve_flags(s.recompute), not s.frozen_base
    k, F, X, Fs = cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.num_experts, \
        cfg.shared_expert_intermediate_size
    ep, r = s.expert_parallel, expert_rows(cfg, s)
    weights = 8 * k + 4 if cfg.norm_topk_prob else 4 * k
    Ex = E if learns else 0
    # the expert GEMMs keep their inputs for the weights' gradients, or over a frozen base for the experts' adapters
    # that read them (as `MoeBlock.saved_by_moe`)
    E_up, E_down = (E if s.lin_of(m) else 0 for m in (EXPERTS_UP_GATE, EXPERTS_DOWN))
    up, glu = "ffn" not in rc, "swiglu" not in rc
    up_in = E * r * C if ep > 1 and not up else E_up * r * C
    rows = "k rows a token" if ep == 1 else f"{r} received rows a token"
    return [ActTerm("moe", 4 * X + 8 * k + weights + 4 + 16 * k + E * k * C + (16 * r if ep > 1 else 0), blk,
                    "routing, permutation, experts' outputs" + (", the exchange's row orders" if ep > 1 else ""),
                    per_layer=4 * (X // ep)),
            ActTerm("moe_up_in", up_in, blk if ep > 1 else up,
                    f"experts' permuted inputs ({rows}, where the up/gate GEMM or its adapter reads them)"),
            ActTerm("moe_up", E * r * 2 * F, blk and (up or s.compiled), f"experts' up/gate outputs ({rows})"),
            ActTerm("moe_swiglu", E_down * r * F, glu,
                    f"experts' SwiGLU outputs ({rows}, where the down GEMM or its adapter reads them)"),
            ActTerm("shared_up", 2 * Fs * E, up, "shared expert's up/gate output"),
            ActTerm("shared_swiglu", swiglu_saved_bytes(Fs, E, "autograd") + Ex * Fs, glu,
                    "shared expert's silu(gate), (down input)"),
            ActTerm("shared_expert", E + E * C, blk, "shared expert's gate and output")]


def document_terms(cfg: Qwen35Config, s: ActivationSettings) -> list[ActTerm]:
    """What a linear-attention layer keeps besides with --document-masking (module docstring), per token. The twins:
    the convolution's K - 1 'no reset within the tap' masks (bool, step qkv); the delta rule's same-document mask of
    each chunk (C x C bool per C tokens: C bytes a token, broadcast over the heads), its two per-position masks (which
    document reads the old state, which writes the next: bool) and the two per-head fp32 decays those masks multiply
    (kept because the product needs them), each chunk's bool 'no reset in it' flag and, for sequences of more than two
    chunks, the masked per-head decay across it (read where a learning state decays), step attention. The op pairs:
    the resets (bool) the convolution's keeps, the per-position document counts (int64) the delta rule's keeps."""
    H, rc, C, T = cfg.linear_num_value_heads, resolve_flags(s.recompute), CHUNK, s.seq_len
    if s.delta_rule_kernels:
        conv, delta = 1, 8
    else:
        later_decays = 4 * H / C if not T or T > 2 * C else 0
        conv, delta = cfg.linear_conv_kernel_dim - 1, C + 2 + 2 * 4 * H + 1 / C + later_decays
    return [ActTerm("conv_documents", conv, "qkv" not in rc, "convolution's document masks"),
            ActTerm("delta_rule_documents", delta, "att" not in rc,
                    "delta rule's document masks" + ("" if s.delta_rule_kernels else " and masked decays"))]


def backward_temporaries(cfg: Qwen35Config, layer: int, tokens: int, s: ActivationSettings) -> int:
    """The largest saved tensors come back as gradients: the MLP's and the mixer's widest, in the model dtype, plus the
    delta rule's fp32 chunk gradients on linear-attention layers (as large as the twin's kept buffers, which the op
    pair's backward recomputes: the twin's statement on either path)."""
    E = DTYPE_BYTES[s.model_dtype]
    mlp = 2 * (cfg.moe_intermediate_size * expert_rows(cfg, s) if cfg.is_moe_layer(layer) else  # received rows
               cfg.intermediate_size)
    mixer = cfg.in_proj_dim if cfg.is_linear(layer) else cfg.attn_qkv_dim
    delta = 0
    if cfg.is_linear(layer):
        twin = replace(s, delta_rule_kernels=False)
        delta = next(t.per_token for t in activation_terms(cfg, layer, twin) if t.name == "delta_rule")
    epilogue = backward_weight_temporaries(cfg.hidden_size, cfg.intermediate_size, E) \
        if s.swiglu_epilogue and not cfg.is_moe_layer(layer) else 0  # --swiglu-epilogue's weight gradient copy
    return int(tokens * (E * (mlp + mixer + 2 * cfg.hidden_size) + delta)) + epilogue
