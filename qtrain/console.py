"""The console: every line qtrain prints goes through `write`, so a console that went away is noticed in one place.

A closed pipe (`qtrain train | head`, or a `tee` that the same Ctrl-C ended) fails a write with EPIPE; a terminal
that was closed (the SIGHUP of closing it) fails it with EIO. Python ignores SIGPIPE, so either arrives as an
exception from whatever print comes next, and would end a run there, without a checkpoint. Here such a stream is
*lost* instead: its file descriptor is pointed at /dev/null (what the Python docs advise for SIGPIPE, so that the
interpreter's own flush at exit cannot fail either), later writes to it are dropped, and `lost()` names it. A
training run takes that as a stop request (`qtrain.train.stop`: the step finishes, a checkpoint is written, the
run exits); its JSON log is a file, not the console, and keeps every line.
"""
from __future__ import annotations

import errno
import os
import sys
from typing import IO

GONE = (errno.EPIPE, errno.EIO)  # the reader of a pipe exited; the terminal was closed

_lost: dict[int, str] = {}  # file descriptor -> what went away, e.g. "stdout (broken pipe)"


def is_gone(e: BaseException) -> bool:
    """Whether an error says the console's reader is gone (as opposed to, say, a full disk behind a redirect)."""
    return isinstance(e, OSError) and e.errno in GONE


def _fd(stream: IO[str]) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):  # an in-memory stream (tests), or a closed one
        return None


def write(text: str, stream: IO[str] | None = None) -> bool:
    """Write and flush `text` (to stdout by default); False when the stream is gone (it is then lost: see the
    module docstring). Other errors are raised."""
    stream = sys.stdout if stream is None else stream
    if stream is None:  # no console at all (pythonw, a daemon that closed it)
        return False
    fd = _fd(stream)
    if fd is not None and fd in _lost:
        return False
    try:
        stream.write(text)
        stream.flush()
    except OSError as e:
        if not is_gone(e):
            raise
        lose(stream, e)
        return False
    return True


def lose(stream: IO[str], error: OSError) -> None:
    """Point a gone stream's file descriptor at /dev/null and remember it (what `write` does on EPIPE / EIO)."""
    fd = _fd(stream)
    if fd is None:
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)
    name = {1: "stdout", 2: "stderr"}.get(fd, f"file descriptor {fd}")
    _lost.setdefault(fd, f"{name} ({os.strerror(error.errno or errno.EPIPE).lower()})")
    try:
        stream.flush()  # what was buffered for the gone reader drains into /dev/null
    except (OSError, ValueError):
        pass


def lost() -> list[str]:
    """The streams that went away, e.g. ["stdout (broken pipe)"]; empty while the console is there."""
    return list(_lost.values())


def flush_standard_streams() -> None:
    """Flush stdout and stderr, as the interpreter does at exit, but a gone one is lost here instead of failing
    there (a message about an ignored exception, and exit code 120)."""
    for stream in (sys.stdout, sys.stderr):
        write("", stream)
