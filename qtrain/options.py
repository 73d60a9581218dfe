"""Every setting of a training run, in one dataclass, validated once before anything large is allocated.

Field names are llm.q's option names with '-' -> '_' (`--grad-accumulation` -> `grad_accumulation`), so
data prepared and commands written for llm.q carry over. The CLI (`qtrain.cli`) and config files (TOML or
YAML) both fill this object; `validate()` is the single place where combinations are checked.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, fields
from typing import Any, Iterable

from qtrain.fsio import shorten
from qtrain.kernels.document_attention import DOCUMENT_ATTENTION
from qtrain.model.fp8_policy import DEFAULT_MIN_BLOCK_GFLOP as DEFAULT_FP8_MIN_BLOCK_GFLOP
from qtrain.model.fp8_policy import DEFAULT_MIN_SIZE as DEFAULT_FP8_MIN_SIZE
from qtrain.model.config import ModelConfig
from qtrain.model.fp8_policy import FP8_POLICIES, Fp8Choice, block_gflop, choose_fp8
from qtrain.model.layers import SDPA_BACKENDS
from qtrain.model.recompute import FLAGS as RECOMPUTE_FLAGS
from qtrain.model.recompute import resolve_flags, splits_mlp

DTYPES = ("fp32", "bf16")
MATMUL_DTYPES = ("fp32", "bf16", "e4m3")
GRADIENT_DTYPES = ("e4m3", "e5m2")
OPT_M_DTYPES = ("fp32", "bf16", "e4m3")
OPT_V_DTYPES = ("fp32", "bf16")
SCHEDULES = ("cosine", "linear", "wsd")
DEFAULT_MODEL = "qtrain-tiny"  # the embedded default: a small model trained on the embedded corpus


# fields with a fixed set of values (validate() checks them; the CLI lists them in --help)
CHOICES: dict[str, tuple[str, ...]] = {
    "model_dtype": DTYPES, "master_dtype": DTYPES, "grad_accum_dtype": DTYPES, "fp8_policy": FP8_POLICIES, "matmul_dtype": MATMUL_DTYPES, "gradient_dtype": GRADIENT_DTYPES,
    "opt_m_dtype": OPT_M_DTYPES, "opt_v_dtype": OPT_V_DTYPES, "lr_schedule": SCHEDULES,
    "device": ("auto", "cpu", "cuda"), "compile": ("auto", "on", "off"), "sdpa_backend": SDPA_BACKENDS,
    "document_attention": DOCUMENT_ATTENTION,  # --document-masking (issue 45)
}
# --use-cuda-graphs unset (auto) turns graphs on up to this much GEMM work per block and micro-step: where the
# host sets the pace. Measured on one H200 (BENCHMARKS.md, session 9), Qwen2.5-0.5B bf16: 366 GFLOP (4 x 1024)
# 2.90x, 1466 (16 x 1024) 1.027x, 2931 (32 x 1024) 1.009x; larger blocks were not measured with graphs.
CUDA_GRAPHS_AUTO_MAX_BLOCK_GFLOP = 3000.0
EMPTY_MEANS_DEFAULT = ("matmul_dtype", "gradient_dtype", "master_dtype", "grad_accum_dtype")  # '' = follow the model / matmul dtype


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate most like a mistyped `name`, for "did you mean ...?" hints. The similarity cut-off (difflib
    ratio 0.7) takes typos (--stesp: 0.86) and cut-off names (--grad-accum: 0.77), not unrelated words
    (--frobnicate vs --from-scratch: 0.62)."""
    import difflib
    found = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.7)
    return found[0] if found else None


class OptionsError(ValueError):
    """A bad option or combination of options; the message names the option(s) and the fix."""


