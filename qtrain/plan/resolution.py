"""One resolution of a run: every automatic choice made once, into a frozen record that the preflight, the Trainer,
the memory plan, the run log's header and `qtrain plan` read instead of deciding again.

    run = resolve_run(cfg, opts, world=2, device="cuda", gpu_memory=total_bytes)
    run.compile, run.fp8, run.block_matmul_dtype, run.fp8_keep_transposes, run.cuda_graphs, run.plan, ...

What is decided here, from options left at 'auto' or '' and from the device and the number of ranks:

    compile              --compile auto: on for CUDA
    fp8                  --matmul-dtype e4m3: which block linears run in FP8 at this micro-batch shape (--fp8-policy,
                         model/fp8_policy.py); `block_matmul_dtype` is '' where the policy puts none in FP8 (the
                         model-dtype path itself: the e4m3 path without an FP8 linear cost 17% host time at 0.5B,
                         micro-batch 4, on an H200)
    fp8_grad_dtype       --gradient-dtype '': e4m3
    fp8_swiglu_onepass   unset: on with e4m3 where no recompute switch splits the MLP into steps
    fp8_keep_transposes  unset: on where the memory plan with the kept e4m3 transposes fits the device with
                         AUTO_MARGIN to spare (a compiled block with FP8 linears on a CUDA device of known size)
    persistent_quants    --persistent-quants: the FP8 block matrices made once per optimizer step
    fp8_head_backward    the LM head's gradient GEMMs in FP8 (only with e4m3); unset: on where the plan with it fits
                         with AUTO_MARGIN to spare (e4m3 on a CUDA device of known size, the head trained and its
                         shapes multiples of 16), decided before fp8_keep_transposes (it gains more: +4.5-7%)
    cuda_graphs          --use-cuda-graphs unset: on where measured faster (`cuda_graphs_on`); `cuda_graph_blockers`
                         are what train/cuda_graphs.py cannot capture yet (`check_cuda_graphs` refuses them)
    sdpa_backend         --sdpa-backend auto: cudnn for bf16 on Hopper GPUs (model/layers.resolve_sdpa_backend)
    delta_rule_precision --delta-rule-precision auto: tf32 (model/choices.AUTO_DELTA_RULE_PRECISION)
    swiglu_epilogue      --swiglu-epilogue auto: the compiled bf16 MLP through quack's epilogue GEMMs where it
                         applies, the device is a Hopper GPU, quack imports (kernels/gated_mlp.py) and a micro-batch
                         holds SWIGLU_EPILOGUE_MIN_TOKENS tokens or more (smaller ones measured slower)
    gradients            the gradient manager: unsharded, reduce-scatter or all-to-all
    memory_changes       --fit-memory (on): where the plan of the given options does not fit a CUDA device of known
                         size, what long sequences take (plan/fit.py: LM head chunks, recompute, --offload-residual,
                         MLP slices),
                         the fewest that fit; every choice above is then made for the options with those changes
                         (`lmhead_chunks`, `mlp_chunks`, `offload_residual`, `recompute` are what the model runs); a
                         resumed run's `keep` (the LM head chunks and MLP slices its checkpoint ran) changes only where
                         nothing fits with it
    master_dtype, grad_accum_dtype   '' = the model dtype, the master dtype

A run resolves once: `preflight` (before the model is built, for every rank) or, for a `Trainer` built without
it, the Trainer itself; the memory plan is part of the record, so a start plans once.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from qtrain.kernels.grouped_gemm_fp8 import FP8_MULTIPLE
from qtrain.model.choices import AUTO_DELTA_RULE_PRECISION, SWIGLU_EPILOGUE_MIN_TOKENS
from qtrain.model.config import ModelConfig
from qtrain.model.fp8_policy import Fp8Choice, block_gflop, choose_fp8
from qtrain.model.layers import resolve_sdpa_backend
from qtrain.model.llama import LLAMA
from qtrain.model.recompute import resolve_flags, splits_mlp
from qtrain.model.moe_family import MoeFamily
from qtrain.model.registry import delta_rule_layers, family_of
from qtrain.options import Options, OptionsError, meant
from qtrain.parallel.context import check_context_parallel
from qtrain.parallel.experts import check_expert_parallel
from qtrain.parallel.groups import check_group_size
from qtrain.parallel.layout import FlatLayout
from qtrain.parallel.weights.persistent_quants import quantized_groups
from qtrain.plan.fit import CHANGES_NUMBERS, FIT_OPTIONS, fit_activations
from qtrain.plan.memory import MemoryPlan, build_plan, run_layout

# --use-cuda-graphs unset (auto) turns graphs on up to this much GEMM work per block and micro-step: where the
# host sets the pace. Measured on one H200, Qwen2.5-0.5B bf16: 366 GFLOP (4 x 1024) 2.90x, 1466 (16 x 1024)
# 1.027x, 2931 (32 x 1024) 1.009x; larger blocks were not measured with graphs.
CUDA_GRAPHS_AUTO_MAX_BLOCK_GFLOP = 3000.0
# What an automatic memory-for-speed choice (--fp8-keep-transposes unset) must leave free besides, as a fraction of
# activations + workspace: fragmentation can exceed the plan's FRAGMENTATION, and a run the user did not ask to
# spend memory on must not fail for it. Measured (H200, Qwen2.5-1.5B e4m3 64 x 2, lmhead 2): the plan put the
# allocated peak within 0.1 GiB, but the allocator held 9.8 GiB in unusable fragments, 8.3% of activations +
# workspace, and the first step ran out of memory with the plan's 0.84 GiB free.
AUTO_MARGIN = 0.04
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class RunResolution:
    """Every automatic choice of one run (module docstring), and the memory plan made with them."""
    device: str  # 'cuda' or 'cpu'
    world: int
    compile: bool
    sdpa_backend: str
    master_dtype: str
    grad_accum_dtype: str
    matmul_dtype: str  # as configured: --matmul-dtype, else the model dtype
    fp8: Fp8Choice | None  # None without e4m3
    block_matmul_dtype: str  # what the block linears run: matmul_dtype, or '' where no linear is in FP8
    fp8_grad_dtype: str
    fp8_keep_transposes: bool
    fp8_swiglu_onepass: bool
    fp8_head_backward: bool
    persistent_quants: tuple[str, ...]
    cuda_graphs: bool
    cuda_graph_blockers: tuple[str, ...]
    gradients: str
    recompute: frozenset[str]
    lmhead_chunks: int
    mlp_chunks: int
    offload_residual: bool
    delta_rule_precision: str  # the Triton delta rule's products (model/choices.DELTA_RULE_PRECISIONS)
    swiglu_epilogue: bool  # the MLP's SwiGLU in its GEMMs' epilogues (kernels/gated_mlp.py)
    plan: MemoryPlan
    memory_changes: tuple[tuple[str, Any], ...] = ()  # --fit-memory's option changes (empty: the options as given)

    @property
    def fp8_linears(self) -> tuple[str, ...]:
        """The block linears that run in FP8 (none without e4m3)."""
        return self.fp8.fp8 if self.fp8 is not None else ()

    @property
    def memory_for_speed_switches(self) -> tuple[str, ...]:
        """The options that turn off what this run spends device memory on for speed, each where it is on (for an
        out-of-memory report): the graphs' pool, the FP8 head's copies, the kept e4m3 transposes."""
        on = (("--no-use-cuda-graphs", self.cuda_graphs), ("--no-fp8-head-backward", self.fp8_head_backward),
              ("--no-fp8-keep-transposes", self.fp8_keep_transposes))
        return tuple(flag for flag, used in on if used)

    def memory_note(self, given: MemoryPlan | None = None) -> str | None:
        """What --fit-memory changed, as one line for the run's log; None where it changed nothing."""
        if not self.memory_changes:
            return None
        flags = " ".join(f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in self.memory_changes)
        return (f"memory: the given options do not fit {self.plan.budget / 2**30:.1f} GiB; the run adds {flags} "
                f"(planned {self.plan.device_total / 2**30:.1f} GiB; --no-fit-memory runs them as given)")


