"""What goes into a training checkpoint and how a run resumes from one.

A checkpoint (`checkpoint_io` handles the files and their atomicity) holds, per rank, the weight shard and
the Adam moment shards of every group (`weights.shard_RRR_of_WWW`, `adam.m...`, `adam.v...`), and in
`checkpoint.json`: the step, the data loader position, the outlier-detector windows, the world size, every
option and the training files (what `--continue` compares: `resume_checks.py`), and in `tokenizer/` a copy of the
tokenizer the export carries; `checkpoint_meta.py` holds the meta's schema, checked before anything is built, and
`checkpoint_checks.py` the checks of the files: their headers against the layout and their recorded digests (in the
preflight), each tensor's digest and values (as it loads, `restore_state`). Stochastic rounding needs no saved
state: its bits are a function of (seed, step, tensor, element), so a resumed run continues bit-exactly.

With the one-pass SwiGLU FP8 kernels (e4m3's default) `checkpoint.json` also holds every rank's scale hints
(`fp8_scale_hints`: per global rank, (layers, 2) exponents; `Transformer.scale_hints`). They are per-rank run state,
not shard data (each rank's follow its own micro-batches, and with hybrid sharding a shard file is written by one
of the ranks holding it), so they are gathered into the meta. The scales those kernels pick depend on them within
one binade: a resume on the same ranks reads its own back and continues bit for bit; a checkpoint without them
(older) or resumed on another number of ranks starts them unset, which moves a scale by at most one binade.

An e4m3 first moment (--opt-m-dtype e4m3) is saved as it is kept: the float8 codes under the group keys and
the fp32 block scales under `<group>.scales`, both in the `adam.m` file (`ShardedAdamW.state_tensors`); the
resumed run reads back the same bits.

Another world size (a checkpoint of N ranks resumed on M, `parallel/reshard.py`): the shards are resharded on
load. Weights and fp32/bf16 moments are exact (the group content does not depend on the world size, only its
padding does); an e4m3 m keeps every block whose extent is unchanged bit for bit and requantizes the blocks a
shard boundary of either world size cuts (within half an e4m3 step). The loader's position is carried as the
global number of sequences consumed (`TokenLoader.load_state_dict`), so the same global batch (batch x
grad-accumulation x ranks) continues with the same sequences. Resharding reads the shards of every old rank.
Another --expert-parallel (with the same or another world, to or from none) is resharded the same way, exactly: the
experts' shards are mapped through the whole expert stacks (`parallel/reshard.py`).

Where the shard files go (multi-node): every rank writes its own shards into the step's temp directory and
leaves a marker there; once all have written, each rank lists the markers it sees. Ranks that see each other
share a directory: the lowest of them commits it (meta + rename). With a checkpoint directory shared by all
nodes that is rank 0 alone and the checkpoint is complete; with a directory local to each node, each node
commits its own copy, holding its ranks' shards (`distributed.ranks` in the meta says which). Such a
checkpoint resumes only with the same ranks on the same nodes (each rank reads its own files); on load every
rank checks the files it needs and a missing one is reported with the rank, host and the way out (copy the
nodes' shard files into one directory).
"""
from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import torch
from qtrain.data.loader import TokenLoader
from safetensors import SafetensorError

from qtrain.fsio import describe_write_error, ensure_free_space, fault_point, owner_tag
from qtrain.model.config import ModelConfig
from qtrain.model.registry import config_from_hf_dict
from qtrain.model.lora.checks import spec_from_options
from qtrain.observe.log import RunLogger
from qtrain.parallel.reshard import reshard_state
from qtrain.train import checkpoint_io as cio
from qtrain.train import checkpoint_meta as cmeta
from qtrain.train.checkpoint_checks import (LORA_META, STATE_KINDS, check_files, checkpoint_layout,
                                           expert_parallel_of, value_problem, verify)
from qtrain.train.checkpoint_checks import shard_stem as _stem
from qtrain.train.checkpoint_io import CheckpointError
from qtrain.train.checkpoint_meta import FORMAT_VERSION, HINTS_META, MUST_MATCH
from qtrain.train.trainer import Trainer

