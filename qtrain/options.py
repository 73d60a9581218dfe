"""Every setting of a training run, in one dataclass, validated once before anything large is allocated.

Field names are llm.q's option names with '-' -> '_' (`--grad-accumulation` -> `grad_accumulation`), so
data prepared and commands written for llm.q carry over. The CLI (`qtrain.cli`) and config files (TOML or
YAML) both fill this object; `validate()` is the single place where combinations are checked.

Beside this module, without torch (every `qtrain` command imports them): `options_values` (the values fields take,
`OptionsError`), `options_checks` (the rules `validate()` applies), `options_names` (llm.q's spellings and aliases,
config-file values); what a run makes of 'auto' and '' is `qtrain.plan.resolution`'s.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, fields
from typing import Any

from qtrain.model.choices import FP8_MIN_BLOCK_GFLOP as DEFAULT_FP8_MIN_BLOCK_GFLOP
from qtrain.model.choices import FP8_MIN_SIZE as DEFAULT_FP8_MIN_SIZE
from qtrain.model.recompute_flags import FLAGS as RECOMPUTE_FLAGS
from qtrain.model.recompute_flags import resolve_flags
from qtrain.options_checks import check_options, check_run_name
from qtrain.options_names import ALIASES, map_names, with_derived_name
from qtrain.options_values import (CHOICES, DEFAULT_MODEL, DTYPES, EMPTY_MEANS_DEFAULT, GRADIENT_DTYPES, MATMUL_DTYPES,
                                   OPT_M_DTYPES, OPT_V_DTYPES, SCHEDULES, OptionsError, closest, meant)

__all__ = ["ALIASES", "CHOICES", "DEFAULT_MODEL", "DTYPES", "EMPTY_MEANS_DEFAULT", "GRADIENT_DTYPES", "MATMUL_DTYPES",
           "OPT_M_DTYPES", "OPT_V_DTYPES", "SCHEDULES", "Options", "OptionsError", "check_run_name", "closest", "meant",
           "normalize_mapping", "with_derived_name"]


@dataclass(kw_only=True)
class Options:
    """Every setting of a run. The string under each field is its --help text; `SECTIONS` (below) groups the
    fields by topic for --help."""

    model: str = ""
    """Model directory, `org/name` in the local HF cache, (with --from-scratch) a preset name, or a tiny preset:
    tiny-gpt2 or tiny-qwen2, the embedded default's shape with the vocabulary of `qtrain tokenize --tokenizer gpt2`
    or `qwen2` (always from scratch, seconds per step on a CPU). Empty: the embedded default (a tiny model trained
    from scratch on the embedded corpus)."""
    from_scratch: bool = False
    """Random initialisation instead of loading weights (a preset name or a config.json is enough)."""
    rope_scaling: str = ""
    """Extend the model's context past its config's positions: RoPE scaling TYPE[:FACTOR] (linear, dynamic, yarn,
    llama3; FACTOR defaults to --seq-len over the positions, rounded up), as transformers computes it; the export's
    config.json carries it (model/context_extension.py). Refused for a model that already has RoPE scaling."""
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
    mlp_chunks: int = 1
    """Run each block's MLP (norm, up/gate, SwiGLU, down) over N slices of the micro-batch's tokens, each rerun in
    backward: its intermediates exist for 1/N of the tokens at a time (long sequences), for one more MLP forward.
    Dense models (llama, qwen2, qwen3). The weight gradients are sums over the slices (regrouped, like the LM head's,
    in the model dtype), and in e4m3 each slice scales its own FP8 operands."""
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
    eval_at_start: bool = False
    """Evaluate before the first step too (--eval-num-steps batches, logged as the eval of the step the run starts at:
    0 for a new run), to see the loss the model starts from."""

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
    verbose: bool = False
    """Print every option at the start, and the info messages (the run log has them either way)."""
    quiet: bool = False
    """Print only warnings, evaluations and the end of the run (where the export, checkpoint and log are); the run
    log has everything either way."""
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

    device: str = "auto"
    """auto | cpu | cuda."""
    compile: str = "auto"
    """torch.compile the blocks: auto (on for CUDA) | on | off."""
    compile_tuning: bool = False
    """With compiled blocks, let inductor tune its generated kernels' launch configurations (coordinate descent).
    Off by default: on a machine that never compiled the shapes it adds about 75 s to the first step of a 0.5B run
    (20 of its kernels, 3.7 s each) and 7.5 s even when cached, for e4m3 blocks 1.4% faster at 1.5B and bf16 ones
    no faster (H100 and H200)."""
    compile_cache: str = "auto"
    """Folder for compiled code kept between runs (inductor's and Triton's caches), so a second run or --continue
    of the same shapes starts in seconds: auto = $XDG_CACHE_HOME/qtrain/compile (~/.cache/qtrain/compile); none
    = torch's own defaults (inductor's in the temp folder); or a folder. TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR
    set in the environment win. Runs may share it."""
    swiglu_epilogue: str = "auto"
    """The model-dtype MLP with its SwiGLU in the GEMMs' epilogues (kernels/gated_mlp.py): the up/gate GEMM writes
    the SwiGLU output and the down projection's input-gradient GEMM runs SwiGLU's backward, through quack-kernels'
    Hopper GEMMs (the optional extra: pip install 'qtrain[hopper]'); the SwiGLU output is not kept for backward
    (the plan counts F model-dtype values per token and layer fewer). Applies to a compiled bf16 dense MLP run as one
    function (no FP8 up/down, no --recompute-swiglu / --recompute-ffn, no LoRA, not an MoE model). auto: on
    where it applies on a Hopper GPU, quack imports (its first import takes ~10 s, its kernels compile in a few
    seconds per shape on first use) and a micro-batch holds 16,384 tokens or more (below, training measured slower:
    0.964x at 7B with 4,096 tokens); on: also on the CPU (its plain-torch twin, for tests), refused on a CUDA device
    without quack or Hopper; off: cuBLAS GEMMs + qtrain's SwiGLU kernels. Measured on an H100: the up/gate GEMM +
    SwiGLU 1.09-1.41x, the down dgrad + SwiGLU backward 0.97-1.25x faster at the Qwen2.5 0.5B-7B shapes."""
    compile_autotune_gemm: bool = False
    """With compiled blocks, let inductor time its Triton GEMM templates against cuBLAS for every block GEMM
    shape and keep the faster (inductor's max_autotune_gemm), fusing the pointwise work after a GEMM into a
    Triton one. At Qwen2.5-14B shapes the templates ran 769/746/797 TFLOP/s against cuBLAS's 788/765/733 (MLP
    up forward/dgrad/wgrad, H200). In training at Qwen2.5-1.5B cuBLAS won every
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
    context_parallel: int = 1
    """Split each sequence over this many ranks (load-balanced causal chunks: parallel/context.py); must divide the
    ranks, --seq-len a multiple of 2N. Runs eager blocks, attention not recomputed (no --recompute-att /
    --recompute-block), no --attn-bwd-chunks or CUDA graphs."""
    context_parallel_mode: str = "allgather"
    """How --context-parallel's attention meets the other ranks' keys and values: allgather (gather the whole
    sequence's K/V, kept for backward) | ring (pass K/V blocks around the ranks, online-softmax merge; keeps only
    this rank's)."""
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
    fit_memory: bool = True
    """On a GPU, where the memory plan of the given options does not fit: add what long sequences take, the LM head
    in chunks of 16k tokens, then recompute (swiglu+norm, ffn, block), then --offload-residual, stopping at the
    first that fits (plan/fit.py; recompute and offload compute the same numbers, chunks regroup the LM head's sums).
    --no-fit-memory runs the options as given."""
    shard_weights: bool = False
    """Keep only this rank's shard of the weights (ZeRO-3); blocks are all-gathered just in time, double buffered."""
    persistent_quants: bool = False
    """Keep e4m3 copies of the block matrices the FP8 policy names from the first micro-step of an optimizer step to the
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
    memory plan with the copies fits the device with 4% of activations + workspace to spare
    (plan/resolution.AUTO_MARGIN: fragmentation can exceed the plan's 5%) (measured 1.4% faster at Qwen2.5-3B, 0.5%
    at 1.5B on an H200), else off."""
    fp8_swiglu_onepass: bool | None = None
    """With --matmul-dtype e4m3: write the SwiGLU output and its gradient (the MLP's two largest tensors) to e4m3
    in one pass each, with power-of-two scales predicted from the layer's previous micro-step (kept while it fits
    and wastes at most one binade) and re-done where it does not, instead of a bf16 pass and a quantize pass with
    the exact scale (6 and 10 bytes per element of the intermediate size moved, instead of 10 and 18). The scale of
    those two tensors is 2^e (their largest element lands between FMAX/4 and FMAX); the predictions are run state,
    saved in checkpoints. Applies where
    the MLP runs as one compiled FP8 function (torch.compile on, no --recompute-swiglu / --recompute-ffn; with
    --recompute-block, which reruns the whole block, it applies); eager blocks quantize as without it. Measured on
    an H200 against llm.q's bf16: +3.2% at Qwen2.5-1.5B, +1.3% at 3B; the fidelity
    suite's 0.5B e4m3 runs with and without it evaluate within 0.25% of each other over 250 steps. Unset (auto): on
    with --matmul-dtype e4m3 unless --recompute-swiglu / --recompute-ffn split the MLP; --no-fp8-swiglu-onepass
    keeps the exact abs-max scales."""
    fp8_head_backward: bool | None = None
    """With --matmul-dtype e4m3: run the LM head's two gradient GEMMs (d(hidden) and d(W_head)) in FP8, the
    cross-entropy writing d(logits) straight to e5m2 at a fixed power-of-two scale (and its transpose) and the head
    weight and final hidden states quantized to e4m3 per micro-step; the logits GEMM, and so the loss, stay in the
    model dtype. llm.q keeps the whole head in bf16; the head is ~16% of a Qwen2.5-1.5B e4m3 step. Needs the
    vocabulary and hidden size to be multiples of 16 (cuBLASLt FP8); a micro-batch whose tokens are not a multiple of
    16 runs its head in bf16. Costs memory (the plan counts it): one byte per logit of a chunk, and the e4m3 copies.
    Measured on an H200: +2.7% (7B, 8 x 8) to +5.5% (0.5B, 64 x 2); on an H100 at 0.5B 32 x 4 e4m3 ran 1.234x
    llm.q's bf16 with it, 1.154x without (session 32). Unset (auto): on with --matmul-dtype e4m3 on a CUDA device
    where the memory plan with it fits with 4% of activations + workspace to spare (as --fp8-keep-transposes,
    which it goes before), the head is trained (no LoRA) and its shapes allow; --no-fp8-head-backward keeps the
    head's gradient GEMMs in bf16. See docs/precision.md for its fidelity."""
    delta_rule_precision: str = "auto"
    """Models with Gated DeltaNet layers (Qwen3.5, Qwen3-Next): the precision of the delta rule's products in its
    Triton kernels (CUDA). fp32 = three TF32 tensor-core passes per product, fp32's accuracy (~5e-7 relative); tf32 =
    one pass, 10 mantissa bits (~2e-3 relative), the kernels in 0.57x the time (Qwen3.5-4B heads, T 4096, one H100:
    forward 1.34 against 1.86 ms, backward 2.84 against 5.44), still finer than the bf16 operands of
    flash-linear-attention (8 bits). The state and every sum stay fp32. auto (the default) = tf32: a whole
    Qwen3.5-4B step at seq 4096 ran 1.25x fp32's tokens/s with the same 30-step loss curve on real text (H100,
    2026-12-06). No effect on the CPU or wherever the plain-torch delta rule runs (it computes in fp32); fp32 and
    tf32 are refused for models without Gated DeltaNet layers."""
    offload_quants: bool = False
    """Keep the persistent e4m3 weight shards in pinned host memory (needs --persistent-quants and sharded weights);
    with --lora-base-dtype e4m3, the frozen base's codes, two layers at a time on the device (needs
    --recompute-block): a base larger than the GPU."""
    offload_master: bool = False
    """Weight shards in pinned host memory (they are the master: qtrain has no separate copy); needs sharded weights."""
    offload_opt_m: bool = False
    """Adam first-moment shards in pinned host memory, streamed through the device for the update."""
    offload_opt_v: bool = False
    """Adam second-moment shards in pinned host memory, streamed through the device for the update."""
    use_zero_copy: bool = False
    """Update offloaded state in place instead of staging it through the device (CPU only; refused on CUDA)."""
    lora_rank: int = 0
    """LoRA: train rank-R adapters of the block matrices over a frozen base (no gradients or optimizer state for the
    base; docs/lora.md); 0 = full fine-tune. The other --lora-* options need it."""
    lora_alpha: float = 0.0
    """LoRA scale numerator: adapters add (alpha / rank) B A x. 0 = the --lora-init-from adapter's, else 2 x rank."""
    lora_dropout: float = 0.0
    """Dropout on each adapter's input (peft's lora_dropout), in [0, 1)."""
    lora_targets: str = ""
    """Comma-separated matrices to adapt, peft's module names without _proj: q,k,v,o,gate,up,down ('' = all seven,
    or the --lora-init-from adapter's); on an MoE model gate,up,down are the routed experts (gate and up together)."""
    lora_init_from: str = ""
    """Start the adapters from an existing PEFT adapter directory (adapter_config.json + adapter_model.safetensors)
    instead of peft's init (A kaiming-uniform, B zero)."""
    lora_merge: bool = False
    """Export the merged model (W + alpha/r B A, a plain HF model) instead of the PEFT adapter."""
    lora_base_dtype: str = ""
    """The frozen base's block matrices: '' = the model dtype; e4m3 = only e4m3 copies with their scales (no
    bf16 copy of a block matrix anywhere), the adapters in the model dtype."""
    use_cuda_graphs: bool | None = None
    """Replay each micro-step's forward and backward from CUDA graphs (llm.q's --use-cuda-graphs), one per phase
    of a step, captured in the second step after a first run eagerly: the host stops setting the pace at small
    sizes, same bits. One process, replicated weights, unsharded gradients, no offload, no --persistent-quants
    (train/cuda_graphs.py refuses the rest); refused with --device cpu, no effect without a CUDA device.
    Unset (auto): on where it was measured faster, i.e. on a CUDA device where nothing blocks it, no block
    linear runs in FP8 and a block's GEMM work per micro-step is at most CUDA_GRAPHS_AUTO_MAX_BLOCK_GFLOP; then
    the first micro-step after a capture that must run eagerly (another loss scale: masked targets) releases the
    graphs and their memory for the rest of the run."""

    # ---- Mixture of Experts (qwen3_moe, olmoe, mixtral) ----
    router_z_loss: float = 0.0
    """MoE models: weight of the router z-loss (ST-MoE: the mean over every MoE layer's tokens of logsumexp(router
    logits)^2), added beside the load-balancing loss the model's config weights (router_aux_loss_coef); 0 = off."""
    log_router_every: int = 10
    """MoE models: print the router line (load-balancing loss, z-loss, tokens per expert min / mean / max) every N
    steps; the JSON log has them at every step."""
    expert_parallel: int = 1
    """MoE models: spread every MoE layer's experts over N ranks (E/N each); the tokens travel to their experts'
    ranks and back by all-to-all. N divides the experts and the number of ranks (world = data-parallel x N); expert
    gradients are averaged over the ranks holding the same experts, the rest over all ranks. 1 = off."""
    fp8_experts: bool = False
    """MoE models, with --matmul-dtype e4m3: run the experts' forward and input-gradient GEMMs in e4m3 with row-wise
    scales (a scale per token row and per expert output column; torch._scaled_grouped_mm on Hopper), their weight
    gradients in the model dtype from the kept e4m3 input; the layer keeps e4m3 copies of the experts' GEMM inputs
    and their row scales instead of model-dtype tensors. Their output gradients are e4m3 whatever --gradient-dtype
    (the grouped FP8 kernel multiplies e4m3 only; each row has its own scale). The hidden and the experts'
    intermediate sizes must be multiples of 16. Off by default (the expert GEMMs run in the model dtype)."""

    # ---------------------------------------------------------------------------------------------
    @property
    def effective_matmul_dtype(self) -> str:
        return meant(self.__getattribute__, "matmul_dtype")

    @property
    def effective_master_dtype(self) -> str:
        """The dtype of the master weights (and of the gradient buffers and the optimizer's weights)."""
        return meant(self.__getattribute__, "master_dtype")

    @property
    def effective_grad_accum_dtype(self) -> str:
        """The dtype of the gradient buffers (--grad-accum-dtype, else the master dtype)."""
        return meant(self.__getattribute__, "grad_accum_dtype")

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

    def expand(self, path: str) -> str:
        return path.replace("%n", self.name)

    def validate(self) -> "Options":
        """Raise OptionsError naming the option(s) and the fix (`options_checks.check_options`); return self."""
        check_options(self)
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