# ---- the rules, one function each ------------------------------------------------------------------------
def delta_rule_precision(opts: Options) -> str:
    return resolve_delta_rule_precision(opts.delta_rule_precision)


def resolve_delta_rule_precision(value: str) -> str:
    """--delta-rule-precision auto: AUTO_DELTA_RULE_PRECISION (model/choices.py says why)."""
    return AUTO_DELTA_RULE_PRECISION if value == "auto" else value


def check_delta_rule_precision(value: str, cfg: ModelConfig) -> None:
    """An explicit --delta-rule-precision on a model without Gated DeltaNet layers is a mistake worth saying
    (`train`, `plan` and `eval` take the option); auto, the default, is every model's."""
    if value != "auto" and not delta_rule_layers(cfg):
        raise OptionsError(f"--delta-rule-precision {value} applies to models with Gated DeltaNet layers (Qwen3.5, "
                           f"Qwen3-Next); this {cfg.model_type} model has none (drop it)")


def compile_on(opts: Options, device: str) -> bool:
    """--compile on, or auto on a CUDA device."""
    return opts.compile == "on" or (opts.compile == "auto" and device == "cuda")


def fp8_choice(cfg: ModelConfig, opts: Options) -> Fp8Choice | None:
    """Which block linears run in FP8 at this micro-batch shape (--fp8-policy and its thresholds); None without
    --matmul-dtype e4m3."""
    if opts.effective_matmul_dtype != "e4m3":
        return None
    return choose_fp8(cfg, opts.batch_size * opts.seq_len, opts.fp8_policy, opts.fp8_min_size,
                      opts.fp8_min_block_gflop)