__all__ = ["CheckpointError", "FORMAT_VERSION", "find", "save", "load", "restore_state", "restore_progress",
           "check_compatible", "check_resumable", "missing_files", "newest_finite", "verify"]

# checkpoint.json's fields: checkpoint_meta.py; HINTS_META holds every rank's one-pass SwiGLU FP8 scale hints
META_SLACK = 1 << 20  # bytes on top of the tensors for checkpoint.json and safetensors headers


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


def _shard_files(kinds: tuple[str, ...], ranks: range | list[int], world: int) -> list[str]:
    return [_stem(kind, r, world) for kind in kinds for r in ranks]


_MARKER = ".rank_{:03d}"  # left by each rank in the temp directory: who can see whose files


def _directory_sharers(tmp: Any, ctx) -> list[int]:
    """The ranks whose markers this rank sees in `tmp` (after every rank has left its own): the ranks that
    share this checkpoint directory."""
    try:
        return sorted(int(p.name[len(".rank_"):]) for p in tmp.glob(".rank_*")) if tmp is not None else [ctx.rank]
    except (OSError, ValueError):
        return [ctx.rank]


def save(ckpt_dir: str, trainer: Trainer, loader: TokenLoader, log: RunLogger, *, keep_n: int = -1,
         major: int = -1, run: dict[str, Any] | None = None, nonfinite_streak: int = 0) -> str:
    """Write this step's checkpoint (every rank its shards; in each directory the lowest rank writing there
    the meta: rank 0 alone when the directory is shared), then apply keep-n. Free space is checked against
    the checkpoint's size first; a failed write removes its temp directory. Errors are agreed across ranks,
    so every rank raises the same CheckpointError instead of waiting for the others."""
    ctx, step = trainer.ctx, trainer.steps_done
    shard, shards = trainer.comm.rank, trainer.comm.world  # hybrid sharding: the shard group's rank and size
    tag = ctx.broadcast_object(owner_tag())
    files = {_stem(kind, shard, shards): {k: t.detach().contiguous().cpu() for k, t in tensors.items()}
             for kind, tensors in trainer.state_tensors().items()}
    nbytes = sum(t.numel() * t.element_size() for f in files.values() for t in f.values())
    need = (sum(ctx.all_gather_object(nbytes)) if ctx.world > 1 else nbytes) + META_SLACK + _size(
        cmeta.tokenizer_files(trainer.tokenizer).values())
    err = None
    try:
        ensure_free_space(ckpt_dir, need, f"the checkpoint of step {step} ({ctx.world} rank(s))")
    except ValueError as e:
        err = str(e)
    if (err := _agree(ctx, err)) is not None:
        raise CheckpointError(err)
    hints = trainer.model.scale_hints()  # None on every rank alike (the options decide): no collective then
    all_hints = None if hints is None else ctx.all_gather_object(hints.tolist()) if ctx.world > 1 else [hints.tolist()]
    final = cio.checkpoint_path(ckpt_dir, step)
    tmp = None
    try:
        tmp = cio.begin(ckpt_dir, step, tag=tag)
        if ctx.world > 1:
            (tmp / _MARKER.format(ctx.rank)).touch()
    except OSError as e:
        err = f"writing the checkpoint of step {step} to {tmp or ckpt_dir} failed: {describe_write_error(e)}"
    err = _agree(ctx, err)  # the point after which every rank's marker is there
    here = _directory_sharers(tmp, ctx) if ctx.world > 1 else [0]
    committer = ctx.rank == min(here, default=ctx.rank)
    # a shard is written once per directory: by the lowest rank there holding it (hybrid: several do)
    digests: dict[str, str] = {}
    if err is None and not any(r < ctx.rank and r % shards == shard for r in here):
        try:
            digests = cio.write_files(tmp, files)
        except (OSError, SafetensorError) as e:
            err = f"writing the checkpoint of step {step} to {tmp} failed: {describe_write_error(e)}"
        err = _agree(ctx, err)
    elif err is None:
        err = _agree(ctx, None)
    if err is not None:
        if committer and tmp is not None:
            cio.remove_tree_quietly(tmp)
        raise CheckpointError(err)
    every_digest = ctx.all_gather_object(digests) if ctx.world > 1 else [digests]
    meta = None
    if ctx.is_main:
        meta = {
            "version": FORMAT_VERSION,
            "step": step,
            "run": dict(run or {}),
            "nonfinite_streak": int(nonfinite_streak),
            "data_loader": loader.state_dict(),
            "logger": log.state_dict(),
            "options": cmeta.options_record(trainer.opts, trainer.run),
            cmeta.MEMORY_META: cmeta.memory_record(trainer.opts, trainer.run),
            "data": cmeta.data_record(loader),
            "model": trainer.cfg.to_hf_dict(),
            "tokenizer": cmeta.tokenizer_record(trainer.tokenizer),  # what `qtrain export` puts beside the weights
        }
        if trainer.lora is not None:  # the adapters' settings; the files hold the trainable groups only
            meta[LORA_META] = trainer.lora.record()
            if trainer.lora_base is not None:  # what the adapters train on (--continue, --lora-merge check it)
                meta[cmeta.LORA_BASE_META] = trainer.lora_base
        if all_hints is not None:
            meta[HINTS_META] = all_hints
    meta = ctx.broadcast_object(meta)
    if committer:
        meta["distributed"] = {"world": shards}
        if ctx.world > shards:
            meta["distributed"]["replicas"] = ctx.world // shards
        held = sorted({r % shards for r in here})
        if len(held) < shards:  # a directory not shared by all ranks: say whose shards it holds
            meta["distributed"].update(ranks=held, host=socket.gethostname())
        meta[cio.DIGESTS] = {f: d for r in here for f, d in sorted(every_digest[r].items())}  # this directory's files
        try:
            for r in here:
                (tmp / _MARKER.format(r)).unlink(missing_ok=True)
            copied = cmeta.write_tokenizer(trainer.tokenizer, tmp)
            if copied is None:  # its source went away: export without one
                meta["tokenizer"] = None
            else:
                meta[cio.DIGESTS].update(copied)
            cio.commit(tmp, final, meta)
        except OSError as e:
            cio.remove_tree_quietly(tmp)
            err = f"committing the checkpoint of step {step} to {final} failed: {describe_write_error(e)}"
        except CheckpointError as e:  # the step's name is the user's link: nothing replaced
            cio.remove_tree_quietly(tmp)
            err = str(e)
    if (err := _agree(ctx, err)) is not None:
        raise CheckpointError(err)
    if committer:
        # the checkpoint just written is this run's newest state, whatever steps beside it are numbered higher (a
        # run resumed from an earlier checkpoint: the older run's later ones stay too, keep-n counting them)
        protect = [final] + ([p] if (p := newest_finite(ckpt_dir)) else [])
        removed = cio.clean_old_checkpoints(ckpt_dir, keep_n, major, protect=protect) if keep_n >= 0 else []
        fault_point("ckpt.saved")
        if ctx.is_main:
            log.message(f"saved checkpoint {final}" + (f" (removed {len(removed)} old)" if removed else ""),
                        step=step)
    ctx.barrier()
    return str(final)


