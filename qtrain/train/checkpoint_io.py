"""Checkpoint files on disk: layout, atomic multi-rank writes, lookup and cleanup.

Layout, as llm.q (reference/llmq.md §2.3):

  <ckpt_dir>/step_00001000/
      weights.shard_000_of_002.safetensors   one file per (kind, rank); names are the caller's
      adam.m.shard_000_of_002.safetensors
      ...
      checkpoint.json                        meta (step, loader, RNG, ...), written last

What this module adds over llm.q is atomicity. Everything goes into `step_XXXXXXXX.tmp-<tag>` first;
only a complete directory is renamed to `step_XXXXXXXX`, and only a directory with that exact name
*and* a `checkpoint.json` counts as a checkpoint. So a crash at any point (mid-shard, before the meta,
during cleanup) leaves either the previous set of checkpoints or the new one, never a half one that
`--continue` would pick up.

Multi-rank protocol (each rank writes its own shards; no tensor moves between ranks):

  tmp = begin(ckpt_dir, step, tag=<rank 0's pid, broadcast>)   # every rank; idempotent mkdir
  write_files(tmp, {f"weights.shard_{r:03d}_of_{w:03d}": ..., ...})   # every rank, own files
  barrier()
  if rank == 0: commit(tmp, checkpoint_path(ckpt_dir, step), meta)    # fsync + meta + rename
  barrier()

`write_checkpoint` is the one-process version of the same sequence.

Temp and half-deleted directories carry their writer's `HOST-PID` tag (`qtrain.fsio.owner_tag`);
`remove_stale` sweeps those of dead writers at the next start, and puts back a checkpoint that a kill left
renamed aside (`.old-`) while it was being replaced. Each file operation is a `qtrain.fsio.fault_point`
(`ckpt.*`), where the fault-injection suite kills the writer.

Integrity: every shard file's digests are computed while it is written (`tensor_file`: each tensor's in the
file's header, the header's in the meta: `"digests": {file name: "sha256-tree:<hex>"}`); `CheckpointFiles`
verifies each tensor in the read that loads it, so a flipped bit, a truncated file or two files swapped are
refused, naming the file and tensor, not trained on.
Checkpoints written before digests existed have no `digests` and load unverified (`CheckpointFiles.verified`).

Symbolic links: qtrain never makes one, so a link among the checkpoints (a `step_N` that is a link, or one
holding a link) is the user's. Such a checkpoint may be read (`--continue`, export), but it is never deleted,
replaced or counted by keep-n, and nothing is deleted through a link (`fsio.remove_tree` refuses).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from safetensors import SafetensorError, safe_open

from qtrain.fsio import (FileSystemError, fault_point, find_link, fsync_path, is_stale, owner_tag, read_bounded,
                        remove_tree, shorten)
from qtrain.train import tensor_file
from qtrain.train.tensor_file import DigestMismatch, TensorFileError

META_FILE = "checkpoint.json"
MAX_META_BYTES = 64 << 20  # far above any real meta (its largest parts: FP8 scale hints, the training files)
DIGESTS = "digests"  # checkpoint.json: {file name: digest} (checkpoint_meta: their forms), computed while writing
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_LEFTOVER = re.compile(r"^(?P<final>step_\d{8,})\.(?P<kind>tmp|old|del)-(?P<tag>.+)$")
_FILE_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be written, read, resumed or exported as asked; the message names the path."""


def checkpoint_path(ckpt_dir: str | os.PathLike, step: int) -> Path:
    return Path(ckpt_dir) / f"step_{step:08d}"


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """Step of a `step_NNNNNNNN` directory name, else None."""
    m = _STEP_DIR.match(Path(path).name)
    return int(m.group(1)) if m else None



# ---- writing ----

def begin(ckpt_dir: str | os.PathLike, step: int, *, tag: str | int | None = None) -> Path:
    """Create (or join) the temp directory for `step`. Ranks must pass the same `tag` (default: this
    process's `HOST-PID`, fine for one process); that is how they end up writing into one directory."""
    tag = owner_tag() if tag is None else tag
    tmp = Path(ckpt_dir) / f"step_{step:08d}.tmp-{tag}"
    tmp.mkdir(parents=True, exist_ok=True)
    fault_point("ckpt.begin")
    return tmp


