"""Which run owns the output paths: checked before anything is built, claimed when the run starts.

A run has an id, made at its fresh start and kept by every resume (checkpoint.json's `run`). Its outputs
carry it, so a new run never mixes with an earlier run's files:

    <checkpoint-dir>/qtrain-run.json   {"run_id", "name", "created"}, written when the run starts
    <out-dir>/qtrain-export.json       the export manifest (model/hf_io.py), with the run id
    <log-file>                         its first line: {"log": "run", "run_id": ...}

`check_paths` refuses output paths that cannot work (a file where a directory belongs, unwritable, one
output on top of another). `lock` then takes them for this process (`qtrain.locks`: the checkpoint dir, the
out-dir and the log file, for the run's whole life), so a live run's paths are refused to any other process,
naming it, before anything is looked at or changed (a `--start-over` or a second `--continue` included).
`check_ownership` refuses to start a new run into an earlier run's checkpoints,
export or log (the message names `--continue`, which resumes it, and `--start-over`, which replaces it), to
resume into another run's outputs, and ever to overwrite a file that qtrain did not write. `claim` (rank 0,
once the checks passed) sweeps what dead processes left, carries out `--start-over`, and writes the marker.
"""
from __future__ import annotations

import datetime
import json
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qtrain.fsio import (FileSystemError, atomic_write_json, check_writable_dir, check_writable_file, read_json,
                         sweep_temp_files)
from qtrain.locks import Locks, Target, hold
from qtrain.model.hf_io import MANIFEST, export_manifest, foreign_export_files, is_export_name, manifest_files
from qtrain.train import checkpoint_io as cio

RUN_MARKER = "qtrain-run.json"
LEGACY = "legacy"  # a qtrain log or checkpoint dir from before run ids


class RunConflictError(ValueError):
    """Output paths that belong to another run (or to nobody qtrain knows); the message says what to do."""


def new_run_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class RunPaths:
    ckpt_dir: str
    out_dir: str
    log_file: str | None

    @classmethod
    def of(cls, opts: Any) -> "RunPaths":
        return cls(ckpt_dir=opts.expand(opts.checkpoint_dir), out_dir=opts.expand(opts.out_dir),
                   log_file=opts.expand(opts.log_file) if opts.log_file else None)


@dataclass
class Found:
    """What the output paths hold now."""
    ckpt_run: str | None = None  # run id of the checkpoint dir's marker (LEGACY: checkpoints, no marker)
    ckpt_steps: list[int] = field(default_factory=list)
    export_run: str | None = None  # run id in the export manifest (LEGACY: a manifest without one)
    foreign: list[str] = field(default_factory=list)  # files the export would overwrite that qtrain did not write
    log_run: str | None = None  # run id on the log's first line; LEGACY: a qtrain log without; None: no log
    log_foreign: bool = False  # the log path holds something that is not a qtrain log


# ---------------------------------------------------------------------------------------------- paths

def _abs(p: str) -> Path:
    return Path(os.path.abspath(p))


def _inside(p: Path, root: Path) -> bool:
    return p == root or root in p.parents


def check_paths(paths: RunPaths) -> None:
    """FileSystemError for an output path that is a file where a directory belongs (or the reverse), that
    cannot be created or written, or that would land on another output. Creates nothing."""
    check_writable_dir(paths.ckpt_dir, "--checkpoint-dir")
    check_writable_dir(paths.out_dir, "--out-dir")
    if paths.log_file:
        check_writable_file(paths.log_file, "--log-file")
    ckpt, out = _abs(paths.ckpt_dir), _abs(paths.out_dir)
    if cio.checkpoint_step(out) is not None and _inside(out, ckpt):
        raise FileSystemError(f"--out-dir {paths.out_dir}: is a checkpoint directory of --checkpoint-dir "
                              f"{paths.ckpt_dir}; the export needs its own folder")
    if any(cio.checkpoint_step(p) is not None for p in [out, *out.parents] if _inside(p, ckpt) and p != ckpt):
        raise FileSystemError(f"--out-dir {paths.out_dir}: lies inside a checkpoint of --checkpoint-dir "
                              f"{paths.ckpt_dir}")
    if paths.log_file:
        log = _abs(paths.log_file)
        for opt, d in (("--checkpoint-dir", ckpt), ("--out-dir", out)):
            if log == d:
                raise FileSystemError(f"--log-file {paths.log_file}: is the {opt} itself")
        if any(cio.checkpoint_step(p) is not None for p in log.parents if _inside(p, ckpt) and p != ckpt):
            raise FileSystemError(f"--log-file {paths.log_file}: lies inside a checkpoint of --checkpoint-dir "
                                  f"{paths.ckpt_dir}")
        if log.parent == out and (log.name == MANIFEST or is_export_name(log.name)):
            raise FileSystemError(f"--log-file {paths.log_file}: the export writes its {log.name} there "
                                  f"(--out-dir {paths.out_dir})")
        if log.parent == ckpt and (log.name == RUN_MARKER or cio.checkpoint_step(log) is not None):
            raise FileSystemError(f"--log-file {paths.log_file}: collides with the checkpoints' {log.name}")


