"""What goes into a training checkpoint and how a run resumes from one.

A checkpoint (`checkpoint_io` handles the files and their atomicity) holds, per rank, the weight shard and
the Adam moment shards of every group (`weights.shard_RRR_of_WWW`, `adam.m...`, `adam.v...`), and in
`checkpoint.json`: the step, the data loader position, the outlier-detector windows, the world size, every
option and the training files (what `--continue` compares: `resume_checks.py`), and in `tokenizer/` a copy of the
tokenizer the export carries; `checkpoint_meta.py` holds the meta's schema, checked before anything is built, and
`check_shard_files` the shard files' headers. Stochastic rounding needs no saved state: its bits are a function of
(seed, step, tensor, element), so a resumed run continues bit-exactly.

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

import socket
from pathlib import Path
from typing import Any

import torch
from qtrain.data.loader import TokenLoader
from safetensors import SafetensorError

from qtrain.fsio import describe_write_error, ensure_free_space, fault_point, owner_tag, shorten
from qtrain.model.config import ModelConfig
from qtrain.model.registry import config_from_hf_dict
from qtrain.observe.log import RunLogger
from qtrain.parallel.layout import FlatLayout
from qtrain.parallel.optimizer import SCALES_SUFFIX, group_m_scales
from qtrain.parallel.reshard import reshard_state
from qtrain.train import checkpoint_io as cio
from qtrain.train import checkpoint_meta as cmeta
from qtrain.train.checkpoint_io import CheckpointError
from qtrain.train.checkpoint_meta import FORMAT_VERSION, HINTS_META, MUST_MATCH
from qtrain.train.trainer import Trainer

__all__ = ["CheckpointError", "FORMAT_VERSION", "find", "save", "load", "check_compatible", "missing_files",
           "check_shard_files", "newest_finite"]

# checkpoint.json's fields: checkpoint_meta.py; HINTS_META holds every rank's one-pass SwiGLU FP8 scale hints
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


def _shard_files(kinds: tuple[str, ...], ranks: range | list[int], world: int) -> list[str]:
    return [_stem(kind, r, world) for kind in kinds for r in ranks]


STATE_KINDS = ("weights", "adam.m", "adam.v")
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
    if err is None and not any(r < ctx.rank and r % shards == shard for r in here):
        try:
            cio.write_files(tmp, files)
        except (OSError, SafetensorError) as e:
            err = f"writing the checkpoint of step {step} to {tmp} failed: {describe_write_error(e)}"
        err = _agree(ctx, err)
    elif err is None:
        err = _agree(ctx, None)
    if err is not None:
        if committer and tmp is not None:
            cio.remove_tree_quietly(tmp)
        raise CheckpointError(err)
    meta = None
    if ctx.is_main:
        meta = {
            "version": FORMAT_VERSION,
            "step": step,
            "run": dict(run or {}),
            "nonfinite_streak": int(nonfinite_streak),
            "data_loader": loader.state_dict(),
            "logger": log.state_dict(),
            "options": cmeta.options_record(trainer.opts),
            "data": cmeta.data_record(loader),
            "model": trainer.cfg.to_hf_dict(),
            "tokenizer": cmeta.tokenizer_record(trainer.tokenizer),  # what `qtrain export` puts beside the weights
        }
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
        try:
            for r in here:
                (tmp / _MARKER.format(r)).unlink(missing_ok=True)
            if not cmeta.write_tokenizer(trainer.tokenizer, tmp):  # its source went away: export without one
                meta["tokenizer"] = None
            cio.commit(tmp, final, meta)
        except OSError as e:
            cio.remove_tree_quietly(tmp)
            err = f"committing the checkpoint of step {step} to {final} failed: {describe_write_error(e)}"
    if (err := _agree(ctx, err)) is not None:
        raise CheckpointError(err)
    if committer:
        protect = [p] if (p := newest_finite(ckpt_dir)) else []
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
    if written != world and "ranks" in dist_meta:
        raise CheckpointError(
            f"{path}: written by {written} rank(s) into a checkpoint directory local to each node (this one, on "
            f"{dist_meta.get('host', '?')}, holds the shards of ranks {_ranges(dist_meta['ranks'])} only); this "
            f"run has {world}: resharding reads every rank's shards. Copy the other nodes' "
            f"{Path(path).name}/*.safetensors into this directory (and drop \"ranks\" from {cio.META_FILE}), "
            f"or resume with {written} ranks on the same nodes")
    for k in MUST_MATCH:
        v = meta["options"][k]
        if getattr(opts, k, v) != v:
            raise CheckpointError(f"{path}: checkpoint has --{k.replace('_', '-')}={v!r}, this run "
                                  f"{getattr(opts, k)!r}")
    if theirs != config_from_hf_dict(cfg.to_hf_dict()):
        diff = [f.name for f in theirs.__dataclass_fields__.values() if getattr(theirs, f.name) != getattr(cfg, f.name)]
        raise CheckpointError(f"{path}: written for another model ({', '.join(diff)} differ from --model's config)")


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


def missing_files(path: str, meta: dict[str, Any], rank: int, world: int) -> str | None:
    """None when the checkpoint directory holds every shard file rank `rank` of `world` reads (its own at the
    same world size, every rank's when resharding); else the message naming what is missing and why."""
    written = meta["distributed"]["world"]
    ranks = [rank] if written == world else range(written)
    missing = [f + ".safetensors" for f in _shard_files(STATE_KINDS, ranks, written)
               if not (Path(path) / f"{f}.safetensors").is_file()]
    if not missing:
        return None
    held = meta["distributed"].get("ranks")
    why = (f"this directory holds the shards of ranks {_ranges(held)} (a checkpoint directory local to each node)"
           if held is not None else "files deleted, or a checkpoint directory that is not shared by the nodes")
    return (f"{path} on {socket.gethostname()}: rank {rank} of {world} needs {', '.join(missing[:4])}"
            f"{f' and {len(missing) - 4} more' if len(missing) > 4 else ''}, which it does not have: {why}. Give "
            f"every node the same directory (a shared filesystem), or copy the missing shard files there")


_SAFETENSORS_DTYPES = {"fp32": "F32", "bf16": "BF16", "e4m3": "F8_E4M3"}


def check_shard_files(path: str, meta: dict[str, Any], cfg: ModelConfig, *, kinds: tuple[str, ...] = STATE_KINDS,
                      optional: tuple[str, ...] = ()) -> None:
    """The shard files of the ranks this directory holds (`distributed.ranks`, else all) against the checkpoint's
    own layout: each there (a kind in `optional` may be absent for every rank: an export needs only the weights),
    holding exactly its groups' tensors with the shape of a `distributed.world`-way shard and the dtype the
    options record. Reads the safetensors headers only; CheckpointError naming the file and the tensor. `meta`
    has passed `checkpoint_meta.validate`, `cfg` is its model."""
    files = cio.CheckpointFiles(Path(path))
    dist, opts = meta["distributed"], meta["options"]
    world = dist["world"]
    ranks = dist.get("ranks") or range(world)
    layout = FlatLayout(cfg, world)
    dtypes = {"weights": opts["master_dtype"] or opts["model_dtype"], "adam.m": opts["opt_m_dtype"],
              "adam.v": opts["opt_v_dtype"]}
    for kind in kinds:
        stems = [_stem(kind, r, world) for r in ranks]
        missing = [s for s in stems if s not in files]
        if kind in optional and len(missing) == len(stems):
            continue
        if missing:
            listed = " it lists in distributed.ranks" if "ranks" in dist else ""
            raise CheckpointError(f"{path}: {missing[0]}.safetensors is missing (a checkpoint of {world} rank(s) holds "
                                  f"a {kind} file per rank{listed})")
        want = {g.key: ((g.shard_size(world),), _SAFETENSORS_DTYPES[dtypes[kind]]) for g in layout.groups}
        if kind == "adam.m" and dtypes[kind] == "e4m3":
            want.update({g.key + SCALES_SUFFIX: ((group_m_scales(g, world),), "F32") for g in layout.groups})
        for stem in stems:
            _check_header(f"{path}/{stem}.safetensors", files.headers(stem), want, world)


def _check_header(file: str, have: dict[str, tuple[tuple[int, ...], str]],
                  want: dict[str, tuple[tuple[int, ...], str]], world: int) -> None:
    if missing := sorted(want.keys() - have.keys()):
        raise CheckpointError(f"{file}: no tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if
                                                                      len(missing) > 1 else ""))
    if extra := sorted(have.keys() - want.keys()):
        raise CheckpointError(f"{file}: tensor {shorten(extra[0])!r} is none of the model's groups")
    for key, (shape, dtype) in want.items():
        if have[key][0] != shape:
            raise CheckpointError(f"{file}: tensor {key!r} has shape {list(have[key][0])}, a {world}-way shard of "
                                  f"the model's layout has {list(shape)}")
        if have[key][1] != dtype:
            raise CheckpointError(f"{file}: tensor {key!r} is {have[key][1]}, the checkpoint's options say {dtype}")