# The fields by topic, in --help's order (the llm.q implementation switches, which are no fields, follow as a group
# of their own). Every field is in exactly one section (tests/test_options.py).
SECTIONS: dict[str, tuple[str, ...]] = {
    "model": ("model", "from_scratch", "rope_scaling", "init_proj_to_zero", "seed", "tokenizer"),
    "data and batch": ("train_file", "eval_file", "train_seed", "eval_seed", "batch_size", "seq_len",
                       "grad_accumulation", "steps", "epochs", "eval_every_n_steps", "eval_num_steps", "eval_at_start"),
    "documents (packed data)": ("document_masking", "document_attention"),
    "optimizer and schedule": ("learning_rate", "warmup", "cooldown", "final_lr_fraction", "lr_schedule", "beta_1",
                               "beta_2", "adam_epsilon", "weight_decay", "grad_clip", "z_loss"),
    "precision": ("model_dtype", "master_dtype", "matmul_dtype", "grad_accum_dtype", "fp8_policy", "fp8_min_size",
                  "fp8_min_block_gflop", "gradient_dtype", "opt_m_dtype", "opt_v_dtype", "stochastic_rounding",
                  "persistent_quants", "fp8_keep_transposes", "fp8_swiglu_onepass", "fp8_head_backward",
                  "delta_rule_precision"),
    "memory (recompute, offload, chunking)": (
        "memory_check", "lmhead_chunks", "attn_bwd_chunks", "mlp_chunks", "recompute_block", "recompute_swiglu", "recompute_norm",
        "recompute_ffn", "recompute_qkv", "recompute_att", "offload_residual", "fit_memory", "offload_master",
        "offload_opt_m", "offload_opt_v", "offload_quants", "use_zero_copy"),
    "LoRA adapters": ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "lora_init_from", "lora_merge",
                      "lora_base_dtype"),
    "parallel (GPUs, sharding)": ("gpus", "zero_level", "shard_gradients", "all_to_all_reduce", "offload_gradients",
                                  "shard_weights", "shard_group_size", "context_parallel", "context_parallel_mode",
                                  "collective_timeout"),
    "execution (device, compile, kernels)": ("device", "compile", "compile_tuning", "compile_cache",
                                             "compile_autotune_gemm", "swiglu_epilogue", "sdpa_backend",
                                             "use_cuda_graphs"),
    "mixture of experts": ("router_z_loss", "log_router_every", "expert_parallel", "fp8_experts"),
    "outputs and checkpoints": ("name", "out_dir", "checkpoint_dir", "ckpt_interval", "ckpt_keep_n", "ckpt_major",
                                "save_training_state", "continue_from", "new_data", "override_schedule", "start_over",
                                "max_nonfinite_steps"),
    "logging": ("log_file", "verbose", "quiet", "tensorboard", "wandb", "log_gpu_util"),
    "debugging": ("debug_time_breakdown", "debug_stack_dump_after", "debug_log_allocations", "debug_log_abs_max"),
}