def swiglu_onepass(opts: Options) -> bool:
    """--fp8-swiglu-onepass as given, else (auto) on with e4m3 matmuls where no recompute splits the MLP and the MLP
    runs in one slice (options_checks says why not with --mlp-chunks)."""
    if opts.fp8_swiglu_onepass is not None:
        return opts.fp8_swiglu_onepass
    return opts.effective_matmul_dtype == "e4m3" and not splits_mlp(opts.recompute) and opts.mlp_chunks == 1


def swiglu_epilogue(cfg: ModelConfig, opts: Options, device: str, compiled: bool, fp8: Fp8Choice | None,
                    recompute: frozenset[str]) -> bool:
    """--swiglu-epilogue (its help says where it applies): auto on where it applies on a Hopper GPU with quack;
    `on` where it does not apply, or on a CUDA device that cannot run it, is one line naming why. Planned for a CUDA
    device this machine does not have (`qtrain plan` elsewhere), `on` is taken as given and auto stays off."""
    if opts.swiglu_epilogue == "off":
        return False
    why_not = ("--compile off: the MLP runs as three steps" if not compiled
               else "an MoE model: its MLPs are routed experts" if cfg.router is not None
               else "the up/down linears run in FP8 (the FP8 MLP)" if fp8 is not None and {"up", "down"} & set(fp8.fp8)
               else "--recompute-swiglu / --recompute-ffn split the MLP into steps" if splits_mlp(recompute)
               # the op pair makes both weight gradients: over a frozen base that doubles the MLP's backward
               else "LoRA: the base is frozen (the op makes weight gradients)" if opts.lora_rank > 0
               else "--debug-log-abs-max wraps the linears" if opts.debug_log_abs_max
               else f"the hidden size {cfg.hidden_size} and intermediate size {cfg.intermediate_size} must be "
                    f"multiples of 8 (16-byte rows)" if cfg.hidden_size % 8 or cfg.intermediate_size % 8
               else "")
    here = device == "cuda" and torch.cuda.is_available()  # else a plan for a machine this one is not: as given
    if not why_not and here:
        from qtrain.kernels.hopper import hopper_device, quack, quack_missing
        why_not = ("needs --model-dtype bf16" if opts.model_dtype != "bf16"
                   else "needs a Hopper GPU (sm90)" if not hopper_device()
                   else f"quack-kernels does not import ({quack_missing()}; pip install 'qtrain[hopper]')"
                   if quack() is None else "")
    if why_not and opts.swiglu_epilogue == "on":
        raise OptionsError(f"--swiglu-epilogue on: {why_not}")
    # auto: where the epilogue GEMMs measured faster, micro-batches of SWIGLU_EPILOGUE_MIN_TOKENS tokens and more
    tokens = opts.batch_size * opts.seq_len // opts.context_parallel
    return not why_not and (opts.swiglu_epilogue == "on" or here and tokens >= SWIGLU_EPILOGUE_MIN_TOKENS)