def _size(paths: Any) -> int:
    try:
        return sum(p.stat().st_size for p in paths)
    except OSError:
        return 0


def check_compatible(path: str, meta: dict[str, Any], cfg: ModelConfig, opts: Any, world: int) -> None:
    """Whether the checkpoint at `path` (its meta) can resume a run of `cfg` with `opts` on `world` ranks;
    CheckpointError naming the difference otherwise. Needs no model: the preflight calls it. Another world
    size is fine (resharding) when the directory holds every rank's shards. The meta is checked against its
    schema first (`checkpoint_meta.validate`)."""
    theirs = cmeta.validate(path, meta)
    dist_meta = meta["distributed"]
    written = dist_meta["world"]
    ep, ep_now = expert_parallel_of(meta), getattr(opts, "expert_parallel", 1)
    if not _same_layout(meta, world, ep_now) and "ranks" in dist_meta:
        now = f"{world}" + (f" with --expert-parallel {ep_now}" if ep_now != ep else "")
        raise CheckpointError(
            f"{path}: written by {written} rank(s)" + (f" with --expert-parallel {ep}" if ep_now != ep else "") +
            f" into a checkpoint directory local to each node (this one, on "
            f"{dist_meta.get('host', '?')}, holds the shards of ranks {_ranges(dist_meta['ranks'])} only); this "
            f"run has {now}: resharding reads every rank's shards. Copy the other nodes' "
            f"{Path(path).name}/*.safetensors into this directory (drop \"ranks\" from {cio.META_FILE} and add their "
            f"\"{cio.DIGESTS}\" entries), or resume with {written} ranks on the same nodes")
    given = {k: getattr(opts, k, meta["options"][k]) for k in MUST_MATCH}
    for k in MUST_MATCH:
        v = meta["options"][k]
        if cmeta.meant_value(given, k) != cmeta.meant_value(meta["options"], k):
            raise CheckpointError(f"{path}: checkpoint has --{k.replace('_', '-')}={v!r}, this run {given[k]!r}")
    mine = spec_from_options(vars(opts), cfg) if hasattr(opts, "lora_rank") else None
    if (mine.record() if mine else None) != (meta.get(LORA_META) or None):
        raise CheckpointError(f"{path}: checkpoint has LoRA adapters {meta.get(LORA_META) or 'none'}, this run "
                              f"{mine.record() if mine else 'none'} (--lora-* options differ)")
    if theirs != config_from_hf_dict(cfg.to_hf_dict()):
        diff = [f.name for f in theirs.__dataclass_fields__.values() if getattr(theirs, f.name) != getattr(cfg, f.name)]
        ran = meta["options"].get("rope_scaling") or "none"
        rope = (f"; rope_scaling: the checkpoint's {theirs.rope_scaling} (its run: --rope-scaling {ran}), this run's "
                f"{cfg.rope_scaling} (--rope-scaling {getattr(opts, 'rope_scaling', '') or 'none'}; without a factor "
                f"it is taken from --seq-len)") if "rope_scaling" in diff else ""
        raise CheckpointError(f"{path}: written for another model ({', '.join(diff)} differ from --model's "
                              f"config{rope})")


