"""`qtrain train`: the whole run around a Trainer: data, schedule, logs, evaluation, checkpoints, export.

Per step (llm.q's order): checkpoint if due, evaluate if due, one `Trainer.step` on the next
grad_accumulation micro-batches (the step's math, loss scale included, is the Trainer's), log.
After the loop: evaluation over the whole eval file, HF export to --out-dir, final checkpoint.
"""
from __future__ import annotations

import os
import sys
import time

import torch

from qtrain.data.corpus import ensure_default_dataset
from qtrain.data.loader import TokenLoader
from qtrain.data.hf_tokenizer import recorded_tokenizer, transformers_caveat
from qtrain.observe.live import attach_observers
from qtrain.observe.log import RunLogger
from qtrain.observe.metrics import device_peaks, model_flops_per_token, ns_per_token, peak_tflops, sol_ops
from qtrain.options import Options
from qtrain.parallel.dist import DistContext, init_distributed
from qtrain.plan.memory import plan_for_trainer
from qtrain.train import checkpointing
from qtrain.train.schedule import LRSchedule
from qtrain.train.trainer import Trainer

DEFAULT_DATA_DIR = os.path.join("data", "qtrain-default")


def data_files(opts: Options) -> tuple[str, str | None]:
    """(train pattern, eval pattern or None). No --train-file: the embedded corpus (built on first use)."""
    if opts.train_file:
        return opts.train_file, opts.eval_file or None
    train, evals = ensure_default_dataset(DEFAULT_DATA_DIR)
    return train, opts.eval_file or evals


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_training(opts: Options, argv: list[str] | None = None, ctx: DistContext | None = None) -> dict:
    """Train as the options say; returns a summary (final eval loss, steps, out_dir) on every rank."""
    opts.validate()
    ctx = ctx or init_distributed(opts.device)
    train_pattern, eval_pattern = _data_files_on_every_rank(opts, ctx)

    trainer = Trainer(opts, ctx)
    cfg, B, T, GA, W = trainer.cfg, opts.batch_size, opts.seq_len, opts.grad_accumulation, ctx.world
    train = TokenLoader(train_pattern, T, rank=ctx.rank, world=W, seed=opts.train_seed, model_vocab_size=cfg.vocab_size)
    evals = (TokenLoader(eval_pattern, T, rank=ctx.rank, world=W, seed=opts.eval_seed,
                         model_vocab_size=cfg.vocab_size, shuffle=False) if eval_pattern else None)
    steps_per_epoch = train.chunks_per_epoch // (B * GA)
    if steps_per_epoch == 0:
        raise ValueError(f"--train-file {train_pattern}: {train.chunks_per_epoch} sequences per rank are fewer than "
                         f"one step needs (batch {B} x grad-accumulation {GA})")
    total_steps = opts.steps if opts.steps > 0 else opts.epochs * steps_per_epoch
    schedule = LRSchedule(peak_lr=opts.learning_rate, total_steps=total_steps, warmup=opts.warmup,
                          cooldown=opts.cooldown, final_lr_fraction=opts.final_lr_fraction, kind=opts.lr_schedule)
    ckpt_dir, out_dir = opts.expand(opts.checkpoint_dir), opts.expand(opts.out_dir)

    log = RunLogger(opts.expand(opts.log_file) if opts.log_file else None, rank=ctx.rank, total_steps=total_steps)
    tb = None  # --tensorboard DIR: the same metrics as TensorBoard scalars (rank 0)
    if opts.tensorboard and ctx.is_main:
        from qtrain.observe.tensorboard import TensorBoardSink
        tb = TensorBoardSink(opts.expand(opts.tensorboard))
        tb.on_event({"log": "options", "step": 0, "options": opts.to_dict()})
    _log_run_header(log, trainer, train, evals, total_steps, argv)

    start = 0
    if opts.continue_from is not None:
        start = _resume(opts, trainer, train, log, ckpt_dir)

    def evaluate(step: int, max_batches: int | None) -> float | None:
        if evals is None:
            return None
        t0 = time.perf_counter()
        loss, n = trainer.evaluate(evals.iterate_eval_batches(B, max_batches))
        obj = log.log_eval(step, loss=loss, eval_tokens=n, duration_ms=1000 * (time.perf_counter() - t0),
                           epoch=train.progress)
        if tb is not None:
            tb.on_event(obj)
        return loss

    def save_checkpoint() -> str:
        return checkpointing.save(ckpt_dir, trainer, train, log, keep_n=opts.ckpt_keep_n, major=opts.ckpt_major)

    for step in range(start, total_steps):
        if step % opts.ckpt_interval == 0 and step > start:
            save_checkpoint()
        if step % opts.eval_every_n_steps == 0 and step > 0 and opts.eval_num_steps > 0:
            evaluate(step, opts.eval_num_steps)
        t0 = time.perf_counter()
        stats = trainer.step([train.next_batch(B) for _ in range(GA)], lr=schedule(step))
        _sync(ctx.device)
        obj = log.log_step(step, step_tokens=B * T * GA * W, duration_ms=1000 * (time.perf_counter() - t0),
                           norm=stats["norm"], loss=stats["loss"], lr=stats["lr"], epoch=train.progress)
        if tb is not None:
            tb.on_event(obj)
        if trainer.abs_maxes is not None:
            log.log_abs_maxes(step, trainer.abs_maxes)
            trainer.abs_maxes = None
        if stats["skipped"]:
            log.message(f"step {step}: non-finite gradient norm, update skipped", step=step, level="warning")

    final = evaluate(total_steps, None)
    if ctx.device.type == "cuda":
        log.log_memory(allocated=torch.cuda.memory_allocated(), reserved=torch.cuda.memory_reserved(),
                       peak=torch.cuda.max_memory_allocated())
    trainer.export(out_dir)
    log.message(f"exported HF model to {out_dir}", level="info")
    final_ckpt = None
    if opts.save_training_state:
        final_ckpt = save_checkpoint()
    log.log_outputs(export=out_dir, checkpoint=final_ckpt or (ckpt_dir if os.path.isdir(ckpt_dir) else None),
                    log_file=log.path,
                    tensorboard=opts.expand(opts.tensorboard) if opts.tensorboard else None)
    if tb is not None:
        tb.close()
    log.close()
    return {"final_eval_loss": final, "steps": total_steps, "out_dir": out_dir, "checkpoint_dir": ckpt_dir}


