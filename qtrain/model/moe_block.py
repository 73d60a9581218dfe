"""The decoder block of the Mixture-of-Experts families (`qwen3_moe/`, `olmoe/`, `mixtral/`), step by step, each step
followed by what it keeps for backward.

    RMSNorm -> fused QKV -> (qk-norm) -> RoPE -> causal SDPA (GQA) -> output projection -> residual      (Llama block)
    -> RMSNorm -> router -> top-k -> permute -> grouped up/gate GEMM -> SwiGLU -> grouped down GEMM -> combine
    -> residual

The attention half is the Llama family's (`llama/block.py`, `LlamaBlock`: its steps, its linears with their FP8
copies, its recompute steps and its saved-bytes statements), so it is not repeated here; `MoeBlock` replaces the MLP
of the layers that route with the functional MoE layer (`model/moe.py`), whose permutation + up/gate GEMM and SwiGLU
are the block's 'up' and 'swiglu' steps (--recompute-ffn / --recompute-swiglu drop them as for a dense MLP). A layer
that keeps a dense MLP (Qwen3-MoE's `mlp_only_layers`) is the Llama block exactly: the block tells the kinds apart by
the weights it receives (a 'router' or an 'up').

Routing in fp32 (`moe_router.route`), the expert GEMMs and the router in the model dtype: with --matmul-dtype e4m3
only the attention projections (and a dense layer's MLP) run in FP8 (the families' `fp8_matrices`); the expert GEMMs
stay in the model dtype unless --fp8-experts, which runs their forward and input-gradient GEMMs in e4m3 with row-wise
scales and their weight gradients in the model dtype (`kernels/grouped_gemm_fp8.py`). The router losses: the block
writes its statistics beside its weights (`ROUTER_STATS`) and puts a node into its output whose backward adds the
losses' gradients (`moe_router.with_router_grads`), so the load-balancing loss (and the router z-loss) reach the router
and every earlier layer through the per-block backward of `transformer.Transformer`, recomputed blocks included
(routing is deterministic).

Memory (eager; `saved_by_moe`): beside the attention's and the dense families' norm terms, per token of a routed layer
the fp32 routing (softmax probabilities E, ids and combine weights k, logsumexp 1), the permutation indices (2 k int64),
the permuted input (k C), the up/gate output (2 k F), the SwiGLU output (k F) and the experts' outputs (k C), and per
layer the expert offsets (E int32). Dropless routing fixes every row count at N k however unevenly the tokens spread
over the experts, so the worst-case imbalance keeps what the balanced case keeps (what a capacity-bounded router would
add, a padded (E, capacity, C) buffer, does not exist here). With expert parallelism it does not: the permuted input,
the up/gate and SwiGLU outputs are the rows this rank's experts received (plus the exchange's two int64 row orders),
planned at the worst case r = ep min(k, E/ep) rows per token (`moe.max_received_rows`; balanced routing: k).

Dimension letters: B batch, T sequence, C hidden, E experts, k experts per token, F an expert's intermediate size.
"""
from __future__ import annotations

import torch

from qtrain.model.family import ActTerm, ActivationSettings, BlockFn, BlockOptions, MatmulSpec
from qtrain.model.llama import block as llama_block
from qtrain.model.llama.block import LlamaBlock, Prenorm, Step, _Saved
from qtrain.model.moe import EXPERTS_DOWN, EXPERTS_UP_GATE, max_received_rows, moe_forward
from qtrain.model.moe_config import MoeConfig
from qtrain.model.moe_router import record_router_stats, with_router_grads

ROUTER = "router"
ATTENTION_FP8 = ("qkv", "o")  # the block linears of a routed layer that may run in FP8 (the experts stay bf16)