def persistent_quants(cfg: ModelConfig, opts: Options, fp8: Fp8Choice | None) -> tuple[str, ...]:
    """--persistent-quants: the block matrices whose FP8 copies are made once per step (those the FP8 policy puts
    in FP8). Sharded weights keep e4m3 shards and gather those; replicated ones cache copies of the full matrices,
    except under --debug-log-abs-max, whose recorder watches the linears quantize their weights themselves."""
    if fp8 is None or not opts.weights_quantized_once or cfg.num_hidden_layers == 0:
        return ()
    if opts.weights_sharded:  # e4m3 shards of each group holding the matrices: their views must be FP8 operands
        try:
            quantized_groups(run_layout(cfg, opts, opts.expert_parallel), fp8.fp8)  # (a world EP divides)
        except ValueError as e:
            raise OptionsError(f"--persistent-quants with sharded weights and --fp8-policy {opts.fp8_policy}: {e}; "
                               f"drop --persistent-quants (or take another --fp8-policy)") from None
    return fp8.fp8


def cuda_graph_blockers(opts: Options, *, world: int) -> list[str]:
    """What --use-cuda-graphs cannot capture yet in this run (train/cuda_graphs.py): empty if nothing."""
    out = []
    if world > 1:
        out.append(f"{world} processes (--gpus, torchrun): graphs run on one process for now")
    if opts.weights_sharded:
        out.append("sharded weights (--shard-weights, --zero-level 3)")
    if opts.gradient_manager_kind != "unsharded":
        out.append("sharded gradients (--shard-gradients, --zero-level 2, --all-to-all-reduce)")
    offload = [f"--{n.replace('_', '-')}" for n in ("offload_master", "offload_opt_m", "offload_opt_v",
                                                     "offload_gradients", "offload_quants", "offload_residual",
                                                     "use_zero_copy") if getattr(opts, n)]
    if offload:
        out.append(f"offloading ({', '.join(offload)})")
    if opts.persistent_quants:
        out.append("--persistent-quants (its per-step FP8 weight cache is host-side logic)")
    if opts.debug_log_abs_max:
        out.append("--debug-log-abs-max (it records values on the host during the micro-step)")
    if getattr(opts, "lora_dropout", 0):
        out.append("--lora-dropout (each micro-step's masks come from its own key, which a graph would fix)")
    if opts.document_masking:
        out.append("--document-masking (the number of documents, so the shapes attention takes, changes "
                   "from micro-batch to micro-batch)")
    if opts.mlp_chunks > 1:  # its checkpoints' capture is not yet checked on a GPU; graphs pay at short micro-batches
        out.append("--mlp-chunks (the MLP's checkpointed slices are not yet verified under a graph's capture)")
    return out


def check_cuda_graphs(opts: Options, *, world: int, device_type: str) -> None:
    """Refuse --use-cuda-graphs with what it cannot capture yet, when graphs would be used (a CUDA device)."""
    if not opts.use_cuda_graphs or device_type != "cuda":
        return
    blockers = cuda_graph_blockers(opts, world=world)
    if blockers:
        raise OptionsError("--use-cuda-graphs does not support " + "; ".join(blockers) + " yet. Drop "
                           "--use-cuda-graphs (or add --no-use-cuda-graphs), or those options.")