# Small models trained from scratch (the embedded default, i.e. no --model, and the tiny presets:
# model/resolve.TINY_MODELS) start from these instead of the dataclass defaults, which are llm.q's fine-tuning ones:
# a far larger learning rate, short sequences that keep a CPU run to minutes, one micro-batch per step, frequent
# evaluations, and the model dtype of SMALL_MODEL_DTYPE (fp32 on a CPU, where bf16 has no fast kernels). Given
# options override them; `cli/options.small_model_defaults` applies them, --help shows them beside the defaults.
SMALL_MODEL_DEFAULTS: dict[str, Any] = dict(
    learning_rate=3e-3, warmup=10, lr_schedule="cosine", final_lr_fraction=0.1, seq_len=256, batch_size=8,
    grad_accumulation=1, epochs=1, eval_every_n_steps=50, eval_num_steps=20)
SMALL_MODEL_DTYPE = {"cpu": "fp32", "cuda": "bf16"}  # model_dtype, by the device a run will have
EMBEDDED_NAME = "qtrain-default"  # the run name of the embedded default


def normalize_mapping(d: dict[str, Any], *, source: str = "options") -> dict[str, Any]:
    """Option names (llm.q spellings, '-' or '_', aliases) -> field names, values -> field types
    (`options_names.map_names`). Raises OptionsError naming `source` and the key for unknown, duplicated or
    ill-typed options."""
    return map_names(d, typing.get_type_hints(Options), source=source)
