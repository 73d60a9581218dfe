"""`qtrain train`: the whole run around a Trainer: data, schedule, logs, evaluation, checkpoints, export.

Before the model is built: every check that can be made (`preflight`), then rank 0 claims the output
paths (`run_dir.claim`: sweeps leftovers of dead processes, writes the run marker).
Per step (llm.q's order): stop if asked (a signal: checkpoint, exit), checkpoint if due, evaluate if due,
one `Trainer.step` on the next grad_accumulation micro-batches (the step's math, loss scale included, is the
Trainer's), log; a streak of non-finite steps stops the run (`stop.py`).
After the loop: the final checkpoint first (a failure later loses nothing), then evaluation over the whole
eval file, then the HF export to --out-dir.
"""
from __future__ import annotations

import os
import sys
import time

import torch

from qtrain import console
from qtrain.data.documents import unmasked_documents_note
from qtrain.data.loader import TokenLoader
from qtrain.data.hf_tokenizer import recorded_tokenizer, transformers_caveat, unavailable_reason
from qtrain.data.token_files import DataChangedError
from qtrain.model.context_extension import adapter_note
from qtrain.model.weights import num_params
from qtrain.observe.allocations import allocator_state
from qtrain.observe.live import attach_observers
from qtrain.observe.log import DEFAULT, QUIET, VERBOSE, RunLogger
from qtrain.observe.startup import Compiling, begin_timeline, mark, phases, seconds_since_start
from qtrain.observe.metrics import device_peaks, model_flops_per_token, ns_per_token, peak_tflops, sol_ops
from qtrain.options import Options
from qtrain.parallel.dist import DistContext, init_distributed, is_collective_error
from qtrain.parallel.context import data_rank
from qtrain.plan.host import return_freed_memory
from qtrain.train import checkpointing, compile_cache, cuda_graphs, run_dir
from qtrain.train.preflight import Prepared, document_args, shared_preflight
from qtrain.train.router_metrics import STEP_FIELDS as ROUTER_FIELDS
from qtrain.train.schedule import LRSchedule
from qtrain.train.stop import (NonFiniteGuard, RunStopped, StackDump, StopSignals, checkpoint_on_request, data_changed,
                               out_of_memory, stopped_after_last_step, stopped_by_signal)
from qtrain.train.trainer import Trainer


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def run_training(opts: Options, argv: list[str] | None = None, ctx: DistContext | None = None,
                 prep: Prepared | None = None) -> dict:
    """Train as the options say; returns a summary (final eval loss, steps, out_dir) on every rank. `prep` is
    the preflight's result when the caller (the --gpus launcher) ran it already."""
    begin_timeline()
    opts.validate()
    ctx = ctx or init_distributed(opts.device, timeout_s=opts.collective_timeout)
    mark("device")
    if ctx.device.type == "cpu":
        return_freed_memory()  # so the host memory the plan checked is what the run holds
    cache_note = compile_cache.use(opts.compile_cache) if _compiles(opts, ctx) else None
    with StopSignals(announce=ctx.is_main) as signals:
        lock = None  # the output paths' lock, when this process took it (rank 0): held until the run ends
        try:
            if prep is None:
                prep = shared_preflight(opts, ctx)
                lock = prep.lock
            return _run(opts, argv, ctx, prep, signals, cache_note)
        except Exception as e:  # a hung or dead rank: name it instead of a backend's message
            if ctx.distributed and is_collective_error(e):
                raise ctx.diagnose(e) from e
            raise
        finally:
            if lock is not None:
                lock.release()


def _claim(prep: Prepared, opts: Options, ctx: DistContext) -> list[str]:
    """Rank 0 takes the output paths for this run (sweep, --start-over, marker); the others wait for it."""
    notes = (run_dir.claim(prep.paths, prep.found, run_id=prep.run_id, name=opts.name, start_over=prep.start_over)
             if ctx.is_main else [])
    ctx.barrier()
    return notes


