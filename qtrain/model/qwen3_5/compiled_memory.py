"""What a torch.compile'd Qwen3.5 block keeps for backward on the GPU's path (compiled blocks, the delta rule as its
op pair: `ActivationSettings.compiled` and `delta_rule_kernels`), per token and layer kind: the memory plan's
statements for those runs (memory.py states the eager blocks and dispatches here).

AOTAutograd's min-cut partitioner (inductor's) keeps fewer tensors than eager autograd: it recomputes the cheap
element-wise work in backward (the norms' fp32 copies and normalized values, SiLU and sigmoid of the gates, the fp32
gains 1 + w), keeping the norms' rstd and the inputs of the GEMMs and of the opaque ops. Inside a compiled block the
causal convolution is traced as its twin (`kernels.dispatch.use_triton` is False while compiling) and the delta rule
stays its op pair (`kernels.delta_rule.gated_delta_rule`), which keeps its inputs only. A recomputed step is a
checkpoint whose ops must be recomputed, but the partitioner keeps a step's outputs that are not views (LN1's output
under --recompute-att, LN2's under --recompute-ffn, the gates g and beta of step qkv under --recompute-att, the MoE
experts' up/gate output under --recompute-ffn, though not the shared expert's: `moe_terms`); the views a step returns
(q, k, v, z of the projection, the convolution's output) are rebuilt with it.
tests/model/test_qwen3_5_compiled_memory.py checks every term against the saved tensors of one compiled block call
(backend aot_eager_decomp_partition, the op pairs forced on the CPU), bf16 and fp32, every recompute switch, both
layer kinds, dense and MoE, and the dense layers with FP8 block linears (e4m3, with and without
--fp8-keep-transposes): exact, 0-dim scales aside.

Not stated here (memory.py's eager statements stand in, above what a compiled block keeps): MoE layers with FP8
linears (the shared expert's are FP8 too), a frozen base (LoRA), --document-masking, and the twins' delta rule (the
CPU, heads the Triton kernels do not serve), whose chunk loop a compiled block unrolls.
"""
from __future__ import annotations

from qtrain.model.family import DTYPE_BYTES, ActivationSettings, ActTerm
from qtrain.model.qwen3_5.config import Qwen35Config
from qtrain.model.recompute import resolve_flags


def states(s: ActivationSettings) -> bool:
    """Whether these statements describe the run's blocks (module docstring)."""
    return s.compiled and s.delta_rule_kernels and not (s.frozen_base or s.documents)


def activation_terms(cfg: Qwen35Config, layer: int, s: ActivationSettings) -> list[ActTerm]:
    """The layer's terms in block order. FP8 block linears (e4m3) keep e4m3 copies of their inputs, and of their
    weights per layer unless --persistent-quants holds them; the e4m3 copies of the two norms' outputs the
    partitioner rebuilds from the residual and rstd (so the outputs themselves are not kept either, unless they are a
    recomputed step's output), unless --fp8-keep-transposes makes the quantizations opaque (module docstring of
    model/llama/block.py: the same rules)."""
    E, C, rc, moe = DTYPE_BYTES[s.model_dtype], cfg.hidden_size, resolve_flags(s.recompute), cfg.is_moe_layer(layer)
    blk, fp8, kt = "block" not in rc, s.fp8, s.fp8 and s.fp8_keep_transposes
    terms = [ActTerm("input", E * C, True, "block input (residual stream)"),
             ActTerm("ln1", 4, blk and "norm" not in rc and "att" not in rc, "RMSNorm-1 rstd"),
             ActTerm("ln1_out", E * C if not fp8 or "att" in rc or "norm" in rc else 0,
                     blk and ("qkv" in rc or "norm" not in rc),
                     "RMSNorm-1 output (the projection's input; a recomputed step's output that is no view)")]
    terms += linear_attention_terms(cfg, s) if cfg.is_linear(layer) else full_attention_terms(cfg, s)
    terms += [ActTerm("res_att", E * C, blk, "the output projection's output (the residual after the mixer is "
                      "rebuilt from it and the block input)"),
              ActTerm("ln2", 4, blk and "norm" not in rc and "ffn" not in rc, "RMSNorm-2 rstd"),
              ActTerm("ln2_out", E * C if moe or not fp8 or "ffn" in rc else 0,
                      blk and ("ffn" in rc or "norm" not in rc or moe),
                      "RMSNorm-2 output (the MLP's input; the MoE's always: a graph break follows it)")]
    if moe:
        return terms + moe_terms(cfg, s) + fp8_weight_terms(cfg, layer, s)
    F = cfg.intermediate_size
    return terms + [ActTerm("mlp_up", 2 * F * E + (C if kt else 0), blk and "ffn" not in rc,
                            "fused up/gate output" + (" + e4m3 copy of the MLP input" if kt else "")),
                    # with --fp8-keep-transposes the down linear keeps its e4m3 input also where SwiGLU reruns
                    # --swiglu-epilogue: the down projection's gradient GEMM rewrites the SwiGLU output
                    ActTerm("swiglu", 0 if s.swiglu_epilogue else F * (1 if fp8 else E),
                            blk and ("swiglu" not in rc or kt),
                            "SwiGLU output (the down projection's input" + (", e4m3" if fp8 else "")
                            + "; its backward kernel recomputes silu)")] + fp8_weight_terms(cfg, layer, s)


