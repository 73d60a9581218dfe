"""Everything about a training run that can be checked before the model is built, in one pass.

    prep = preflight(opts, world=2)    # raises a ValueError of qtrain naming the option / file / tensor

checks, in order, what would otherwise fail late (after minutes of loading, or at the final evaluation):
options and their combinations (and what --use-cuda-graphs cannot capture: train/cuda_graphs.py); the device;
the model's config.json and the weight files' headers (names, shapes, dtypes; no tensor data is read); that
--seq-len fits the model's positions; the run's automatic choices, resolved once with its memory plan for every
rank (`plan/resolution.py`: `Prepared.run`, which the Trainer builds from); the output paths (writable, not on top
of each other, not another run's: `run_dir`; and locked here for the run's life, so a live run's paths are refused
to any other process); the token files (header, size, each id within the model's vocabulary: scanned
memory-mapped and cached per file); the
checkpoint `--continue` names and whether it fits this run; and the host memory the plan needs. Nothing large
is allocated.

`qtrain train --gpus N` runs it once in the launcher, before starting any worker; a run under torchrun
runs it on rank 0 and hands the result (or the error) to the other ranks.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from qtrain.data.corpus import ensure_default_dataset
from qtrain.data.hf_tokenizer import check_export_tokenizer, export_tokenizer
from qtrain.data.loader import TokenLoader
from qtrain.locks import Locks
from qtrain.model.config import ModelConfig
from qtrain.model.hf_io import check_hf_weights
from qtrain.model.lora.checks import spec_from_options
from qtrain.model.resolve import resolve_model
from qtrain.options import Options, OptionsError
from qtrain.parallel.dist import DeviceError, check_device
from qtrain.parallel.groups import check_group_size
from qtrain.plan.resolution import RunResolution, check_cuda_graphs, check_model_support, resolve_run
from qtrain.train import checkpoint_io as cio
from qtrain.train import checkpointing, compile_cache, resume_checks, run_dir

DEFAULT_DATA_DIR = os.path.join("data", "qtrain-default")


@dataclass
class Prepared:
    """What the preflight found: enough to start the run without looking again."""
    run_id: str
    resume: str | None  # checkpoint to load (None: fresh start)
    note: str | None  # a message for the log (e.g. "--continue found no checkpoint, starting fresh")
    train_pattern: str
    eval_pattern: str | None
    total_steps: int
    paths: run_dir.RunPaths
    found: run_dir.Found
    start_over: bool
    review: resume_checks.Review | None = None  # --continue: what changed since the checkpoint, or that it is done
    run: RunResolution | None = None  # every automatic choice of the run, and its memory plan
    lock: Locks | None = dataclasses.field(default=None, repr=False, compare=False)  # the paths, held by this process

    def shareable(self) -> "Prepared":
        """The same without the lock, to hand to other processes (workers): the lock stays with its holder."""
        return dataclasses.replace(self, lock=None)


def data_files(opts: Options) -> tuple[str, str | None]:
    """(train pattern, eval pattern or None). No --train-file: the embedded corpus (built on first use)."""
    if opts.train_file:
        return opts.train_file, opts.eval_file or None
    train, evals = ensure_default_dataset(DEFAULT_DATA_DIR)
    return train, opts.eval_file or evals


def _device_type(opts: Options) -> str:
    import torch
    return "cuda" if opts.device == "cuda" or (opts.device == "auto" and torch.cuda.is_available()) else "cpu"


def resolve(opts: Options, cfg: ModelConfig, world: int, keep: frozenset[str] = frozenset()) -> RunResolution:
    """The run's automatic choices and its memory plan, for this machine's device (budget: the total memory of
    the first visible CUDA device, which every rank of a machine has the same of; none on CPU). keep: options
    --fit-memory leaves as given where it can (a resumed run's, `resolve_run`)."""
    import torch
    device = _device_type(opts)
    total = torch.cuda.get_device_properties(torch.device("cuda")).total_memory if device == "cuda" else None
    return resolve_run(cfg, opts, world=world, device=device, gpu_memory=total, keep=keep)


def check_seq_len(seq_len: int, cfg: ModelConfig, prefix: str = "") -> None:
    """--seq-len within the positions the model was made for (RoPE scaling, the config's rope_scaling, extends them):
    beyond them its logits mean nothing (train and eval alike)."""
    if seq_len > cfg.context_length:
        scaled = (f" ({cfg.rope_scaling['rope_type']} rope scaling: {cfg.context_length})" if cfg.rope_scaling else
                  "; --rope-scaling TYPE (yarn, linear, dynamic, llama3) extends it")
        raise OptionsError(f"{prefix}--seq-len {seq_len} exceeds the model's max_position_embeddings "
                           f"{cfg.max_position_embeddings}{scaled}")


def check_model(opts: Options) -> ModelConfig:
    """The model's config and, when weights are loaded, their headers; the export's tokenizer files; and what
    the options ask of it."""
    source = resolve_model(opts.model, from_scratch=opts.from_scratch, rope_scaling=opts.rope_scaling,
                           seq_len=opts.seq_len)
    cfg = source.cfg
    if source.weights_dir is not None:
        check_hf_weights(source.weights_dir, cfg)
    check_export_tokenizer(export_tokenizer(explicit=opts.tokenizer, model_dir=source.tokenizer_dir), cfg)
    if opts.fp8_head_backward and (cfg.vocab_size % 16 or cfg.hidden_size % 16):
        raise OptionsError(f"--fp8-head-backward: the model's vocab_size {cfg.vocab_size} and hidden_size "
                           f"{cfg.hidden_size} must be multiples of 16 (cuBLASLt's FP8 GEMMs); drop the option")
    spec_from_options(vars(opts), cfg, check_adapter=True)  # LoRA: targets, rank, the --lora-init-from adapter
    check_seq_len(opts.seq_len, cfg)
    check_model_support(cfg, opts, device_type=_device_type(opts))  # MoE: no CUDA graphs, no sharded weights, ...
    return cfg


def document_args(opts: Options, cfg: ModelConfig) -> dict[str, Any]:
    """A TokenLoader's --document-masking arguments: the option, and the model's EOS id for files that say neither
    their documents nor their own EOS (data/documents.py)."""
    return {"document_masking": opts.document_masking,
            "eos_ids": cfg.end_of_document_ids}


def check_data(opts: Options, cfg: ModelConfig, world: int) -> tuple[str, str | None, int]:
    """(train pattern, eval pattern, total steps) once the token files passed every check (TokenLoader:
    headers, sizes, vocabulary field, id range, enough sequences for each rank and for one step; with
    --document-masking, each file's documents)."""
    train_pattern, eval_pattern = data_files(opts)
    world //= max(1, opts.context_parallel)  # the data-parallel replicas: a context group shares its sequences
    train = TokenLoader(train_pattern, opts.seq_len, world=world, seed=opts.train_seed, model_vocab_size=cfg.vocab_size,
                        **document_args(opts, cfg))
    if eval_pattern:
        TokenLoader(eval_pattern, opts.seq_len, world=world, seed=opts.eval_seed, model_vocab_size=cfg.vocab_size,
                    shuffle=False, **document_args(opts, cfg))
    B, GA = opts.batch_size, opts.grad_accumulation
    steps_per_epoch = train.chunks_per_epoch // (B * GA)
    if steps_per_epoch == 0:
        raise OptionsError(f"--train-file {train_pattern}: {train.chunks_per_epoch} sequences per rank are fewer than "
                           f"one step needs (batch {B} x grad-accumulation {GA})")
    total = opts.steps if opts.steps > 0 else opts.epochs * steps_per_epoch
    if opts.steps <= 0 and opts.warmup + opts.cooldown > total:
        raise OptionsError(f"--warmup ({opts.warmup}) + --cooldown ({opts.cooldown}) exceed the {total} steps of "
                           f"--epochs {opts.epochs}")
    return train_pattern, eval_pattern, total


def check_resume(opts: Options, cfg: ModelConfig, world: int, paths: run_dir.RunPaths, found: run_dir.Found, *,
                 train_pattern: str,
                 total_steps: int) -> tuple[str, str | None, str | None, resume_checks.Review | None]:
    """(run id, checkpoint to resume or None, note, review): --continue resolved and checked against this run (its
    meta's schema, its files' headers and recorded digests, the options and data it records: `resume_checks`), and
    the output paths' owners and the user's links among the checkpoints checked against the run that will write
    them."""
    if opts.continue_from is None:
        run_dir.check_links(paths, from_step=0, start_over=opts.start_over)
        run_dir.check_ownership(paths, found, run_id=None, start_over=opts.start_over)
        return run_dir.new_run_id(), None, None, None
    review = None
    path = checkpointing.find(paths.ckpt_dir, opts.continue_from)
    if path is None:
        run_id = found.ckpt_run if found.ckpt_run not in (None, run_dir.LEGACY) else run_dir.new_run_id()
        note = f"--continue: no checkpoint in {paths.ckpt_dir} yet; starting from scratch"
    else:
        meta, files = cio.read_checkpoint(path)
        shards = check_group_size(opts.shard_group_size, world)
        checkpointing.check_compatible(path, meta, cfg, opts, shards)
        checkpointing.check_resumable(path, meta, files, cfg, opts, shards, paths.ckpt_dir)
        review = resume_checks.review(path, meta, opts, world=world, train_pattern=train_pattern,
                                      total_steps=total_steps, out_dir=paths.out_dir, cfg=cfg)
        run_id = (meta.get("run") or {}).get("id") or (
            found.ckpt_run if found.ckpt_run not in (None, run_dir.LEGACY) else run_dir.new_run_id())
        note = None if files.verified else checkpointing.unverified_note(path)
    run_dir.check_links(paths, from_step=(cio.checkpoint_step(path) or 0) if path else 0)
    run_dir.check_ownership(paths, found, run_id=run_id)
    return run_id, path, note, review


def check_memory(opts: Options, cfg: ModelConfig, run: RunResolution, procs: int) -> None:
    """Refuse a plan that cannot fit the host (CPU runs; pinned offload buffers on CUDA), and a --lora-merge whose
    merged model would not fit beside it at the end of the run."""
    if not opts.memory_check:
        return
    from qtrain.model.family import DTYPE_BYTES
    from qtrain.model.weights import num_params
    from qtrain.plan.host import check_host_memory, merged_export_bytes, process_rss
    merged = merged_export_bytes(num_params(cfg), DTYPE_BYTES[run.master_dtype],
                                 weights_sharded=opts.weights_sharded) if opts.lora_merge else 0
    check_host_memory(run.plan, procs, baseline=process_rss(), merged_export=merged)


def preflight(opts: Options, *, world: int, local_procs: int | None = None) -> Prepared:
    """Run every check (see the module docstring); `local_procs` is the processes of this machine (default
    `world`). Raises the first problem found as a ValueError of qtrain."""
    opts.validate()
    check_group_size(opts.shard_group_size, world)
    check_cuda_graphs(opts, world=world, device_type=_device_type(opts))
    check_device(opts.device)
    if _device_type(opts) == "cuda":
        import torch
        if local_procs and local_procs > torch.cuda.device_count():
            raise DeviceError(f"--gpus {local_procs}: only {torch.cuda.device_count()} CUDA device(s) visible")
    cfg = check_model(opts)
    run = resolve(opts, cfg, world)  # with the checks of the ranks (`resolution.check_ranks`)
    paths = run_dir.RunPaths.of(opts)
    run_dir.check_paths(paths)
    compile_cache.check(opts.compile_cache)
    lock = run_dir.lock(paths)  # released by the caller when the run ends, or here when a check fails
    try:
        found = run_dir.inspect(paths)
        train_pattern, eval_pattern, total = check_data(opts, cfg, world)
        run_id, resume, note, review = check_resume(opts, cfg, world, paths, found,
                                                    train_pattern=train_pattern, total_steps=total)
        if review is not None:
            if review.pinned:  # the checkpoint's automatic choices that change the numbers
                kept = resolve(dataclasses.replace(opts, **review.pinned), cfg, world, keep=frozenset(review.pinned))
                # nothing fits with them where the command's own options fit (a new run's fit): they go, each said
                run = kept if kept.plan.fits or not run.plan.fits else run
            review.changes += resume_checks.memory_differences(review, opts, run)
        check_memory(opts, cfg, run, local_procs or world)
    except BaseException:
        lock.release()
        raise
    note = "; ".join(n for n in [note, *lock.notes] if n) or None
    return Prepared(run_id=run_id, resume=resume, note=note, train_pattern=train_pattern, eval_pattern=eval_pattern,
                    total_steps=total, paths=paths, found=found, start_over=opts.start_over, review=review,
                    run=run, lock=lock)


def shared_preflight(opts: Options, ctx: Any) -> Prepared:
    """Rank 0 runs the preflight and hands every rank the result, or the error to raise (so no rank waits
    for a rank that already failed). Rank 0 holds the paths' lock (the other ranks of the job need none)."""
    result: Any = None
    if ctx.is_main:
        try:
            result = preflight(opts, world=ctx.world, local_procs=int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world)))
        except ValueError as e:
            result = e
    try:
        shared = ctx.broadcast_object(result.shareable() if isinstance(result, Prepared) else result)
    except BaseException:
        if isinstance(result, Prepared) and result.lock is not None:
            result.lock.release()
        raise
    if isinstance(shared, BaseException):
        raise shared
    return result if ctx.is_main else shared