def check_model_support(cfg: ModelConfig, opts: Options, *, device_type: str) -> None:
    """Refuse what this model's structure cannot run yet: --use-cuda-graphs for an MoE model (the tokens each expert
    gets set its grouped GEMMs' row counts anew every micro-step, and a graph replays fixed shapes; `cuda_graphs_on`
    leaves it off), sharded weights where `sharded_weights_refusal` says why not; --fp8-experts where the model
    has no experts or their GEMMs' sizes are not multiples of 16 (`_check_fp8_experts`); --delta-rule-precision other
    than auto where no layer runs the gated delta rule; --context-parallel for a family other than the dense ones
    (its attention across ranks is built for theirs); --mlp-chunks where `mlp_chunks_refusal` says why not."""
    if opts.mlp_chunks > 1 and (why := mlp_chunks_refusal(cfg)) is not None:
        raise OptionsError(f"--mlp-chunks {opts.mlp_chunks}: {why}; drop it")
    if opts.context_parallel > 1 and (cfg.model_type not in LLAMA.architectures):
        raise OptionsError(f"--context-parallel {opts.context_parallel}: model_type {cfg.model_type!r} is not "
                           f"supported yet (its attention across ranks is built for the dense families: "
                           f"{', '.join(LLAMA.architectures)})")
    if opts.use_cuda_graphs and device_type == "cuda" and cfg.router is not None:
        raise OptionsError(f"--use-cuda-graphs cannot capture a step of {cfg.model_type} (a Mixture-of-Experts "
                           "model): the number of tokens each expert gets changes the shapes of its GEMMs from one "
                           "micro-step to the next, and a CUDA graph replays fixed shapes. Drop --use-cuda-graphs.")
    if opts.fp8_experts:
        _check_fp8_experts(cfg)
    check_delta_rule_precision(opts.delta_rule_precision, cfg)
    if opts.weights_sharded and (why := sharded_weights_refusal(cfg, opts)) is not None:
        raise OptionsError(f"--shard-weights / --zero-level 3 is not supported for this run: {why}; drop it "
                           f"(--shard-gradients / --zero-level 2 still shard the gradients and the optimizer state)")


def mlp_chunks_refusal(cfg: ModelConfig) -> str | None:
    """Why this model's MLPs cannot run in token slices (--mlp-chunks), None if they can: the dense families' block
    slices its MLP (model/llama/block.py); an MoE block's routed experts record per-call router statistics, and
    Qwen3.5's block has no slicing yet."""
    if cfg.model_type not in LLAMA.architectures:
        return (f"model_type {cfg.model_type!r} is not supported yet (the MLP runs in token slices in the dense "
                f"families: {', '.join(LLAMA.architectures)})")
    return None


def sharded_weights_refusal(cfg: ModelConfig, opts: Options) -> str | None:
    """Why this run's weights cannot be sharded (parallel/weights/sharded.py), None if they can: a LoRA base held as
    e4m3 is replicated. `qtrain plan` proposes sharded weights only where this is None."""
    if opts.lora_rank and opts.lora_base_dtype:
        return f"--lora-base-dtype {opts.lora_base_dtype} holds the frozen base as e4m3 on every rank"
    return None


def _check_fp8_experts(cfg: ModelConfig) -> None:
    """--fp8-experts: an MoE model of a family whose experts run through `model/moe_block.py` (qwen3_moe, olmoe,
    mixtral: Qwen3.5-MoE's block calls the experts without it, so the option would do nothing there) whose expert
    GEMMs' K and N (hidden size, 2 x and 1 x the experts' intermediate size) are multiples of 16
    (torch._scaled_grouped_mm; kernels/grouped_gemm_fp8.py)."""
    if cfg.router is None:
        raise OptionsError(f"--fp8-experts applies to Mixture-of-Experts models; {cfg.model_type} has no experts "
                           "(drop it)")
    if not isinstance(family_of(cfg), MoeFamily):
        raise OptionsError(f"--fp8-experts is not built for {cfg.model_type} yet (its experts run in bf16; FP8 experts "
                           f"are qwen3_moe's, olmoe's and mixtral's): drop it")
    C, F = cfg.hidden_size, cfg.moe_intermediate_size
    if C % FP8_MULTIPLE or F % FP8_MULTIPLE:
        raise OptionsError(f"--fp8-experts: the model's hidden_size {C} and moe_intermediate_size {F} must be "
                           f"multiples of {FP8_MULTIPLE} (FP8 grouped GEMMs); drop the option")


