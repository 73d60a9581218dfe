"""Files qtrain writes: atomic writes, temp names, leftovers of dead processes, free space, fault points.

The rules every writer in qtrain follows (checkpoints, HF exports, run markers):

* A file is written under a temp name in its final directory (`.NAME.tmp-HOST-PID`), fsynced, and renamed
  onto its name: a reader sees the old file or the new one, never half of one.
* A directory is deleted by renaming it out of its namespace first (`step_N.del-HOST-PID`), then removing
  it file by file: a kill mid-delete leaves a name nothing reads, swept at the next start.
* Temp names carry the host and process id of their writer, so `is_stale` can tell the leftovers of a dead
  process from the files of a live one (`sweep_temp_files`).
* Before a large write, `ensure_free_space` compares the bytes it needs with the free bytes of the
  filesystem and raises `DiskSpaceError` naming both, instead of failing half-way with ENOSPC.

`fault_point(name)` marks each moment between two file operations. It does nothing unless the test-only
environment variable QTRAIN_FAULT is set to `PATTERN:N` (an fnmatch pattern of point names and a 1-based
count): then the process kills itself with SIGKILL at the N-th point whose name matches, which is how the
fault-injection suite (tests/reliability) stops a run inside each write, rename and unlink window. With
QTRAIN_FAULT_ACTION=stop it stops itself with SIGSTOP there instead (a test then holds a live process at that point,
and lets it go on with SIGCONT).
QTRAIN_FAULT_TRACE=FILE appends the name of every point reached to FILE (to enumerate the windows).
"""
from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import signal
import socket
import stat
from pathlib import Path
from typing import Any, Callable

# ---------------------------------------------------------------------------------------------- fault points

_fault: dict[str, Any] | None = None


def _fault_config() -> dict[str, Any]:
    global _fault
    if _fault is None:
        spec = os.environ.get("QTRAIN_FAULT", "")
        pattern, _, n = spec.rpartition(":")
        _fault = {"pattern": pattern if spec else None, "n": int(n) if spec else 0, "hits": 0,
                  "trace": os.environ.get("QTRAIN_FAULT_TRACE") or None,
                  "signal": signal.SIGSTOP if os.environ.get("QTRAIN_FAULT_ACTION") == "stop" else signal.SIGKILL}
    return _fault


def fault_point(name: str) -> None:
    """A moment between two file operations (see the module docstring); free unless QTRAIN_FAULT is set."""
    cfg = _fault_config()
    if cfg["trace"]:
        with open(cfg["trace"], "a", encoding="utf-8") as f:
            f.write(name + "\n")
    if cfg["pattern"] and fnmatch.fnmatchcase(name, cfg["pattern"]):
        cfg["hits"] += 1
        if cfg["hits"] == cfg["n"]:
            os.kill(os.getpid(), cfg["signal"])


# ---------------------------------------------------------------------------------------------- errors

class FileSystemError(ValueError):
    """A path qtrain cannot write as asked (full, read-only, a file where a directory should be); names it."""


class DiskSpaceError(FileSystemError):
    """Not enough free space for a write; the message names the path, the bytes needed and the bytes free."""


def describe_write_error(e: BaseException) -> str:
    """The cause of a failed write in a few words (an OSError's strerror; what safetensors' own error wraps)."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return re.sub(r"^Error while serializing: (I/O error: )?", "", str(e)).replace(" (os error ", " (errno ")


def format_bytes(n: int | float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} bytes"


# ---------------------------------------------------------------------------------------------- durability

def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or directory: a rename is only durable once the bytes and the directory entries are."""
    fd = os.open(Path(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------- owner tags

def owner_tag() -> str:
    """`HOST-PID` of this process: what temp names carry so a later start can tell whether their writer lives."""
    host = re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}"


_TAG = re.compile(r"^(?P<host>[A-Za-z0-9_]+)-(?P<pid>\d+)$")


def is_stale(tag: str) -> bool:
    """Whether the writer named by a tag is gone: another host's, an unparsable one, this process's own
    (a pid recycled after a restart), or a pid of this host that no longer runs."""
    m = _TAG.match(tag)
    if m is None:
        return True
    here, pid = owner_tag().rsplit("-", 1)[0], int(m.group("pid"))
    if m.group("host") != here or pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    return False


def temp_path(final: str | os.PathLike) -> Path:
    """Where `final` is written before the rename that publishes it: a hidden sibling with this owner's tag."""
    final = Path(final)
    return final.parent / f".{final.name}.tmp-{owner_tag()}"


_TEMP_FILE = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<tag>[A-Za-z0-9_]+-\d+)$")


def sweep_temp_files(directory: str | os.PathLike) -> list[Path]:
    """Remove temp files (`.NAME.tmp-HOST-PID`) that dead writers left in `directory`; returns them."""
    removed = []
    d = Path(directory)
    if not d.is_dir():
        return removed
    for p in d.iterdir():
        m = _TEMP_FILE.match(p.name)
        if m and p.is_file() and not p.is_symlink() and is_stale(m.group("tag")):
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed


# ---------------------------------------------------------------------------------------------- writing

