"""Which option values and combinations a run refuses: `Options.validate` runs these rules once, before anything
large is allocated (CLI flags and config files both go through it). Each message names the option(s) and the fix."""
from __future__ import annotations

import math
import re
from dataclasses import fields
from typing import Any, Callable

from qtrain.model.recompute_flags import splits_mlp
from qtrain.options_values import CHOICES, EMPTY_MEANS_DEFAULT, OptionsError

MLP_SLICE_ROWS = 16  # an FP8 linear's rows (tokens) are a multiple of this, so each --mlp-chunks slice's are too (e4m3)


def check_options(opts: Any) -> None:
    """Raise OptionsError naming the option(s) and the fix (`Options.validate`); each rule names every option it
    involves, so a message always says what to change."""
    def err(msg: str) -> OptionsError:
        return OptionsError(msg)

    def choice(opt: str, value: str, allowed: tuple[str, ...]) -> None:
        if value not in allowed:
            raise err(f"--{opt}={value!r}: must be one of {', '.join(allowed)}")

    for f in fields(opts):  # NaN / inf pass every comparison below (nan < 0 is False): refuse them first
        v = getattr(opts, f.name)
        if isinstance(v, float) and not math.isfinite(v):
            raise err(f"--{f.name.replace('_', '-')} must be a finite number, got {v}")
    check_run_name(opts.name)
    for opt, v in (("out-dir", opts.out_dir), ("checkpoint-dir", opts.checkpoint_dir),
                   ("compile-cache", opts.compile_cache)):
        if not v.strip():
            raise err(f"--{opt} must not be empty")
    for name, allowed in CHOICES.items():
        value = getattr(opts, name)
        if value or name not in EMPTY_MEANS_DEFAULT:
            choice(name.replace("_", "-"), value, allowed)
    if opts.fp8_min_size < 0:
        raise err(f"--fp8-min-size must be >= 0, got {opts.fp8_min_size}")
    if not opts.fp8_min_block_gflop >= 0:
        raise err(f"--fp8-min-block-gflop must be >= 0, got {opts.fp8_min_block_gflop}")
    if opts.gradient_dtype and opts.effective_matmul_dtype != "e4m3":
        raise err("--gradient-dtype only applies with --matmul-dtype e4m3")
    if opts.model_dtype == "fp32" and (opts.opt_m_dtype != "fp32" or opts.opt_v_dtype != "fp32"):
        raise err("--model-dtype fp32 needs --opt-m-dtype fp32 and --opt-v-dtype fp32 "
                  "(low-precision moments with fp32 weights are not a supported combination)")
    _check_master(opts, err)
    _check_lora(opts, err)
    if opts.opt_m_dtype == "e4m3" and opts.opt_v_dtype != "bf16":
        raise err("--opt-m-dtype e4m3 needs --opt-v-dtype bf16 (llm.q's only e4m3 combination)")
    if opts.opt_m_dtype == "e4m3" and not opts.stochastic_rounding:
        raise err("--opt-m-dtype e4m3 needs stochastic rounding (drop --no-stochastic-rounding): the "
                  "round-to-nearest baseline has no block-scaled e4m3 writer")
    for opt, v in (("batch-size", opts.batch_size), ("seq-len", opts.seq_len),
                   ("grad-accumulation", opts.grad_accumulation), ("lmhead-chunks", opts.lmhead_chunks),
                   ("attn-bwd-chunks", opts.attn_bwd_chunks), ("mlp-chunks", opts.mlp_chunks),
                   ("epochs", opts.epochs), ("eval-every-n-steps", opts.eval_every_n_steps),
                   ("ckpt-interval", opts.ckpt_interval)):
        if v < 1:
            raise err(f"--{opt} must be >= 1, got {v}")
    if opts.steps == 0 or opts.steps < -1:
        raise err(f"--steps must be positive (or -1 for --epochs), got {opts.steps}")
    if (opts.batch_size * opts.seq_len) % opts.lmhead_chunks:
        raise err(f"--lmhead-chunks={opts.lmhead_chunks} must divide batch*seq-len="
                  f"{opts.batch_size * opts.seq_len}")
    local_tokens = opts.batch_size * opts.seq_len // max(1, opts.context_parallel)  # a rank's part of each sequence
    if local_tokens % opts.mlp_chunks:
        raise err(f"--mlp-chunks={opts.mlp_chunks} must divide the tokens of a micro-batch on one rank "
                  f"({local_tokens})")
    slice_tokens = local_tokens // opts.mlp_chunks
    if opts.mlp_chunks > 1 and opts.effective_matmul_dtype == "e4m3" and slice_tokens % MLP_SLICE_ROWS:
        raise err(f"--mlp-chunks={opts.mlp_chunks} with --matmul-dtype e4m3: each slice's {slice_tokens} tokens must "
                  f"be a multiple of {MLP_SLICE_ROWS} (the FP8 GEMMs' rows)")
    if opts.mlp_chunks > 1 and opts.debug_log_abs_max:
        raise err("--debug-log-abs-max with --mlp-chunks is not supported: the recorder books four linears a layer, "
                  "and a sliced MLP calls its two once per slice; drop one of them")
    if opts.batch_size % opts.attn_bwd_chunks:
        raise err(f"--attn-bwd-chunks={opts.attn_bwd_chunks} must divide --batch-size={opts.batch_size}")
    if opts.offload_residual and not opts.recompute_block:
        raise err("--offload-residual needs --recompute-block (only the block inputs it keeps are offloaded)")
    if opts.eval_num_steps < 0:
        raise err(f"--eval-num-steps must be >= 0, got {opts.eval_num_steps}")
    if opts.learning_rate <= 0:
        raise err(f"--learning-rate must be positive, got {opts.learning_rate}")
    if not 0 <= opts.final_lr_fraction <= 1:
        raise err(f"--final-lr-fraction must be in [0, 1], got {opts.final_lr_fraction}")
    if opts.warmup < 0 or opts.cooldown < 0:
        raise err("--warmup and --cooldown must be >= 0")
    if opts.steps > 0 and opts.warmup + opts.cooldown > opts.steps:
        raise err(f"--warmup ({opts.warmup}) + --cooldown ({opts.cooldown}) exceed --steps ({opts.steps})")
    if not (0 <= opts.beta_1 < 1 and 0 <= opts.beta_2 < 1):
        raise err("--beta-1 and --beta-2 must be in [0, 1)")
    if opts.adam_epsilon <= 0 or opts.weight_decay < 0 or opts.z_loss < 0:
        raise err("--adam-epsilon must be > 0, --weight-decay and --z-loss >= 0")
    if opts.init_proj_to_zero and not opts.from_scratch:
        raise err("--init-proj-to-zero needs --from-scratch")
    if opts.new_data and opts.continue_from is None:
        raise err("--new-data needs --continue")
    if opts.override_schedule and opts.continue_from is None:
        raise err("--override-schedule needs --continue")
    if opts.zero_level not in (0, 1, 2, 3):
        raise err(f"--zero-level must be 0..3, got {opts.zero_level}")
    if opts.zero_level >= 2 and opts.shard_gradients:
        raise err("--zero-level and --shard-gradients are mutually exclusive (--zero-level 2 implies it)")
    if opts.zero_level >= 2 and opts.shard_weights:
        raise err("--zero-level and --shard-weights are mutually exclusive (--zero-level 3 implies it)")
    if opts.all_to_all_reduce and opts.gradient_manager_kind == "unsharded":
        raise err("--all-to-all-reduce needs sharded gradients (--shard-gradients or --zero-level 2)")
    if opts.shard_group_size < 0:
        raise err(f"--shard-group-size must be >= 0 (0: all ranks), got {opts.shard_group_size}")
    if opts.offload_gradients and opts.gradient_manager_kind == "unsharded":
        raise err("--offload-gradients needs sharded gradients (--shard-gradients or --zero-level 2): "
                  "unsharded gradients cannot be offloaded")
    # sharded weights, FP8 weight copies, offload (llm.q: --persistent-quants needs the --shard-weights flag
    # literally, so --zero-level 3 cannot use it [quirk]; here either way of sharding the weights works)
    e4m3_base = bool(opts.lora_rank and opts.lora_base_dtype)  # --offload-quants: the base's codes on the host
    if opts.persistent_quants and e4m3_base:
        raise err("--persistent-quants with --lora-base-dtype e4m3: the base is already held as e4m3 codes, made once "
                  "(drop --persistent-quants; --offload-quants keeps those codes on the host)")
    if opts.offload_quants and e4m3_base and not opts.recompute_block:
        raise err("--offload-quants with --lora-base-dtype e4m3 needs --recompute-block: two layers of the base are on "
                  "the device at a time, so each block's backward re-runs its forward on codes copied in again")
    if opts.offload_quants and not opts.persistent_quants and not e4m3_base:
        raise err("--offload-quants needs --persistent-quants (or --lora-base-dtype e4m3: the base's codes on the "
                  "host)")
    if opts.offload_quants and not opts.weights_sharded and not e4m3_base:
        raise err("--offload-quants needs sharded weights (--shard-weights or --zero-level 3): replicated "
                  "weights keep their e4m3 copies on the device")
    if opts.persistent_quants and opts.effective_matmul_dtype != "e4m3":
        raise err("--persistent-quants (and --offload-quants) only apply with --matmul-dtype e4m3: they keep "
                  "FP8 copies of the weights")
    if opts.fp8_keep_transposes and opts.effective_matmul_dtype != "e4m3":
        raise err("--fp8-keep-transposes only applies with --matmul-dtype e4m3: it keeps the e4m3 transposes "
                  "of the block linears' inputs")
    if opts.fp8_head_backward and opts.effective_matmul_dtype != "e4m3":
        raise err("--fp8-head-backward only applies with --matmul-dtype e4m3: it runs the LM head's gradient "
                  "GEMMs in FP8")
    if opts.fp8_experts and opts.effective_matmul_dtype != "e4m3":
        raise err("--fp8-experts only applies with --matmul-dtype e4m3: it runs the MoE experts' GEMMs in FP8")
    if opts.fp8_experts and opts.lora_base_dtype:
        raise err("--fp8-experts with --lora-base-dtype e4m3 is not supported: the frozen base's experts are held as "
                  "e4m3 codes with their own scales (drop one of them)")
    if opts.fp8_experts and opts.expert_parallel > 1:
        raise err("--fp8-experts with --expert-parallel is not supported yet (use --expert-parallel 1)")
    if opts.fp8_swiglu_onepass and opts.effective_matmul_dtype != "e4m3":
        raise err("--fp8-swiglu-onepass only applies with --matmul-dtype e4m3: it writes the SwiGLU output and "
                  "its gradient in e4m3")
    if opts.fp8_swiglu_onepass and splits_mlp(opts.recompute):
        raise err("--fp8-swiglu-onepass needs the MLP as one FP8 function, which --recompute-swiglu / "
                  "--recompute-ffn split into separate steps: drop one of them")
    if opts.lora_dropout and opts.mlp_chunks > 1:
        raise err("--lora-dropout with --mlp-chunks is not supported yet: a mask is keyed by layer and target, so "
                  "every slice of the MLP would draw the same one; drop one of them")
    if opts.fp8_swiglu_onepass and opts.mlp_chunks > 1:
        raise err("--fp8-swiglu-onepass with --mlp-chunks: its scale hints carry from one call to the next, so a "
                  "slice's rerun in backward would read the later slices' hints: drop one of them")
    if opts.offload_master and not opts.weights_sharded:
        raise err("--offload-master needs sharded weights (--shard-weights or --zero-level 3): qtrain keeps no "
                  "separate master copy (the model-dtype weights are the master), and replicated weights must "
                  "stay on the device for the forward")
    if opts.use_zero_copy and not (opts.offload_master or opts.offload_opt_m or opts.offload_opt_v):
        raise err("--use-zero-copy needs offloaded state (--offload-master, --offload-opt-m or --offload-opt-v)")
    if opts.use_zero_copy and opts.device == "cuda":
        raise err("--use-zero-copy is not supported on CUDA: the AdamW update takes all operands on the "
                  "device, so offloaded state is streamed through staging buffers (leave it off)")
    if opts.effective_matmul_dtype == "fp32" and opts.model_dtype == "bf16":
        raise err("--matmul-dtype fp32 with --model-dtype bf16 is not supported")
    if opts.matmul_dtype == "bf16" and opts.model_dtype == "fp32":  # the linears would run in fp32 all the same
        raise err("--matmul-dtype bf16 with --model-dtype fp32 is not supported: the block matmuls run in the "
                  "model dtype; use --model-dtype bf16 (add --master-dtype fp32 to keep fp32 master weights), "
                  "or drop --matmul-dtype")
    if opts.debug_stack_dump_after < 0:
        raise err(f"--debug-stack-dump-after must be >= 0 seconds (0 = off), got {opts.debug_stack_dump_after}")
    if opts.debug_log_abs_max < 0:
        raise err(f"--debug-log-abs-max must be >= 0, got {opts.debug_log_abs_max}")
    if opts.gpus < 0:
        raise err(f"--gpus must be >= 0, got {opts.gpus}")
    if opts.use_cuda_graphs and opts.device == "cpu":
        raise err("--use-cuda-graphs needs a CUDA device (drop it, or --no-use-cuda-graphs, with --device cpu)")
    if opts.log_gpu_util < 0:
        raise err(f"--log-gpu-util must be >= 0 (0 = off), got {opts.log_gpu_util}")
    if opts.debug_log_allocations < -1 or opts.debug_log_allocations == 0:
        raise err(f"--debug-log-allocations takes a size in MiB >= 1 (-1 = off), got {opts.debug_log_allocations}")
    if opts.ckpt_keep_n == 0:
        raise err("--ckpt-keep-n 0 would delete each checkpoint right after writing it; use 1 to keep only the "
                  "newest, or -1 (the default) to keep all")
    if opts.ckpt_keep_n < -1:
        raise err(f"--ckpt-keep-n must be -1 (keep all) or >= 1, got {opts.ckpt_keep_n}")
    if opts.max_nonfinite_steps < 0:
        raise err(f"--max-nonfinite-steps must be >= 0 (0 = never stop), got {opts.max_nonfinite_steps}")
    if opts.collective_timeout <= 0:
        raise err(f"--collective-timeout must be > 0 seconds, got {opts.collective_timeout}")
    if opts.router_z_loss < 0 or opts.log_router_every < 1:
        raise err(f"--router-z-loss must be >= 0 and --log-router-every >= 1, got {opts.router_z_loss} and "
                  f"{opts.log_router_every}")
    if opts.expert_parallel < 1:
        raise err(f"--expert-parallel must be >= 1 (1 = off), got {opts.expert_parallel}")
    if opts.expert_parallel > 1 and opts.shard_group_size:
        raise err("--expert-parallel with --shard-group-size is not supported yet: drop --shard-group-size (the "
                  "state is then sharded over all ranks, the experts' over the ranks holding them)")
    if opts.verbose and opts.quiet:
        raise err("--verbose and --quiet exclude each other: pick one")
    _check_context_parallel(opts, err)
    if opts.start_over and opts.continue_from is not None:
        raise err("--start-over and --continue exclude each other: --continue resumes the earlier run, "
                  "--start-over replaces it")