def linear_attention_terms(cfg: Qwen35Config, s: ActivationSettings) -> list[ActTerm]:
    """Gated DeltaNet: the projection's output (z and a are views of it), the convolution's fp32 padded input (its
    weight's gradient) and output (q, k, v are views of it), the gates, the delta rule's op inputs (q, k normalized,
    q scaled, fp32, repeated to the H value heads; v's fp32 copy, in fp32 a view of the convolution's output) with the
    L2 norms' rstd, its output o (the gated norm's input), and the gated norm's rstd and output."""
    E, rc = DTYPE_BYTES[s.model_dtype], resolve_flags(s.recompute)
    H, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    cd, vd, K, T = cfg.conv_dim, cfg.linear_value_dim, cfg.linear_conv_kernel_dim, s.seq_len
    f32, blk = E == 4, "block" not in rc
    padded = 4 * cd * (1 + (K - 1) / T if T else 1)  # K - 1 zero rows a sequence
    if "qkv" not in rc:  # sigmoid(b) (in bf16 also its fp32 copy, the op's beta), g, and softplus's input (fp32)
        gates = E * H + 8 * H
    elif "att" not in rc:  # beta's fp32 copy, made in step attention (in fp32 a view of step qkv's output)
        gates = 0 if f32 else 4 * H
    else:  # step qkv's outputs g and beta (not views: kept though recomputed)
        gates = E * H + 4 * H
    delta = 2 * 4 * H + 2 * 4 * H * dk + (0 if f32 else 4 * H * dv) + E * vd
    f8_in = cfg.hidden_size if s.fp8 and s.fp8_keep_transposes else 0  # the projection input's e4m3 copy
    return [ActTerm("in_proj", E * cfg.in_proj_dim + padded + E * cd + f8_in, blk and "qkv" not in rc,
                    "projection output (z, a), convolution's fp32 padded input and output (q, k, v)"
                    + (", e4m3 copy of the projection input" if f8_in else "")),
            ActTerm("gates", gates, blk, "gates beta, g (module docstring)"),
            ActTerm("delta_rule", delta, blk and "att" not in rc,
                    "delta rule's op inputs (q, k, v fp32), L2-norm rstd, output o"),
            ActTerm("gated_norm", 4 * H + (1 if s.fp8 else E) * vd, blk,
                    "gated RMSNorm rstd + output projection input" + (" (e4m3)" if s.fp8 else ""))]


def full_attention_terms(cfg: Qwen35Config, s: ActivationSettings) -> list[ActTerm]:
    """Gated full attention: the fused projection's output (the q/k norms' inputs, v and the gate are views of it),
    the norms' rstd, q and k after RoPE, SDPA's output and log-sum-exp, the attention output's (B, T, q_dim) copy for
    the gate's gradient, and the gated output (the o projection's input)."""
    E, rc = DTYPE_BYTES[s.model_dtype], resolve_flags(s.recompute)
    q, kv, nh, nkv = cfg.q_dim, cfg.kv_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    blk = "block" not in rc
    f8_in = cfg.hidden_size if s.fp8 and s.fp8_keep_transposes else 0  # the projection input's e4m3 copy
    return [ActTerm("qkv", E * cfg.attn_qkv_dim + 4 * (nh + nkv) + E * (q + kv) + f8_in, blk and "qkv" not in rc,
                    "fused projection output, q/k norm rstd, q, k after RoPE"
                    + (", e4m3 copy of the projection input" if f8_in else "")),
            ActTerm("attention", E * q + 4 * nh, blk and "att" not in rc, "SDPA output + log-sum-exp"),
            ActTerm("gate", E * q, blk and "qkv" not in rc, "attention output (B, T, q_dim), for the gate's gradient"),
            # e4m3: the partitioner rebuilds the copy from the attention output and the gate, unless
            # --fp8-keep-transposes makes the quantization opaque
            ActTerm("o_in", (q if s.fp8_keep_transposes else 0) if s.fp8 else E * q, blk,
                    "gated output (o projection input" + (", e4m3)" if s.fp8 else ")"))]