def write_files(tmp_path: str | os.PathLike, files: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, str]:
    """Write `files[name]` as `<tmp_path>/<name>.safetensors` and fsync each. Tensors are copied to CPU.
    Returns {file name: digest}, the digests hashed on the way (what `commit` records in the meta). Each
    file's header names the file (`name` in its metadata), so a file renamed or swapped with another rank's
    shows in its header too."""
    digests = {}
    for name, tensors in files.items():
        if not _FILE_NAME.match(name) or name in (".", ".."):
            raise ValueError(f"checkpoint file name {name!r}: use letters, digits, '_', '.', '-' only")
        path = Path(tmp_path) / f"{name}.safetensors"
        digests[path.name] = tensor_file.write(path, tensors, {"format": "pt", "name": name})
        fault_point("ckpt.shard")
    return digests


def commit(tmp_path: str | os.PathLike, final_path: str | os.PathLike, meta: Mapping[str, Any]) -> Path:
    """Write the meta and publish the directory under its final name (rank 0, after a barrier).

    An existing checkpoint of the same step is replaced: it is first renamed aside (no longer a
    checkpoint name), then the new one is renamed in, then the old one removed (a kill in between leaves
    the old one aside, and `remove_stale` puts it back).
    """
    tmp, final = Path(tmp_path), Path(final_path)
    if os.path.lexists(final) and (link := find_link(final)) is not None:
        raise CheckpointError(f"{final}: not replaced by the new checkpoint of this step: {link} is a symbolic "
                              f"link (qtrain makes none; it is yours); move it away")
    meta_tmp = tmp / (META_FILE + ".part")
    with open(meta_tmp, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2, allow_nan=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    fault_point("ckpt.meta")
    os.replace(meta_tmp, tmp / META_FILE)
    fsync_path(tmp)
    fault_point("ckpt.sealed")
    old = None
    if os.path.lexists(final):
        old = final.with_name(f"{final.name}.old-{owner_tag()}")
        os.replace(final, old)
        fault_point("ckpt.aside")
    os.replace(tmp, final)
    fsync_path(final.parent)
    fault_point("ckpt.commit")
    if old is not None:
        remove_tree(old, point="ckpt.old")
    return final


def write_checkpoint(ckpt_dir: str | os.PathLike, step: int, files: Mapping[str, Mapping[str, torch.Tensor]],
                     meta: Mapping[str, Any]) -> Path:
    """Single-process write: begin, write_files, commit. On any error the temp directory is removed."""
    tmp = begin(ckpt_dir, step)
    try:
        digests = write_files(tmp, files)
        return commit(tmp, checkpoint_path(ckpt_dir, step), {**meta, DIGESTS: digests})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_stale(ckpt_dir: str | os.PathLike) -> list[Path]:
    """Sweep what dead writers left (`step_N.tmp-TAG` half-written, `.del-TAG` half-deleted, `.old-TAG` renamed
    aside while being replaced): each is deleted, except an `.old-` checkpoint whose step has no checkpoint
    any more, which is renamed back. Leftovers of a live writer (its tag's process runs) are kept, and so is
    one that holds a symbolic link (the user's). Call on rank 0 before a run writes. Returns the paths removed."""
    removed = []
    root = Path(ckpt_dir)
    if not root.is_dir():
        return removed
    for p in sorted(root.iterdir()):
        m = _LEFTOVER.match(p.name)
        if not (m and p.is_dir() and is_stale(m.group("tag"))) or find_link(p) is not None:
            continue
        final = root / m.group("final")
        if m.group("kind") == "old" and not os.path.lexists(final) and (p / META_FILE).is_file():
            os.replace(p, final)  # the replacement never arrived: the old checkpoint is still the one
            fsync_path(root)
            continue
        doomed = p if m.group("kind") == "del" else p.with_name(f"{m.group('final')}.del-{owner_tag()}")
        if doomed != p:
            os.replace(p, doomed)
        remove_tree(doomed, point="ckpt.sweep")
        removed.append(p)
    return removed


# ---- reading ----

class CheckpointFiles:
    """Lazy access to the safetensors files of one checkpoint; nothing is read until asked for. With the
    meta's `digests` (`verified`), whatever is read is checked against them: a header when it is read, each
    tensor in the read that loads it (`load`, `get`)."""

    def __init__(self, path: Path, digests: Mapping[str, str] | None = None) -> None:
        self.path = path
        self.digests = digests
        self._headers: dict[str, tensor_file.Header] = {}  # verified headers, for `get`

    @property
    def verified(self) -> bool:
        """Whether the checkpoint records digests (those written before qtrain stored them do not)."""
        return self.digests is not None

    @property
    def names(self) -> list[str]:
        return sorted(p.name.removesuffix(".safetensors") for p in self.path.glob("*.safetensors"))

    def __contains__(self, name: str) -> bool:
        return (self.path / f"{name}.safetensors").is_file()

    def _file(self, name: str) -> Path:
        p = self.path / f"{name}.safetensors"
        if not p.is_file():
            raise CheckpointError(f"checkpoint {self.path}: no file {p.name} (has: {', '.join(self.names)})")
        return p

    def digest(self, name: str) -> str | None:
        """The recorded digest of file `name` (None: an unverified checkpoint); CheckpointError when the meta
        records digests but none for this file."""
        if self.digests is None:
            return None
        file = f"{name}.safetensors"
        if file not in self.digests:
            raise CheckpointError(f"{self.path / META_FILE}: {DIGESTS} has no entry for {file}")
        return self.digests[file]

    def header(self, name: str, *, verify: bool = True) -> tensor_file.Header:
        """The file's header (names, dtypes, shapes, metadata), verified against the recorded digest unless
        `verify` is False; reads a few kilobytes."""
        if name in self._headers:
            return self._headers[name]
        path = self._file(name)
        try:
            header = tensor_file.read_header(path)
            if verify and (digest := self.digest(name)) is not None:
                header.verify(path, digest)
        except DigestMismatch as e:
            raise CheckpointError(str(e)) from None
        except TensorFileError as e:
            raise CheckpointError(_unreadable(e)) from None
        if verify:
            self._headers[name] = header
        return header

    def keys(self, name: str) -> list[str]:
        return list(self.header(name).tensors)

    def get(self, name: str, key: str, *, device: str = "cpu") -> torch.Tensor:
        """One tensor (a piecewise read: resharding), verified against its digest in the header."""
        header, path = self.header(name), self._file(name)
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                t = f.get_tensor(key)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path}: unreadable checkpoint file (corrupt or truncated?): {e}") from None
        if self.digests is not None:
            try:
                header.check_tensor(path, key, tensor_file.tensor_bytes(t))
            except DigestMismatch as e:
                raise CheckpointError(str(e)) from None
        return t.to(device)

    def load(self, name: str, *, device: str = "cpu") -> dict[str, torch.Tensor]:
        """Every tensor of file `name`, each verified against its digest in the read that loads it."""
        path = self._file(name)
        try:
            tensors, _ = tensor_file.read(path, self.digest(name))
        except DigestMismatch as e:
            raise CheckpointError(str(e)) from None
        except TensorFileError as e:
            raise CheckpointError(_unreadable(e)) from None
        return tensors if device == "cpu" else {k: t.to(device) for k, t in tensors.items()}

    def __call__(self, name: str, *, device: str = "cpu") -> dict[str, torch.Tensor]:
        return self.load(name, device=device)