def _build_trainer(opts: Options, ctx: DistContext, prep: Prepared) -> Trainer:
    """The Trainer, with the run the preflight resolved; running out of memory while it allocates is reported
    with the plan's numbers."""
    try:
        return Trainer(opts, ctx, run=prep.run)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not isinstance(e, torch.OutOfMemoryError) and "can't allocate memory" not in str(e):
            raise
        from qtrain.plan.host import HostMemoryError
        plan = prep.run.plan.summary()
        raise HostMemoryError(f"out of {ctx.device.type} memory while building the model ({plan}): "
                              f"{str(e).splitlines()[0]}") from None


def _stop_requested(signals: StopSignals, ctx: DistContext) -> bool:
    """Whether any rank got a signal, or the launcher asked to stop (the same answer on every rank); the ranks
    agree on SIGUSR1's checkpoint requests in the same exchange (`StopSignals.agree`)."""
    signals.agree(ctx)
    return bool(signals.requested)


def _logged(log: RunLogger, stop: RunStopped) -> RunStopped:
    """A stop's message goes into the JSON log too (the console may be gone: `qtrain.console`)."""
    log.message(str(stop), level="warning", on_console=False)
    return stop


def _compiles(opts: Options, ctx: DistContext) -> bool:
    """Whether the blocks will be torch.compile'd (Trainer's rule), so the compile cache matters."""
    return opts.compile == "on" or (opts.compile == "auto" and ctx.device.type == "cuda")


