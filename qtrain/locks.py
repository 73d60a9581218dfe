"""Which live process writes a folder: an exclusive lock per output folder, so two processes never share one.

    with hold([Target(ckpt_dir, "--checkpoint-dir"), Target(out_dir, "--out-dir")]):
        ...   # a second `qtrain` on the same folders is refused, naming this process

A folder's lock is `fcntl.flock(LOCK_EX | LOCK_NB)` on `.qtrain-lock` inside it (a file's, e.g. a log's, is
`.NAME.qtrain-lock` beside it). The kernel releases it when the process ends, however it ends (SIGKILL, a
machine restart), so a lock file left behind is stale and simply locked again; nothing ever deletes a lock file
another process holds. The holder writes who it is into the file (host, pid, start time, command line), and a
refused process names it: "--checkpoint-dir ckpt/run: in use by qtrain pid 1234 on host X since ...".

A clean release deletes the lock file while still holding it, and a process that got the lock checks that the
path still names the file it locked (else it locks the new one): a holder deleting its file can never let two
processes in. Directories the lock had to create are removed again if they are still empty (a run refused
later in its checks leaves nothing). Locks are per process and re-entrant: a folder locked twice by one process
(the out-dir and checkpoint-dir being one folder) counts, and is released with the last.

On a filesystem without flock (Lustre mounted without `-o flock` answers ENOSYS) nothing can be locked: the
lock is then held in name only and says so in `Locks.notes`.
"""
from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import shlex
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from qtrain.fsio import FileSystemError, fault_point, shorten

LOCK_NAME = ".qtrain-lock"
HOLDER_MAX_BYTES = 4096  # a holder record is a few hundred bytes; never read more of a lock file
_UNSUPPORTED = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL)


class PathInUseError(FileSystemError):
    """Another live process holds the lock of an output folder; the message names it and what to do."""


@dataclass(frozen=True)
class Target:
    """A path to lock: a folder (its lock file inside it) or, with `is_file`, a file (the lock file beside it)."""
    path: str
    what: str  # how the user named it, e.g. "--checkpoint-dir"
    is_file: bool = False

    def lock_file(self) -> Path:
        p = Path(os.path.abspath(self.path))
        return p.parent / f".{p.name}{LOCK_NAME}" if self.is_file else p / LOCK_NAME


class _Held:
    """One lock file this process holds: its descriptor (None: flock unsupported there), and how often taken."""

    def __init__(self, path: Path, fd: int | None, created: list[Path]) -> None:
        self.path, self.fd, self.created, self.count = path, fd, created, 1


_HELD: dict[str, _Held] = {}  # this process's locks, by lock-file path


def holder_record() -> dict[str, object]:
    """Who holds a lock: what a refused process shows the user."""
    argv = list(sys.argv)
    if argv and os.path.basename(argv[0]) in ("main.py", "__main__.py", "qtrain"):
        argv[0] = "qtrain"
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": shorten(" ".join(shlex.quote(a) for a in argv), 160)}