def cuda_graphs_on(cfg: ModelConfig, opts: Options, *, world: int, device_type: str,
                   fp8: Fp8Choice | None = None) -> bool:
    """Whether this run's micro-steps replay from CUDA graphs: --use-cuda-graphs as given (on a CUDA device);
    unset, only where they were measured faster (Qwen2.5-0.5B at 4 x 8 2.90x, 16 x 2 1.027x, 32 x 4 1.009x on an
    H200), i.e. nothing blocks them, no linear runs in FP8 (a cold-compile hang with FP8 under capture is not
    understood yet) and the block's GEMM work per micro-step is at most CUDA_GRAPHS_AUTO_MAX_BLOCK_GFLOP: above it
    the GPU, not the host, sets the pace. `fp8`: the run's FP8 choice, when made already."""
    if device_type != "cuda" or opts.use_cuda_graphs is False or cfg.router is not None:
        return False  # an MoE model's GEMM shapes change every micro-step (`check_model_support`)
    if opts.use_cuda_graphs:
        return True
    fp8 = fp8 if fp8 is not None else fp8_choice(cfg, opts)
    return (not cuda_graph_blockers(opts, world=world) and not (fp8 is not None and fp8.fp8)
            and opts.debug_log_allocations < 0  # it locates the first step's allocations: keep them eager
            and block_gflop(cfg, opts.batch_size * opts.seq_len) <= CUDA_GRAPHS_AUTO_MAX_BLOCK_GFLOP)


def sdpa_backend(opts: Options, device: torch.device) -> str:
    """--sdpa-backend, with auto resolved for the device that runs it (kept as given for a CUDA device that this
    machine does not have: a plan for another machine does not need it)."""
    if device.type == "cuda" and not torch.cuda.is_available():
        return opts.sdpa_backend
    return resolve_sdpa_backend(opts.sdpa_backend, device, TORCH_DTYPES[opts.model_dtype])


def auto_head_backward(cfg: ModelConfig, opts: Options, device_type: str, gpu_memory: int | None) -> bool:
    """--fp8-head-backward unset: tried first where it can run (e4m3 on a CUDA device of known size, the head
    trained: no LoRA, its shapes multiples of 16); taken where its plan fits with AUTO_MARGIN (`_resolve`).
    Measured on one H100 against llm.q's bf16 at Qwen2.5-0.5B 32 x 4: e4m3 1.154x, with it 1.234x (session 32);
    +2.7% (7B) to +5.5% (0.5B) on an H200; its eval loss within 0.13% of e4m3's (docs/precision.md)."""
    return (opts.fp8_head_backward is None and opts.effective_matmul_dtype == "e4m3" and device_type == "cuda"
            and gpu_memory is not None and not opts.lora_rank and not cfg.vocab_size % 16
            and not cfg.hidden_size % 16)


def keeps_transposes(kept: MemoryPlan) -> bool:
    """--fp8-keep-transposes unset: keep them where the plan with them fits with AUTO_MARGIN of activations +
    workspace to spare."""
    margin = AUTO_MARGIN * (kept.item("activations").device + kept.item("workspace").device)
    return kept.fits and kept.headroom >= margin


def check_ranks(cfg: ModelConfig, opts: Options, world: int) -> None:
    """What the options ask of `world` ranks (known here first, for `qtrain train` and `qtrain plan` alike): the
    shard groups, expert and context parallelism must divide them (and the experts)."""
    check_group_size(opts.shard_group_size, world)
    check_expert_parallel(opts.expert_parallel, num_experts=cfg.router.experts if cfg.router else None, world=world,
                          model_type=cfg.model_type)
    check_context_parallel(opts.context_parallel, world=world, seq_len=opts.seq_len)