def atomic_write(path: str | os.PathLike, write: Callable[[Path], None], *, point: str = "file") -> Path:
    """`write(tmp)` creates the temp file; it is fsynced and renamed onto `path`. On any error the temp file
    is removed and `path` is left as it was. Fault points: `<point>.tmp` (written, not yet renamed) and
    `<point>.done` (renamed)."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        write(tmp)
        fsync_path(tmp)
        fault_point(f"{point}.tmp")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)
    fault_point(f"{point}.done")
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, point: str = "file") -> Path:
    return atomic_write(path, lambda tmp: tmp.write_bytes(data), point=point)


def atomic_write_json(path: str | os.PathLike, obj: Any, *, point: str = "file") -> Path:
    return atomic_write_bytes(path, (json.dumps(obj, indent=2, allow_nan=True) + "\n").encode("utf-8"), point=point)


def read_json(path: str | os.PathLike) -> Any | None:
    """A JSON file qtrain wrote, or None when it is missing or unreadable (a marker that is not there)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def remove_tree(path: str | os.PathLike, *, point: str = "rmtree") -> None:
    """Delete a directory tree file by file (fault point `<point>.unlink` after each file): callers first
    rename the tree out of its namespace, so a kill half-way leaves only a name that is swept later."""
    path = Path(path)
    if not path.exists():
        return
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files:
            os.unlink(os.path.join(root, name))
            fault_point(f"{point}.unlink")
        for name in dirs:
            p = os.path.join(root, name)
            if os.path.islink(p):
                os.unlink(p)
            else:
                os.rmdir(p)
    os.rmdir(path)


# ---------------------------------------------------------------------------------------------- inputs

class InputError(ValueError):
    """An input file qtrain refuses to read (not a regular file, too large, too deeply nested); names it."""


SHOWN_CHARS = 200


def shorten(value: Any, limit: int = SHOWN_CHARS) -> str:
    """`value` as text for a one-line message, cut to `limit` characters: a hostile value is never echoed whole."""
    text = value if isinstance(value, str) else repr(value)
    text = text.replace("\n", "\\n")
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def check_regular_file(path: str | os.PathLike, what: str) -> Path:
    """Refuse anything but a regular file (a FIFO or device would block or never end a read; a directory
    cannot be read); symlinks to regular files are fine. Returns the path."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise InputError(f"{what} {shorten(str(path))}: no such file") from None
    except OSError as e:
        raise InputError(f"{what} {shorten(str(path))}: cannot be read ({describe_write_error(e)})") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file (a pipe, socket or device)"
        raise InputError(f"{what} {shorten(str(path))}: is {kind}")
    return p


def read_bounded(path: str | os.PathLike, what: str, max_bytes: int) -> bytes:
    """The bytes of a small input file (a config, a manifest), refused when it is not a regular file or is
    larger than `max_bytes`: a hostile file never makes qtrain read gigabytes or block on a pipe."""
    p = check_regular_file(path, what)
    size = os.stat(p).st_size
    if size > max_bytes:
        raise InputError(f"{what} {shorten(str(path))}: {format_bytes(size)} is larger than the "
                         f"{format_bytes(max_bytes)} such a file may have")
    try:
        with open(p, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise InputError(f"{what} {shorten(str(path))}: cannot be read ({describe_write_error(e)})") from None
    if len(data) > max_bytes:
        raise InputError(f"{what} {shorten(str(path))}: grew past {format_bytes(max_bytes)} while being read")
    return data


# ---------------------------------------------------------------------------------------------- checks

def existing_ancestor(path: str | os.PathLike) -> Path:
    """`path` itself or its nearest ancestor that exists (where a mkdir of `path` would start)."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes (for this user) of the filesystem that holds, or would hold, `path`."""
    return shutil.disk_usage(existing_ancestor(path)).free


def ensure_free_space(path: str | os.PathLike, need: int, what: str) -> None:
    """Raise DiskSpaceError when the filesystem of `path` has fewer than `need` free bytes."""
    free = free_bytes(path)
    if free < need:
        raise DiskSpaceError(f"{what} needs {format_bytes(need)}, but {existing_ancestor(path)} has only "
                             f"{format_bytes(free)} free; free some space or choose another directory")


def check_writable_dir(path: str | os.PathLike, option: str) -> None:
    """Refuse a directory path qtrain could not create or write into: a file on the way, or no write
    permission where it would be created. Nothing is created here."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise FileSystemError(f"{option} {path}: exists and is not a directory")
    anc = existing_ancestor(p)
    if not anc.is_dir():
        raise FileSystemError(f"{option} {path}: {anc} is a file, so the directory cannot be created")
    if not _can_write(anc):
        where = "is not writable" if anc == Path(os.path.abspath(p)) else f"cannot be created ({anc} is not writable)"
        raise FileSystemError(f"{option} {path}: {where}")


def check_writable_file(path: str | os.PathLike, option: str) -> None:
    """Refuse a file path qtrain could not create or append to (a directory there, or no permission)."""
    p = Path(path)
    if p.is_dir():
        raise FileSystemError(f"{option} {path}: is a directory, not a file")
    if p.exists():
        if not _can_write(p):
            raise FileSystemError(f"{option} {path}: is not writable")
        return
    check_writable_dir(p.parent, f"{option} {path}: its folder")


def _can_write(p: Path) -> bool:
    """Write permission as this process's effective user has it (root passes unless the filesystem is
    read-only)."""
    mode = os.W_OK | (os.X_OK if p.is_dir() else 0)
    if os.access in os.supports_effective_ids:
        return os.access(p, mode, effective_ids=True)
    return os.access(p, mode)
