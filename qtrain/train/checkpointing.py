"""What goes into a training checkpoint and how a run resumes from one.

A checkpoint (`checkpoint_io` handles the files and their atomicity) holds, per rank, the weight shard and
the Adam moment shards of every group (`weights.shard_RRR_of_WWW`, `adam.m...`, `adam.v...`), and in
`checkpoint.json`: the step, the data loader position, the outlier-detector windows, the world size and
the options that change the math. Stochastic rounding needs no saved state: its bits are a function of
(seed, step, tensor, element), so a resumed run continues bit-exactly.

An e4m3 first moment (--opt-m-dtype e4m3) is saved as it is kept: the float8 codes under the group keys and
the fp32 block scales under `<group>.scales`, both in the `adam.m` file (`ShardedAdamW.state_tensors`); the
resumed run reads back the same bits. A checkpoint only resumes with the world size that wrote it (weights
and moments are per-rank shards); for an e4m3 m that would stay so even with resharding, because its
blocks are cut by the shard boundaries (`parallel/optimizer.py`): re-quantizing m for other cuts would
change the run.
"""
from __future__ import annotations

from typing import Any

from qtrain.data.loader import TokenLoader
from safetensors import SafetensorError

from qtrain.fsio import describe_write_error, ensure_free_space, fault_point, owner_tag
from qtrain.model.config import ConfigError, ModelConfig
from qtrain.observe.log import RunLogger
from qtrain.train import checkpoint_io as cio
from qtrain.train.checkpoint_io import CheckpointError
from qtrain.train.trainer import Trainer

__all__ = ["CheckpointError", "FORMAT_VERSION", "find", "save", "load", "check_compatible", "newest_finite"]

FORMAT_VERSION = 1
# options that must match for a resume to continue the same run
_MUST_MATCH = ("model_dtype", "master_dtype", "opt_m_dtype", "opt_v_dtype", "seed")
META_SLACK = 1 << 20  # bytes on top of the tensors for checkpoint.json and safetensors headers


def _stem(kind: str, rank: int, world: int) -> str:
    return f"{kind}.shard_{rank:03d}_of_{world:03d}"


def find(ckpt_dir: str, spec: str | None) -> str | None:
    """`--continue` semantics: '' / 'latest' -> the newest in `ckpt_dir`, None when there is none (llm.q: the
    run starts fresh); a step number; a step_NNNNNNNN path; a directory (its newest). A step or path that
    names no checkpoint is a CheckpointError: starting fresh then would overwrite the checkpoints of the
    run that was meant."""
    if spec in (None, "", "latest"):
        p = cio.find_checkpoint(ckpt_dir, None)
        return None if p is None else str(p)
    p = cio.find_checkpoint(ckpt_dir, int(spec) if spec.isdigit() else spec)
    if p is not None:
        return str(p)
    if spec.isdigit():
        have = [s for s, _ in cio.list_checkpoints(ckpt_dir)]
        listing = f"it has steps {', '.join(map(str, have[-8:]))}" if have else "it holds no checkpoint"
        raise CheckpointError(f"--continue {spec}: no checkpoint of step {int(spec)} in {ckpt_dir} ({listing})")
    raise CheckpointError(f"--continue {spec}: not a checkpoint (a step_NNNNNNNN directory with {cio.META_FILE}) "
                          f"and no directory holding one")


def newest_finite(ckpt_dir: str) -> str | None:
    """The newest checkpoint written after a finite step (no non-finite streak): what keep-n never deletes."""
    for _, p in reversed(cio.list_checkpoints(ckpt_dir)):
        try:
            meta, _ = cio.read_checkpoint(p)
        except CheckpointError:
            continue
        if not meta.get("nonfinite_streak", 0):
            return str(p)
    return None


def _agree(ctx, err: str | None) -> str | None:
    """Every rank learns the first rank's error (or None), so all ranks take the same path."""
    errs = ctx.all_gather_object(err) if ctx.world > 1 else [err]
    return next((e for e in errs if e), None)