def check_export_place(out_dir: str) -> None:
    """FileSystemError when `qtrain export`'s `out_dir` is a checkpoint (a step_NNNNNNNN folder holding
    checkpoint.json, of any run) or lies inside one: keep-n and --start-over remove a checkpoint folder whole, the
    export with it (`check_paths` refuses the same for a run's own --out-dir before its checkpoints exist)."""
    out = _abs(out_dir)
    for p in [out, *out.parents]:
        if cio.checkpoint_step(p) is not None and (p / cio.META_FILE).is_file():
            where = "is a checkpoint directory" if p == out else f"lies inside the checkpoint directory {p}"
            raise FileSystemError(f"--out-dir {out_dir}: {where}; the export needs its own folder (keep-n and "
                                  f"--start-over remove a checkpoint folder whole)")


def lock(paths: RunPaths) -> Locks:
    """Take the run's paths for this process (PathInUseError naming the live process that has them). Creates the
    folders it locks; a release removes them again while they are empty."""
    targets = [Target(paths.ckpt_dir, "--checkpoint-dir"), Target(paths.out_dir, "--out-dir")]
    if paths.log_file:
        targets.append(Target(paths.log_file, "--log-file", is_file=True))
    return hold(targets)


# ---------------------------------------------------------------------------------------------- ownership