def fp8_weight_terms(cfg: Qwen35Config, layer: int, s: ActivationSettings) -> list[ActTerm]:
    """FP8: each block linear keeps its e4m3 weight and two scales (per layer), those of a recomputed step rebuilt;
    with --persistent-quants (`fp8_weight_copies` False) views of the held e4m3 weights (the plan's own row)."""
    if not s.fp8:
        return []
    rc, C, w8 = resolve_flags(s.recompute), cfg.hidden_size, 1 if s.fp8_weight_copies else 0
    blk, lin = "block" not in rc, cfg.is_linear(layer)
    mixer_in, mixer_out = (("in_proj", cfg.in_proj_dim), ("out", cfg.linear_value_dim)) if lin else \
        (("qkv", cfg.attn_qkv_dim), ("o", cfg.q_dim))
    terms = [ActTerm(f"fp8_w_{mixer_in[0]}", 0, blk and "qkv" not in rc, "e4m3 mixer input projection weight",
                     per_layer=w8 * (C * mixer_in[1] + 8)),
             ActTerm(f"fp8_w_{mixer_out[0]}", 0, blk, "e4m3 mixer output projection weight",
                     per_layer=w8 * (mixer_out[1] * C + 8))]
    if cfg.is_moe_layer(layer):  # the experts and the shared expert run in the model dtype
        return terms
    F = cfg.intermediate_size
    return terms + [ActTerm("fp8_w_up", 0, blk and "ffn" not in rc, "e4m3 up/gate weight",
                            per_layer=w8 * (2 * F * C + 8)),
                    ActTerm("fp8_w_down", 0, blk, "e4m3 down weight", per_layer=w8 * (F * C + 8))]


def moe_terms(cfg: Qwen35Config, s: ActivationSettings) -> list[ActTerm]:
    """The routed experts (as memory.moe_terms, less what the partitioner recomputes: the router's softmax from its
    model-dtype logits, the renormalised weights from the top-k ones) and the gated shared expert (its SwiGLU
    backward kernel recomputes silu). --recompute-ffn drops the experts' permuted inputs (the permutation is rerun)
    but not their up/gate output, the grouped GEMM's, which the partitioner keeps rather than rerun; the shared
    expert's up/gate output it rebuilds from the kept RMSNorm-2 output. --recompute-swiglu drops both SwiGLU outputs
    (measured, tests/model/test_qwen3_5_compiled_memory.py)."""
    E, C, rc = DTYPE_BYTES[s.model_dtype], cfg.hidden_size, resolve_flags(s.recompute)
    k, F, X, Fs = cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.num_experts, \
        cfg.shared_expert_intermediate_size
    blk, up, glu = "block" not in rc, "ffn" not in rc, "swiglu" not in rc
    routing = E * X + 8 * k + (4 * k + 4 if cfg.norm_topk_prob else 4 * k) + 16 * k + 4
    return [ActTerm("moe", routing + E * k * C, blk, "router logits, top-k ids and weights, permutation, experts' "
                    "outputs", per_layer=4 * X if blk else 0),
            ActTerm("moe_up_in", E * k * C, up, "experts' permuted inputs"),
            ActTerm("moe_up", E * k * 2 * F, blk, "experts' up/gate outputs"),
            ActTerm("moe_swiglu", E * k * F, glu, "experts' SwiGLU outputs"),
            ActTerm("shared_up", 2 * Fs * E, up, "shared expert's up/gate output"),
            ActTerm("shared_swiglu", Fs * E, glu, "shared expert's SwiGLU output"),
            ActTerm("shared_expert", E + E * C, blk, "shared expert's output and sigmoid gate")]