def _unreadable(e: TensorFileError) -> str:
    path, _, why = str(e).partition(": ")
    return f"{path}: unreadable checkpoint file (corrupt or truncated?): {why}"


def read_checkpoint(path: str | os.PathLike) -> tuple[dict[str, Any], CheckpointFiles]:
    """(meta, lazy file loader) of a committed checkpoint directory. The loader verifies the files against
    the meta's `digests` when it has them."""
    path = Path(path)
    meta_file = path / META_FILE
    if not meta_file.is_file():
        raise CheckpointError(f"{path}: not a complete checkpoint (no {META_FILE})")
    try:
        meta = json.loads(read_bounded(meta_file, "checkpoint meta", MAX_META_BYTES))
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{meta_file}: unreadable ({shorten(str(e))})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{meta_file}: not a JSON object")
    return meta, CheckpointFiles(path, meta.get(DIGESTS))


# ---- finding and cleaning ----

def list_checkpoints(ckpt_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Committed checkpoints as (step, path), oldest first. Temp, half-deleted and meta-less
    directories are not checkpoints."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        step = checkpoint_step(p)
        if step is not None and (p / META_FILE).is_file():
            found.append((step, p))
    return sorted(found)


def _latest(ckpt_dir: Path) -> Path | None:
    # like llm.q: step 0 is never "latest" (resuming it equals a fresh start)
    found = [(s, p) for s, p in list_checkpoints(ckpt_dir) if s > 0]
    return found[-1][1] if found else None


def find_checkpoint(ckpt_dir: str | os.PathLike, spec: str | int | os.PathLike | bool | None = None) -> Path | None:
    """Resolve llm.q's `--continue [X]`; None when nothing matches (the caller warns and starts fresh).

    * None / True / "" (bare `--continue`): the latest checkpoint in `ckpt_dir`.
    * an int or a string of digits: that step in `ckpt_dir`.
    * a path whose last part is `step_NNNNNNNN`: that checkpoint.
    * any other path: the latest checkpoint inside it.
    """
    if spec is None or spec is True or spec == "":
        return _latest(Path(ckpt_dir))
    if isinstance(spec, bool):
        return None  # False: --continue not given
    if isinstance(spec, int) or (isinstance(spec, str) and spec.isdigit()):
        p = checkpoint_path(ckpt_dir, int(spec))
        return p if (p / META_FILE).is_file() else None
    p = Path(spec)
    if checkpoint_step(p) is not None:
        return p if (p / META_FILE).is_file() else None
    return _latest(p)


def users_link(path: str | os.PathLike) -> Path | None:
    """The symbolic link that makes checkpoint `path` the user's (it is one, or holds one), else None."""
    return find_link(path)


def linked_checkpoints(ckpt_dir: str | os.PathLike) -> list[tuple[int, Path, Path]]:
    """(step, path, link) of every `step_N` entry in `ckpt_dir` that is or holds a symbolic link, oldest first:
    the ones qtrain reads but never deletes or replaces."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if (step := checkpoint_step(p)) is not None and (link := users_link(p)) is not None:
            found.append((step, p, link))
    return sorted(found)


def delete_checkpoint(path: str | os.PathLike) -> None:
    """Rename out of the checkpoint namespace first, so a crash mid-delete leaves no half checkpoint. A
    checkpoint that is or holds a symbolic link is the user's: CheckpointError, nothing renamed or deleted."""
    path = Path(path)
    if (link := users_link(path)) is not None:
        raise CheckpointError(f"{path}: not deleted: {link} is a symbolic link (qtrain makes none; it is yours)")
    doomed = path.with_name(f"{path.name}.del-{owner_tag()}")
    os.replace(path, doomed)
    fault_point("ckpt.delete")
    remove_tree(doomed, point="ckpt.delete")


def clean_old_checkpoints(ckpt_dir: str | os.PathLike, keep_n: int, major: int = -1,
                          protect: Iterable[str | os.PathLike] = ()) -> list[Path]:
    """llm.q's `--ckpt-keep-n` / `--ckpt-major`: keep the newest `keep_n` checkpoints whose step is not a
    multiple of `major`; those "major" ones are never deleted and do not count towards `keep_n`.
    keep_n < 0 keeps everything; major <= 0 means no majors. Paths in `protect` (the newest checkpoint
    written after a finite step) are never deleted, and neither are the user's (a checkpoint that is or holds
    a symbolic link: `users_link`), which do not count towards `keep_n` either. Returns the deleted paths."""
    if keep_n < 0:
        return []
    keep = {Path(p).resolve() for p in protect}
    minors = [(s, p) for s, p in list_checkpoints(ckpt_dir)
              if not (major > 0 and s % major == 0) and users_link(p) is None]
    doomed = [p for _, p in minors[:max(len(minors) - keep_n, 0)] if p.resolve() not in keep]
    for p in doomed:
        delete_checkpoint(p)
    return doomed


def remove_tree_quietly(path: str | os.PathLike) -> None:
    """Remove a temp directory after a failed write; errors are ignored (the next start sweeps it)."""
    try:
        remove_tree(path, point="ckpt.abort")
    except (OSError, FileSystemError):  # FileSystemError: it holds a link of the user's, which stays
        pass