@dataclass(kw_only=True)
class Options:
    # ---- model / dtypes ----
    model: str = ""
    """Model directory, `org/name` in the local HF cache, or (with --from-scratch) a preset name.
    Empty: the embedded default (a tiny model trained from scratch on the embedded corpus)."""
    from_scratch: bool = False
    """Random initialisation instead of loading weights (a preset name or a config.json is enough)."""
    init_proj_to_zero: bool = False
    """Zero-initialise attention-out and MLP-down projections (needs --from-scratch)."""
    seed: int = 42
    """Seed of the from-scratch initialisation and of stochastic rounding."""
    model_dtype: str = "bf16"
    """Weights the model computes with, activations and weight gradients: fp32 or bf16. They are also the
    master weights the optimizer updates unless --master-dtype differs (bf16 then has no fp32 copy)."""
    master_dtype: str = ""
    """Master weights, their gradient accumulation and the optimizer's weights: '' = the model dtype; fp32 with
    --model-dtype bf16 keeps fp32 master weights and fp32 gradient sums while the model runs in bf16 (a bf16
    copy of the master made once per optimizer step; docs/precision.md). llm.q's Python-only master_dtype."""
    matmul_dtype: str = ""
    """Dtype of the four block linears; '' = model dtype; e4m3 = FP8."""
    grad_accum_dtype: str = ""
    """Weight-gradient buffers (the sums over micro-steps the optimizer reads): '' = the master dtype; bf16 with
    --master-dtype fp32 halves their bytes and adds stochastically rounded (the first micro-step's copy is exact)."""
    fp8_policy: str = "auto"
    """With --matmul-dtype e4m3: which block linears run in FP8. auto = only where FP8 pays: none when a block's
    GEMMs per micro-step are too small to keep the GPU the bottleneck (--fp8-min-block-gflop: FP8's extra kernels
    would slow a host-bound step), else those whose GEMM is large enough (--fp8-min-size); the others stay in the
    model dtype and the choice is logged at start (docs/precision.md). all = the four (QKV, attention out, MLP up
    and down) whatever the layout."""
    fp8_min_size: int = DEFAULT_FP8_MIN_SIZE
    """--fp8-policy auto's threshold on a linear's GEMM size M*N*K/(M*K+M*N+N*K) (M = batch x seq tokens, N, K its
    output / input features): FP8 at or above it."""
    fp8_min_block_gflop: float = DEFAULT_FP8_MIN_BLOCK_GFLOP
    """--fp8-policy auto's threshold on the GFLOP of one block's four linears per micro-step (6 x tokens x their
    weights): below it no linear runs in FP8 (model/fp8_policy.py)."""
    gradient_dtype: str = ""
    """FP8 format of activation gradients with --matmul-dtype e4m3 (e4m3 or e5m2); '' = e4m3."""
    opt_m_dtype: str = "fp32"
    """Adam first moment: fp32, bf16 (stochastically rounded) or e4m3 (block-scaled)."""
    opt_v_dtype: str = "fp32"
    """Adam second moment: fp32 or bf16 (stochastically rounded)."""
    stochastic_rounding: bool = True
    """Round bf16 weight and Adam-state writes stochastically (--no-stochastic-rounding: to nearest, which
    stalls small updates; for experiments that show why SR matters)."""

    # ---- data / shapes ----
    train_file: str = ""
    """Token file(s) (a glob, quote it); empty = the embedded corpus."""
    eval_file: str = ""
    """Token file(s) for evaluation; empty = the embedded corpus' eval split (or none with --train-file)."""
    train_seed: int = 0x83B45442
    """Seed of the training data order (file and chunk shuffling per epoch)."""
    eval_seed: int = 0x384B4524
    """Seed of the evaluation loader (evaluation reads its files in order; kept for llm.q's command lines)."""
    batch_size: int = 4
    """Micro-batch per GPU (sequences)."""
    seq_len: int = 1024
    """Tokens per sequence (the loader cuts token files into non-overlapping chunks of this length)."""
    lmhead_chunks: int = 1
    """Split the LM head + loss into N row chunks so fp32 logits exist for 1/N of the tokens at a time."""
    attn_bwd_chunks: int = 1
    """Run attention as N calls over batch slices: backward workspace for B/N sequences, one more copy of the output."""
    sdpa_backend: str = "auto"
    """Attention kernel: auto (cudnn for bf16 on Hopper GPUs, else torch's choice) | flash | cudnn | math. All
    compute the same function, but each takes only some dtypes and devices (flash and cudnn: bf16/fp16 on
    CUDA; on the CPU, cudnn runs its fp32 specification, which materializes the (B, heads, T, T) scores)."""

    # ---- document masking (packed SFT data: `qtrain tokenize --pack-to`; data/documents.py) ----
    document_masking: bool = False
    """Keep attention inside each document and restart RoPE positions at each document's first token: documents
    as the token files record them (qtrain tokenize --pack-to), else split after each EOS token; a row starts a new
    document, and targets that cross into the next document are not trained. Train and eval files alike."""
    document_attention: str = "auto"
    """Attention with --document-masking: auto (varlen for bf16 on CUDA, else masked) | varlen (flash attention over
    the documents as variable-length sequences) | masked (SDPA with a block-diagonal causal mask: the fallback)."""

    # ---- optimiser / schedule ----
    learning_rate: float = 1e-5
    """Peak learning rate (after warmup)."""
    warmup: int = 0
    """Steps of linear warmup from 0 to the peak learning rate."""
    cooldown: int = 0
    """Final steps of 1-sqrt cooldown (to --final-lr-fraction; the tail of a wsd run)."""
    final_lr_fraction: float = 1.0
    """Learning rate of the last step, as a fraction of the peak (0 = decay to zero)."""
    lr_schedule: str = "cosine"
    """Shape after warmup: cosine or linear decay to the final fraction, or wsd (constant, then --cooldown)."""
    beta_1: float = 0.9
    """AdamW beta1 (first-moment decay)."""
    beta_2: float = 0.95
    """AdamW beta2 (second-moment decay)."""
    adam_epsilon: float = 1e-8
    """AdamW epsilon, added to sqrt(v)."""
    weight_decay: float = 0.1
    """Decoupled weight decay of the matrices and embeddings (not of norms and biases)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (<= 0 disables)."""
    z_loss: float = 0.0
    """Strength of the z-loss (log-sum-exp squared) that keeps logits from drifting; 0 = off."""
    grad_accumulation: int = 4
    """Micro-batches per optimizer step (sequences per step = batch x grad-accumulation x GPUs)."""
    steps: int = -1
    """Optimizer steps; -1 = epochs x steps per epoch."""
    epochs: int = 1
    """Passes over the training files when --steps is -1."""
    eval_every_n_steps: int = 100
    """Evaluate every N optimizer steps (and once over the whole eval file at the end)."""
    eval_num_steps: int = 100
    """Batches per periodic evaluation; the final evaluation covers the whole eval file."""

    # ---- output / checkpoints / logging ----
    name: str = "qtrain"
    """Run name; replaces %n in --out-dir, --checkpoint-dir, --log-file and --tensorboard. Not given: the last
    folder of a given --out-dir (so each fine-tune into its own folder has its own checkpoints and log)."""
    out_dir: str = "output/%n"
    """Directory of the final Hugging Face export (config.json, safetensors, tokenizer, generation config)."""
    checkpoint_dir: str = "ckpt/%n"
    """Directory of the training checkpoints (step_NNNNNNNN/), for --continue and `qtrain export`."""
    ckpt_interval: int = 100
    """Write a checkpoint every N optimizer steps."""
    ckpt_keep_n: int = -1
    """Keep the newest N checkpoints (besides --ckpt-major ones); -1 keeps all. The newest checkpoint written
    after a finite step is never deleted. 0 is refused: it would delete each checkpoint right after writing it."""
    ckpt_major: int = -1
    """Checkpoints at steps divisible by N are never deleted by --ckpt-keep-n (-1 = none)."""
    save_training_state: bool = True
    """Write a final checkpoint at the end (--no-save-training-state to skip)."""
    continue_from: str | None = None
    """`--continue [STEP|PATH]`: resume from the latest checkpoint, a step, or a path."""
    new_data: bool = False
    """With --continue: accept training data that changed since the checkpoint (a token file replaced, appended to,
    truncated or rewritten, a glob that gained or lost a file), another --seq-len or --train-seed; the data position
    is not restored but restarts at the start of the training data (without it such a resume is refused)."""
    override_schedule: bool = False
    """With --continue: take the learning-rate schedule (--lr-schedule, --warmup, --cooldown, --final-lr-fraction)
    and the global batch (batch x grad-accumulation x ranks) from this command instead of refusing a change of them
    (Megatron-LM's --override-opt_param-scheduler). Other changed options (--lr, --weight-decay, ...) are always
    accepted and reported; --steps may grow, never fall below the checkpoint's step."""
    start_over: bool = False
    """Start a new run where an earlier one left checkpoints, an export or a log (without it qtrain refuses, and
    --continue resumes that run): its checkpoints are deleted, its export files replaced, its log kept aside."""
    max_nonfinite_steps: int = 10
    """Stop the run (exit code 3) after this many steps in a row with a non-finite loss or gradient norm; each
    is skipped and reported, and the newest finite checkpoint is kept (0 = never stop)."""
    log_file: str = "logs/%n.jsonl"
    """JSON Lines run log (`qtrain plot`, `qtrain export-wandb`); '' = none; %n = --name."""
    tensorboard: str = ""
    """Directory for live TensorBoard scalars (loss, lr, norm, tokens/s, eval); '' = off."""
    wandb: str = ""
    """Weights & Biases project to log the run to live (rank 0); '' = off. WANDB_MODE=offline keeps it local
    (`wandb sync` uploads later); WANDB_ENTITY / WANDB_DIR as usual."""
    tokenizer: str = ""
    """Tokenizer written into exports (qwen2 | gpt2 | tokenizer.json | HF model directory); '' = the model
    directory's tokenizer files, else the tokenizer the token files record (or their vocab size implies)."""
    log_gpu_util: int = 25
    """Every N steps log GPU utilisation, power, clocks, temperature and memory (needs NVML: nvidia-ml-py);
    0 = off. Has no effect on CPU runs."""
    debug_time_breakdown: bool = False
    """Log how long each micro-step (forward + backward) and the update take, timed with device events;
    costs a device sync per step."""
    debug_stack_dump_after: int = 0
    """Seconds a step (with its evaluation and checkpoint) may take before every thread's Python stack is written
    to stderr (faulthandler), once per step, while the run goes on: where a stalled run waits. 0 = off."""
    debug_log_allocations: int = -1
    """Record device memory allocations and, after the first step, log every live one of at least this many
    MiB with the code that made it (-1 = off; CUDA only)."""
    debug_log_abs_max: int = 0
    """Every N steps log the abs-max (= FP8 scale) of each block linear's input, output gradient and weight
    (0 = off); the debug steps run the blocks uncompiled."""

    # ---- execution ----
    device: str = "auto"
    """auto | cpu | cuda."""
    compile: str = "auto"
    """torch.compile the blocks: auto (on for CUDA) | on | off."""
    compile_tuning: bool = False
    """With compiled blocks, let inductor tune its generated kernels' launch configurations (coordinate descent).
    Off by default: on a machine that never compiled the shapes it adds about 75 s to the first step of a 0.5B run
    (20 of its kernels, 3.7 s each) and 7.5 s even when cached, for e4m3 blocks 1.4% faster at 1.5B and bf16 ones
    no faster (H100/H200 measurements in BENCHMARKS.md)."""
    compile_cache: str = "auto"
    """Folder for compiled code kept between runs (inductor's and Triton's caches), so a second run or --continue
    of the same shapes starts in seconds: auto = $XDG_CACHE_HOME/qtrain/compile (~/.cache/qtrain/compile); none
    = torch's own defaults (inductor's in the temp folder); or a folder. TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR
    set in the environment win. Runs may share it."""
    compile_autotune_gemm: bool = False
    """With compiled blocks, let inductor time its Triton GEMM templates against cuBLAS for every block GEMM
    shape and keep the faster (inductor's max_autotune_gemm), fusing the pointwise work after a GEMM into a
    Triton one. At Qwen2.5-14B shapes the templates ran 769/746/797 TFLOP/s against cuBLAS's 788/765/733 (MLP
    up forward/dgrad/wgrad, BENCHMARKS.md session 6). In training at Qwen2.5-1.5B (session 17) cuBLAS won every
    one of the 12 bf16 block GEMM shapes (the best template at 65-92% of its speed) and the 4 e4m3 forward shapes
    timed (85-95%), so the step ran as without (0.978x llm.q both ways), after minutes of compiling (bf16 ~2 min;
    e4m3 over 5: 106 candidates per FP8 shape). Off unless asked."""
    gpus: int = 0
    """Local worker processes to start (0 = all visible GPUs, or 1 on CPU). Under torchrun: the launcher's."""
    collective_timeout: float = 600.0
    """Seconds a collective waits for the other ranks before the run fails with an error naming the rank that
    stopped answering (raise it for exports or checkpoints on slow storage)."""
    memory_check: bool = True
    """Refuse a run whose memory plan does not fit the host's available memory (CPU runs, offloaded
    buffers) before allocating anything (--no-memory-check to try anyway)."""
    zero_level: int = 1
    """ZeRO level: 1 shards the Adam state, 2 also the gradients, 3 also the weights (0 acts as 1)."""
    shard_gradients: bool = False
    """Shard the gradients across ranks (ZeRO-2): reduce-scatter per block every micro-step."""
    all_to_all_reduce: bool = False
    """With sharded gradients: reduce with an all-to-all exchange instead of a reduce-scatter."""
    offload_gradients: bool = False
    """Keep the sharded gradient shards in pinned host memory (needs sharded gradients)."""
    shard_group_size: int = 0
    """Hybrid sharding: cut optimizer state, gradients and (sharded) weights across groups of this many
    consecutive ranks (e.g. one node's GPUs) and replicate them across the groups; gradients are reduced inside
    a group, then their shards across groups. 0 = all ranks (flat sharding); must divide the number of ranks."""
    recompute_block: bool = False
    """Keep only each block's input, rerun the whole block in backward (implies att, ffn, norm)."""
    recompute_swiglu: bool = False
    """Recompute SwiGLU from the MLP-up output in backward instead of keeping it."""
    recompute_norm: bool = False
    """Recompute the two RMSNorm outputs (LN1, LN2) in backward instead of keeping them."""
    recompute_ffn: bool = False
    """Recompute LN2, the MLP-up GEMM and SwiGLU in backward (implies --recompute-swiglu)."""
    recompute_qkv: bool = False
    """Recompute the QKV GEMM (+ qk-norm) and RoPE in backward instead of keeping Q, K, V."""
    recompute_att: bool = False
    """Recompute LN1, QKV + RoPE and attention in backward (implies --recompute-qkv)."""
    offload_residual: bool = False
    """With --recompute-block: keep block inputs in pinned host memory, so activations stop growing with depth."""
    shard_weights: bool = False
    """Keep only this rank's shard of the weights (ZeRO-3); blocks are all-gathered just in time, double buffered."""
    persistent_quants: bool = False
    """Keep e4m3 copies of the four block matrices from the first micro-step of an optimizer step to the
    update, reused by every micro-step (needs --matmul-dtype e4m3). Sharded weights: each rank's shard in
    e4m3, gathered instead of the bf16 matrices (half the bytes); replicated weights: a copy of every layer and
    its transpose on the device (2 bytes per block parameter; the linears' saved per-layer copies, 1 byte, go
    away). Without it each linear quantizes its weight and its backward transposes it, every micro-step."""
    fp8_keep_transposes: bool | None = None
    """With --matmul-dtype e4m3 and a compiled block: keep the e4m3 transposed copy of each block linear's input
    for its weight gradient (1 byte per element, as an eager block does) instead of letting torch.compile rebuild
    it in backward, where inductor writes transposes at 1-2 TB/s; every transposed quantization then runs the
    Triton kernel (~4.8 TB/s on an H200). The same quantization; costs memory (the plan counts it): two
    hidden-size rows of e4m3 per token and layer (the norm outputs' copies; the attention and SwiGLU outputs'
    stay rebuilt where --recompute-att / --recompute-swiglu rebuild those outputs). Unset (auto): on where the
    memory plan with the copies fits the device with 4% of activations + workspace to spare (plan/memory.AUTO_MARGIN:
    fragmentation can exceed the plan's 5%) (measured 1.4% faster at Qwen2.5-3B, 0.5% at 1.5B on an H200), else
    off."""
    fp8_swiglu_onepass: bool | None = None
    """With --matmul-dtype e4m3: write the SwiGLU output and its gradient (the MLP's two largest tensors) to e4m3
    in one pass each, with power-of-two scales predicted from the layer's previous micro-step (kept while it fits
    and wastes at most one binade) and re-done where it does not, instead of a bf16 pass and a quantize pass with
    the exact scale (6 and 10 bytes per element of the intermediate size moved, instead of 10 and 18). The scale of
    those two tensors is 2^e (their largest element lands between FMAX/4 and FMAX); the predictions are run state,
    saved in checkpoints. Applies where
    the MLP runs as one compiled FP8 function (torch.compile on, no --recompute-swiglu / --recompute-ffn; with
    --recompute-block, which reruns the whole block, it applies); eager blocks quantize as without it. Measured on
    an H200 against llm.q's bf16 (BENCHMARKS.md, sessions 14-15): +3.2% at Qwen2.5-1.5B, +1.3% at 3B; the fidelity
    suite's 0.5B e4m3 runs with and without it evaluate within 0.25% of each other over 250 steps. Unset (auto): on
    with --matmul-dtype e4m3 unless --recompute-swiglu / --recompute-ffn split the MLP; --no-fp8-swiglu-onepass
    keeps the exact abs-max scales."""
    fp8_head_backward: bool = False
    """With --matmul-dtype e4m3: run the LM head's two gradient GEMMs (d(hidden) and d(W_head)) in FP8, the
    cross-entropy writing d(logits) straight to e5m2 at a fixed power-of-two scale (and its transpose) and the head
    weight and final hidden states quantized to e4m3 per micro-step; the logits GEMM, and so the loss, stay in the
    model dtype. llm.q keeps the whole head in bf16; the head is ~16% of a Qwen2.5-1.5B e4m3 step. Needs the
    vocabulary and hidden size to be multiples of 16 (cuBLASLt FP8); a micro-batch whose tokens are not a multiple of
    16 runs its head in bf16. Costs memory (the plan counts it): one byte per logit of a chunk, and the e4m3 copies.
    Measured on an H200 (BENCHMARKS.md session 23): +2.7% (7B, 8 x 8) to +5.5% (0.5B, 64 x 2); off by default for
    the memory. See docs/precision.md for its fidelity."""
    offload_quants: bool = False
    """Keep the persistent e4m3 weight shards in pinned host memory (needs --persistent-quants and sharded weights)."""
    offload_master: bool = False
    """Weight shards in pinned host memory (they are the master: qtrain has no separate copy); needs sharded weights."""
    offload_opt_m: bool = False
    """Adam first-moment shards in pinned host memory, streamed through the device for the update."""
    offload_opt_v: bool = False
    """Adam second-moment shards in pinned host memory, streamed through the device for the update."""
    use_zero_copy: bool = False
    """Update offloaded state in place instead of staging it through the device (CPU only; refused on CUDA)."""
    use_cuda_graphs: bool | None = None
    """Replay each micro-step's forward and backward from CUDA graphs (llm.q's --use-cuda-graphs), one per phase
    of a step, captured after one eager warm-up micro-step of each: the host stops setting the pace at small
    sizes, same bits. One process, replicated weights, unsharded gradients, no offload, no --persistent-quants
    (train/cuda_graphs.py refuses the rest); refused with --device cpu, no effect without a CUDA device.
    Unset (auto): on where it was measured faster, i.e. on a CUDA device where nothing blocks it, no block
    linear runs in FP8 and a block's GEMM work per micro-step is at most CUDA_GRAPHS_AUTO_MAX_BLOCK_GFLOP."""

    # ---------------------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        pass

    @property
    def effective_matmul_dtype(self) -> str:
        return self.matmul_dtype or self.model_dtype

    @property
    def effective_fp8_swiglu_onepass(self) -> bool:
        """--fp8-swiglu-onepass as given, else (auto) on with e4m3 matmuls where no recompute splits the MLP."""
        if self.fp8_swiglu_onepass is not None:
            return self.fp8_swiglu_onepass
        return self.effective_matmul_dtype == "e4m3" and not splits_mlp(self.recompute)

    def fp8_choice(self, cfg: ModelConfig) -> Fp8Choice | None:
        """Which block linears run in FP8 at this micro-batch shape (--fp8-policy and its thresholds); None
        without --matmul-dtype e4m3."""
        if self.effective_matmul_dtype != "e4m3":
            return None
        return choose_fp8(cfg, self.batch_size * self.seq_len, self.fp8_policy, self.fp8_min_size,
                          self.fp8_min_block_gflop)

    def cuda_graph_blockers(self, *, world: int) -> list[str]:
        """What --use-cuda-graphs cannot capture yet in this run (train/cuda_graphs.py): empty if nothing."""
        out = []
        if world > 1:
            out.append(f"{world} processes (--gpus, torchrun): graphs run on one process for now")
        if self.weights_sharded:
            out.append("sharded weights (--shard-weights, --zero-level 3)")
        if self.gradient_manager_kind != "unsharded":
            out.append("sharded gradients (--shard-gradients, --zero-level 2, --all-to-all-reduce)")
        offload = [f"--{n.replace('_', '-')}" for n in ("offload_master", "offload_opt_m", "offload_opt_v",
                                                         "offload_gradients", "offload_quants", "offload_residual",
                                                         "use_zero_copy") if getattr(self, n)]
        if offload:
            out.append(f"offloading ({', '.join(offload)})")
        if self.persistent_quants:
            out.append("--persistent-quants (its per-step FP8 weight cache is host-side logic)")
        if self.debug_log_abs_max:
            out.append("--debug-log-abs-max (it records values on the host during the micro-step)")
        if self.document_masking:  # issue 45
            out.append("--document-masking (the number of documents, so the shapes attention takes, changes "
                       "from micro-batch to micro-batch)")
        return out

    def cuda_graphs_on(self, cfg: ModelConfig, *, world: int, device_type: str) -> bool:
        """Whether this run's micro-steps replay from CUDA graphs: --use-cuda-graphs as given (on a CUDA
        device); unset, only where they were measured faster (BENCHMARKS.md, session 9: Qwen2.5-0.5B at 4 x 8
        2.90x, 16 x 2 1.027x, 32 x 4 1.009x), i.e. nothing blocks them, no linear runs in FP8 (a cold-compile
        hang with FP8 under capture is not understood yet) and the block's GEMM work per micro-step is at most
        CUDA_GRAPHS_AUTO_MAX_BLOCK_GFLOP: above it the GPU, not the host, sets the pace."""
        if device_type != "cuda" or self.use_cuda_graphs is False:
            return False
        if self.use_cuda_graphs:
            return True
        fp8 = self.fp8_choice(cfg)
        return (not self.cuda_graph_blockers(world=world) and not (fp8 is not None and fp8.fp8)
                and self.debug_log_allocations < 0  # it locates the first step's allocations: keep them eager
                and block_gflop(cfg, self.batch_size * self.seq_len) <= CUDA_GRAPHS_AUTO_MAX_BLOCK_GFLOP)

    @property
    def effective_master_dtype(self) -> str:
        """The dtype of the master weights (and of the gradient buffers and the optimizer's weights)."""
        return self.master_dtype or self.model_dtype

    @property
    def effective_grad_accum_dtype(self) -> str:
        """The dtype of the gradient buffers (--grad-accum-dtype, else the master dtype)."""
        return self.grad_accum_dtype or self.effective_master_dtype

    @property
    def separate_master(self) -> bool:
        """--master-dtype fp32 with --model-dtype bf16: the model runs on a bf16 copy of fp32 master weights."""
        return self.effective_master_dtype != self.model_dtype

    @property
    def recompute(self) -> frozenset[str]:
        """The --recompute-* switches that are on, with what they imply (the set the model runs with)."""
        return resolve_flags(f for f in RECOMPUTE_FLAGS if getattr(self, f"recompute_{f}"))

    @property
    def weights_sharded(self) -> bool:
        """--shard-weights or --zero-level 3 (which also shards the gradients)."""
        return self.shard_weights or self.zero_level == 3

    @property
    def weights_quantized_once(self) -> bool:
        """--persistent-quants in effect: the FP8 weights are made once per optimizer step (sharded weights: e4m3
        shards; replicated: cached copies, except under --debug-log-abs-max, whose recorder watches the linears
        quantize their weights themselves). Whether any linear runs in FP8 is the FP8 policy's to say."""
        return self.persistent_quants and (self.weights_sharded or not self.debug_log_abs_max)

    @property
    def gradient_manager_kind(self) -> str:
        if self.shard_gradients or self.zero_level >= 2:
            return "all-to-all" if self.all_to_all_reduce else "reduce-scatter"
        return "unsharded"

    def _validate_master(self, err) -> None:
        """--master-dtype: only fp32 master weights under a bf16 model are a separate copy (docs/precision.md)."""
        if self.grad_accum_dtype and self.grad_accum_dtype != self.effective_master_dtype and not self.separate_master:
            raise err(f"--grad-accum-dtype {self.grad_accum_dtype} only applies with --master-dtype fp32 (otherwise the "
                      "gradient buffers are in the model dtype)")
        if not self.separate_master:
            return
        if self.model_dtype != "bf16":
            raise err(f"--master-dtype {self.master_dtype} with --model-dtype {self.model_dtype}: a separate master "
                      "copy is fp32 under a bf16 model (--model-dtype bf16 --master-dtype fp32); for all-fp32 "
                      "training use --model-dtype fp32 alone")
        if self.opt_m_dtype != "fp32" or self.opt_v_dtype != "fp32":
            raise err("--master-dtype fp32 needs --opt-m-dtype fp32 and --opt-v-dtype fp32 (low-precision moments "
                      "with fp32 master weights are not a supported combination)")
        if self.offload_master:
            raise err("--master-dtype fp32 with --offload-master is not supported yet: the offloaded shards are "
                      "gathered in their own dtype (drop one of them)")

    def expand(self, path: str) -> str:
        return path.replace("%n", self.name)

    def validate(self) -> "Options":
        """Raise OptionsError naming the option(s) and the fix; return self for chaining."""
        def err(msg: str) -> OptionsError:
            return OptionsError(msg)

        def choice(opt: str, value: str, allowed: tuple[str, ...]) -> None:
            if value not in allowed:
                raise err(f"--{opt}={value!r}: must be one of {', '.join(allowed)}")

        for f in fields(self):  # NaN / inf pass every comparison below (nan < 0 is False): refuse them first
            v = getattr(self, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise err(f"--{f.name.replace('_', '-')} must be a finite number, got {v}")
        check_run_name(self.name)
        for opt, v in (("out-dir", self.out_dir), ("checkpoint-dir", self.checkpoint_dir),
                       ("compile-cache", self.compile_cache)):
            if not v.strip():
                raise err(f"--{opt} must not be empty")
        for name, allowed in CHOICES.items():
            value = getattr(self, name)
            if value or name not in EMPTY_MEANS_DEFAULT:
                choice(name.replace("_", "-"), value, allowed)
        if self.fp8_min_size < 0:
            raise err(f"--fp8-min-size must be >= 0, got {self.fp8_min_size}")
        if not self.fp8_min_block_gflop >= 0:
            raise err(f"--fp8-min-block-gflop must be >= 0, got {self.fp8_min_block_gflop}")
        if self.gradient_dtype and self.effective_matmul_dtype != "e4m3":
            raise err("--gradient-dtype only applies with --matmul-dtype e4m3")
        if self.model_dtype == "fp32" and (self.opt_m_dtype != "fp32" or self.opt_v_dtype != "fp32"):
            raise err("--model-dtype fp32 needs --opt-m-dtype fp32 and --opt-v-dtype fp32 "
                      "(low-precision moments with fp32 weights are not a supported combination)")
        self._validate_master(err)
        if self.opt_m_dtype == "e4m3" and self.opt_v_dtype != "bf16":
            raise err("--opt-m-dtype e4m3 needs --opt-v-dtype bf16 (llm.q's only e4m3 combination)")
        if self.opt_m_dtype == "e4m3" and not self.stochastic_rounding:
            raise err("--opt-m-dtype e4m3 needs stochastic rounding (drop --no-stochastic-rounding): the "
                      "round-to-nearest baseline has no block-scaled e4m3 writer")
        for opt, v in (("batch-size", self.batch_size), ("seq-len", self.seq_len),
                       ("grad-accumulation", self.grad_accumulation), ("lmhead-chunks", self.lmhead_chunks),
                       ("attn-bwd-chunks", self.attn_bwd_chunks),
                       ("epochs", self.epochs), ("eval-every-n-steps", self.eval_every_n_steps),
                       ("ckpt-interval", self.ckpt_interval)):
            if v < 1:
                raise err(f"--{opt} must be >= 1, got {v}")
        if self.steps == 0 or self.steps < -1:
            raise err(f"--steps must be positive (or -1 for --epochs), got {self.steps}")
        if (self.batch_size * self.seq_len) % self.lmhead_chunks:
            raise err(f"--lmhead-chunks={self.lmhead_chunks} must divide batch*seq-len="
                      f"{self.batch_size * self.seq_len}")
        if self.batch_size % self.attn_bwd_chunks:
            raise err(f"--attn-bwd-chunks={self.attn_bwd_chunks} must divide --batch-size={self.batch_size}")
        if self.offload_residual and not self.recompute_block:
            raise err("--offload-residual needs --recompute-block (only the block inputs it keeps are offloaded)")
        if self.eval_num_steps < 0:
            raise err(f"--eval-num-steps must be >= 0, got {self.eval_num_steps}")
        if self.learning_rate <= 0:
            raise err(f"--learning-rate must be positive, got {self.learning_rate}")
        if not 0 <= self.final_lr_fraction <= 1:
            raise err(f"--final-lr-fraction must be in [0, 1], got {self.final_lr_fraction}")
        if self.warmup < 0 or self.cooldown < 0:
            raise err("--warmup and --cooldown must be >= 0")
        if self.steps > 0 and self.warmup + self.cooldown > self.steps:
            raise err(f"--warmup ({self.warmup}) + --cooldown ({self.cooldown}) exceed --steps ({self.steps})")
        if not (0 <= self.beta_1 < 1 and 0 <= self.beta_2 < 1):
            raise err("--beta-1 and --beta-2 must be in [0, 1)")
        if self.adam_epsilon <= 0 or self.weight_decay < 0 or self.z_loss < 0:
            raise err("--adam-epsilon must be > 0, --weight-decay and --z-loss >= 0")
        if self.init_proj_to_zero and not self.from_scratch:
            raise err("--init-proj-to-zero needs --from-scratch")
        if self.new_data and self.continue_from is None:
            raise err("--new-data needs --continue")
        if self.override_schedule and self.continue_from is None:
            raise err("--override-schedule needs --continue")
        if self.zero_level not in (0, 1, 2, 3):
            raise err(f"--zero-level must be 0..3, got {self.zero_level}")
        if self.zero_level >= 2 and self.shard_gradients:
            raise err("--zero-level and --shard-gradients are mutually exclusive (--zero-level 2 implies it)")
        if self.zero_level >= 2 and self.shard_weights:
            raise err("--zero-level and --shard-weights are mutually exclusive (--zero-level 3 implies it)")
        if self.all_to_all_reduce and self.gradient_manager_kind == "unsharded":
            raise err("--all-to-all-reduce needs sharded gradients (--shard-gradients or --zero-level 2)")
        if self.shard_group_size < 0:
            raise err(f"--shard-group-size must be >= 0 (0: all ranks), got {self.shard_group_size}")
        if self.offload_gradients and self.gradient_manager_kind == "unsharded":
            raise err("--offload-gradients needs sharded gradients (--shard-gradients or --zero-level 2): "
                      "unsharded gradients cannot be offloaded")
        # sharded weights, FP8 weight copies, offload (llm.q: --persistent-quants needs the --shard-weights flag
        # literally, so --zero-level 3 cannot use it [quirk]; here either way of sharding the weights works)
        if self.offload_quants and not self.persistent_quants:
            raise err("--offload-quants needs --persistent-quants")
        if self.offload_quants and not self.weights_sharded:
            raise err("--offload-quants needs sharded weights (--shard-weights or --zero-level 3): replicated "
                      "weights keep their e4m3 copies on the device")
        if self.persistent_quants and self.effective_matmul_dtype != "e4m3":
            raise err("--persistent-quants (and --offload-quants) only apply with --matmul-dtype e4m3: they keep "
                      "FP8 copies of the weights")
        if self.fp8_keep_transposes and self.effective_matmul_dtype != "e4m3":
            raise err("--fp8-keep-transposes only applies with --matmul-dtype e4m3: it keeps the e4m3 transposes "
                      "of the block linears' inputs")
        if self.fp8_head_backward and self.effective_matmul_dtype != "e4m3":
            raise err("--fp8-head-backward only applies with --matmul-dtype e4m3: it runs the LM head's gradient "
                      "GEMMs in FP8")
        if self.fp8_swiglu_onepass and self.effective_matmul_dtype != "e4m3":
            raise err("--fp8-swiglu-onepass only applies with --matmul-dtype e4m3: it writes the SwiGLU output and "
                      "its gradient in e4m3")
        if self.fp8_swiglu_onepass and splits_mlp(self.recompute):
            raise err("--fp8-swiglu-onepass needs the MLP as one FP8 function, which --recompute-swiglu / "
                      "--recompute-ffn split into separate steps: drop one of them")
        if self.offload_master and not self.weights_sharded:
            raise err("--offload-master needs sharded weights (--shard-weights or --zero-level 3): qtrain keeps no "
                      "separate master copy (the model-dtype weights are the master), and replicated weights must "
                      "stay on the device for the forward")
        if self.use_zero_copy and not (self.offload_master or self.offload_opt_m or self.offload_opt_v):
            raise err("--use-zero-copy needs offloaded state (--offload-master, --offload-opt-m or --offload-opt-v)")
        if self.use_zero_copy and self.device == "cuda":
            raise err("--use-zero-copy is not supported on CUDA: the AdamW update takes all operands on the "
                      "device, so offloaded state is streamed through staging buffers (leave it off)")
        if self.effective_matmul_dtype == "fp32" and self.model_dtype == "bf16":
            raise err("--matmul-dtype fp32 with --model-dtype bf16 is not supported")
        if self.matmul_dtype == "bf16" and self.model_dtype == "fp32":  # the linears would run in fp32 all the same
            raise err("--matmul-dtype bf16 with --model-dtype fp32 is not supported: the block matmuls run in the "
                      "model dtype; use --model-dtype bf16 (add --master-dtype fp32 to keep fp32 master weights), "
                      "or drop --matmul-dtype")
        if self.debug_stack_dump_after < 0:
            raise err(f"--debug-stack-dump-after must be >= 0 seconds (0 = off), got {self.debug_stack_dump_after}")
        if self.debug_log_abs_max < 0:
            raise err(f"--debug-log-abs-max must be >= 0, got {self.debug_log_abs_max}")
        if self.gpus < 0:
            raise err(f"--gpus must be >= 0, got {self.gpus}")
        if self.use_cuda_graphs and self.device == "cpu":
            raise err("--use-cuda-graphs needs a CUDA device (drop it, or --no-use-cuda-graphs, with --device cpu)")
        if self.log_gpu_util < 0:
            raise err(f"--log-gpu-util must be >= 0 (0 = off), got {self.log_gpu_util}")
        if self.debug_log_allocations < -1 or self.debug_log_allocations == 0:
            raise err(f"--debug-log-allocations takes a size in MiB >= 1 (-1 = off), got {self.debug_log_allocations}")
        if self.ckpt_keep_n == 0:
            raise err("--ckpt-keep-n 0 would delete each checkpoint right after writing it; use 1 to keep only the "
                      "newest, or -1 (the default) to keep all")
        if self.ckpt_keep_n < -1:
            raise err(f"--ckpt-keep-n must be -1 (keep all) or >= 1, got {self.ckpt_keep_n}")
        if self.max_nonfinite_steps < 0:
            raise err(f"--max-nonfinite-steps must be >= 0 (0 = never stop), got {self.max_nonfinite_steps}")
        if self.collective_timeout <= 0:
            raise err(f"--collective-timeout must be > 0 seconds, got {self.collective_timeout}")
        if self.start_over and self.continue_from is not None:
            raise err("--start-over and --continue exclude each other: --continue resumes the earlier run, "
                      "--start-over replaces it")
        return self

    # ---- config files ----
    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    @classmethod
    def from_mapping(cls, d: dict[str, Any], *, source: str = "options") -> "Options":
        return cls(**normalize_mapping(d, source=source))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")


def check_run_name(name: str) -> None:
    """A run name is one path component (it replaces %n in --out-dir, --checkpoint-dir and --log-file), so
    it can never point outside them: no '/', no '..', no leading '.', no spaces or control characters."""
    if not _RUN_NAME.match(name) or ".." in name:
        safe = re.sub(r"[^A-Za-z0-9._+-]+", "_", name).strip("._") or "run"
        raise OptionsError(f"--name {name!r}: a run name is one path component of letters, digits and '._+-' "
                           f"(it replaces %n in --out-dir, --checkpoint-dir and --log-file); e.g. --name {safe}")


def with_derived_name(given: dict[str, Any]) -> dict[str, Any]:
    """Option values as given (flags over config file) with `name` derived from `out_dir` when only the out-dir
    was given: its last component, made a valid run name. Without that, every run into its own --out-dir would
    share the default name's checkpoint-dir and log, and a second one would be refused as the first's."""
    if "name" in given or "%n" in str(given.get("out_dir", "%n")):
        return given
    last = os.path.basename(os.path.normpath(str(given["out_dir"])))
    name = re.sub(r"\.{2,}", ".", re.sub(r"[^A-Za-z0-9._+-]+", "_", last))  # as check_run_name's suggestion
    name = re.sub(r"^[^A-Za-z0-9]+", "", name)[:128].rstrip("._-")
    return {**given, "name": name} if name else given


ALIASES = {"batch": "batch_size", "seq_length": "seq_len", "lr": "learning_rate", "continue": "continue_from",
           "use_all_to_all_reduce": "all_to_all_reduce", "offload_grads": "offload_gradients"}


def _coerce(key: str, value: Any, source: str, spelled: str = "") -> Any:
    """A config-file value -> the field's type. Config files are loosely typed (PyYAML reads `3e-4` as a
    string, a TOML seed may be written "0x83b45442"), so parse strings for numeric fields and reject what
    does not fit, naming the file and key, instead of failing later with a TypeError."""
    import typing
    typ = typing.get_type_hints(Options)[key]
    def bad(what: str) -> OptionsError:
        return OptionsError(f"{source}: option {spelled or key!r} must be {what}, got {shorten(repr(value))}")
    if key == "continue_from":  # `continue = true` (latest), a step number, or a path
        if value is None or value is False:
            return None
        if value is True:
            return "latest"
        if isinstance(value, (int, str)):
            return str(value)
        raise bad("true, a step number or a path")
    if typ is bool:
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if typ == bool | None:  # unset = auto
        if value is None or value == "auto":
            return None
        if not isinstance(value, bool):
            raise bad('true, false or "auto"')
        return value
    if typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value.strip(), 0)
            except ValueError:
                pass
        raise bad("an integer")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise bad("a number")
    if not isinstance(value, str):
        raise bad("a string")
    return value


def normalize_mapping(d: dict[str, Any], *, source: str = "options") -> dict[str, Any]:
    """Option names (llm.q spellings, '-' or '_', aliases) -> field names, values -> field types.
    Raises OptionsError naming `source` and the key for unknown, duplicated or ill-typed options."""
    names = Options.field_names()
    norm: dict[str, Any] = {}
    unknown: list[str] = []
    for k, v in d.items():
        key = str(k).replace("-", "_")
        key = ALIASES.get(key, key)
        if key not in names:
            unknown.append(str(k))
            continue
        if key in norm:
            raise OptionsError(f"{source}: option {key!r} given twice (as {k!r} and another spelling)")
        norm[key] = _coerce(key, v, source, spelled=str(k))
    if unknown:
        spelled = sorted(names | {a for a in ALIASES})
        hints = [f"{shorten(repr(u), 60)} -> {m!r}" for u in sorted(unknown)[:5]
                 if (m := closest(u.replace("-", "_"), spelled)) is not None]
        raise OptionsError(f"{source}: unknown option(s) {shorten(repr(sorted(unknown)))}"
                           + (f" (did you mean {', '.join(hints)}?)" if hints else ""))
    return norm