def log_run_id(path: str) -> tuple[str | None, bool]:
    """(run id, foreign) of an existing log: the run id on its first line, LEGACY for a qtrain log from before
    run ids, None for a missing or empty file; foreign=True when the file is not a qtrain log at all."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except FileNotFoundError:
        return None, False
    except OSError:
        return None, True
    if not head.strip():
        return None, False
    try:
        first = json.loads(head.split(b"\n", 1)[0])
    except ValueError:
        return None, True
    if not isinstance(first, dict) or "log" not in first:
        return None, True
    return (str(first["run_id"]) if first.get("log") == "run" and first.get("run_id") else LEGACY), False


def inspect(paths: RunPaths) -> Found:
    found = Found()
    marker = read_json(Path(paths.ckpt_dir) / RUN_MARKER)
    found.ckpt_steps = [s for s, _ in cio.list_checkpoints(paths.ckpt_dir)]
    if isinstance(marker, dict) and marker.get("run_id"):
        found.ckpt_run = str(marker["run_id"])
    elif found.ckpt_steps:
        found.ckpt_run = LEGACY
    man = export_manifest(paths.out_dir)
    if man is not None:
        found.export_run = str(man.get("run_id") or LEGACY)
    found.foreign = foreign_export_files(paths.out_dir)
    if paths.log_file:
        found.log_run, found.log_foreign = log_run_id(paths.log_file)
    return found


def _short(run: str) -> str:
    return "of unknown run" if run == LEGACY else f"of run {run[:8]}"


def check_ownership(paths: RunPaths, found: Found, *, run_id: str | None, start_over: bool = False) -> None:
    """A fresh start (run_id None) needs outputs that no earlier run holds, unless `start_over`; a resume of
    `run_id` needs outputs that hold nothing of another run. Files qtrain did not write are never taken."""
    if found.foreign:
        raise RunConflictError(
            f"--out-dir {paths.out_dir}: {', '.join(found.foreign[:4])} exist(s) and no qtrain export wrote them; "
            f"the export would overwrite them: choose another --out-dir (or --name), or move them away")
    if found.log_foreign:
        raise RunConflictError(f"--log-file {paths.log_file}: exists and is not a qtrain log; choose another "
                               f"--log-file (or --name)")
    if run_id is None:
        if start_over:
            return
        held = []
        if found.ckpt_steps or found.ckpt_run:
            steps = (f"steps {found.ckpt_steps[0]}..{found.ckpt_steps[-1]}" if found.ckpt_steps else "no checkpoint yet")
            held.append(f"--checkpoint-dir {paths.ckpt_dir} ({_short(found.ckpt_run or LEGACY)}, {steps})")
        if found.export_run:
            held.append(f"the export in --out-dir {paths.out_dir} ({_short(found.export_run)})")
        if found.log_run:
            held.append(f"--log-file {paths.log_file} ({_short(found.log_run)})")
        if held:
            raise RunConflictError(
                f"an earlier run's outputs are in the way: {'; '.join(held)}. Resume that run with --continue, "
                f"or start over with --start-over (deletes its checkpoints and export files, keeps its log aside), "
                f"or give this run another --name")
        return
    others = []
    if found.ckpt_run not in (None, run_id, LEGACY):
        others.append(f"--checkpoint-dir {paths.ckpt_dir} holds the outputs {_short(found.ckpt_run)}")
    if found.export_run not in (None, run_id, LEGACY):
        others.append(f"the export in --out-dir {paths.out_dir} holds the outputs {_short(found.export_run)}")
    if found.log_run not in (None, run_id) and not (found.log_run == LEGACY and found.ckpt_run in (None, LEGACY)):
        others.append(f"--log-file {paths.log_file} holds the outputs {_short(found.log_run)}")
    if others:
        raise RunConflictError(f"resuming run {run_id[:8]}, but {'; '.join(others)}; resume with the paths of that "
                               f"run, or give this one other paths (--name, --checkpoint-dir, --out-dir, --log-file)")


def check_links(paths: RunPaths, *, from_step: int, start_over: bool = False) -> None:
    """Refuse a run that could write a checkpoint over the user's symbolic link (a `step_N` in the checkpoint
    directory that is or holds one: `checkpoint_io.linked_checkpoints`): one of a step after `from_step` (the
    step the run starts from), or any with `start_over`. qtrain never deletes or replaces such a link, so the
    run would fail at that checkpoint; this says so before anything starts."""
    linked = [(s, p, link) for s, p, link in cio.linked_checkpoints(paths.ckpt_dir) if start_over or s > from_step]
    if not linked:
        return
    s, p, link = linked[0]
    what = f"is a symbolic link to {os.path.realpath(p)}" if link == p else f"holds a symbolic link ({link.name})"
    why = ("--start-over deletes only the checkpoints qtrain wrote, and the new run" if start_over
           else f"this run (from step {from_step})")
    raise RunConflictError(f"--checkpoint-dir {paths.ckpt_dir}: {p.name} {what}, which qtrain never deletes or "
                           f"replaces, and {why} could write step {s} there; move it out of the folder first")


# ---------------------------------------------------------------------------------------------- claim

def claim(paths: RunPaths, found: Found, *, run_id: str, name: str, start_over: bool) -> list[str]:
    """Rank 0, after the checks: sweep leftovers of dead processes, carry out --start-over, write the marker.
    Returns what was done, one message each."""
    notes = []
    swept = cio.remove_stale(paths.ckpt_dir) + sweep_temp_files(paths.ckpt_dir) + sweep_temp_files(paths.out_dir)
    if paths.log_file:
        swept += sweep_temp_files(Path(paths.log_file).parent if Path(paths.log_file).parent != Path("") else ".")
    if swept:
        notes.append(f"removed {len(swept)} leftover(s) of interrupted writes: {', '.join(p.name for p in swept[:4])}")
    if start_over:
        notes += _start_over(paths, found)
    marker = Path(paths.ckpt_dir) / RUN_MARKER
    old = read_json(marker)
    if not (isinstance(old, dict) and old.get("run_id") == run_id):
        marker.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(marker, {"run_id": run_id, "name": name,
                                   "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds")},
                          point="run.marker")
    return notes


def _remove_file(p: Path) -> None:
    """Remove a file qtrain wrote; a symbolic link there is the user's and stays."""
    if not p.is_symlink():
        p.unlink(missing_ok=True)


def _start_over(paths: RunPaths, found: Found) -> list[str]:
    """Delete the earlier run's checkpoints and export files (only what qtrain wrote; never a symbolic link,
    which `check_links` refused up front), keep its log aside."""
    notes = []
    ckpts = [(s, p) for s, p in cio.list_checkpoints(paths.ckpt_dir) if cio.users_link(p) is None]
    for _, p in ckpts:
        cio.delete_checkpoint(p)
    _remove_file(Path(paths.ckpt_dir) / RUN_MARKER)
    if ckpts:
        notes.append(f"--start-over: deleted {len(ckpts)} checkpoint(s) of the earlier run in {paths.ckpt_dir}")
    man = export_manifest(paths.out_dir)
    if man is not None:
        for n in sorted(manifest_files(man)):
            _remove_file(Path(paths.out_dir) / n)
        _remove_file(Path(paths.out_dir) / MANIFEST)
        notes.append(f"--start-over: removed the earlier run's export files from {paths.out_dir}")
    if paths.log_file and found.log_run and os.path.exists(paths.log_file):
        stem, ext = os.path.splitext(paths.log_file)
        tag = found.log_run[:8] if found.log_run != LEGACY else "earlier"
        aside, i = f"{stem}.{tag}{ext}", 1
        while os.path.exists(aside):
            aside, i = f"{stem}.{tag}-{i}{ext}", i + 1
        os.replace(paths.log_file, aside)
        notes.append(f"--start-over: the earlier run's log is now {aside}")
    return notes