def _run(opts: Options, argv: list[str] | None, ctx: DistContext, prep: Prepared | None,
         signals: StopSignals, cache_note: str | None = None) -> dict:
    prep = prep or shared_preflight(opts, ctx)
    mark("preflight")
    if prep.review is not None and prep.review.finished:  # --continue of a finished run: nothing is built or written
        if ctx.is_main:
            console.write(f"qtrain: {prep.review.finished}\n", sys.stdout)
        return {"final_eval_loss": None, "steps": prep.total_steps, "out_dir": prep.paths.out_dir,
                "checkpoint_dir": prep.paths.ckpt_dir}
    train_pattern, eval_pattern = prep.train_pattern, prep.eval_pattern
    if _compiles(opts, ctx):  # after the preflight: a refused run does not wait for inductor's import first
        compile_cache.remember_keys(opts.compile_cache)
    trainer = _build_trainer(opts, ctx, prep)
    mark("model")
    # the checkpoint's tensors are verified as they load, before anything is written: a refused one changes nothing
    resumed = checkpointing.restore_state(prep.resume, trainer) if prep.resume is not None else None
    notes = _claim(prep, opts, ctx)  # after the model is built: a run that fails to start writes nothing
    cfg, B, T, GA, W = trainer.cfg, opts.batch_size, opts.seq_len, opts.grad_accumulation, ctx.world
    dp_rank, dp_world = data_rank(ctx.rank, W, opts.context_parallel)  # a context group reads the same sequences
    train = TokenLoader(train_pattern, T, rank=dp_rank, world=dp_world, seed=opts.train_seed,
                        model_vocab_size=cfg.vocab_size, **document_args(opts, cfg))
    evals = (TokenLoader(eval_pattern, T, rank=dp_rank, world=dp_world, seed=opts.eval_seed,
                         model_vocab_size=cfg.vocab_size, shuffle=False, **document_args(opts, cfg))
             if eval_pattern else None)
    total_steps = prep.total_steps
    schedule = LRSchedule(peak_lr=opts.learning_rate, total_steps=total_steps, warmup=opts.warmup,
                          cooldown=opts.cooldown, final_lr_fraction=opts.final_lr_fraction, kind=opts.lr_schedule)
    ckpt_dir, out_dir = prep.paths.ckpt_dir, prep.paths.out_dir

    verbosity = QUIET if opts.quiet else VERBOSE if opts.verbose else DEFAULT  # --quiet / --verbose
    log = RunLogger(prep.paths.log_file, rank=ctx.rank, total_steps=total_steps, verbosity=verbosity,
                    router_every=opts.log_router_every)
    log.log("run", run_id=prep.run_id, name=opts.name, resume=prep.resume)  # a new log's first line: its owner
    packed = unmasked_documents_note(train.files + (evals.files if evals else []), opts.document_masking)
    for note in notes + [n for n in (prep.note, cache_note, packed) if n]:
        log.message(note, level="warning")
    if prep.review is not None:
        prep.review.report(log)
    graphs_note = cuda_graphs.status(opts, trainer.run.device, on=trainer.run.cuda_graphs,
                                     fp8_linears=bool(trainer.run.fp8_linears))
    if graphs_note:
        log.message(graphs_note, level="info")
    tb = None  # --tensorboard DIR: the same metrics as TensorBoard scalars (rank 0)
    if opts.tensorboard and ctx.is_main:
        from qtrain.observe.tensorboard import TensorBoardSink
        tb = TensorBoardSink(opts.expand(opts.tensorboard))
        tb.on_event({"log": "options", "step": 0, "options": opts.to_dict()})
    _log_run_header(log, trainer, train, evals, total_steps, argv)

    start = 0
    if resumed is not None:
        start = checkpointing.restore_progress(resumed, trainer, train_loader=None if opts.new_data else train,
                                               logger=log)
        log.message(f"resumed from {prep.resume} at step {start}", level="warning")

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

    guard = NonFiniteGuard(opts.max_nonfinite_steps)
    run = {"id": prep.run_id, "name": opts.name}
    due = start % opts.eval_every_n_steps == 0 and start > 0  # the loop evaluates before its first step anyway
    if opts.eval_at_start and opts.eval_num_steps > 0 and not due and start < total_steps:
        evaluate(start, opts.eval_num_steps)  # --eval-at-start: the loss the run starts from

    def save_checkpoint() -> str:
        return checkpointing.save(ckpt_dir, trainer, train, log, keep_n=opts.ckpt_keep_n, major=opts.ckpt_major,
                                  run=run, nonfinite_streak=guard.streak)

    step_tokens = B * T * GA * dp_world  # --context-parallel: a group's ranks share their sequences
    stacks = StackDump(opts.debug_stack_dump_after)
    try:  # a stall anywhere in a step leaves a stack dump behind (--debug-stack-dump-after)
        for step in range(start, total_steps):
            stacks.arm()
            if _stop_requested(signals, ctx):  # after a signal: this step's state is saved, then the run exits
                raise _logged(log, stopped_by_signal(signals.requested, step,
                                                     save_checkpoint() if step > start else None))
            ctx.mark_progress(step)
            requested = step > start and signals.take_checkpoint_request()  # SIGUSR1: checkpoint, go on
            if (step % opts.ckpt_interval == 0 or requested) and step > start:
                saved = save_checkpoint()
                if requested:
                    log.message(checkpoint_on_request(step, saved), step=step, level="warning")
            if step % opts.eval_every_n_steps == 0 and step > 0 and opts.eval_num_steps > 0:
                evaluate(step, opts.eval_num_steps)
            t0 = time.perf_counter()
            # no device sync after the step: it ends reading the gradient norm (a sync before the update runs);
            # draining the update too would leave the GPU idle while the host starts the next step (the CLI's
            # 0.5B step took 883 ms where the same step through the API took 862, 2026-12-02). So a step's time
            # is from its start to its norm, and the update's GPU time lands in the next step's.
            first = step == start
            if first:
                mark("ready")
            try:
                with Compiling(first and trainer.model.run.compile and log.verbosity >= DEFAULT and ctx.is_main,
                               "the model for its first step", stream=log.stream):
                    stats = trainer.step(train.next_batches(B, GA), lr=schedule(step))
            except torch.OutOfMemoryError as e:
                raise _out_of_memory(step, e, trainer, ckpt_dir, log) from None
            dt_ms = 1000 * (time.perf_counter() - t0)
            if first:
                _log_startup(log, step, dt_ms, compiled=trainer.model.run.compile)
            obj = log.log_step(step, step_tokens=step_tokens, duration_ms=dt_ms, norm=stats["norm"],
                               loss=stats["loss"], lr=stats["lr"], epoch=train.progress,
                               **{k: stats[k] for k in ROUTER_FIELDS if k in stats})  # an MoE model's routers
            if tb is not None:
                tb.on_event(obj)
            if trainer.abs_maxes is not None:
                log.log_abs_maxes(step, trainer.abs_maxes)
                trainer.abs_maxes = None
            _check_finite(guard, step, stats, log, ckpt_dir)
    except DataChangedError as e:  # a token file changed under the run: stop as on a signal, with the last good step
        raise _logged(log, data_changed(e, step, save_checkpoint() if step > start and not ctx.distributed else None)) \
            from None
    finally:
        stacks.disarm()

    final = _finish(opts, ctx, trainer, log, save_checkpoint, evaluate, signals, start, total_steps, run)
    if tb is not None:
        tb.close()
    log.close()
    return {"final_eval_loss": final, "steps": total_steps, "out_dir": out_dir, "checkpoint_dir": ckpt_dir}