def _check_lora(opts: Any, err: Callable[[str], OptionsError]) -> None:
    """The LoRA options that need no model (model/lora/checks.py checks the rest against it: targets, rank vs the
    matrices, the --lora-init-from adapter)."""
    given = [f for f, unset in (("alpha", 0.0), ("dropout", 0.0), ("targets", ""), ("init_from", ""),
                                ("merge", False), ("base_dtype", "")) if getattr(opts, f"lora_{f}") != unset]
    if opts.lora_rank < 0:
        raise err(f"--lora-rank must be >= 1 (0: no adapters), got {opts.lora_rank}")
    if not opts.lora_rank:
        if given:
            raise err(f"--lora-{given[0].replace('_', '-')} needs --lora-rank (the adapters' rank)")
        return
    if opts.lora_alpha < 0:
        raise err(f"--lora-alpha must be > 0 (0: the default), got {opts.lora_alpha}")
    if not 0 <= opts.lora_dropout < 1:
        raise err(f"--lora-dropout must be in [0, 1), got {opts.lora_dropout}")
    if opts.lora_merge and opts.lora_base_dtype:
        raise err("--lora-merge with --lora-base-dtype e4m3 is not supported: the run holds the base only as e4m3; "
                  "merge into the --model base with `qtrain export --checkpoint-dir DIR --lora-merge`")
    if opts.lora_base_dtype and opts.separate_master:
        raise err("--lora-base-dtype e4m3 with --master-dtype fp32 is not supported: the adapters run in "
                  "--model-dtype (drop --master-dtype)")