def _data_files_on_every_rank(opts: Options, ctx: DistContext) -> tuple[str, str | None]:
    """`data_files`; rank 0 builds the embedded corpus (if needed) before the others look for it."""
    files = data_files(opts) if ctx.is_main else None
    ctx.barrier()
    return files if files is not None else data_files(opts)


def _log_run_header(log: RunLogger, trainer: Trainer, train: TokenLoader, evals: TokenLoader | None,
                    total_steps: int, argv: list[str] | None) -> None:
    """What the run is: command, options, data, device, speed-of-light model, memory plan."""
    opts, ctx, cfg = trainer.opts, trainer.ctx, trainer.cfg
    T, W = opts.seq_len, ctx.world
    log.log_cmd(argv if argv is not None else sys.argv)
    log.log_options(opts.to_dict())
    attach_observers(opts, log, trainer, ctx.device)  # --wandb, --log-gpu-util, --debug-* (qtrain.observe.live)
    if trainer.tokenizer is None:  # nothing explicit and no model directory: the tokenizer the data was made with
        trainer.tokenizer = recorded_tokenizer([f.header for f in train.files])
    log.message(f"export tokenizer: {trainer.tokenizer}" if trainer.tokenizer else
                "no tokenizer is known for the export (no model directory files, none recorded in the token "
                "files): pass --tokenizer", level="info" if trainer.tokenizer else "warning")
    if caveat := transformers_caveat(trainer.tokenizer, cfg):
        log.message(caveat, level="warning")
    log.log_dataset("train", files=len(train.files), tokens=train.num_tokens, seed=opts.train_seed)
    if evals is not None:
        log.log_dataset("eval", files=len(evals.files), tokens=evals.num_tokens, seed=opts.eval_seed)
    dev_name = _device_name(ctx.device)
    log.log_device(name=dev_name, rank=ctx.rank, world=W, device=str(ctx.device))
    ops = sol_ops(cfg, T, matmul_dtype=opts.effective_matmul_dtype, model_dtype=opts.model_dtype)
    peaks = device_peaks(dev_name)
    log.log_sol(blocks=ops.blocks, lm_head=ops.lm_head, attention=ops.attention,
                ns_per_token=ns_per_token(ops, dev_name, world=W),
                peaks=None if peaks is None else {"bf16": peaks.bf16, "fp8": peaks.fp8},
                mfu_flops_per_token=model_flops_per_token(cfg, T), bf16_peak_tflops=peak_tflops(dev_name, "bf16"),
                world=W)
    plan = plan_for_trainer(trainer)  # budget: the device's total memory on CUDA, none on CPU
    log.log("memory-plan", **plan.to_dict())
    log._print(plan.format() + "\n")
    if not plan.fits:
        log.message(f"memory plan: {plan.summary()}; `qtrain plan` proposes a configuration that fits",
                    level="warning")
    log.message(f"model {cfg.model_type}: {cfg.num_params() / 1e6:.1f}M parameters, {total_steps} steps of "
                f"{opts.batch_size * T * opts.grad_accumulation * W} tokens", level="info")


def _resume(opts: Options, trainer: Trainer, train: TokenLoader, log: RunLogger, ckpt_dir: str) -> int:
    """--continue: restore the checkpoint it names (and the data position unless --new-data); returns the
    step to continue from (0 when there is none)."""
    path = checkpointing.find(ckpt_dir, opts.continue_from)
    if path is None:
        log.message(f"--continue: no checkpoint found in {ckpt_dir}; starting from scratch", level="warning")
        return 0
    start = checkpointing.load(path, trainer, train_loader=None if opts.new_data else train, logger=log)
    log.message(f"resumed from {path} at step {start}", level="warning")
    return start