class MoeBlock(LlamaBlock):
    """The Llama block with a routed MoE MLP in the layers that have a router (module docstring)."""

    def __init__(self, cfg: MoeConfig, o: BlockOptions):
        super().__init__(cfg, o)
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.exchange = o.experts  # expert parallelism's token exchange, or None
        self.fp8_experts = o.fp8_experts  # --fp8-experts: the expert GEMMs in e4m3 (kernels/grouped_gemm_fp8.py)

    # ---- 5) MLP: the router -> top-k experts -> their SwiGLU MLPs -> the weighted sum ----
    def mlp(self, x: torch.Tensor, h: torch.Tensor, pre: Prenorm | None, w: dict[str, torch.Tensor],
            step: Step) -> torch.Tensor:
        """x + the MoE MLP of h (B, T, C) in a routed layer; the Llama block's dense MLP in the others."""
        if ROUTER not in w:
            return super().mlp(x, h, pre, w, step)
        moe = moe_forward(h, w[ROUTER], w[EXPERTS_UP_GATE], w[EXPERTS_DOWN], top_k=self.top_k,
                          norm_topk_prob=self.norm_topk_prob, step=step, exchange=self.exchange,
                          adapter=self.adapter.experts_of(w) if self.adapter is not None else None,
                          fp8=self.fp8_experts)
        record_router_stats(moe.stats, w)  # training: this layer's row of the step's router statistics
        return x + with_router_grads(moe.out, moe.stats, w)

    @staticmethod
    def saved_by_moe(a: _Saved) -> list[ActTerm]:
        """Eager, per token: routing (softmax probabilities E fp32, top-k ids k int64, combine weights k fp32 -- with
        norm_topk_prob the top-k values and their sum too, which the division keeps --, logsumexp 1 fp32 for the
        z-statistic), the permutation's indices (order, inverse: 2 k int64), the permuted input (k C, the up/gate
        GEMM's), its output (2 k F, SwiGLU's), the SwiGLU output (k F, the down GEMM's) and the experts' outputs
        (k C, the combine's, for the weights' gradient); per layer the expert offsets (E int32). In e4m3 the router
        keeps its input, the RMSNorm-2 output, which the dense block's FP8 linear would keep as an e4m3 copy. Over a
        frozen base (LoRA) the router keeps nothing of its input and the experts' GEMMs (`grouped_gemm.expert_linear`)
        none of theirs, the permuted input and the SwiGLU output: only their weights' gradients read them. The
        'up' step (--recompute-ffn) drops the permuted input and the up/gate output, 'swiglu' the SwiGLU output;
        the routing and the indices stay (the steps' inputs).
        Compiled (AOTAutograd's partitioner, measured on the CPU): the experts' tensors as eager, but with 'ffn' the
        up/gate output stays (the permutation and grouped GEMM are opaque ops it does not rebuild across the two
        checkpointed steps), and with 'norm' alone the RMSNorm-2 output stays (the block compiles as two graphs
        around the router losses' node, which is not compiled); the routing term is an upper bound there: depending on E and k the partitioner keeps
        the bf16 logits instead of the fp32 probabilities (and rebuilds the softmax), or one (N, k) tensor fewer
        with norm_topk_prob -- at most 2 E + 4 k + 8 bytes per token less, under 0.5% of a routed layer's bytes at
        Qwen3-30B-A3B's shape.
        --fp8-experts (`kernels/grouped_gemm_fp8.py`): the two expert GEMMs keep, for their weights' gradients, e4m3
        copies of the permuted input and of the SwiGLU output (k C and k F bytes) and an fp32 scale per row (4 k bytes
        each) instead of the model-dtype tensors (measured eager on the CPU, tests/model/test_moe_fp8.py); over a
        frozen base they keep nothing, and an adapter that reads the input keeps its model-dtype copy as without.
        The down GEMM quantizes the SwiGLU output outside the 'swiglu' step, so --recompute-swiglu does not drop its
        e4m3 copy (only --recompute-block does); the up GEMM's copy is made inside the 'up' step, which
        --recompute-ffn drops. Compiled, the partitioner rebuilds the down GEMM's copy from the up/gate output (kept
        for SwiGLU's backward anyway), so it keeps none of it; the rest as eager (measured on the CPU).
        Expert parallelism (`expert_parallel`): the permuted input, up/gate and SwiGLU outputs hold the r rows per
        token this rank's experts received (`expert_rows`: the worst case), and the exchange keeps two row orders
        (received <-> expert-major, r int64 each); the experts' outputs, the permutation and the routing stay the
        rank's own k rows, the offsets per layer its E/ep experts'. The 'up' step is then the local up/gate GEMM
        alone, whose input, the received rows, --recompute-ffn keeps to rerun it (measured eager on the CPU, gloo)."""
        cfg, Eb, rc, blk, compiled = a.cfg, a.E, a.rc, a.blk, a.s.compiled
        C, F, X, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok
        weights = 8 * k + 4 if cfg.norm_topk_prob else 4 * k
        ep, r = a.s.expert_parallel, expert_rows(cfg, a.s)  # r: rows per token after the exchange (k without it)
        # the experts' GEMMs keep their inputs for their weights' gradients, or over a frozen base for the experts'
        # adapters that read them (their A's grouped GEMM holds the same tensor); in FP8 an e4m3 copy and row scales
        fp8 = a.s.fp8_experts and not a.s.frozen_base
        up_in, down_in = ((r * (width + 4) if fp8 else (Eb if a.s.lin_of(m) else 0) * r * width)
                          for m, width in (("experts_up_gate", C), ("experts_down", F)))
        if ep > 1 and "ffn" in rc:  # the recomputed 'up' step keeps its input, the received rows
            up_in = Eb * r * C
        kept = "e4m3 + row scales" if fp8 else "model dtype"
        rows = "k rows a token" if ep == 1 else \
            f"k = {k} received rows a token, balanced routing" if a.s.balanced_experts else \
            f"{r} received rows a token at the worst case, ep min(k, E/ep); balanced routing k = {k}"
        terms = [ActTerm("moe_routing", 4 * X + 8 * k + weights + 4, blk,
                         "router softmax (fp32), top-k ids, combine weights, logsumexp", per_layer=4 * (X // ep)),
                 ActTerm("moe_permutation", 16 * k, blk, "permutation indices (order, inverse)"),
                 ActTerm("moe_up_in", up_in, blk if ep > 1 else "ffn" not in rc,
                         f"permuted tokens (C per row, {rows}; expert order, {kept})"),
                 ActTerm("moe_up_out", Eb * r * 2 * F, blk and ("ffn" not in rc or compiled),
                         f"experts' up/gate outputs (2F per row, {rows})"),
                 ActTerm("moe_swiglu", down_in, (blk and not compiled) if fp8 else "swiglu" not in rc,
                         f"experts' SwiGLU outputs (F per row, {rows}; {kept})"),
                 ActTerm("moe_down_out", Eb * k * C, blk, "experts' outputs (k, C), for the combine weights")]
        if ep > 1:
            terms.append(ActTerm("moe_exchange", 16 * r, blk,
                                 f"the token exchange's two row orders (int64 per row, {rows})"))
        if a.s.fp8 and not a.s.frozen_base:  # a frozen router keeps nothing of its input
            terms.append(ActTerm("router_in", Eb * C, not ("norm" in rc or "ffn" in rc),
                                 "the router's input (RMSNorm-2 output, model dtype)"))
        if compiled:  # the block is two graphs around the router losses' node (`with_router_grads`)
            terms.append(ActTerm("router_in_kept", Eb * C, blk and "norm" in rc and "ffn" not in rc,
                                 "RMSNorm-2 output, which the partitioner keeps with --recompute-norm"))
        return terms

    @staticmethod
    def saved_by_fp8_weights(a: _Saved) -> list[ActTerm]:
        """FP8: the attention projections' e4m3 weights (the Llama block's statement for them); the experts are bf16."""
        return [t for t in LlamaBlock.saved_by_fp8_weights(a) if t.name in ("fp8_w_qkv", "fp8_w_o")]


def expert_rows(cfg: MoeConfig, s: ActivationSettings) -> int:
    """Rows per token of the rank's that its experts' GEMMs hold after the token exchange: k without expert
    parallelism (or with `balanced_experts`), else the most they can receive (`moe.max_received_rows`)."""
    k = cfg.num_experts_per_tok
    if s.balanced_experts:
        return k
    return max_received_rows(1, top_k=k, num_experts=cfg.num_experts, ep=s.expert_parallel)


# what a routed layer keeps for backward, step by step in block order (the attention's statements are the Llama
# block's; a family whose attention differs passes its own `qkv` statement)
def statements(qkv=LlamaBlock.saved_by_qkv) -> tuple:
    return (LlamaBlock.saved_by_input, LlamaBlock.saved_by_ln1, qkv, LlamaBlock.saved_by_attention,
            LlamaBlock.saved_by_residual_and_ln2, MoeBlock.saved_by_moe, MoeBlock.saved_by_fp8_weights)


def activation_terms(cfg: MoeConfig, layer: int, s: ActivationSettings, qkv=LlamaBlock.saved_by_qkv
                     ) -> list[ActTerm]:
    """What block `layer` keeps for backward: a dense layer's are the Llama block's (with `qkv` for the attention)."""
    if layer in cfg.dense_layers:
        dense = tuple(qkv if f is LlamaBlock.saved_by_qkv else f for f in llama_block._STATEMENTS)
        return llama_block.activation_terms(cfg, s, dense)
    return llama_block.activation_terms(cfg, s, statements(qkv))


def make_block_fn(cfg: MoeConfig, o: BlockOptions, block_cls: type[MoeBlock] = MoeBlock) -> BlockFn:
    """The block as a function of (x, weights, cos, sin), every recompute mechanism of the Llama block's (not its MLP
    slices: a routed layer's router statistics are one call's, `resolution.mlp_chunks_refusal`)."""
    if o.mlp_chunks > 1:
        raise ValueError(f"mlp_chunks {o.mlp_chunks}: an MoE block runs its MLP in one call")
    return llama_block.make_block_fn(cfg, o, block_cls)


def matmuls(cfg: MoeConfig, layer: int) -> dict[str, MatmulSpec]:
    """Block `layer`'s GEMMs: the attention projections, and the router and the expert stacks (each expert's GEMM
    takes k / E of the tokens' rows: the active FLOPs) or a dense layer's MLP."""
    C, F, X, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok
    out = {"qkv": MatmulSpec(cfg.qkv_dim, C, step="qkv"), "o": MatmulSpec(C, cfg.q_dim)}
    if layer in cfg.dense_layers:
        Fd = cfg.intermediate_size
        return {**out, "up": MatmulSpec(2 * Fd, C, step="up"), "down": MatmulSpec(C, Fd)}
    return {**out, ROUTER: MatmulSpec(X, C),
            EXPERTS_UP_GATE: MatmulSpec(2 * F, C, step="up", rows=k / X, count=X),
            EXPERTS_DOWN: MatmulSpec(C, F, rows=k / X, count=X)}


def backward_temporaries(cfg: MoeConfig, layer: int, tokens: int, s: ActivationSettings) -> int:
    """The largest saved tensors come back as gradients: a dense layer's as the Llama block's; a routed layer's
    experts' (k (3F + 2C) elements per token in the model dtype: d(up/gate), d(SwiGLU), d(permuted), d(outputs); with
    expert parallelism the received rows' instead of k, `expert_rows`) and
    the routing's fp32 gradients (2 E per token), with the attention's q_dim fp32 per attention call.
    --fp8-experts adds, in an expert GEMM's backward, the dequantized input (k max(C, F) in the model dtype), the
    output gradient's e4m3 copy (k max(2F, C) bytes) and the weight stack's e4m3 copy in the other major order
    (E 2F C bytes, per layer); eager, the quantizations' fp32 products are transients besides (a compiled block fuses
    them)."""
    routed = layer not in cfg.dense_layers
    if not routed:
        width = cfg.intermediate_size + 2 * cfg.hidden_size
    else:  # with expert parallelism the received rows' (`expert_rows`, at least k): a bound of the own rows' too
        width = expert_rows(cfg, s) * (3 * cfg.moe_intermediate_size + 2 * cfg.hidden_size)
    fp8 = 0
    if routed and s.fp8_experts:
        C, F, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
        fp8 = tokens * k * (s.dtype_bytes * max(C, F) + max(2 * F, C)) + cfg.num_experts * 2 * F * C
    return fp8 + tokens * (s.dtype_bytes * width + 8 * cfg.num_experts * routed + 4 * cfg.q_dim // s.attn_chunks)