def _check_context_parallel(opts: Any, err: Callable[[str], OptionsError]) -> None:
    """--context-parallel N: the sequence cut into 2N equal chunks, and none of what its attention cannot serve yet
    (the ranks it must divide are known at the start: parallel/context.check_context_parallel)."""
    n = opts.context_parallel
    if n < 1:
        raise err(f"--context-parallel must be >= 1, got {n}")
    if n == 1:
        if opts.context_parallel_mode != "allgather":
            raise err(f"--context-parallel-mode {opts.context_parallel_mode} needs --context-parallel N > 1")
        return
    if opts.seq_len % (2 * n):
        raise err(f"--context-parallel {n}: --seq-len {opts.seq_len} must be a multiple of {2 * n} (each sequence "
                  f"is cut into 2 x {n} equal chunks)")
    blocked = [f for f, on in (("--use-cuda-graphs", opts.use_cuda_graphs),
                               (f"--attn-bwd-chunks {opts.attn_bwd_chunks}", opts.attn_bwd_chunks > 1),
                               ("--document-attention varlen", opts.document_attention == "varlen"),
                               (f"--expert-parallel {opts.expert_parallel}", opts.expert_parallel > 1)) if on]
    if blocked:
        raise err(f"--context-parallel {n} does not support {', '.join(blocked)} yet (its attention meets the "
                  f"other ranks' keys and values in one call per block, outside CUDA graphs)")