def _same_layout(meta: dict[str, Any], world: int, expert_parallel: int) -> bool:
    """Whether a run of `world` ranks and `expert_parallel` holds the checkpoint's shards as they are (each rank reads
    its own files); else every rank's shards are resharded (parallel/reshard.py)."""
    return meta["distributed"]["world"] == world and expert_parallel_of(meta) == expert_parallel


def _ranges(ranks: list[int]) -> str:
    """'0-1, 4' for [0, 1, 4]."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(f"{start}-{r}" if r > start else str(r))
            start = None
    return ", ".join(out)


def missing_files(path: str, meta: dict[str, Any], rank: int, world: int, expert_parallel: int = 1) -> str | None:
    """None when the checkpoint directory holds every shard file rank `rank` of `world` (with `expert_parallel`)
    reads (its own in the same layout, every rank's when resharding); else the message naming what is missing and
    why."""
    written = meta["distributed"]["world"]
    ranks = _reads(meta, rank, world, expert_parallel)
    missing = [f + ".safetensors" for f in _shard_files(STATE_KINDS, ranks, written)
               if not (Path(path) / f"{f}.safetensors").is_file()]
    if not missing:
        return None
    held = meta["distributed"].get("ranks")
    why = (f"this directory holds the shards of ranks {_ranges(held)} (a checkpoint directory local to each node)"
           if held is not None else "files deleted, or a checkpoint directory that is not shared by the nodes")
    return (f"{path} on {socket.gethostname()}: rank {rank} of {world} needs {', '.join(missing[:4])}"
            f"{f' and {len(missing) - 4} more' if len(missing) > 4 else ''}, which it does not have: {why}. Give "
            f"every node the same directory (a shared filesystem), or copy the missing shard files there (with their "
            f"\"{cio.DIGESTS}\" entries)")


# ---- integrity: what `--continue` refuses (checkpoint_checks.py says what is checked) ----

def newest_verifying(path: str, problem_of, ctx=None) -> str | None:
    """The newest checkpoint beside `path` (in its directory, step > 0, `path` itself excluded) for which
    `problem_of(candidate)` is None: what a refusal names instead of resuming an older one unasked. With
    several ranks (`ctx`), each rank checks its own files and a candidate counts when every rank agrees."""
    found = [str(p) for s, p in reversed(cio.list_checkpoints(Path(path).parent))
             if s > 0 and os.path.abspath(p) != os.path.abspath(path)]
    if ctx is not None and ctx.world > 1:
        found = ctx.broadcast_object(found)
    for candidate in found:
        try:
            problem = problem_of(candidate)
        except (ValueError, TypeError, KeyError, AttributeError, OSError) as e:  # a malformed candidate: on one
            problem = f"{candidate}: {type(e).__name__}: {e}"  # rank only, so say it rather than leave the rest waiting
        if (_agree(ctx, problem) if ctx is not None else problem) is None:
            return candidate
    return None


def refusal(problem: str, alternative: str | None, hint) -> CheckpointError:
    """The one-line refusal: the problem (file and tensor), then the newest checkpoint that verifies and how
    to use it (`hint(path, step)`), or that there is none."""
    if alternative is None:
        return CheckpointError(f"{problem}; no other checkpoint beside it verifies")
    return CheckpointError(f"{problem}; the newest checkpoint that verifies is {alternative}: "
                           f"{hint(alternative, cio.checkpoint_step(alternative))}")


def continue_hint(ckpt_dir: str):
    """How to resume another checkpoint: `--continue STEP` inside the run's checkpoint directory, else its path."""
    def hint(path: str, step: int | None) -> str:
        same = os.path.abspath(Path(path).parent) == os.path.abspath(ckpt_dir)
        return f"resume it with --continue {step if same and step is not None else path}"
    return hint


def unverified_note(path: str) -> str:
    return (f"checkpoint {path} records no file digests (written before qtrain stored them): its files are checked "
            f"for names, dtypes, shapes and finite values, but a changed bit that stays finite cannot be found")


def check_resumable(path: str, meta: dict[str, Any], files: cio.CheckpointFiles, cfg: ModelConfig, opts: Any,
                    world: int, ckpt_dir: str) -> None:
    """The preflight's part, after `check_compatible` (no model, no tensor data read): every file of every rank the
    directory holds is there and its header fits the layout and its recorded digest (`checkpoint_checks.check_files`).
    A refusal names the newest checkpoint that does verify (fully: that one is read)."""
    if problem := check_files(path, meta, files, cfg):
        def problem_of(c: str) -> str | None:
            try:
                m, _ = cio.read_checkpoint(c)
                check_compatible(c, m, cfg, opts, world)
            except CheckpointError as e:
                return str(e)
            return verify(c)
        raise refusal(problem, newest_verifying(path, problem_of), continue_hint(ckpt_dir))


def _reads(meta: dict[str, Any], shard: int, shards: int, expert_parallel: int) -> list[int]:
    """The ranks of a checkpoint whose files shard `shard` of `shards` (with `expert_parallel`) reads."""
    same = _same_layout(meta, shards, expert_parallel)
    return [shard] if same else list(range(meta["distributed"]["world"]))


def restore_state(path: str, trainer: Trainer) -> dict[str, Any]:
    """Load the checkpoint's weights, Adam moments and scale hints into `trainer`, verified: each file's digest
    in the read that loads it, the headers against this run's layout, and the values (finite; v >= 0) where
    they now live (the trainer's device, or host memory when offloaded). A checkpoint of another world size is
    resharded (module docstring; its values are checked as they are read). Every rank checks its own files
    and the ranks agree, so a refusal is the same CheckpointError on every rank, naming the newest checkpoint
    that verifies. Returns the meta (for `restore_progress`). Writes nothing: called before the run claims
    its output paths."""
    meta, files = cio.read_checkpoint(path)
    ctx, shard, shards, cfg = trainer.ctx, trainer.comm.rank, trainer.comm.world, trainer.cfg
    ep = trainer.layout.expert_parallel
    check_compatible(path, meta, cfg, trainer.opts, shards)
    if (err := _agree(ctx, missing_files(path, meta, shard, shards, ep))) is not None:
        raise CheckpointError(err)
    world, same = meta["distributed"]["world"], _same_layout(meta, shards, ep)
    src = checkpoint_layout(cfg, meta)
    state = None
    err = check_files(path, meta, files, cfg, ranks=_reads(meta, shard, shards, ep))
    if err is None:
        try:
            if same:
                state = {kind: files.load(_stem(kind, shard, world)) for kind in STATE_KINDS}
            else:
                def read(kind: str, q: int, key: str) -> torch.Tensor:
                    t = files.get(_stem(kind, q, world), key)
                    if problem := value_problem(files.path / f"{_stem(kind, q, world)}.safetensors", kind, key, t,
                                                src, q):
                        raise CheckpointError(problem)
                    return t
                state = reshard_state(src, trainer.layout, shard, STATE_KINDS, read)
        except CheckpointError as e:
            err = str(e)
    if (err := _agree(ctx, err)) is None:
        trainer.load_state_tensors(state, int(meta["step"]))
        if same:  # where the state now lives, without another copy
            err = next((p for kind, tensors in trainer.state_tensors().items() for key, t in tensors.items()
                        if (p := value_problem(files.path / f"{_stem(kind, shard, world)}.safetensors", kind, key, t,
                                               src, shard))), None)
        err = _agree(ctx, err)
    if err is not None:
        def problem_of(c: str) -> str | None:
            try:
                m, _ = cio.read_checkpoint(c)
                check_compatible(c, m, cfg, trainer.opts, shards)
                if (missing := missing_files(c, m, shard, shards, ep)) is not None:
                    return missing
            except CheckpointError as e:
                return str(e)
            return verify(c, ranks=_reads(m, shard, shards, ep))
        hint = continue_hint(trainer.opts.expand(trainer.opts.checkpoint_dir))
        raise refusal(err, newest_verifying(path, problem_of, ctx), hint)
    hints = meta.get(HINTS_META)  # checked by check_compatible
    if hints is not None and len(hints) == ctx.world and hints[ctx.rank] is not None:  # else they start unset
        trainer.model.load_scale_hints(torch.tensor(hints[ctx.rank], dtype=torch.int32))
    return meta


def restore_progress(meta: dict[str, Any], trainer: Trainer, *, train_loader: TokenLoader | None,
                     logger: RunLogger | None) -> int:
    """Restore the loader and logger state of a checkpoint whose tensors `restore_state` loaded; returns the
    step to continue from."""
    world, shards, ep = meta["distributed"]["world"], trainer.comm.world, trainer.layout.expert_parallel
    skipped = 0
    if train_loader is not None:
        skipped = train_loader.load_state_dict(meta["data_loader"])
    if logger is not None and "logger" in meta:
        logger.load_state_dict(meta["logger"])
    if logger is not None and not _same_layout(meta, shards, ep):
        eps = f" (--expert-parallel {expert_parallel_of(meta)} -> {ep})" if expert_parallel_of(meta) != ep else ""
        logger.message(f"resumed a checkpoint sharded {world} way(s) on {shards}{eps}: weights and Adam state resharded"
                       + (f"; the data position was rounded up to the new world size ({skipped} sequence(s) "
                          f"skipped)" if skipped else ""), step=int(meta["step"]))
    return int(meta["step"])


def load(path: str, trainer: Trainer, *, train_loader: TokenLoader | None, logger: RunLogger | None) -> int:
    """Restore trainer state (and loader / logger state when given); returns the step to continue from.
    A checkpoint of another world size is resharded (module docstring); every file is verified
    (`restore_state`)."""
    meta = restore_state(path, trainer)
    return restore_progress(meta, trainer, train_loader=train_loader, logger=logger)