def _log_startup(log: RunLogger, step: int, first_step_ms: float, *, compiled: bool) -> None:
    """The run log's `startup` event (seconds from the process's start to the end of its first step, that step's
    own time, which holds the compile, and when each start-up phase ended) and one console line."""
    since = seconds_since_start()
    ends = phases()
    log.log("startup", step=step, seconds_to_first_step=round(since, 2), first_step_s=round(first_step_ms / 1000, 2),
            compiled=compiled, phases=ends)
    what = " (compiling included)" if compiled else ""
    took = ", ".join(f"{name} {s:.1f}" for name, s in ends.items())
    log.message(f"first step done {since:.1f} s after the start ({took}); the step took {first_step_ms / 1000:.1f} s"
                f"{what}")


def _out_of_memory(step: int, error: BaseException, trainer: Trainer, ckpt_dir: str, log: RunLogger) -> Exception:
    """A step that ran out of device memory: the report with the plan, the allocator's fragments and the newest
    checkpoint (nothing is written: the step's state is half-updated), in the run log too, beside the allocator's
    state (`observe.allocations.allocator_state`: what --debug-log-allocations recorded names the code of each
    allocation)."""
    fragments = peak = largest = pool_free = None
    if trainer.device.type == "cuda":  # the failed step's tensors are still held here (the traceback keeps them)
        fragments = torch.cuda.memory_reserved(trainer.device) - torch.cuda.memory_allocated(trainer.device)
        peak = torch.cuda.max_memory_allocated(trainer.device)
        state = allocator_state(torch.cuda.memory._snapshot())
        largest, pool_free = state["largest_free_bytes"], state["private_pool_free_bytes"]
        log.log("out_of_memory", step=step, peak_bytes=peak, **state)
    rank = trainer.ctx.rank if trainer.ctx.world > 1 else None
    return _logged(log, out_of_memory(step, error, trainer.run.plan.summary(), fragments,
                                      checkpointing.newest_finite(ckpt_dir), rank=rank, peak=peak,
                                      largest_free=largest, pool_free=pool_free,
                                      switches=trainer.run.memory_for_speed_switches))


def _check_finite(guard: NonFiniteGuard, step: int, stats: dict, log: RunLogger, ckpt_dir: str) -> None:
    """Report a non-finite step; stop the run after --max-nonfinite-steps of them in a row."""
    warning = guard.update(step, stats["loss"], stats["norm"])
    if warning:
        log.message(warning, step=step, level="warning")
    if guard.exceeded:
        raise _logged(log, guard.error(step, checkpointing.newest_finite(ckpt_dir)))