def save(ckpt_dir: str, trainer: Trainer, loader: TokenLoader, log: RunLogger, *, keep_n: int = -1,
         major: int = -1, run: dict[str, Any] | None = None, nonfinite_streak: int = 0) -> str:
    """Write this step's checkpoint (every rank its shards, rank 0 the meta), then apply keep-n. Free space is
    checked against the checkpoint's size first; a failed write removes its temp directory. Errors are
    agreed across ranks, so every rank raises the same CheckpointError instead of waiting for the others."""
    ctx, step = trainer.ctx, trainer.steps_done
    tag = ctx.broadcast_object(owner_tag())
    files = {_stem(kind, ctx.rank, ctx.world): {k: t.detach().contiguous().cpu() for k, t in tensors.items()}
             for kind, tensors in trainer.state_tensors().items()}
    nbytes = sum(t.numel() * t.element_size() for f in files.values() for t in f.values())
    need = (sum(ctx.all_gather_object(nbytes)) if ctx.world > 1 else nbytes) + META_SLACK
    err = None
    try:
        ensure_free_space(ckpt_dir, need, f"the checkpoint of step {step} ({ctx.world} rank(s))")
    except ValueError as e:
        err = str(e)
    if (err := _agree(ctx, err)) is not None:
        raise CheckpointError(err)
    final = cio.checkpoint_path(ckpt_dir, step)
    tmp = None
    try:
        tmp = cio.begin(ckpt_dir, step, tag=tag)
        cio.write_files(tmp, files)
    except (OSError, SafetensorError) as e:
        err = f"writing the checkpoint of step {step} to {tmp or ckpt_dir} failed: {describe_write_error(e)}"
    if (err := _agree(ctx, err)) is not None:
        if ctx.is_main and tmp is not None:
            cio.remove_tree_quietly(tmp)
        raise CheckpointError(err)
    if ctx.is_main:
        meta = {
            "version": FORMAT_VERSION,
            "step": step,
            "run": dict(run or {}),
            "nonfinite_streak": int(nonfinite_streak),
            "distributed": {"world": ctx.world},
            "data_loader": loader.state_dict(),
            "logger": log.state_dict(),
            "options": {k: getattr(trainer.opts, k) for k in _MUST_MATCH},
            "model": trainer.cfg.to_hf_dict(),
            "tokenizer": trainer.tokenizer,  # what `qtrain export` puts beside the weights
        }
        try:
            cio.commit(tmp, final, meta)
        except OSError as e:
            cio.remove_tree_quietly(tmp)
            err = f"committing the checkpoint of step {step} to {final} failed: {describe_write_error(e)}"
    if (err := _agree(ctx, err)) is not None:
        raise CheckpointError(err)
    if ctx.is_main:
        protect = [p] if (p := newest_finite(ckpt_dir)) else []
        removed = cio.clean_old_checkpoints(ckpt_dir, keep_n, major, protect=protect) if keep_n >= 0 else []
        fault_point("ckpt.saved")
        log.message(f"saved checkpoint {final}" + (f" (removed {len(removed)} old)" if removed else ""), step=step)
    ctx.barrier()
    return str(final)


def check_compatible(path: str, meta: dict[str, Any], cfg: ModelConfig, opts: Any, world: int) -> None:
    """Whether the checkpoint at `path` (its meta) can resume a run of `cfg` with `opts` on `world` ranks;
    CheckpointError naming the difference otherwise. Needs no model: the preflight calls it."""
    written = meta.get("distributed", {}).get("world")
    if written != world:
        why = ("resharding across world sizes is not supported yet" + (
            "; with --opt-m-dtype e4m3 it could not be bit-exact either: m's block scales are cut by the shard "
            "boundaries of the world size that wrote them" if opts.opt_m_dtype == "e4m3" else ""))
        raise CheckpointError(f"{path}: written by {written} rank(s), this run has {world}; resume with --gpus "
                              f"{written} ({why})")
    for k, v in meta.get("options", {}).items():
        if getattr(opts, k, v) != v:
            raise CheckpointError(f"{path}: checkpoint has --{k.replace('_', '-')}={v!r}, this run "
                                  f"{getattr(opts, k)!r}")
    if "model" in meta:
        try:
            theirs = ModelConfig.from_hf_dict(meta["model"], source=f"{path}/{cio.META_FILE}")
        except ConfigError as e:
            raise CheckpointError(str(e)) from None
        if theirs != ModelConfig.from_hf_dict(cfg.to_hf_dict()):
            diff = [f.name for f in theirs.__dataclass_fields__.values() if getattr(theirs, f.name) != getattr(cfg, f.name)]
            raise CheckpointError(f"{path}: written for another model ({', '.join(diff)} differ from --model's config)")


def load(path: str, trainer: Trainer, *, train_loader: TokenLoader | None, logger: RunLogger | None) -> int:
    """Restore trainer state (and loader / logger state when given); returns the step to continue from."""
    meta, files = cio.read_checkpoint(path)
    ctx = trainer.ctx
    check_compatible(path, meta, trainer.cfg, trainer.opts, ctx.world)
    world = meta["distributed"]["world"]
    state = {kind: files.load(_stem(kind, ctx.rank, world)) for kind in ("weights", "adam.m", "adam.v")}
    trainer.load_state_tensors(state, int(meta["step"]))
    if train_loader is not None:
        train_loader.load_state_dict(meta["data_loader"])
    if logger is not None and "logger" in meta:
        logger.load_state_dict(meta["logger"])
    return int(meta["step"])