def load(path: str, trainer: Trainer, *, train_loader: TokenLoader | None, logger: RunLogger | None) -> int:
    """Restore trainer state (and loader / logger state when given); returns the step to continue from.
    A checkpoint of another world size is resharded (module docstring)."""
    meta, files = cio.read_checkpoint(path)
    ctx, shard, shards = trainer.ctx, trainer.comm.rank, trainer.comm.world
    check_compatible(path, meta, trainer.cfg, trainer.opts, shards)
    if (err := _agree(ctx, missing_files(path, meta, shard, shards))) is not None:
        raise CheckpointError(err)
    world = meta["distributed"]["world"]
    if world == shards:
        state = {kind: files.load(_stem(kind, shard, world)) for kind in STATE_KINDS}
    else:
        state = reshard_state(FlatLayout(trainer.cfg, world), trainer.layout, shard, STATE_KINDS,
                              lambda kind, q, key: files.get(_stem(kind, q, world), key))
    trainer.load_state_tensors(state, int(meta["step"]))
    hints = meta.get(HINTS_META)  # checked by check_compatible
    if hints is not None and len(hints) == ctx.world and hints[ctx.rank] is not None:  # else they start unset
        trainer.model.load_scale_hints(torch.tensor(hints[ctx.rank], dtype=torch.int32))
    skipped = 0
    if train_loader is not None:
        skipped = train_loader.load_state_dict(meta["data_loader"])
    if logger is not None and "logger" in meta:
        logger.load_state_dict(meta["logger"])
    if logger is not None and world != shards:
        logger.message(f"resumed a checkpoint sharded {world} way(s) on {shards}: weights and Adam state resharded"
                       + (f"; the data position was rounded up to the new world size ({skipped} sequence(s) "
                          f"skipped)" if skipped else ""), step=int(meta["step"]))
    return int(meta["step"])
