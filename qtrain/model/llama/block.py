"""One Llama-family decoder block (Qwen2 / Llama 2-3 / Qwen3 dense), step by step, each step followed by what it
keeps for backward.

    RMSNorm -> fused QKV (+bias for Qwen2) -> qk-norm (Qwen3) -> RoPE -> causal SDPA (GQA) -> output projection ->
    residual -> RMSNorm -> fused up/gate -> SwiGLU -> down -> residual

`make_block_fn(cfg, options)` binds the settings (`family.BlockOptions`) into a `LlamaBlock` and returns the block
as a function of (x, weights, cos, sin[, docs]), so one compiled graph serves every layer (weights are inputs, not
captured constants); `docs` (a `DocumentMask`, --document-masking) keeps attention inside each document, and cos, sin
then come gathered at each token's position in its document. The `saved_by_*` statements beside the steps say, per token, what autograd keeps of each step for
backward, for eager and torch.compile'd blocks, every recompute setting and FP8 (`activation_terms` lists them in
block order; `model/activations.py` sums them for the memory plan). Two tables in effect: eager blocks (measured
exactly on CPU with saved-tensor hooks) and compiled ones (AOTAutograd's min-cut partitioner saves fewer tensors:
it recomputes the cheap element-wise ops; measured with the same partitioner on CPU). The recompute switches drop
terms as llm.q's flags do (§4.5); `block` keeps only each block's input. tests/model/test_activations.py and
tests/plan/test_memory.py check them against what autograd saves and what a real micro-step holds.

Dimension letters: B batch, T sequence, C hidden, F intermediate, nh / nkv query / kv heads, hs head size.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from qtrain.kernels.attention import causal_attention
from qtrain.kernels.document_attention import DocumentMask, document_attention
from qtrain.kernels.rope import qkv_rope
from qtrain.kernels.swiglu import swiglu
from qtrain.kernels.swiglu.activation import saved_bytes_per_token as swiglu_saved_bytes
from qtrain.model.family import DTYPE_BYTES, ActivationSettings, ActTerm, BlockFn, BlockOptions
from qtrain.model.layers import rms_norm, rms_norm_and_rstd, sdpa_backends
from qtrain.model.llama.config import LlamaConfig
from qtrain.model.recompute import (MLP_STEPS, CheckpointSteps, Recomputer, must_recompute_context, observe_saved,
                                    resolve_flags, run_step)
from qtrain.model.weight_source import SCALE_HINT, quantized_weight

FP8_MATRICES = ("qkv", "o", "up", "down")  # the four block linears that run in FP8 (--matmul-dtype e4m3)
# the recompute step whose rerun rebuilds a linear's input, by block matrix: the attention output and the SwiGLU
# output (the two norm outputs, in e4m3 blocks, are re-made from the residual whether or not LN is recomputed)
REBUILT_BY = {"o": "attention", "down": "swiglu"}

Prenorm = tuple[torch.Tensor, ...]
Step = Callable[..., object]  # step(name, fn, *args): runs fn(*args), keeping or recomputing its results


@dataclass(frozen=True)
class _Saved:
    """What the saved-bytes statements read: the config's sizes and the settings' consequences, derived once."""
    cfg: LlamaConfig
    s: ActivationSettings

    @property
    def E(self) -> int:  # bytes per element of the model dtype
        return DTYPE_BYTES[self.s.model_dtype]

    @property
    def rc(self) -> frozenset[str]:  # `block` implies every other switch: only the block input stays
        return resolve_flags(self.s.recompute)

    @property
    def up(self) -> int:  # fp32 copies that eager RMSNorm makes of a bf16 input (none for fp32)
        return 4 if self.E != 4 else 0

    @property
    def lin(self) -> int:  # bytes/element of a linear input the linear saves (fp8: an e4m3 copy instead)
        return 0 if self.s.fp8 else self.E

    @property
    def f8(self) -> int:
        return 1 if self.s.fp8 else 0

    @property
    def gain(self) -> int:  # bytes/element a norm's gain product keeps of the normalized value (none: a frozen gain)
        return 0 if self.s.frozen_base else self.E

    def lin_of(self, matrix: str) -> int:
        """Bytes/element of `matrix`'s input that its linear keeps in the model dtype: for the weight's gradient (`lin`)
        or, over a frozen base (LoRA), only for the adapter that reads it."""
        if matrix in self.s.adapter_inputs:
            return self.E
        return 0 if self.s.frozen_base else self.lin

    def keeps_input(self, matrix: str) -> bool:
        """Whether a compiled block keeps `matrix`'s model-dtype input: for the weight's gradient unless the linear
        is FP8 (an e4m3 copy instead); over a frozen base (LoRA) only for the adapter that reads it, FP8 or not (on an
        H100 the saved tensors of Qwen2.5-7B LoRA over an e4m3 base were those over a bf16 base, session 36)."""
        return matrix in self.s.adapter_inputs if self.s.frozen_base else not self.s.fp8

    @property
    def f8_in(self) -> int:  # an e4m3 copy of a linear's input, kept for its weight gradient (none for a frozen base)
        return 0 if self.s.frozen_base else self.f8

    @property
    def blk(self) -> bool:
        return "block" not in self.rc

    @property
    def sliced(self) -> bool:  # --mlp-chunks: the MLP's checkpointed slices keep only their input, x
        return self.s.mlp_chunks > 1

    @property
    def f8_norm_out(self) -> int:
        """e4m3 copies of the two norm outputs (the QKV and MLP-up inputs): compiled, the partitioner rebuilds them
        from what it keeps, unless they are opaque ops (--fp8-keep-transposes); none over a frozen base (no weight
        gradient)."""
        kt = self.s.compiled and self.s.fp8 and self.s.fp8_keep_transposes
        return 0 if self.s.frozen_base else self.f8 if (kt or not self.s.compiled) else 0


class LlamaBlock:
    """The block's steps with its settings bound (`make_block_fn`'s docstring in transformer.py says what each
    setting does); a plain object, whose attributes torch.compile reads as constants."""

    def __init__(self, cfg: LlamaConfig, o: BlockOptions):
        self.nh, self.nkv, self.hs = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.eps, self.q_dim, self.qk_norm, self.gqa = cfg.rms_norm_eps, cfg.q_dim, cfg.qk_norm, self.nh != self.nkv
        self.linear, self.linears, self.rebuilt_input_linear = o.linear, o.linears, o.rebuilt_input_linear
        self.swiglu_mode, self.rope_mode = o.swiglu, o.rope
        self.adapter = o.adapter
        # the one-function MLP has no seam for an adapter of up/gate/down: those run as three steps
        adapted_mlp = o.adapter is not None and o.adapter.covers("up", "down")
        # --mlp-chunks: each slice of the MLP is rerun whole in backward, so no step inside it is recomputed again
        self.mlp_chunks, self.compiled = o.mlp_chunks, o.compiled
        steps = o.recompute if o.mlp_chunks == 1 else o.recompute - MLP_STEPS
        self.fused_mlp = o.mlp if not (MLP_STEPS & steps) and not adapted_mlp else None
        self.norm_fed_fp8 = o.norm_fed_fp8 and not o.recompute  # the norms and their linears are then plain calls
        self.rebuilt = {n for n, step in REBUILT_BY.items() if step in steps}
        self.attn_chunks, self.sdpa_backend = o.attn_chunks, o.sdpa_backend
        self.context = o.context  # context parallelism: attention over the sequence's other parts too

    # ---- the block input (the residual stream) ----
    @staticmethod
    def saved_by_input(a: _Saved) -> list[ActTerm]:
        return [ActTerm("input", a.E * a.cfg.hidden_size, True, "block input (residual stream)")]

    # ---- the linears ----
    def project(self, h: torch.Tensor, w: dict[str, torch.Tensor], name: str, bias: str | None = None,
                prenorm: Prenorm | None = None) -> torch.Tensor:
        """h @ w[name]^T (+ w[bias]), with the source's FP8 copy of the weight when there is one (and the norm h
        comes from, for an FP8 linear, with norm_fed_fp8)."""
        b = w.get(bias) if bias else None
        if self.linears and name in self.linears:  # a model-dtype linear: no FP8 copy applies
            y = self.linears[name](h, w[name], b)
        else:
            fn = self.linear
            if self.rebuilt_input_linear is not None and name in self.rebuilt:
                fn = self.rebuilt_input_linear
            q = quantized_weight(w, name)
            extra = {} if prenorm is None else {"prenorm": prenorm}
            y = fn(h, w[name], b, **extra) if q is None else fn(h, w[name], b, q, **extra)
        return y if self.adapter is None else self.adapter(name, h, w, y)  # LoRA: + s B A h

    @staticmethod
    def saved_by_fp8_weights(a: _Saved) -> list[ActTerm]:
        """FP8: each linear keeps its e4m3 weight and two scales (per layer); those inside a recomputed step are
        rebuilt. With --persistent-quants (`fp8_weight_copies` False) the weight it keeps is a view of the gathered
        e4m3 block, which `ShardedWeights.saving()` keeps as a handle (the bytes are the plan's fp8 weights row)."""
        if not a.s.fp8:
            return []
        C, Fi, q, qkv, rc, blk = a.cfg.hidden_size, a.cfg.intermediate_size, a.cfg.q_dim, a.cfg.qkv_dim, a.rc, a.blk
        w8 = 1 if a.s.fp8_weight_copies else 0
        return [ActTerm("fp8_w_qkv", 0, "qkv" not in rc, "e4m3 QKV weight", per_layer=w8 * (C * qkv + 8)),
                ActTerm("fp8_w_o", 0, blk, "e4m3 attention-projection weight", per_layer=w8 * (q * C + 8)),
                ActTerm("fp8_w_up", 0, "ffn" not in rc and not a.sliced, "e4m3 up/gate weight",
                        per_layer=w8 * (2 * Fi * C + 8)),
                ActTerm("fp8_w_down", 0, blk and not a.sliced, "e4m3 down weight", per_layer=w8 * (Fi * C + 8))]

    # ---- 1) RMSNorm ----
    def norm(self, name: str, x: torch.Tensor, gain: torch.Tensor, step: Step) -> tuple[torch.Tensor, Prenorm | None]:
        """The step's RMSNorm output, and with norm_fed_fp8 (x, rstd, gain) for the FP8 linear it feeds."""
        if not self.norm_fed_fp8:
            return step(name, rms_norm, x, gain, self.eps), None
        h, rstd = rms_norm_and_rstd(x, gain, self.eps)
        return h, (x, rstd, gain)

    @staticmethod
    def saved_by_ln1(a: _Saved) -> list[ActTerm]:
        """Eager RMSNorm keeps its fp32 upcast of a bf16 input, rstd and the normalized value, and the QKV linear keeps
        the gain product (its input; with --recompute-qkv in e4m3 the recomputed step keeps that input, the model-dtype
        output, not an e4m3 copy). Compiled: rstd, and the output where the QKV region needs it -- in e4m3 the
        partitioner rebuilds it from the residual and rstd where rstd is kept; where LN1 is recomputed itself
        (--recompute-att, --recompute-norm) the output, the QKV region's input, is kept. Over a frozen base (LoRA;
        eager) the gain keeps no normalized value and the output is kept for q/k/v's adapters or a recomputed QKV."""
        C, E, rc = a.cfg.hidden_size, a.E, a.rc
        dropped = "norm" in rc or "att" in rc
        if not a.s.compiled:
            return [ActTerm("ln1", a.up * C + 4 + a.gain * C + (E if "qkv" in rc else a.lin_of("qkv")) * C,
                            not dropped, "RMSNorm-1 fp32 copy, rstd, normalized, output")]
        return [ActTerm("ln1", 4, not dropped, "RMSNorm-1 rstd"),
                ActTerm("ln1_out", E * C if (a.keeps_input("qkv") or "att" in rc or "norm" in rc) else 0,
                        a.blk and ("qkv" in rc or "norm" not in rc),
                        "RMSNorm-1 output" + (" (input of the recomputed QKV step)" if "qkv" in rc else ""))]

    # ---- 2) fused QKV projection, qk-norm, RoPE ----
    def qkv_rope(self, h: torch.Tensor, w: dict[str, torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                 prenorm: Prenorm | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fused QKV projection -> (qk-norm) -> RoPE: (B, T, C) -> q (B, nh, T, hs), k, v (B, nkv, T, hs)."""
        qkv = self.project(h, w, "qkv", "qkv_bias", prenorm)  # (B, T, q_dim + 2 kv_dim)
        if self.qk_norm:  # Qwen3: q and k normalized per head between the split and the rotation
            def qk_norm(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                return rms_norm(q, w["q_norm"], self.eps), rms_norm(k, w["k_norm"], self.eps)
        else:
            qk_norm = None
        # RoPE in the (B, T, heads, hs) layout the projection wrote, then the transposed views
        q, k, v = qkv_rope(qkv, cos, sin, self.nh, self.nkv, self.hs, mode=self.rope_mode, qk_norm=qk_norm)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, nh|nkv, T, hs)

    @staticmethod
    def saved_by_qkv(a: _Saved) -> list[ActTerm]:
        """v, which SDPA saves, is copied out of the fused QKV output (`kernels.rope.split_qkv`), so the fused buffer
        (pre-RoPE q and k) is freed after RoPE unless something else saves views of it: the qk-norm's backward
        (compiled, or eager in fp32) keeps it. SDPA keeps q and k after RoPE; the qk-norm its rstd (and, eager, its
        fp32 copy and normalized value); in e4m3 the QKV linear an e4m3 copy of its input."""
        cfg, E, rc, up = a.cfg, a.E, a.rc, a.up
        q, kv, qkv, nh, nkv = cfg.q_dim, cfg.kv_dim, cfg.qkv_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        if cfg.qk_norm and (a.s.compiled or up == 0):
            what, per_token = "fused QKV output + v copied out of it", E * (qkv + kv)
        else:
            what, per_token = "v, copied out of the fused QKV output (SDPA input)", E * kv
        f8_in = a.f8_norm_out if a.s.compiled else a.f8_in
        terms = [ActTerm("qkv", per_token + f8_in * cfg.hidden_size, "qkv" not in rc,
                         what + (" + e4m3 copy of the QKV input" if f8_in else ""))]
        if cfg.qk_norm and a.s.compiled:
            terms.append(ActTerm("qk_norm", 4 * (nh + nkv), "qkv" not in rc, "q/k RMSNorm rstd"))
        elif cfg.qk_norm:
            terms.append(ActTerm("qk_norm", up * (q + kv) + 4 * (nh + nkv) + a.gain * (q + kv), "qkv" not in rc,
                                 "q/k RMSNorm state"))
        kept = a.blk and "qkv" not in rc if a.s.compiled else "qkv" not in rc
        return terms + [ActTerm("rope", E * (q + kv), kept, "q, k after RoPE (SDPA inputs)")]

    # ---- 3) causal attention ----
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  docs: DocumentMask | None = None) -> torch.Tensor:
        """Causal SDPA: (B, nh|nkv, T, hs) -> (B, T, q_dim). With attn_chunks > 1, one SDPA call per batch
        slice (llm.q's --attn-bwd-chunks): sequences are independent, so results are bit-identical, and
        each backward call (with its fp32 workspace) covers B/chunks sequences. The price: the slices'
        outputs, which their backward keeps, are concatenated into a second copy for the projection.
        `docs`: attention inside each document instead (kernels/document_attention.py; its slices are the
        Transformer's, made for attn_chunks; with a split sequence, what its `documents` or `causal` made)."""
        B, _, T, _ = q.shape
        if self.context is not None:  # this rank's queries over every rank's keys and values (`docs`: its causal or
            # documents' inputs)
            att = self.context.attention(q, k, v, docs).transpose(1, 2)
        elif docs is not None:
            return document_attention(q, k, v, docs).reshape(B, T, self.q_dim)
        elif self.attn_chunks == 1:
            att = self.sdpa(q, k, v).transpose(1, 2)
        else:
            # slice in the (B, T, nh, hs) layout the projection wrote: the gradients of q, k, v are then
            # assembled in that layout, as unsliced, so later reductions (qk-norm weights) sum in the same order
            n = min(self.attn_chunks, B)
            slices = zip(*(t.transpose(1, 2).tensor_split(n) for t in (q, k, v)))  # (B/n, T, nh|nkv, hs)
            att = torch.cat([self.sdpa(qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2)).transpose(1, 2)
                             for qs, ks, vs in slices])  # (B, T, nh, hs) contiguous
        return att.reshape(B, T, self.q_dim)

    def sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One causal attention call, (B, nh, T, hs) out. cuDNN goes through qtrain's opaque op pair
        (kernels/attention.py): reached through F.scaled_dot_product_attention inside compiled graphs its
        gradients were wrong on the H200."""
        if self.sdpa_backend == "cudnn":
            return causal_attention(q, k, v)
        gqa = self.gqa
        if gqa and q.is_cuda and q.dtype == torch.float32:
            # fp32 has no flash kernel and the memory-efficient one takes no enable_gqa: without K/V expanded to the
            # query heads SDPA falls back to the math kernel and its (B, nh, T, T) scores (128 GiB at 65k tokens)
            rep = q.shape[1] // k.shape[1]
            k, v, gqa = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), False
        with sdpa_backends(self.sdpa_backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    @staticmethod
    def saved_by_attention(a: _Saved) -> list[ActTerm]:
        """SDPA keeps its output and the log-sum-exp (B, nh, T) fp32; with --attn-bwd-chunks also the concatenation of
        the slices' outputs where the projection keeps its input (not e4m3; over a frozen base only for o's adapter).
        In e4m3 the output projection keeps an e4m3 copy of its input (not a frozen one), which a compiled block with
        --recompute-att rebuilds with the attention output."""
        cfg, E, rc = a.cfg, a.E, a.rc
        chunked = a.s.attn_chunks > 1 and a.lin_of("o") > 0  # the projection keeps the concatenation
        terms = [ActTerm("attention", E * cfg.q_dim + 4 * cfg.num_attention_heads + (E * cfg.q_dim if chunked else 0),
                         "att" not in rc, "SDPA output + log-sum-exp (fp32)" + (" + concatenated slices" if chunked
                                                                                else ""))]
        if a.f8_in:
            terms.append(ActTerm("o_in_fp8", cfg.q_dim, a.blk and not (a.s.compiled and "att" in rc),
                                 "e4m3 copy of the attention projection's input"))
        return terms

    # ---- 4) residual, RMSNorm-2 ----
    @staticmethod
    def saved_by_residual_and_ln2(a: _Saved) -> list[ActTerm]:
        """The residual after attention (eager RMSNorm-2 keeps it as its fp32 copy unless it is recomputed; compiled
        with --recompute-ffn the partitioner keeps one more (B, T, C) tensor than its steps' inputs); RMSNorm-2's
        rstd and output, and eager its normalized value and the up linear's input (over a frozen base: no normalized
        value, and the input only for up/gate's adapters)."""
        C, E, rc = a.cfg.hidden_size, a.E, a.rc
        dropped = "norm" in rc or "ffn" in rc or a.sliced
        if a.s.compiled:
            return [ActTerm("res_att", E * C, a.blk, "residual after attention"),
                    ActTerm("ffn_extra", E * C, a.blk and "ffn" in rc and not a.sliced,
                            "kept by the partitioner with --recompute-ffn"),
                    ActTerm("ln2", 4 + (E * C if a.keeps_input("up") else 0), not dropped, "RMSNorm-2 rstd + output")]
        res = E * C if (dropped or E == 4) else 4 * C
        return [ActTerm("res_att", res, a.blk,
                        "residual after attention" + ("" if res == E * C else " (as RMSNorm-2's fp32 copy)")),
                ActTerm("ln2", 4 + a.gain * C + a.lin_of("up") * C, not dropped, "RMSNorm-2 rstd, normalized, output")]

    # ---- 5) MLP: fused up/gate -> SwiGLU -> down ----
    def mlp(self, x: torch.Tensor, h: torch.Tensor, pre: Prenorm | None, w: dict[str, torch.Tensor],
            step: Step) -> torch.Tensor:
        """x + down(SwiGLU(up(h))): one function (the FP8 MLP) where no MLP step is recomputed, else three steps."""
        if self.fused_mlp is not None:
            extra = {} if pre is None else {"prenorm": pre}
            return x + self.fused_mlp(h, w["up"], w["down"], quantized_weight(w, "up"), quantized_weight(w, "down"),
                                      w.get(SCALE_HINT), **extra)
        u = step("up", self.project, h, w, "up") if pre is None else self.project(h, w, "up", None, pre)  # (B, T, 2F)
        return x + self.project(step("swiglu", self.activation, u), w, "down")

    def mlp_slices(self, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        """x + MLP(RMSNorm-2(x)) over `mlp_chunks` slices of the tokens (--mlp-chunks), each a checkpoint: forward
        keeps only x, and backward reruns one slice at a time, so the MLP's intermediates (the up/gate output, 2F
        per token) and their gradients exist for 1/N of the tokens at once. Each token's MLP is its own, so the
        slices are rows of the flattened (B*T, C) tokens (contiguous, whatever B); the weight gradients are the
        slices' sums. Compiled, every op of a slice is tagged MUST_RECOMPUTE (what `CheckpointSteps` says why). No
        RNG state is kept: nothing in a slice draws from torch's generators (LoRA dropout, keyed, is refused with
        slices), and a CUDA graph could not capture the state's reads."""
        B, T, C = x.shape
        rows = x.reshape(1, B * T, C)
        if torch.is_grad_enabled():  # the checkpoints hold their inputs, views of x, by reference: the res_att term
            observe_saved(rows)
        n, extra = divmod(B * T, self.mlp_chunks)
        # one split (one autograd node: its backward concatenates the slices' gradients once, where n narrow views
        # would each make a zero-filled (B*T, C) gradient)
        parts = rows.split([n + (i < extra) for i in range(self.mlp_chunks)], dim=1)
        outs = [self._mlp_slice(part, w) if not torch.is_grad_enabled() else
                checkpoint(self._mlp_slice, part, w, use_reentrant=False, preserve_rng_state=False,
                           **({"context_fn": must_recompute_context} if self.compiled else {}))
                for part in parts]
        return torch.cat(outs, dim=1).view(B, T, C)

    def _mlp_slice(self, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        h, pre = self.norm("ln2", x, w["ln2"], run_step)
        return self.mlp(x, h, pre, w, run_step)

    def activation(self, u: torch.Tensor) -> torch.Tensor:
        """SwiGLU of the up/gate output (B, T, 2F) -> (B, T, F), in the mode the Transformer resolved."""
        return swiglu(u, self.swiglu_mode)

    @staticmethod
    def saved_by_mlp(a: _Saved) -> list[ActTerm]:
        """The up/gate output (B, T, 2F) (+ in e4m3 the copy of the MLP input); SwiGLU keeps silu(gate) and the down
        linear its input, the product (compiled: the SwiGLU output only, none in e4m3, whose MLP is one FP8
        Function); in e4m3 the down linear's e4m3 input, which a compiled block with SwiGLU recomputed rebuilds (the
        quantization is traceable: measured on the CPU and on the H200 at 14B e4m3; none with --swiglu-epilogue, whose
        op keeps the up/gate output and rewrites the SwiGLU output in backward). Over a frozen base (eager) the
        down linear keeps its input only for down's adapter, and no e4m3 copies."""
        C, Fi, E, rc = a.cfg.hidden_size, a.cfg.intermediate_size, a.E, a.rc
        if a.s.compiled:
            # over a frozen base in FP8 without down's adapter: the FP8 MLP's e4m3 copy of the SwiGLU output
            e4m3_copy = a.s.frozen_base and a.s.fp8 and not a.keeps_input("down")
            swiglu_term = ActTerm("swiglu", 0 if a.s.swiglu_epilogue else E * Fi if a.keeps_input("down")
                                  else Fi if e4m3_copy else 0, "swiglu" not in rc,
                                  "SwiGLU output" + (" (the FP8 MLP's e4m3 copy)" if e4m3_copy else ""))
            terms = [ActTerm("mlp_up", 2 * Fi * E + a.f8_norm_out * C, "ffn" not in rc,
                             "fused up/gate output (B, T, 2F)" + (" + e4m3 copy of the MLP input" if a.f8_norm_out
                                                                  else "")),
                     # --swiglu-epilogue: the down projection's gradient GEMM rewrites the SwiGLU output
                     swiglu_term]
        else:
            terms = [ActTerm("mlp_up", 2 * Fi * E + a.f8_in * C, "ffn" not in rc,
                             "fused up/gate output (B, T, 2F)"),
                     ActTerm("swiglu", swiglu_saved_bytes(Fi, E, "autograd") + a.lin_of("down") * Fi,
                             "swiglu" not in rc,
                             "silu(gate), SwiGLU output")]
        if a.f8_in:
            terms.append(ActTerm("down_in_fp8", Fi, a.blk and not (a.s.compiled and "swiglu" in rc),
                                 "e4m3 copy of the down projection's input"))
        # --mlp-chunks: nothing of the MLP stays (each slice is rebuilt in backward: activations.workspace_phases)
        return [dataclasses.replace(t, kept=False) for t in terms] if a.sliced else terms

    # ---- the whole block ----
    def body(self, x: torch.Tensor, w: dict[str, torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
             step: Step, docs: DocumentMask | None = None) -> torch.Tensor:
        """`step(name, fn, *args)` runs fn(*args), keeping or recomputing its results per the policy."""
        # 1) attention: norm -> fused QKV projection (+ qk-norm) + RoPE -> causal SDPA -> output projection
        h, pre = self.norm("ln1", x, w["ln1"], step)
        q, k, v = step("qkv", self.qkv_rope, h, w, cos, sin) if pre is None else self.qkv_rope(h, w, cos, sin, pre)
        att = step("attention", self.attention, q, k, v, docs)
        x = x + self.project(att, w, "o")
        # 2) MLP: norm -> fused up/gate projection -> SwiGLU -> down projection
        if self.mlp_chunks > 1:
            return self.mlp_slices(x, w)
        h, pre = self.norm("ln2", x, w["ln2"], step)
        return self.mlp(x, h, pre, w, step)


# what one layer keeps for backward, step by step in block order
_STATEMENTS = (LlamaBlock.saved_by_input, LlamaBlock.saved_by_ln1, LlamaBlock.saved_by_qkv,
               LlamaBlock.saved_by_attention, LlamaBlock.saved_by_residual_and_ln2, LlamaBlock.saved_by_mlp,
               LlamaBlock.saved_by_fp8_weights)


def activation_terms(cfg: LlamaConfig, s: ActivationSettings,
                     statements: tuple[Callable[[_Saved], list[ActTerm]], ...] = _STATEMENTS) -> list[ActTerm]:
    """What autograd keeps per layer for backward, term by term (the `saved_by_*` statements in block order; a family
    built on this block passes its own list)."""
    a = _Saved(cfg, s)
    return [t for statement in statements for t in statement(a)]


def make_block_fn(cfg: LlamaConfig, o: BlockOptions, block_cls: type[LlamaBlock] = LlamaBlock) -> BlockFn:
    """One pre-norm decoder block as a function of (x, weights, cos, sin[, docs]) (`transformer.make_block_fn`
    documents the options); `o.recompute` picks the recompute mechanism: none, checkpoints (compiled) or `Recomputer`.
    `block_cls`: a family built on this block (model/moe_block.py) passes its subclass."""
    body = block_cls(cfg, o).body
    recompute = o.recompute
    if not recompute:
        def block(x: torch.Tensor, w: dict[str, torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                  docs: DocumentMask | None = None) -> torch.Tensor:
            return body(x, w, cos, sin, run_step, docs)
    elif o.compiled:
        policy = CheckpointSteps(recompute)

        def block(x: torch.Tensor, w: dict[str, torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                  docs: DocumentMask | None = None) -> torch.Tensor:
            return body(x, w, cos, sin, policy, docs)
    else:
        def block(x: torch.Tensor, w: dict[str, torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                  docs: DocumentMask | None = None) -> torch.Tensor:
            with Recomputer(recompute) as rc:  # one per call: it holds that call's recompute state
                return body(x, w, cos, sin, rc, docs)

    return block
