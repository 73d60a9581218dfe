"""How long a run takes to start, and a console that says it is compiling rather than hanging.

The first step of a compiled run includes compiling the block (seconds with a warm compile cache, a minute or
more on a machine that never compiled those shapes): `Compiling` shows a line that counts the seconds on a
terminal (one line when the console is a file), and `startup_times` measures from the process's start (the
kernel's record of it, so the interpreter's and torch's imports count) for the run log's `startup` event, with
the end of each start-up phase (`mark`: imports, device, preflight, then the model's weights, blocks and the rest of
it, ready) so a slow start says where its seconds went.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import IO

from qtrain import console

_IMPORTED = time.time()  # the fallback start where /proc is not there


def process_start() -> float:
    """The wall-clock time this process started (Linux: /proc/self/stat), else when this module was imported."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, after the command name
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return _IMPORTED


def seconds_since_start() -> float:
    return time.time() - process_start()


_PHASES: dict[str, float] = {}  # this process's start-up timeline: phase -> seconds since the process started


def begin_timeline() -> None:
    """A run starts in this process (a process may run several through the API): its timeline starts over, and
    the imports end here."""
    _PHASES.clear()
    mark("imports")


def mark(phase: str) -> None:
    """Note that start-up `phase` ended now, so the `startup` event says where the seconds before the first step
    went."""
    _PHASES[phase] = round(seconds_since_start(), 2)


def phases() -> dict[str, float]:
    """The phases marked so far, in the order they ended, as seconds since the process started."""
    return dict(_PHASES)


class Compiling:
    """`with Compiling(enabled, what):` around the first step: on a terminal a line `compiling WHAT ... N s` redrawn
    each second by a daemon thread and erased at the end; on another console one line at the start; nothing when
    not `enabled` (an eager run, another rank, --quiet)."""

    def __init__(self, enabled: bool, what: str, stream: IO[str] | None = None, interval_s: float = 1.0):
        self.enabled, self.what, self.interval_s = enabled, what, interval_s
        self.stream = stream if stream is not None else sys.stdout
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def __enter__(self) -> "Compiling":
        if not self.enabled:
            return self
        self._t0 = time.monotonic()
        if self._tty:
            self._thread = threading.Thread(target=self._tick, name="qtrain-compiling", daemon=True)
            self._thread.start()
        else:
            console.write(f"compiling {self.what} ...\n", self.stream)
        return self

    def _tick(self) -> None:
        while not self._stop.wait(self.interval_s):
            console.write(f"\r\x1b[Kcompiling {self.what} ... {time.monotonic() - self._t0:.0f} s", self.stream)

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            console.write("\r\x1b[K", self.stream)
