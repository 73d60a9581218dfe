"""The seam between the family-independent model code and a model family.

A *family* (`qtrain/model/<family>/`, found by `model/registry.py` from a config.json's `model_type`) is
everything qtrain knows about one kind of decoder: its config fields and their HF mapping, its parameters
(`TensorSpec`: shape, HF names, weight decay, initialisation, expert stacks, layout group), its block function,
its block matrices' GEMM shapes (`MatmulSpec`: what the FP8 policy, FLOPs/SOL and the step-cost and scale
models read) and what its block keeps for backward (`ActTerm`, stated beside the block's steps). The rest of
qtrain asks the family through `ModelFamily` and names none of a family's block tensors or dimensions (but the
non-block tensors every decoder has, 'embed', 'norm', 'lm_head', and the matrices 'up' / 'down' that the
one-function MLP of `BlockOptions.mlp` takes):

    model/transformer.py   the per-block loop, embedding, final norm, LM head + loss   (block_fn per layer)
    model/weights.py       parameter names and shapes, HF name mapping                 (non_block/block_tensors)
    model/hf_io.py, init   HF load/save driver, from-scratch initialisation            (TensorSpec)
    model/fp8_policy.py    which block linears run in FP8                              (matmuls, fp8_matrices)
    model/activations.py   activation memory: the sum of the family's statements       (activation_terms)
    parallel/layout.py     flat groups per layer                                       (block_tensors)
    observe/metrics.py, plan/step_cost.py, plan/scale.py: FLOPs                        (matmuls, attention_flops)

Every block of a model takes (x, weights, cos, sin[, docs]) and returns x (`docs`, a
`kernels.document_attention.DocumentMask`, only with --document-masking: the block hands it to its attention,
`document_attention(q, k, v, docs)`, and the cos, sin it gets are then (B, T, hs), one row per token's position):
blocks of one model may differ (a hybrid model's linear-attention and full-attention layers hold different
tensors), `block_tensors(cfg, layer)` says which tensors layer `layer` has, and the one block function tells the
kinds apart by the weights it receives.
Every family keeps documents apart (a hybrid model's linear-attention layers restart their state at each
document). A family whose layers run the gated delta rule counts them in an optional method
`delta_rule_layers(cfg)` (`registry.delta_rule_layers`: --delta-rule-precision applies to them, and is refused for a
model without any).
docs/architecture.md, "Adding a model family", walks through a new one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

import torch

from qtrain.model.config import ModelConfig
from qtrain.model.sequence_split import SequenceSplit

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "e4m3": 1}
INITS = ("normal", "residual", "ones", "zeros", "log_uniform")

# (x, weight, bias[, (weight_fp8, inv_scale[, weight_fp8_t])]) -> x @ weight^T + bias; the 4th argument only when
# the weight source provides a quantized copy (weight_source.quantized_weight)
Linear = Callable[..., torch.Tensor]
# (ln2 output, w_up, w_down, up_fp8, down_fp8, scale_hint) -> out; the fp8 tuples are None without quantized copies,
# scale_hint (SCALE_HINT) None unless the Transformer keeps hints (--fp8-swiglu-onepass)
Mlp = Callable[..., torch.Tensor]
# (x (B, T, C), the block's weights by short name, cos, sin (T, hs) or (B, T, hs)[, docs]) -> the block's output
# (B, T, C); docs: the micro-batch's DocumentMask (--document-masking), given only then
BlockFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class HfLayout:
    """Another layout in which transformers reads a tensor from a checkpoint (`TensorSpec.hf_alternatives`): its HF
    tensors (full names, shapes) and how they become the tensor (`to_ours`: the HF tensors, in order -> the tensor;
    None: their elements back to back, as `TensorSpec.hf`). Loading accepts it; export writes `TensorSpec.hf`."""
    hf: tuple[tuple[str, tuple[int, ...]], ...]
    to_ours: Callable[[list[torch.Tensor]], torch.Tensor] | None = None


@dataclass(frozen=True)
class TensorSpec:
    """One parameter tensor of a family: what the layout, the HF mapping, the optimizer and the init read.

    `hf` lists the HF tensors (full names, shapes) whose elements, back to back, are this tensor's: one entry for
    a tensor stored as HF stores it, several for a fused one (qkv = [q; k; v] rows), one per expert for a stack:
    what export writes; `hf_alternatives` are the other layouts loading accepts.
    A stack of identical expert tensors has `experts` E > 0 and shape (E, ...): expert e is `t[e]`, and expert
    parallelism can give each rank whole experts (`parallel.layout.Group.expert_pieces`)."""
    name: str  # short name inside its block ('qkv'); a non-block tensor's full name ('embed')
    shape: tuple[int, ...]
    hf: tuple[tuple[str, tuple[int, ...]], ...]
    decay: bool = True  # AdamW weight decay (matrices, embeddings); off for norm gains and biases
    init: str = "normal"  # normal: N(0, INIT_STD); residual: N(0, INIT_STD / sqrt(2 L)) (0 with init_proj_to_zero),
    # for the projections that write into the residual stream; ones / zeros: norm gains / biases; log_uniform:
    # log(U(1, 16)) (a Gated DeltaNet's A_log, init.py)
    experts: int = 0  # > 0: a stack of that many identical tensors along dim 0
    group: str = ""  # the flat layout group within its layer: '' is the block's own group ('block.{layer}'),
    # another name X a group of its own ('block.{layer}.X'), e.g. adapters that train while the block is frozen
    hf_alternatives: tuple[HfLayout, ...] = ()  # other checkpoint layouts transformers reads (an MoE model's
    # experts fused into one tensor, or under a renamed module), accepted on load
    hf_rows: tuple[tuple[int, int], ...] = ()  # () or the HF tensors' rows, back to back, as runs (start, count) of
    # this tensor's rows, in the order the checkpoint holds them (Qwen3-Next interleaves its fused projections' rows
    # per key-head group): `weights.hf_to_internal` / `internal_to_hf` permute them

    def __post_init__(self) -> None:
        if self.init not in INITS:
            raise ValueError(f"{self.name}: init {self.init!r} is not one of {INITS}")
        if self.hf_rows and sorted(self.hf_rows) != _tiling(self.hf_rows, self.shape[0]):
            raise ValueError(f"{self.name}: hf_rows must tile its {self.shape[0]} rows")
        if self.experts and (not self.shape or self.shape[0] != self.experts):
            raise ValueError(f"{self.name}: a stack of {self.experts} experts needs shape ({self.experts}, ...), "
                             f"got {self.shape}")


def _tiling(runs: tuple[tuple[int, int], ...], rows: int) -> list[tuple[int, int]]:
    """`runs` sorted if they cover 0..rows-1 once each, else something else (TensorSpec's check)."""
    ordered, at = sorted(runs), 0
    for start, count in ordered:
        if start != at or count <= 0:
            return []
        at += count
    return ordered if at == rows else []


@dataclass(frozen=True)
class MatmulSpec:
    """One block matrix's GEMM, y (M, N) = x (M, K) W^T, for a micro-batch of `tokens` tokens: M = rows x tokens.
    A routed expert stack is `count` GEMMs (one grouped GEMM) of `rows` = top_k / experts rows per token each."""
    n: int
    k: int
    step: str = ""  # the block step (recompute.STEPS' names) whose recomputation reruns it ('' for none)
    rows: float = 1  # rows of x per token of the micro-batch
    count: int = 1  # identical GEMMs (a stack of experts)

    def shape(self, tokens: int) -> tuple[int, int, int]:
        """(M, N, K) of one of its GEMMs at `tokens` tokens per micro-batch."""
        return (tokens if self.rows == 1 else round(self.rows * tokens), self.n, self.k)

    @property
    def weights(self) -> int:
        """Weights the matrix holds: count x N x K (every expert of a stack, whichever a token is routed to)."""
        return self.count * self.n * self.k

    @property
    def weights_per_token(self) -> float:
        """Multiply-adds per token of the forward (half its FLOPs): rows x count x N x K (an int for dense ones)."""
        return self.n * self.k * self.count if self.rows == 1 else self.rows * self.count * self.n * self.k


@dataclass(frozen=True)
class BlockOptions:
    """How a block function runs, the same for every family (the Transformer fills it from RunOptions; a family
    ignores what its block does not have). See `transformer.make_block_fn` for each field."""
    linear: Linear = torch.nn.functional.linear
    recompute: frozenset[str] = frozenset()  # block steps (recompute.STEPS' names) rerun in backward
    attn_chunks: int = 1
    mlp_chunks: int = 1  # the MLP over token slices, each rerun in backward (a family that has no such seam refuses)
    compiled: bool = False
    swiglu: str = "autograd"  # the SwiGLU op's mode (kernels/swiglu: "autograd" or "kernel")
    mlp: Mlp | None = None
    sdpa_backend: str = "auto"
    linears: Mapping[str, Linear] | None = None
    rope: str = "autograd"  # the RoPE op's mode (kernels/rope.py: "autograd" or "kernel")
    rebuilt_input_linear: Linear | None = None
    norm_fed_fp8: bool = False
    # (matrix name, linear input, the block's weights, linear output) -> output with a low-rank adapter's term added
    # (model/lora/adapter.py); None: no adapters
    adapter: Callable[[str, torch.Tensor, dict, torch.Tensor], torch.Tensor] | None = None
    experts: Any = None  # expert parallelism's token exchange (model/moe.ExpertExchange); None: every expert here
    fp8_experts: bool = False  # the expert GEMMs in e4m3, row-wise scaled (--fp8-experts: kernels/grouped_gemm_fp8.py)
    context: SequenceSplit | None = None  # context parallelism: this rank's part of each sequence (eager blocks)
    delta_rule_precision: str = "fp32"  # the delta rule's products on CUDA (choices.DELTA_RULE_PRECISIONS)


@dataclass(frozen=True)
class ActivationSettings:
    """What the saved bytes of a block depend on besides the config (activations.activation_terms' arguments)."""
    model_dtype: str = "bf16"
    matmul_dtype: str = ""  # '' (the model dtype) or 'e4m3'
    compiled: bool = False
    recompute: frozenset[str] = frozenset()  # recompute switches (resolved: recompute.resolve_flags)
    attn_chunks: int = 1
    mlp_chunks: int = 1  # --mlp-chunks: the MLP keeps nothing but its input; its backward rebuilds 1/N at a time
    fp8_weight_copies: bool = True  # False with --persistent-quants (the linears keep views, not copies)
    fp8_keep_transposes: bool = False
    documents: bool = False  # --document-masking: the block keeps its documents' masks (Qwen3.5's delta rule)
    # LoRA (--lora-rank): no base tensor needs a gradient, so a norm's gain product keeps no normalized value and a
    # base linear keeps its input only for an adapter that reads it, the block matrices in `adapter_inputs` (each
    # target's matrix, without --lora-dropout: with it the adapter keeps its dropped copy, the plan's LoRA row)
    frozen_base: bool = False
    adapter_inputs: frozenset[str] = frozenset()
    seq_len: int = 0  # tokens of one sequence (a rank's part); 0: unknown, taken as long (Qwen3.5's delta rule keeps
    # one chunk less of some buffers per sequence)
    fp8_experts: bool = False  # --fp8-experts: the expert GEMMs keep e4m3 inputs and row scales (model/moe_block.py)
    delta_rule_kernels: bool = False  # Gated DeltaNet's convolution and delta rule run as their op pairs (CUDA with
    # Triton: `kernels.delta_rule.op_pairs_on`), which keep their inputs only, not the twins' chunk buffers
    expert_parallel: int = 1  # --expert-parallel: an MoE layer's experts keep the rows the token exchange brought
    # them, planned at the worst case (`moe.max_received_rows`) unless `balanced_experts` (the plan's comparison)
    balanced_experts: bool = False
    swiglu_epilogue: bool = False  # the compiled model-dtype MLP as one op whose GEMMs carry the SwiGLU
    # (kernels/gated_mlp.py): it keeps its input and the up/gate output, never the SwiGLU output

    def lin_of(self, matrix: str) -> bool:
        """Whether a block linear of `matrix` keeps its (model-dtype) input: for its weight's gradient, or over a
        frozen base only for the adapter that reads it."""
        return matrix in self.adapter_inputs or not self.frozen_base

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.model_dtype]

    @property
    def fp8(self) -> bool:
        return (self.matmul_dtype or self.model_dtype) == "e4m3"


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


