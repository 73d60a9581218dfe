"""The decoder of any family, with an explicit per-block forward/backward loop.

Reading order: `make_block_fn` (the family's block, functional: model/llama/block.py for the Llama family) ->
`Transformer.forward_backward` (embedding -> blocks -> final norm + chunked LM head loss -> blocks backward, one
block at a time -> embedding backward). Nothing here names a family's tensors: the family's block function
reads them (model/family.py).

Why an explicit loop instead of one autograd graph: the backward of block l ends inside our code, so the
gradient manager receives that block's weight gradients at once (`GradientSink.accumulate_block`) and can
start communicating them while block l-1 runs its backward (llm.q's `notify_block`); recomputation and
weight gathering hook into the same loop. Within a block, autograd (and, on the GPU, torch.compile) does
the work. Weights come from a `WeightSource`, so replicated, sharded or quantized weights look the same here.

Documents (--document-masking): `forward_backward`, `hidden_states`, `logits` and `loss_sum` take position ids (B, T)
(each token's position in its document; the loader makes them: data/documents.py). The RoPE tables are then gathered
at those positions and every block gets the micro-batch's `DocumentMask` (kernels/document_attention.py, built once
here) as its fifth argument, which its attention takes: attention stays inside each document, and a row of packed
documents computes what each of them would alone.

Activation memory (reference/llmq.md §4.5): `--recompute-{norm,swiglu,qkv,att,ffn}` rerun named steps of
the block in backward (recompute.py says how, eagerly and under torch.compile); `--recompute-block` keeps
only each block's input and reruns the whole block in the loop, with `--offload-residual` those inputs
wait in host memory (`ResidualStash`). All of them change what is stored, never what is computed: losses
and gradients are bit-identical to the plain run (tests/test_recompute.py).

Dimension letters: B batch, T sequence, C hidden, nh / nkv query / kv heads, hs head size, V vocab.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from qtrain.kernels.cross_entropy import (IGNORE_INDEX, chunked_lm_head_loss, head_logits_buffer,
                                          lm_head_loss_and_grads)
from qtrain.kernels.document_attention import document_mask, resolve_document_attention
from qtrain.model.choices import DELTA_RULE_PRECISIONS, DOCUMENT_ATTENTION
from qtrain.kernels.rope import rope_tables
from qtrain.kernels.swiglu import ScaleHints
from qtrain.model.config import ModelConfig
from qtrain.model.family import BlockFn, BlockOptions, Linear, Mlp
from qtrain.model.layers import SDPA_BACKENDS, final_norm_fn
from qtrain.model.matmul import FP8_GRAD_DTYPES, block_linear, block_mlp
from qtrain.model.moe_router import RouterLosses
from qtrain.model.recompute import ResidualStash, block_steps, resolve_flags, splits_mlp
from qtrain.model.registry import family_of
from qtrain.model.sequence_split import SequenceSplit
from qtrain.model.weight_source import (FP8_INV_SCALE, FP8_WEIGHT, FP8_WEIGHT_T, SCALE_HINT, GradientSink,
                                        WeightSource, quantized_weight)
from qtrain.model.weights import param_shapes
from qtrain.numerics.frozen_e4m3 import frozen_e4m3_linear

# the weight-dict conventions between weight sources and blocks live in weight_source.py; named here too because
# the loop's callers (parallel/, tests) meet them through this module
__all__ = ["FP8_INV_SCALE", "FP8_WEIGHT", "FP8_WEIGHT_T", "SCALE_HINT", "GradientSink", "WeightSource",
           "quantized_weight", "make_block_fn", "RunOptions", "Transformer", "allocate_params"]


def make_block_fn(cfg: ModelConfig, linear: Linear = F.linear, *, recompute: frozenset[str] = frozenset(),
                  attn_chunks: int = 1, mlp_chunks: int = 1, compiled: bool = False, swiglu: str = "autograd",
                  mlp: Mlp | None = None, sdpa_backend: str = "auto",
                  linears: dict[str, Linear] | None = None, rope: str = "autograd",
                  rebuilt_input_linear: Linear | None = None, norm_fed_fp8: bool = False,
                  adapter: Callable | None = None, experts: Any = None,
                  context: SequenceSplit | None = None, fp8_experts: bool = False,
                  delta_rule_precision: str = "fp32") -> BlockFn:
    """The block of `cfg`'s family as a function of (x, weights, cos, sin[, docs]), so one compiled graph serves
    every layer (weights are inputs, not captured constants); for the Llama family see model/llama/block.py.

    recompute: steps ('ln1', 'qkv', 'attention', 'ln2', 'up', 'swiglu'; see recompute.STEPS) whose results
    are rerun in backward instead of kept; `compiled` picks the mechanism that works under torch.compile.
    swiglu, rope: the SwiGLU and RoPE ops' modes (`kernels.swiglu.swiglu`, `kernels.rope.qkv_rope`): "kernel" (what
    compiled blocks use) runs each backward as one kernel, where inductor's own versions ran at half the memory
    bandwidth and at 0.5-2 TB/s; "autograd" differentiates the plain-torch forward.
    attn_chunks: run attention, forward and backward, as that many independent calls over batch slices.
    mlp_chunks: run the MLP (from its norm on) over that many slices of the tokens, each rerun in backward (a family
    that cannot refuses it: `resolution.mlp_chunks_refusal`).
    sdpa_backend: the attention kernel (layers.SDPA_BACKENDS; 'auto' = torch's choice).
    mlp: the whole MLP after LN2 as one function (FP8's `fp8_swiglu_mlp`, which keeps the SwiGLU output in
    FP8 only) instead of linear -> SwiGLU -> linear; ignored when the 'up' or 'swiglu' step is recomputed,
    since those need the steps separately (recompute.MLP_STEPS).
    linears: per-linear replacements of `linear` by block matrix name (the FP8 policy's bf16 linears).
    rebuilt_input_linear: instead of `linear` for a linear whose input a recomputed step rebuilds (the attention
    output under 'attention', the SwiGLU output under 'swiglu'): FP8 without --fp8-keep-transposes, so that what
    the linear keeps is rebuilt with the step instead of undoing its saving.
    norm_fed_fp8: the FP8 linears (and MLP) after the two norms quantize their input from the norm's input, rstd and
    gain (`kernels.fp8_quant.quantize_for_gemms`'s prenorm), so the norm's output is never written; for a compiled block
    with kept transposes and no recomputed step (the Transformer decides).
    adapter: adds a low-rank adapter's term to the block linears' outputs (LoRA: model/lora/adapter.py).
    experts: expert parallelism's token exchange (model/moe.ExpertExchange) for an MoE family's block.
    context: each sequence split across ranks (model/sequence_split.py): attention through it.
    fp8_experts: an MoE family's expert GEMMs in e4m3 with row-wise scales (kernels/grouped_gemm_fp8.py).
    delta_rule_precision: a Gated DeltaNet family's delta-rule products in its Triton kernels (choices.
    DELTA_RULE_PRECISIONS: fp32, three TF32 passes; tf32, one)."""
    options = BlockOptions(linear=linear, recompute=frozenset(recompute), attn_chunks=attn_chunks,
                           mlp_chunks=mlp_chunks, compiled=compiled,
                           swiglu=swiglu, mlp=mlp, sdpa_backend=sdpa_backend, linears=linears,
                           rope=rope, rebuilt_input_linear=rebuilt_input_linear,
                           norm_fed_fp8=norm_fed_fp8, adapter=adapter, experts=experts,
                           context=context, fp8_experts=fp8_experts, delta_rule_precision=delta_rule_precision)
    return family_of(cfg).make_block_fn(cfg, options)


class _BackwardFrom(torch.autograd.Function):
    """A 0-dim stand-in whose backward hands `grad` to `t`: autograd.grad(_BackwardFrom.apply(t, grad), inputs) is
    autograd.grad(t, inputs, grad), except that once the caller drops its name for `grad` only the engine holds it,
    which frees it as soon as t's node has used it (the LM head's d(hidden) during the final norm's backward)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(grad)
        return t.new_zeros(())

    @staticmethod
    def backward(ctx, _one: torch.Tensor) -> tuple[torch.Tensor, None]:
        (grad,) = ctx.saved_tensors
        return grad, None


@dataclass(kw_only=True)
class RunOptions:
    """How the model executes (not what it computes)."""

    lmhead_chunks: int = 1  # row chunks of the LM head + loss: fp32 logits live for 1/chunks of the batch
    attn_bwd_chunks: int = 1  # attention as independent calls over batch slices (smaller backward workspace)
    mlp_chunks: int = 1  # the MLP over token slices, each rerun in backward (its intermediates for 1/N of the tokens)
    sdpa_backend: str = "auto"  # attention kernel: layers.SDPA_BACKENDS
    # llm.q's recompute switches (recompute.FLAGS: swiglu, norm, ffn, qkv, att, block) rerun in backward instead
    # of kept from forward; the implications are added here (recompute.resolve_flags), so this is the full set
    recompute: frozenset[str] = frozenset()
    offload_residual: bool = False  # with recompute 'block': keep the block inputs in (pinned) host memory
    compile: bool = False  # torch.compile the block function (GPU)
    compile_tuning: bool = False  # with compile: inductor's coordinate-descent tuning of its kernels
    compile_autotune_gemm: bool = False  # with compile: inductor's Triton GEMM templates timed against cuBLAS
    matmul_dtype: str = ""  # the four block linears: '' (model dtype) or 'e4m3' (FP8, matmul.py)
    fp8_linears: tuple[str, ...] | None = None  # with e4m3: the block linears in FP8, the others in the model
    # dtype (model/fp8_policy.py chooses them; None: all of the family's `fp8_matrices`)
    fp8_grad_dtype: str = "e4m3"  # with e4m3 matmuls: the output gradients' FP8 format, e4m3 or e5m2
    fp8_keep_transposes: bool = False  # with e4m3 and compile: keep the inputs' e4m3 transposes (numerics.fp8)
    fp8_swiglu_onepass: bool = False  # with e4m3 and the fused MLP: h and du in one pass, power-of-two scales
    fp8_head_backward: bool = False  # the LM head's gradient GEMMs in FP8 (kernels/cross_entropy)
    wrap_linear: Callable[[Linear], Linear] | None = None  # instrumentation around the block linears
    # (--debug-log-abs-max); with it the MLP runs as separate linears, which the wrapper sees
    document_attention: str = "auto"  # with position ids: kernels/document_attention.py's form (auto, varlen, masked)
    adapter: Callable | None = None  # LoRA's term after the block linears (model/lora/adapter.LoraAdapter)
    expert_exchange: Any = None  # --expert-parallel: the MoE layers' token exchange (parallel/experts.TokenExchange)
    fp8_experts: bool = False  # --fp8-experts: the MoE layers' expert GEMMs in e4m3 (kernels/grouped_gemm_fp8.py)
    delta_rule_precision: str = "fp32"  # --delta-rule-precision: Gated DeltaNet's Triton products (choices.py)
    context: SequenceSplit | None = None  # --context-parallel: this rank's part of each sequence
    # the block matrices come as e4m3 codes only (LoRA's --lora-base-dtype e4m3): every block linear runs through
    # numerics/frozen_e4m3.py (FP8 GEMMs with matmul_dtype e4m3 on CUDA, else dequantized inside the op)
    frozen_e4m3: bool = False
    # the model-dtype MLP as one op with the SwiGLU in its GEMMs' epilogues (kernels/gated_mlp.py; compiled blocks
    # with neither up nor down in FP8; --swiglu-epilogue)
    swiglu_epilogue: bool = False

    def __post_init__(self) -> None:
        if self.attn_bwd_chunks < 1:
            raise ValueError(f"attn_bwd_chunks must be >= 1, got {self.attn_bwd_chunks}")
        if self.mlp_chunks < 1:
            raise ValueError(f"mlp_chunks must be >= 1, got {self.mlp_chunks}")
        if self.sdpa_backend not in SDPA_BACKENDS:
            raise ValueError(f"sdpa_backend must be one of {SDPA_BACKENDS}, got {self.sdpa_backend!r}")
        if self.document_attention not in DOCUMENT_ATTENTION:
            raise ValueError(f"document_attention must be one of {DOCUMENT_ATTENTION}, got {self.document_attention!r}")
        if self.delta_rule_precision not in DELTA_RULE_PRECISIONS:
            raise ValueError(f"delta_rule_precision must be one of {DELTA_RULE_PRECISIONS}, "
                             f"got {self.delta_rule_precision!r}")
        self.recompute = resolve_flags(self.recompute)
        if self.context is not None and self.attn_bwd_chunks > 1:
            raise ValueError("a sequence split across ranks runs its attention in one call (attn_bwd_chunks 1)")
        if self.offload_residual and "block" not in self.recompute:
            raise ValueError("offload_residual needs recompute 'block' (only block inputs are offloaded)")

    def inductor_options(self) -> dict[str, bool] | None:
        """torch.compile's inductor options for the block: coordinate-descent tuning of its kernels' launch
        configurations (compile_tuning) and its Triton GEMM templates timed against cuBLAS per GEMM shape, the
        faster kept (compile_autotune_gemm: inductor's max_autotune_gemm)."""
        options = {**({"coordinate_descent_tuning": True} if self.compile_tuning else {}),
                   **({"max_autotune_gemm": True} if self.compile_autotune_gemm else {})}
        return options or None


class Transformer:
    """Runs forward, backward and evaluation of a decoder whose weights come from a WeightSource."""

    def __init__(self, cfg: ModelConfig, run: RunOptions | None = None):
        self.cfg = cfg
        self.run = run or RunOptions()
        run = self.run
        linear = block_linear(run.matmul_dtype, run.fp8_grad_dtype, run.fp8_keep_transposes)
        rebuilt = block_linear(run.matmul_dtype, run.fp8_grad_dtype) if run.fp8_keep_transposes else None
        fp8_matrices = family_of(cfg).fp8_matrices
        fp8_linears = fp8_matrices if run.fp8_linears is None else run.fp8_linears
        plain = [n for n in fp8_matrices if n not in fp8_linears] if run.matmul_dtype == "e4m3" else []
        linears = {n: F.linear for n in plain}  # the FP8 policy's model-dtype linears
        if run.wrap_linear is not None:
            linear, mlp = run.wrap_linear(linear), None
            rebuilt = run.wrap_linear(rebuilt) if rebuilt is not None else None
            linears = {n: run.wrap_linear(f) for n, f in linears.items()}
        else:  # the fused FP8 MLP needs both of its linears in FP8
            fp8_mlp = run.matmul_dtype == "e4m3" and not {"up", "down"} & set(plain)
            mlp = (block_mlp(run.matmul_dtype, run.fp8_grad_dtype, run.fp8_keep_transposes, run.fp8_swiglu_onepass)
                   if fp8_mlp else block_mlp(epilogue=run.swiglu_epilogue))
        if run.adapter is not None and run.adapter.covers("up", "down"):
            mlp = None  # adapters of the MLP's matrices need its three steps (the block's linears add them)
        if run.frozen_e4m3:  # one linear for every block matrix, over its e4m3 codes
            linear = frozen_e4m3_linear(run.matmul_dtype, FP8_GRAD_DTYPES[run.fp8_grad_dtype or "e4m3"])
            linear = run.wrap_linear(linear) if run.wrap_linear is not None else linear
            mlp, rebuilt, linears = None, None, {}
        # whether the one-pass SwiGLU FP8 kernels run (and the layers need scale hints): the fused FP8 MLP, compiled,
        # not split into steps by a recompute switch (make_block_fn's rule)
        self.swiglu_onepass = bool(run.fp8_swiglu_onepass and mlp is not None and run.compile
                                   and not splits_mlp(run.recompute))
        ops = "kernel" if run.compile else "autograd"  # SwiGLU's and RoPE's backward kernels where inductor is slow
        fn = make_block_fn(cfg, linear, recompute=block_steps(run.recompute), attn_chunks=run.attn_bwd_chunks,
                           mlp_chunks=run.mlp_chunks, compiled=run.compile, swiglu=ops, rope=ops, mlp=mlp if run.compile else None,
                           sdpa_backend=run.sdpa_backend, linears=linears, rebuilt_input_linear=rebuilt,
                           norm_fed_fp8=bool(run.compile and run.matmul_dtype == "e4m3" and run.fp8_keep_transposes
                                             and run.wrap_linear is None and not run.frozen_e4m3),
                           adapter=run.adapter, experts=run.expert_exchange, context=run.context,
                           fp8_experts=run.fp8_experts, delta_rule_precision=run.delta_rule_precision)
        self.block_fn: BlockFn = torch.compile(fn, dynamic=False, options=run.inductor_options()) if run.compile else fn
        self._eager_block_fn: BlockFn = fn
        if run.compile:  # the compiled flavour of the recompute mechanism differs; eager needs its own
            self._eager_block_fn = make_block_fn(cfg, linear, recompute=block_steps(run.recompute),
                                                 attn_chunks=run.attn_bwd_chunks, mlp_chunks=run.mlp_chunks,
                                                 compiled=False,
                                                 sdpa_backend=run.sdpa_backend, linears=linears,
                                                 adapter=run.adapter, experts=run.expert_exchange,
                                                 context=run.context, fp8_experts=run.fp8_experts,
                                                 delta_rule_precision=run.delta_rule_precision)
        # the final norm, forward and backward, as inductor's fused kernels where the blocks are compiled: eager it was
        # several elementwise passes over fp32 copies of the (B*T, C) hidden states, each way, per micro-step
        norm = final_norm_fn(cfg.zero_centered_norms)
        self._final_norm = torch.compile(norm, dynamic=False, options=run.inductor_options()) if run.compile else norm
        self._stash = ResidualStash(offload=run.offload_residual)  # block inputs with recompute_block
        self._rope: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._scale_hints = ScaleHints(cfg.num_hidden_layers)  # SCALE_HINT's tensors, with swiglu_onepass
        self.router_losses: RouterLosses | None = None  # an MoE model's last micro-step: router statistics, losses

    @contextlib.contextmanager
    def eager(self) -> Iterator[None]:
        """Run the uncompiled block function inside this context: instrumentation that records values
        (e.g. --debug-log-abs-max) cannot live inside a compiled graph."""
        compiled, self.block_fn = self.block_fn, self._eager_block_fn
        try:
            yield
        finally:
            self.block_fn = compiled

    def rope(self, T: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (T, str(device), dtype)
        if key not in self._rope:
            split = self.run.context
            if split is None:
                self._rope[key] = rope_tables(self.cfg, T, device, dtype)
            else:  # this rank's T tokens of sequences of T x parts: the rows of their positions
                pos = split.positions(T, "cpu")
                cos, sin = rope_tables(self.cfg, T * split.parts, "cpu", dtype)
                self._rope[key] = (cos[pos].to(device), sin[pos].to(device))
        return self._rope[key]

    def _tables_and_docs(self, T: int, device: torch.device, dtype: torch.dtype, positions: torch.Tensor | None
                         ) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """(cos, sin, the blocks' extra arguments): the (T, hs) RoPE tables and no extra argument, or with position ids
        the tables at the positions (B, T, hs) and the micro-batch's DocumentMask, its attention slices those of
        --attn-bwd-chunks (the block's own slicing). A split sequence (context parallelism) takes the whole rows'
        position ids (B, T x parts) and its own `documents` instead, and without them passes its `causal` inputs."""
        split = self.run.context
        if positions is None:
            return (*self.rope(T, device, dtype), () if split is None else (split.causal(T, device),))
        if split is not None:  # the whole rows' positions: this rank's RoPE rows, and the documents of every rank
            if positions.shape[1] != T * split.parts:
                raise ValueError(f"position ids of shape {tuple(positions.shape)} for sequences of {T} x "
                                 f"{split.parts} tokens split over {split.parts} ranks")
            key = ("documents", T * split.parts, str(device), dtype)
            if key not in self._rope:
                self._rope[key] = rope_tables(self.cfg, T * split.parts, device, dtype)
            cos, sin = self._rope[key]
            at = split.shard(positions).to(device, non_blocking=True)
            return cos[at], sin[at], (split.documents(positions, device),)
        cos, sin = self.rope(T, device, dtype)
        if positions.shape[1] != T:
            raise ValueError(f"position ids of shape {tuple(positions.shape)} for sequences of {T} tokens")
        kind = resolve_document_attention(self.run.document_attention, device, dtype)
        docs = document_mask(positions, kind=kind, slices=min(self.run.attn_bwd_chunks, positions.shape[0]),
                             device=device, dynamic=self.run.compile)
        at = positions.to(device, non_blocking=True)
        return cos[at], sin[at], (docs,)

    def _with_scale_hint(self, w: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
        """The block's weights plus the layer's scale hints where the one-pass SwiGLU FP8 kernels run (one tensor per
        layer, made once, so every micro-step and CUDA-graph replay reads and updates the same one), else w."""
        if not self.swiglu_onepass:
            return w
        return {**w, SCALE_HINT: self._scale_hints.of(layer, next(iter(w.values())).device)}

    def _block_weights(self, weights: WeightSource, layer: int, router: RouterLosses | None) -> dict[str, torch.Tensor]:
        """Block `layer`'s weights with what the loop hands a block beside them: the FP8 scale hints, and in training an
        MoE layer's row of the router statistics and the router losses' gradients (moe_router.RouterLosses)."""
        w = self._with_scale_hint(weights.block(layer), layer)
        return w if router is None else {**w, **router.slot(layer)}

    def scale_hints(self) -> torch.Tensor | None:
        """The layers' FP8 scale hints as one (layers, 2) int32 CPU tensor, None where the one-pass SwiGLU kernels do
        not run: run state that checkpoints save (kernels/swiglu/hints.py)."""
        return self._scale_hints.state() if self.swiglu_onepass else None

    def load_scale_hints(self, hints: torch.Tensor) -> None:
        """Continue from `scale_hints()`'s tensor (a checkpoint's, checked by `checkpointing.check_compatible`);
        refused if its shape is not (layers, 2) int32. Without the one-pass kernels nothing reads them."""
        self._scale_hints.load(hints)

    def _head_weight(self, nb: dict[str, torch.Tensor]) -> torch.Tensor:
        return nb["embed"] if self.cfg.tie_word_embeddings else nb["lm_head"]

    # ---- training ----
    def forward_backward(self, weights: WeightSource, inputs: torch.Tensor, targets: torch.Tensor, *,
                         grads: GradientSink, loss_scale: float, z_loss: float = 0.0, router_z_loss: float = 0.0,
                         router_loss_scale: float = 1.0, positions: torch.Tensor | None = None) -> torch.Tensor:
        """One micro-step. inputs/targets: (B, T) int64 on the compute device. Differentiates
        loss_scale * (summed token loss) and hands every weight gradient to `grads`; returns that scaled
        loss as a detached fp32 scalar (no host sync). positions: (B, T) position ids of documents (best on the
        host, see the module docstring), None for rows that are one sequence each.

        An MoE model (`cfg.router`) adds router_loss_scale * (aux_loss_coef * load-balancing loss + router_z_loss *
        router z-loss) of this micro-batch (transformers' loss with output_router_logits; moe_router.py): the trainer
        passes 1 / grad_accumulation, so that a step's sum over micro-steps, averaged over ranks as the gradient
        managers average, is the mean of the micro-batches' router losses, as the loss scale makes the token loss the
        global batch's mean. Their values and the tokens per expert stay in `router_losses` (device tensors)."""
        cfg, C, L = self.cfg, self.cfg.hidden_size, self.cfg.num_hidden_layers
        B, T = inputs.shape
        recompute_block, stash = "block" in self.run.recompute, self._stash
        nb = weights.non_block()
        embed = nb["embed"]
        cos, sin, docs = self._tables_and_docs(T, embed.device, embed.dtype, positions)

        # an MoE model's router statistics (written by each routed block) and losses' gradients (read by its backward)
        router = RouterLosses(cfg.router, B * T, embed.device, z_loss=router_z_loss > 0) if cfg.router else None
        self.router_losses = router

        # the head's logits first, while only the persistent state is live (`head_logits_buffer` says why); with
        # recompute_block the activations are a stash of block inputs, and the logits would outlive the blocks' own
        # forward temporaries that the plan counts without them
        head_w = self._head_weight(nb)
        logits = None if recompute_block else head_logits_buffer(B * T, head_w, chunks=self.run.lmhead_chunks,
                                                                 fp8_backward=self.run.fp8_head_backward)
        # forward: each block starts from a leaf (so its backward stops there); keep the block's graph, or with
        # recompute_block only its input (in host memory with offload_residual)
        x = F.embedding(inputs, embed.detach())  # (B, T, C)
        graphs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (block input, block output)
        for layer in range(L):
            w = self._block_weights(weights, layer, router)
            x_in = x.detach().requires_grad_(True)
            if recompute_block:
                with torch.no_grad():
                    x = self.block_fn(x_in, w, cos, sin, *docs)
                stash.store(layer, x_in)
            else:
                with torch.enable_grad():
                    x = self.block_fn(x_in, w, cos, sin, *docs)
                graphs.append((x_in, x))
            weights.release_block(layer)
        if recompute_block:
            stash.prefetch(L - 1)  # comes back while the LM head runs
        if router is not None:  # every layer's statistics are in: the router losses' gradients for the backward
            router.set_grads(aux_coef=router_loss_scale * router.router.aux_loss_coef,
                             z_coef=router_loss_scale * router_z_loss)

        # head: final norm + chunked LM head + loss; its gradients are computed right here
        x_last = x.detach().requires_grad_(True)
        norm_w = nb["norm"]
        with torch.enable_grad():
            h = self._final_norm(x_last, norm_w, cfg.rms_norm_eps).view(B * T, C)
        loss, dh, d_head = lm_head_loss_and_grads(h.detach(), head_w.detach(), targets.reshape(-1),
                                                  chunks=self.run.lmhead_chunks, z_loss=z_loss, scale=loss_scale,
                                                  fp8_backward=self.run.fp8_head_backward,
                                                  need_weight_grad=head_w.requires_grad,  # a frozen head: none
                                                  logits_buffer=logits)
        start = _BackwardFrom.apply(h, dh)
        del h, dh, x, logits
        # a frozen tensor (one that does not require grad: parallel/layout.py's frozen groups) gets no gradient
        dx, *d_norm = torch.autograd.grad(start, [x_last] + ([norm_w] if norm_w.requires_grad else []))
        del start, x_last
        head = {"norm": d_norm[0]} if d_norm else {}
        if not cfg.tie_word_embeddings:
            if head_w.requires_grad:
                head["lm_head"] = d_head
            d_head = None
        if head:
            grads.accumulate_non_block(head)

        # backward through the blocks, last to first; each block's weight gradients leave immediately
        for layer in reversed(range(L)):
            w = self._block_weights(weights, layer, router)
            names = [n for n, t in w.items() if t.requires_grad]  # not the FP8 copies or the scale hints
            if recompute_block:
                x_in = stash.load(layer).requires_grad_(True)
                stash.prefetch(layer - 1)  # the next block's input travels while this one runs
                with torch.enable_grad():
                    y = self.block_fn(x_in, w, cos, sin, *docs)
            else:
                x_in, y = graphs.pop()
            with torch.enable_grad():
                g = torch.autograd.grad(y, [x_in] + [w[n] for n in names], dx)
            dx = g[0]
            del y, x_in
            weights.release_block(layer)
            grads.accumulate_block(layer, dict(zip(names, g[1:])))

        if embed.requires_grad:
            grads.accumulate_non_block({"embed": self._embedding_backward(inputs, dx, embed, d_head)})
        return loss.detach()

    def _embedding_backward(self, inputs: torch.Tensor, dx: torch.Tensor, embed: torch.Tensor,
                            d_head: torch.Tensor | None) -> torch.Tensor:
        """Dense (V, C) gradient of the embedding (+ the tied LM head's). aten's embedding backward sums
        rows deterministically in fp32 (sort + segment sum on CUDA) without a host sync."""
        g = torch.ops.aten.embedding_dense_backward(dx, inputs, embed.shape[0], -1, False)
        if d_head is None:
            return g
        return d_head.add_(g)

    # ---- evaluation ----
    @torch.no_grad()
    def hidden_states(self, weights: WeightSource, inputs: torch.Tensor,
                      positions: torch.Tensor | None = None) -> torch.Tensor:
        """Final-norm hidden states (B, T, C) (positions: as `forward_backward`'s)."""
        nb = weights.non_block()
        cos, sin, docs = self._tables_and_docs(inputs.shape[1], nb["embed"].device, nb["embed"].dtype, positions)
        x = F.embedding(inputs, nb["embed"])
        for layer in range(self.cfg.num_hidden_layers):
            x = self.block_fn(x, weights.block(layer), cos, sin, *docs)
            weights.release_block(layer)
        return final_norm_fn(self.cfg.zero_centered_norms)(x, nb["norm"], self.cfg.rms_norm_eps)

    @torch.no_grad()
    def logits(self, weights: WeightSource, inputs: torch.Tensor, positions: torch.Tensor | None = None
               ) -> torch.Tensor:
        """Full logits (B, T, V) in the model dtype: for tests and small-scale use only."""
        h = self.hidden_states(weights, inputs, positions)
        return h @ self._head_weight(weights.non_block()).t()

    @torch.no_grad()
    def loss_sum(self, weights: WeightSource, inputs: torch.Tensor, targets: torch.Tensor,
                 positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed token loss fp32, number of valid targets) of one batch, without gradients (positions: as
        `forward_backward`'s)."""
        B, T = inputs.shape
        h = self.hidden_states(weights, inputs, positions).view(B * T, -1)
        t = targets.reshape(-1)
        loss = chunked_lm_head_loss(h, self._head_weight(weights.non_block()), t, chunks=self.run.lmhead_chunks)
        return loss, (t != IGNORE_INDEX).sum()


def allocate_params(cfg: ModelConfig, *, dtype: torch.dtype, device: torch.device | str,
                    requires_grad: bool = True) -> dict[str, torch.Tensor]:
    """Uninitialised parameters of every internal name (fill them with `init.init_params` or a loader)."""
    return {n: torch.empty(s, dtype=dtype, device=device).requires_grad_(requires_grad)
            for n, s in param_shapes(cfg).items()}