def _finish(opts: Options, ctx: DistContext, trainer: Trainer, log: RunLogger, save_checkpoint,
            evaluate, signals: StopSignals, start: int, total_steps: int, run: dict) -> float | None:
    """The end of a run, in the order that loses nothing: the final checkpoint, then the final evaluation
    (a bad eval file or a full disk later cannot cost the training), then the export."""
    path = None
    if opts.save_training_state and total_steps > start:
        path = save_checkpoint()
    if _stop_requested(signals, ctx):
        raise _logged(log, stopped_after_last_step(signals.requested, path))
    final = evaluate(total_steps, None)
    if trainer.graphs is not None:
        log.message(trainer.graphs.summary(), level="info")
    if ctx.device.type == "cuda":
        log.log_memory(allocated=torch.cuda.memory_allocated(), reserved=torch.cuda.memory_reserved(),
                       peak=torch.cuda.max_memory_allocated())
    out_dir = opts.expand(opts.out_dir)
    trainer.export(out_dir, owner={"run_id": run["id"], "name": run["name"], "step": total_steps})
    log.message(f"exported HF model to {out_dir}", level="info")
    ckpt_dir = opts.expand(opts.checkpoint_dir)
    log.log_outputs(export=out_dir, checkpoint=path or (ckpt_dir if os.path.isdir(ckpt_dir) else None),
                    log_file=log.path, tensorboard=opts.expand(opts.tensorboard) if opts.tensorboard else None)
    return final


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
    if reason := unavailable_reason(trainer.tokenizer):
        log.message(f"the export will carry no tokenizer files: {reason}", level="warning")
        trainer.tokenizer = None
    log.message(f"export tokenizer: {trainer.tokenizer}" if trainer.tokenizer else
                "no tokenizer is known for the export (no model directory files, none recorded in the token "
                "files): pass --tokenizer", level="info" if trainer.tokenizer else "warning")
    if caveat := transformers_caveat(trainer.tokenizer, cfg):
        log.message(caveat, level="warning")
    if opts.rope_scaling:
        adapter = opts.lora_rank and not opts.lora_merge
        log.message(adapter_note(opts.rope_scaling, cfg) if adapter else
                    f"--rope-scaling {opts.rope_scaling}: the model runs with rope_scaling {cfg.rope_scaling} (context "
                    f"{cfg.context_length}), which the export's config.json carries",
                    level="warning" if adapter else "info")
    log.log_dataset("train", files=len(train.files), tokens=train.num_tokens, seed=opts.train_seed)
    if evals is not None:
        log.log_dataset("eval", files=len(evals.files), tokens=evals.num_tokens, seed=opts.eval_seed)
    dev_name = _device_name(ctx.device)
    log.log_device(name=dev_name, rank=ctx.rank, world=W, device=str(ctx.device))
    ops = sol_ops(cfg, T, matmul_dtype=trainer.run.matmul_dtype, model_dtype=opts.model_dtype)
    peaks = device_peaks(dev_name)
    log.log_sol(blocks=ops.blocks, lm_head=ops.lm_head, attention=ops.attention,
                ns_per_token=ns_per_token(ops, dev_name, world=W),
                peaks=None if peaks is None else {"bf16": peaks.bf16, "fp8": peaks.fp8},
                mfu_flops_per_token=model_flops_per_token(cfg, T), bf16_peak_tflops=peak_tflops(dev_name, "bf16"),
                world=W)
    plan = trainer.run.plan  # the run's, made once at the start (budget: the device's total memory on CUDA)
    log.log("memory-plan", **plan.to_dict())
    log._print(plan.format() + "\n")
    if trainer.run.memory_note():  # --fit-memory changed the options so that the plan fits
        log.message(trainer.run.memory_note(), level="warning")
    if not plan.fits:
        log.message(f"memory plan: {plan.summary()}; `qtrain plan` proposes a configuration that fits",
                    level="warning")
    if trainer.fp8 is not None:  # shown (as a warning) whenever a block linear does or would run in bf16
        log.message(trainer.fp8.describe(), level="warning" if trainer.fp8.keeps_bf16 else "info")
    if trainer.model.swiglu_onepass:
        log.message("fp8: the SwiGLU output and its gradient take power-of-two scales, in one pass each "
                    "(--fp8-swiglu-onepass, on by default with e4m3; --no-fp8-swiglu-onepass keeps every tensor's "
                    "exact abs-max scale)", level="info")
    log.message(f"model {cfg.model_type}: {num_params(cfg) / 1e6:.1f}M parameters, {total_steps} steps of "
                f"{opts.batch_size * T * opts.grad_accumulation * (W // opts.context_parallel)} tokens", level="info")