def _check_master(opts: Any, err: Callable[[str], OptionsError]) -> None:
    """--master-dtype: only fp32 master weights under a bf16 model are a separate copy (docs/precision.md)."""
    if opts.grad_accum_dtype and opts.grad_accum_dtype != opts.effective_master_dtype and not opts.separate_master:
        raise err(f"--grad-accum-dtype {opts.grad_accum_dtype} only applies with --master-dtype fp32 (otherwise the "
                  "gradient buffers are in the model dtype)")
    if not opts.separate_master:
        return
    if opts.model_dtype != "bf16":
        raise err(f"--master-dtype {opts.master_dtype} with --model-dtype {opts.model_dtype}: a separate master "
                  "copy is fp32 under a bf16 model (--model-dtype bf16 --master-dtype fp32); for all-fp32 "
                  "training use --model-dtype fp32 alone")
    if opts.opt_m_dtype != "fp32" or opts.opt_v_dtype != "fp32":
        raise err("--master-dtype fp32 needs --opt-m-dtype fp32 and --opt-v-dtype fp32 (low-precision moments "
                  "with fp32 master weights are not a supported combination)")
    if opts.offload_master:
        raise err("--master-dtype fp32 with --offload-master is not supported yet: the offloaded shards are "
                  "gathered in their own dtype (drop one of them)")


_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")


def check_run_name(name: str) -> None:
    """A run name is one path component (it replaces %n in --out-dir, --checkpoint-dir and --log-file), so
    it can never point outside them: no '/', no '..', no leading '.', no spaces or control characters."""
    if not _RUN_NAME.match(name) or ".." in name:
        safe = re.sub(r"[^A-Za-z0-9._+-]+", "_", name).strip("._") or "run"
        raise OptionsError(f"--name {name!r}: a run name is one path component of letters, digits and '._+-' "
                           f"(it replaces %n in --out-dir, --checkpoint-dir and --log-file); e.g. --name {safe}")