# ---- the record --------------------------------------------------------------------------------------------
def resolve_run(cfg: ModelConfig, opts: Options, *, world: int = 1, device: str | torch.device = "cuda",
                gpu_memory: int | None = None, compiled: bool | None = None, reserve: int | None = None,
                layout: FlatLayout | None = None, model_name: str | None = None,
                recompute: frozenset[str] | None = None, fit: bool | None = None,
                keep: frozenset[str] = frozenset()) -> RunResolution:
    """Every automatic choice of `opts` for `cfg` on `world` ranks of `device`, and the memory plan per rank with
    them. gpu_memory: the device's bytes (the plan's budget; None: unknown, and the memory-for-speed choices stay
    off). compiled: force the compile choice (a plan of eager or compiled blocks). reserve: the plan's fixed device
    reserve (None: 1 GiB on CUDA, 0 on CPU). recompute: the recompute switches of a model built by hand, instead of
    the options' (with what they imply). fit: make the plan fit with `fit_memory_changes` (None: --fit-memory; never
    with a budget unknown, off CUDA, or with `recompute` given). keep: options the fit leaves as given unless
    nothing fits with them (a resumed run's, as its checkpoint ran them: `train/resume_checks.review`, which reports
    one it changes)."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    check_ranks(cfg, opts, world)
    dev = torch.device(device) if isinstance(device, str) else device
    kw = dict(world=world, device=dev, gpu_memory=gpu_memory, compiled=compiled, reserve=reserve, layout=layout,
              model_name=model_name, recompute=recompute)
    given = _resolve(cfg, opts, **kw)
    if not (opts.fit_memory if fit is None else fit) or dev.type != "cuda" or gpu_memory is None \
            or recompute is not None or given.plan.fits:
        return given
    changes = fit_memory_changes(cfg, opts, given, keep=keep, **kw)
    if not changes and keep & set(FIT_OPTIONS):  # nothing fits keeping them: the fit a new run would make
        changes = fit_memory_changes(cfg, opts, given, **kw)
    if not changes:
        return given
    fitted = _resolve(cfg, dataclasses.replace(opts, **changes), **kw)
    return dataclasses.replace(fitted, memory_changes=tuple(changes.items()))


def fit_memory_changes(cfg: ModelConfig, opts: Options, given: RunResolution, *, keep: frozenset[str] = frozenset(),
                       **kw: Any) -> dict[str, Any]:
    """--fit-memory: the fewest activation-side option changes with which the run's plan fits (`plan.fit`), each
    candidate resolved as a run of those options would be, none to the options in `keep`; none where nothing fits. A
    run that asks for CUDA graphs gets no change they cannot capture (--offload-residual), one that asks for
    --swiglu-epilogue none that splits the MLP (--recompute-swiglu / --recompute-ffn)."""
    def plan_of(o: Options) -> MemoryPlan | None:
        if o.use_cuda_graphs and cuda_graph_blockers(o, world=kw["world"]):
            return None
        if o.swiglu_epilogue == "on" and splits_mlp(o.recompute):
            return None
        if o.mlp_chunks > 1 and mlp_chunks_refusal(cfg) is not None:
            return None
        return _resolve(cfg, o, **kw).plan
    changes, _ = fit_activations(opts, plan_of, plan=given.plan, keep=keep)
    return changes


def _resolve(cfg: ModelConfig, opts: Options, *, world: int, device: torch.device, gpu_memory: int | None,
             compiled: bool | None, reserve: int | None, layout: FlatLayout | None, model_name: str | None,
             recompute: frozenset[str] | None) -> RunResolution:
    """The record for `opts` as they are (`resolve_run` without --fit-memory)."""
    dev = device
    use_compile = compile_on(opts, dev.type) if compiled is None else compiled
    fp8 = fp8_choice(cfg, opts)
    matmul = opts.effective_matmul_dtype
    run = dict(device=dev.type, world=world, compile=use_compile, sdpa_backend=sdpa_backend(opts, dev),
               master_dtype=opts.effective_master_dtype, grad_accum_dtype=opts.effective_grad_accum_dtype,
               matmul_dtype=matmul, fp8=fp8, block_matmul_dtype=matmul if fp8 is None or fp8.fp8 else "",
               fp8_grad_dtype=meant(opts.__getattribute__, "gradient_dtype"), fp8_swiglu_onepass=swiglu_onepass(opts),
               persistent_quants=persistent_quants(cfg, opts, fp8),
               cuda_graphs=cuda_graphs_on(cfg, opts, world=world, device_type=dev.type, fp8=fp8),
               cuda_graph_blockers=tuple(cuda_graph_blockers(opts, world=world)),
               gradients=opts.gradient_manager_kind,
               recompute=opts.recompute if recompute is None else resolve_flags(recompute),
               lmhead_chunks=opts.lmhead_chunks, mlp_chunks=opts.mlp_chunks, offload_residual=opts.offload_residual,
               delta_rule_precision=delta_rule_precision(opts))
    run["swiglu_epilogue"] = swiglu_epilogue(cfg, opts, dev.type, use_compile, fp8, run["recompute"])
    shards = opts.shard_group_size if 0 < opts.shard_group_size <= world else world  # hybrid: the shard group

    def plan(keep: bool, head: bool) -> MemoryPlan:
        return build_plan(cfg, opts, device=dev.type, world=world, shards=shards, compiled=use_compile,
                          fp8_linears=fp8.fp8 if fp8 is not None else (), quants=run["persistent_quants"],
                          keep_transposes=keep, fp8_head_backward=head,
                          cuda_graphs=run["cuda_graphs"], recompute=run["recompute"],
                          swiglu_epilogue=run["swiglu_epilogue"],
                          gpu_memory=gpu_memory, reserve=reserve, layout=layout, model_name=model_name)

    auto_keep = (opts.fp8_keep_transposes is None and dev.type == "cuda" and use_compile and fp8 is not None
                 and bool(fp8.fp8) and gpu_memory is not None)
    given_head = bool(opts.fp8_head_backward and matmul == "e4m3")
    heads = (True, False) if auto_head_backward(cfg, opts, dev.type, gpu_memory) else (given_head,)
    for i, head in enumerate(heads):  # the auto head first; the last choice is taken whatever its margin
        last = i == len(heads) - 1
        if auto_keep:  # auto: kept where the plan with them fits with a margin
            kept = plan(True, head)
            if keeps_transposes(kept):
                return RunResolution(**run, fp8_head_backward=head, fp8_keep_transposes=True, plan=kept)
        keep = bool(opts.fp8_keep_transposes)
        planned = plan(keep, head)
        if last or keeps_transposes(planned):
            return RunResolution(**run, fp8_head_backward=head, fp8_keep_transposes=keep, plan=planned)
    raise AssertionError("unreachable: the last head choice always resolves")


def plan_memory(cfg: ModelConfig, opts: Options, *, world: int = 1, gpu_memory: int | None = None,
                device: str = "cuda", compiled: bool | None = None, reserve: int | None = None,
                layout: FlatLayout | None = None, model_name: str | None = None,
                recompute: frozenset[str] | None = None) -> MemoryPlan:
    """The memory plan of `opts` for `cfg` on `world` ranks of `device` (default: a CUDA device), with the run's
    automatic choices resolved as a run would resolve them (`resolve_run`), for the options as given (no
    --fit-memory): what `qtrain plan` prints."""
    return resolve_run(cfg, opts, world=world, device=device, gpu_memory=gpu_memory, compiled=compiled,
                       reserve=reserve, layout=layout, model_name=model_name, recompute=recompute, fit=False).plan


def plan_for_trainer(trainer: Any, gpu_memory: int | None = None) -> MemoryPlan:
    """The plan of a constructed `Trainer`: the one its run resolved with (budget: the device's total memory on
    CUDA, none on CPU), or, for another `gpu_memory`, its options planned again for that budget, with the choices
    the model was built with (the FP8 head backward and the kept transposes, which a budget would decide again, and
    the LM head chunks and MLP slices a resume kept from its checkpoint)."""
    if gpu_memory is None:
        return trainer.run.plan
    run = trainer.run
    ran = {**dict(run.memory_changes), **{k: getattr(run, k) for k in CHANGES_NUMBERS}}
    opts = dataclasses.replace(trainer.opts, **ran, fp8_head_backward=run.fp8_head_backward,
                               fp8_keep_transposes=run.fp8_keep_transposes if run.fp8_linears else None)
    return resolve_run(trainer.cfg, opts, world=trainer.ctx.world, device=trainer.device,
                       gpu_memory=gpu_memory, compiled=trainer.run.compile, layout=trainer.layout, fit=False).plan