class ModelFamily(Protocol):
    """What a model family provides (module docstring). One instance per family, listed in model/registry.py."""

    name: str  # the folder's name, e.g. 'llama'
    architectures: Mapping[str, str]  # HF model_type -> the architecture its config.json names (and qtrain writes)
    presets: Mapping[str, Callable[[], ModelConfig]]  # built-in sizes for --from-scratch without a config.json
    fp8_matrices: tuple[str, ...]  # block matrices whose linears may run in FP8 (--matmul-dtype e4m3)

    def config_from_hf(self, d: dict[str, Any], *, source: str) -> ModelConfig:
        """The family's config from a parsed config.json whose model_type it owns; errors name `source` and the key."""

    def non_block_tensors(self, cfg: ModelConfig) -> tuple[TensorSpec, ...]:
        """The tensors outside the blocks, in layout order: 'embed', 'norm' and, untied, 'lm_head'."""

    def block_tensors(self, cfg: ModelConfig, layer: int) -> tuple[TensorSpec, ...]:
        """Block `layer`'s tensors in their fixed order (buffers, RNG keys, gradients)."""

    def ignored_hf_tensor(self, cfg: ModelConfig, name: str) -> str | None:
        """What a checkpoint tensor outside the model is ('the vision tower') when loading skips it with a note, None
        when it is not one the family knows (an unexpected tensor is then an error)."""

    def make_block_fn(self, cfg: ModelConfig, options: BlockOptions) -> BlockFn:
        """The block function serving every layer (weights are inputs, so one compiled function does); a family whose
        layers differ tells them apart by the tensors it receives (under torch.compile each kind compiles once)."""

    def matmuls(self, cfg: ModelConfig, layer: int) -> dict[str, MatmulSpec]:
        """Block `layer`'s matrices as GEMMs, by weight name."""

    def attention_flops(self, cfg: ModelConfig, layer: int, seq_len: int) -> int:
        """Forward FLOPs per token of block `layer`'s sequence mixing beyond its matrices (causal attention: the
        QK^T and PV products over seq_len / 2 keys on average)."""

    def activation_terms(self, cfg: ModelConfig, layer: int, s: ActivationSettings) -> list[ActTerm]:
        """What block `layer` keeps for backward, per token and per layer, term by term (stated beside its steps)."""

    def backward_temporaries(self, cfg: ModelConfig, layer: int, tokens: int, s: ActivationSettings) -> int:
        """Bytes of activation-gradient temporaries block `layer`'s backward allocates at its peak, beyond its
        weight gradients and d(input) (a measured upper bound: activations.workspace_phases)."""


def decoder_non_block_tensors(cfg: ModelConfig) -> tuple[TensorSpec, ...]:
    """The embedding, the final norm and the untied LM head under transformers' decoder names (`model.embed_tokens`,
    `model.norm`, `lm_head`): what the families so far share."""
    V, C, p = cfg.vocab_size, cfg.hidden_size, cfg.hf_prefix
    specs = [TensorSpec("embed", (V, C), ((f"{p}embed_tokens.weight", (V, C)),)),
             TensorSpec("norm", (C,), ((f"{p}norm.weight", (C,)),), decay=False, init="ones")]
    if not cfg.tie_word_embeddings:
        specs.append(TensorSpec("lm_head", (V, C), (("lm_head.weight", (V, C)),)))
    return tuple(specs)
