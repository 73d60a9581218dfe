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

import os

from qtrain.data.loader import TokenLoader
from qtrain.observe.log import RunLogger
from qtrain.train import checkpoint_io as cio
from qtrain.train.trainer import Trainer

FORMAT_VERSION = 1
# options that must match for a resume to continue the same run
_MUST_MATCH = ("model_dtype", "opt_m_dtype", "opt_v_dtype", "seed")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed or exported as asked; the message names the path."""


def _stem(kind: str, rank: int, world: int) -> str:
    return f"{kind}.shard_{rank:03d}_of_{world:03d}"


def find(ckpt_dir: str, spec: str | None) -> str | None:
    """`--continue` semantics: '' / 'latest' -> newest; a step number; a step_NNNNNNNN path; a directory."""
    if spec in (None, "", "latest"):
        p = cio.find_checkpoint(ckpt_dir, None)
    elif spec.isdigit():
        p = cio.find_checkpoint(ckpt_dir, int(spec))
    else:
        p = cio.find_checkpoint(ckpt_dir, spec)
    return None if p is None else str(p)


def save(ckpt_dir: str, trainer: Trainer, loader: TokenLoader, log: RunLogger, *, keep_n: int = -1,
         major: int = -1) -> str:
    ctx, step = trainer.ctx, trainer.steps_done
    tag = ctx.broadcast_object(os.getpid())
    tmp = cio.begin(ckpt_dir, step, tag=tag)
    files = {_stem(kind, ctx.rank, ctx.world): {k: t.detach().contiguous().cpu() for k, t in tensors.items()}
             for kind, tensors in trainer.state_tensors().items()}
    cio.write_files(tmp, files)
    ctx.barrier()
    final = cio.checkpoint_path(ckpt_dir, step)
    if ctx.is_main:
        meta = {
            "version": FORMAT_VERSION,
            "step": step,
            "distributed": {"world": ctx.world},
            "data_loader": loader.state_dict(),
            "logger": log.state_dict(),
            "options": {k: getattr(trainer.opts, k) for k in _MUST_MATCH},
            "model": trainer.cfg.to_hf_dict(),
            "tokenizer": trainer.tokenizer,  # what `qtrain export` puts beside the weights
        }
        cio.commit(tmp, final, meta)
        removed = cio.clean_old_checkpoints(ckpt_dir, keep_n, major) if keep_n >= 0 else []
        log.message(f"saved checkpoint {final}" + (f" (removed {len(removed)} old)" if removed else ""), step=step)
    ctx.barrier()
    return str(final)


def load(path: str, trainer: Trainer, *, train_loader: TokenLoader | None, logger: RunLogger | None) -> int:
    """Restore trainer state (and loader / logger state when given); returns the step to continue from."""
    meta, files = cio.read_checkpoint(path)
    ctx = trainer.ctx
    world = meta["distributed"]["world"]
    if world != ctx.world:
        why = ("resharding across world sizes is not supported yet" + (
            "; with --opt-m-dtype e4m3 it could not be bit-exact either: m's block scales are cut by the shard "
            "boundaries of the world size that wrote them" if trainer.opts.opt_m_dtype == "e4m3" else ""))
        raise CheckpointError(f"{path}: written by {world} rank(s), this run has {ctx.world}; resume with --gpus {world} "
                              f"({why})")
    for k, v in meta.get("options", {}).items():
        if getattr(trainer.opts, k) != v:
            raise CheckpointError(f"{path}: checkpoint has --{k.replace('_', '-')}={v!r}, this run "
                             f"{getattr(trainer.opts, k)!r}")
    state = {kind: files.load(_stem(kind, ctx.rank, world)) for kind in ("weights", "adam.m", "adam.v")}
    trainer.load_state_tensors(state, int(meta["step"]))
    if train_loader is not None:
        train_loader.load_state_dict(meta["data_loader"])
    if logger is not None and "logger" in meta:
        logger.load_state_dict(meta["logger"])
    return int(meta["step"])
