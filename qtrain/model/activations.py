"""What a decoder block keeps for backward and what a micro-step needs besides, stated per token from the ops of
`transformer.make_block_fn` / `Transformer.forward_backward` without running them: the activation and workspace
rows of the memory plan (`plan/memory.py`; docs/memory.md).

    terms = activation_terms(cfg, model_dtype="bf16", compiled=True, recompute=resolve_flags({"ffn"}))
    acts = activation_memory(cfg, tokens=B * T, model_dtype="bf16", compiled=True)  # .device, .host
    phases = workspace_phases(cfg, tokens=B * T, model_dtype="bf16", cuda=True)    # lm_head, block_backward, ...

Two tables: eager blocks (measured exactly on CPU with saved-tensor hooks) and torch.compile'd blocks
(AOTAutograd's min-cut partitioner saves fewer tensors: it recomputes the cheap element-wise ops; measured
with the same partitioner on CPU). The recompute switches drop terms as llm.q's flags do (§4.5); `block` keeps
only each block's input. tests/model/test_activations.py and tests/plan/test_memory.py check them against what
autograd saves and what a real micro-step holds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from qtrain.model.config import ModelConfig
from qtrain.model.loss import head_workspace_bytes
from qtrain.model.recompute import resolve_flags
from qtrain.model.weights import block_shapes

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "e4m3": 1}


@dataclass(frozen=True)
class ActTerm:
    """Bytes one layer keeps for backward: `per_token` x (B*T) + `per_layer`; `kept` is False when the
    recompute switches drop it (it is rebuilt in backward instead)."""
    name: str
    per_token: float
    kept: bool = True
    what: str = ""
    per_layer: int = 0

    def nbytes(self, tokens: int) -> int:
        return int(round(self.per_token * tokens)) + self.per_layer


def activation_terms(cfg: ModelConfig, *, model_dtype: str = "bf16", matmul_dtype: str = "", compiled: bool = False,
                     recompute: frozenset[str] = frozenset(), attn_chunks: int = 1,
                     fp8_weight_copies: bool = True, fp8_keep_transposes: bool = False) -> list[ActTerm]:
    """What autograd keeps per layer for backward, term by term, for the ops of `transformer.make_block_fn`
    and its recompute steps (ln1, qkv [+ qk-norm + RoPE], attention, ln2, up, swiglu).

    Eager (exact; tests measure it): RMSNorm keeps its fp32 upcast of a bf16 input, rstd and the
    normalized value, and the next linear keeps the gain product (its input); SDPA keeps q and k after
    RoPE, v (copied out of the fused QKV buffer, which is then freed, except under an fp32 qk-norm that saves
    views of it), its output and the log-sum-exp (B, nh, T) fp32; SwiGLU
    keeps the up/gate output, silu(gate), and the down linear keeps the product. A recomputed step drops
    what it saved and its result where later ops save it; its inputs stay (recompute.Recomputer).

    Compiled (torch.compile; measured with AOTAutograd's min-cut partitioner, the one inductor uses): the
    norm outputs + rstd, v (the fused QKV buffer with qk-norm), q/k after RoPE, attention output + LSE, the
    residual after attention, the up/gate and SwiGLU outputs -- llm.q's set (§4.5) with its in-place RoPE'd
    QKV. Recomputed steps are checkpoint regions whose inputs stay: LN1's output with --recompute-qkv/att,
    and --recompute-ffn keeps one more (B, T, C) tensor than its steps' inputs.

    FP8 (--matmul-dtype e4m3): each linear keeps an e4m3 copy of its input instead of the model-dtype one,
    and its e4m3 weight (per layer; rebuilt when the linear is inside a recomputed step) -- unless
    `fp8_weight_copies` is False (--persistent-quants): then the weight it keeps is a view of the gathered
    e4m3 block, which `ShardedWeights.saving()` keeps as a handle (the bytes are the plan's fp8 weights
    row). Compiled, the partitioner rebuilds the e4m3 copies of the two norm outputs (and of the attention output
    with --recompute-att) from what it keeps instead; the terms are then what it keeps for the compiled GPU path,
    whose MLP is one FP8 Function (`numerics.fp8.fp8_swiglu_mlp`), measured on the CPU term for term. With
    `fp8_keep_transposes` (--fp8-keep-transposes) a compiled block keeps, as eager does, the e4m3 copies (their
    transposes) of the two norm outputs; the attention and SwiGLU outputs' copies it keeps anyway, except where a
    recomputed step rebuilds them (`transformer.REBUILT_BY`: those linears do not keep theirs)."""
    E = DTYPE_BYTES[model_dtype]
    fp8 = (matmul_dtype or model_dtype) == "e4m3"
    rc = resolve_flags(recompute)  # `block` implies every other switch: only the block input stays
    up = 4 if E != 4 else 0  # fp32 copies that eager RMSNorm makes of a bf16 input (none for fp32)
    C, Fi, q, kv, qkv = cfg.hidden_size, cfg.intermediate_size, cfg.q_dim, cfg.kv_dim, cfg.qkv_dim
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    lin = 0 if fp8 else E  # bytes/element of a linear input the linear saves (fp8: an e4m3 copy instead)
    f8 = 1 if fp8 else 0
    chunked = attn_chunks > 1 and not fp8  # SDPA slices' outputs + their concatenation (the projection input)
    blk = "block" not in rc
    T = ActTerm

    # e4m3 copies of the linears' inputs: compiled, the partitioner rebuilds those it can (not the opaque op's)
    kt = compiled and fp8 and fp8_keep_transposes
    f8_norm_out = f8 if (kt or not compiled) else 0  # the two norm outputs (the QKV and MLP-up inputs)

    def qkv_term(fused_kept: bool) -> ActTerm:
        """v, which SDPA saves, is copied out of the fused QKV output (transformer.qkv_rope), so the fused buffer
        (pre-RoPE q and k) is freed after RoPE unless something else saves views of it."""
        if fused_kept:  # the qk-norm's backward keeps the buffer (compiled, or eager fp32), and SDPA the copy of v
            what, per_token = "fused QKV output + v copied out of it", E * (qkv + kv)
        else:
            what, per_token = "v, copied out of the fused QKV output (SDPA input)", E * kv
        return T("qkv", per_token + f8_norm_out * C, "qkv" not in rc,
                 what + (" + e4m3 copy of the QKV input" if f8_norm_out else ""))
    t = [T("input", E * C, True, "block input (residual stream)")]
    if compiled:
        t += [T("ln1", 4, not ("norm" in rc or "att" in rc), "RMSNorm-1 rstd"),
              # e4m3: the partitioner rebuilds LN1's output from the residual and rstd where rstd is kept; where LN1
              # is recomputed itself (--recompute-att, --recompute-norm) the output, the QKV region's input, is kept
              T("ln1_out", E * C if (not fp8 or "att" in rc or "norm" in rc) else 0, blk and ("qkv" in rc or "norm" not in rc),
                "RMSNorm-1 output" + (" (input of the recomputed QKV step)" if "qkv" in rc else "")),
              qkv_term(cfg.qk_norm)]  # the partitioner keeps the fused buffer for the compiled qk-norm's backward
        if cfg.qk_norm:
            t.append(T("qk_norm", 4 * (nh + nkv), "qkv" not in rc, "q/k RMSNorm rstd"))
        t.append(T("rope", E * (q + kv), blk and "qkv" not in rc, "q, k after RoPE (SDPA inputs)"))
    else:
        # e4m3 with --recompute-qkv: the recomputed step keeps its input, the model-dtype output, not an e4m3 copy
        t += [T("ln1", up * C + 4 + E * C + (E if fp8 and "qkv" in rc else lin) * C, not ("norm" in rc or "att" in rc),
                "RMSNorm-1 fp32 copy, rstd, normalized, output"),
              qkv_term(cfg.qk_norm and up == 0)]  # fp32 qk-norm saves its input: views of the fused buffer
        if cfg.qk_norm:
            t.append(T("qk_norm", up * (q + kv) + 4 * (nh + nkv) + E * (q + kv), "qkv" not in rc, "q/k RMSNorm state"))
        t.append(T("rope", E * (q + kv), "qkv" not in rc, "q, k after RoPE (SDPA inputs)"))
    t.append(T("attention", E * q + 4 * nh + (E * q if chunked else 0), "att" not in rc,
               "SDPA output + log-sum-exp (fp32)" + (" + concatenated slices" if chunked else "")))
    if fp8:  # compiled with --recompute-att the partitioner rebuilds it with the attention output
        t.append(T("o_in_fp8", q, blk and not (compiled and "att" in rc), "e4m3 copy of the attention projection's input"))
    ln2_dropped = "norm" in rc or "ffn" in rc
    if compiled:
        t += [T("res_att", E * C, blk, "residual after attention"),
              T("ffn_extra", E * C, blk and "ffn" in rc, "kept by the partitioner with --recompute-ffn"),
              T("ln2", 4 + (0 if fp8 else E * C), not ln2_dropped, "RMSNorm-2 rstd + output"),
              T("mlp_up", 2 * Fi * E + f8_norm_out * C, "ffn" not in rc,
                "fused up/gate output (B, T, 2F)" + (" + e4m3 copy of the MLP input" if f8_norm_out else "")),
              T("swiglu", 0 if fp8 else E * Fi, "swiglu" not in rc, "SwiGLU output")]
    else:
        # eager RMSNorm-2 keeps an fp32 copy of the residual; when it is recomputed the residual itself stays
        res = E * C if (ln2_dropped or E == 4) else 4 * C
        t += [T("res_att", res, blk,
                "residual after attention" + ("" if res == E * C else " (as RMSNorm-2's fp32 copy)")),
              T("ln2", 4 + E * C + lin * C, not ln2_dropped, "RMSNorm-2 rstd, normalized, output"),
              T("mlp_up", 2 * Fi * E + f8_norm_out * C, "ffn" not in rc, "fused up/gate output (B, T, 2F)"),
              T("swiglu", E * Fi + lin * Fi, "swiglu" not in rc, "silu(gate), SwiGLU output")]
    if fp8:  # each linear keeps its e4m3 weight and two scales; those inside a recomputed step are rebuilt
        w8 = 1 if fp8_weight_copies else 0  # persistent quants: views of the gathered e4m3 block, not copies
        # compiled, with SwiGLU recomputed, the partitioner recomputes its e4m3 copy too (the quantization is
        # traceable): measured on the CPU (AOT's partitioner) and on the H200 (14B e4m3, session 11)
        t += [T("down_in_fp8", Fi, blk and not (compiled and "swiglu" in rc), "e4m3 copy of the down projection's input"),
              T("fp8_w_qkv", 0, "qkv" not in rc, "e4m3 QKV weight", per_layer=w8 * (C * qkv + 8)),
              T("fp8_w_o", 0, blk, "e4m3 attention-projection weight", per_layer=w8 * (q * C + 8)),
              T("fp8_w_up", 0, "ffn" not in rc, "e4m3 up/gate weight", per_layer=w8 * (2 * Fi * C + 8)),
              T("fp8_w_down", 0, blk, "e4m3 down weight", per_layer=w8 * (Fi * C + 8))]
    return t


def layer_activation_bytes(cfg: ModelConfig, tokens: int, **kw: Any) -> int:
    """Bytes one layer keeps for backward besides its input (`activation_terms` kwargs)."""
    return sum(a.nbytes(tokens) for a in activation_terms(cfg, **kw) if a.kept and a.name != "input")


@dataclass(frozen=True)
class Activations:
    """What one micro-step keeps for backward on a rank: `per_layer` bytes of each layer's saved tensors, each
    block's `input` (the residual stream), and the last block's output (alive until the LM head has run). With
    `offload_residual` (--recompute-block) the block inputs wait in host memory and two are on the device:
    the one in use and the prefetched one (`recompute.ResidualStash`)."""
    layers: int
    per_layer: int
    input: int
    offload_residual: bool
    terms: tuple[ActTerm, ...]

    @property
    def device(self) -> int:
        inputs = 2 * self.input if self.offload_residual else self.layers * self.input
        return self.layers * self.per_layer + inputs + self.input

    @property
    def host(self) -> int:
        return self.layers * self.input if self.offload_residual else 0


def activation_memory(cfg: ModelConfig, tokens: int, *, model_dtype: str = "bf16", offload_residual: bool = False,
                      **kw: Any) -> Activations:
    """The activations of a micro-step of `tokens` tokens (`activation_terms` kwargs; `offload_residual` only
    counts with the `block` switch)."""
    terms = tuple(activation_terms(cfg, model_dtype=model_dtype, **kw))
    per_layer = sum(a.nbytes(tokens) for a in terms if a.kept and a.name != "input")
    offload = offload_residual and "block" in resolve_flags(kw.get("recompute", ()))
    return Activations(cfg.num_hidden_layers, per_layer, tokens * cfg.hidden_size * DTYPE_BYTES[model_dtype],
                       offload, terms)


def workspace_phases(cfg: ModelConfig, tokens: int, *, model_dtype: str = "bf16", lmhead_chunks: int = 1,
                     cuda: bool = True, fp8_head_backward: bool = False, **kw: Any) -> dict[str, int]:
    """Transient bytes of a micro-step's phases beyond the activations (`activation_terms` kwargs), estimates
    checked against a CPU allocation tracker and the H200's peaks:
      lm_head             the final RMSNorm (eager: fp32 copy, normalized value, output, rstd) and the chunked
                          head and loss (`loss.head_workspace_bytes`, with --fp8-head-backward's operands);
      block_backward      one block's backward: d(input) and the incoming d(output), fresh weight gradients,
                          activation-gradient temporaries (the largest saved tensors come back as gradients),
                          the tied head's gradient (kept for the embedding), and the recomputed steps' saved
                          tensors (with `block`: the block's whole saved set);
      embedding_backward  d(input), the dense embedding gradient (+ the tied head's), fp32 row sums."""
    E = DTYPE_BYTES[model_dtype]
    N, C, V = tokens, cfg.hidden_size, cfg.vocab_size
    rc = resolve_flags(kw.pop("recompute", ()))
    attn_chunks = kw.get("attn_chunks", 1)
    up = 4 if E != 4 else 0
    tied = cfg.tie_word_embeddings
    inp = N * C * E
    head = N * ((up + 2 * E) * C + 4) + head_workspace_bytes(N, C, V, dtype_bytes=E, chunks=lmhead_chunks, cuda=cuda,
                                                             fp8_backward=fp8_head_backward)
    full_block = layer_activation_bytes(cfg, N, model_dtype=model_dtype, **kw)
    block_numel = sum(math.prod(s) for s in block_shapes(cfg).values()) if cfg.num_hidden_layers else 0
    grad_tmp = N * (E * (cfg.intermediate_size + 2 * C) + 4 * cfg.q_dim // attn_chunks)  # CPU-measured bound
    bwd = 2 * inp + block_numel * E + grad_tmp + (V * C * E if tied else 0)
    if "block" in rc:
        bwd += full_block
    elif rc:  # the dropped steps of one layer are rebuilt
        bwd += full_block - layer_activation_bytes(cfg, N, model_dtype=model_dtype, recompute=rc, **kw)
    embed = inp + V * C * E * (2 if tied else 1) + N * C * 4
    return {"lm_head": head, "block_backward": bwd, "embedding_backward": embed}