def _read_holder(fd: int) -> dict[str, str] | None:
    """The holder record in a lock file (None: being written, or not one: a refusal then says less). Every
    field is cut short: the file is another process's, its contents are never echoed whole."""
    try:
        rec = json.loads(os.pread(fd, HOLDER_MAX_BYTES, 0).decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(rec, dict) or "pid" not in rec:
        return None
    return {k: shorten(str(rec.get(k, "?")), n) for k, n in (("pid", 20), ("host", 80), ("since", 40),
                                                              ("command", 240))}


def _refusal(target: Target, holder: dict[str, str] | None) -> PathInUseError:
    where = f"{target.what} {shorten(target.path)}"
    if holder is None:
        return PathInUseError(f"{where}: in use by another qtrain process (it has not said which yet); two processes "
                              f"must not write one run's files: wait for it to end, then run this again")
    pid, host = holder["pid"], holder["host"]
    return PathInUseError(
        f"{where}: in use by qtrain pid {pid} on host {host} since {holder['since']} (started as "
        f"`{holder['command']}`); two processes must not write one run's files: wait for it to end, or stop it "
        f"(kill -INT {pid} on {host}, or Ctrl-C where it runs; a training run writes a checkpoint first), then run "
        f"this again")


def _make_dirs(d: Path) -> list[Path]:
    """mkdir -p, returning the directories it created (deepest last)."""
    missing = []
    p = d
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    created = []
    for m in reversed(missing):
        try:
            m.mkdir()
            created.append(m)
        except FileExistsError:
            pass
    return created


def _open_lock_file(path: Path, target: Target) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EISDIR):
            raise FileSystemError(f"{target.what} {shorten(target.path)}: {path.name} there is not qtrain's lock file "
                                  f"(a symbolic link or a directory); remove it") from None
        raise FileSystemError(f"{target.what} {shorten(target.path)}: cannot create its lock file {path.name} "
                              f"({e.strerror})") from None


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _lock(path: Path, target: Target, notes: list[str]) -> int | None:
    """An open descriptor of `path` holding its flock (None: the filesystem has no flock; a note says so)."""
    while True:
        fd = _open_lock_file(path, target)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise _refusal(target, holder) from None
        except OSError as e:
            os.close(fd)
            if e.errno not in _UNSUPPORTED:
                raise
            path.unlink(missing_ok=True)  # nobody can hold it there: leave no file that looks like a lock
            notes.append(f"{target.what} {shorten(target.path)}: the filesystem does not support file locks "
                         f"(flock: {e.strerror}); nothing stops a second process from writing there")
            return None
        if _same_file(fd, path):
            return fd
        os.close(fd)  # its holder deleted it on release after we opened it: lock the file there now


def _acquire(target: Target, notes: list[str]) -> str:
    """Take `target`'s lock (see the module docstring); returns the key to release it by."""
    path = target.lock_file()
    key = str(Path(os.path.realpath(path.parent)) / path.name)
    if key in _HELD:
        _HELD[key].count += 1
        return key
    if not target.is_file and os.path.lexists(target.path) and not os.path.isdir(target.path):
        raise FileSystemError(f"{target.what} {shorten(target.path)}: exists and is not a directory")
    created = _make_dirs(path.parent)
    fd = None
    try:
        fd = _lock(path, target, notes)
        if fd is not None:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(holder_record()).encode("utf-8") + b"\n", 0)
    except BaseException:
        if fd is not None:  # held: the file is this process's to delete
            path.unlink(missing_ok=True)
            os.close(fd)
        _remove_empty(created)
        raise
    _HELD[key] = _Held(path, fd, created)
    fault_point("lock.held")
    return key


def _remove_empty(created: list[Path]) -> None:
    for d in reversed(created):
        try:
            d.rmdir()
        except OSError:
            return


def _release(key: str) -> None:
    held = _HELD.get(key)
    if held is None:
        return
    held.count -= 1
    if held.count > 0:
        return
    del _HELD[key]
    if held.fd is not None:
        try:
            if _same_file(held.fd, held.path):
                held.path.unlink()  # still holding it: no other process can hold this file now
        except OSError:
            pass
        os.close(held.fd)
    _remove_empty(held.created)


class Locks:
    """The locks of several paths, taken all or none; `release` (or the end of a `with`) gives them back.
    A Locks never leaves its process: pickling one (to hand to a worker) is an error, since a copy would
    release what it does not hold."""

    def __init__(self, keys: list[str], notes: list[str]) -> None:
        self._keys = keys
        self.notes = notes

    def release(self) -> None:
        while self._keys:
            _release(self._keys.pop())

    def __enter__(self) -> "Locks":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __reduce__(self):
        raise TypeError("a Locks stays in the process that took it")


def hold(targets: list[Target]) -> Locks:
    """Lock every target, in order; PathInUseError naming the live process that holds one (nothing is held
    then, and the folders made on the way are gone again)."""
    keys: list[str] = []
    notes: list[str] = []
    try:
        for t in targets:
            keys.append(_acquire(t, notes))
    except BaseException:
        Locks(keys, notes).release()
        raise
    return Locks(keys, notes)
