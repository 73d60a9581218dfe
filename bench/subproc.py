"""Kinds that drive another program (`qtrain train`, llm.q, pytest, the HF baseline) run it through here: its
output goes to the case's output line by line, and it can be stopped early as a whole process group."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Finished:
    returncode: int
    stopped: bool  # `stop` said so and the group was terminated
    lines: list[str] = field(default_factory=list)

    def last(self, n: int = 1) -> str:
        """The last n non-empty output lines (warnings left out), for error messages."""
        keep = [x for x in self.lines if x.strip() and "warn" not in x.lower()]
        return " | ".join(keep[-n:])


def stream(cmd: list[str], *, cwd: str | None = None, env: dict[str, str] | None = None,
           stop: Callable[[], bool] | None = None, echo: Callable[[str], bool] | None = None, poll_s: float = 0.5,
           grace_s: float = 5.0) -> Finished:
    """Run `cmd` in a new process group, copying its stdout and stderr to ours (the lines `echo` accepts, all by
    default; every line is kept in the result); every `poll_s` ask `stop()` and
    terminate the group (SIGTERM, SIGKILL after grace_s) when it says so. A SIGTERM to this process (the
    harness's timeout) kills the group first: it is not in ours, so the harness's kill would miss it."""
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         errors="replace", start_new_session=True)
    lines: list[str] = []

    def pump() -> None:
        for line in p.stdout:
            lines.append(line.rstrip("\n"))
            if echo is None or echo(line):
                sys.stdout.write(line)
                sys.stdout.flush()
    t = threading.Thread(target=pump, daemon=True)
    t.start()
    stopped = False

    def on_term(signum, frame):  # noqa: ARG001 - the harness stops this case: stop the program's group too
        _signal(p, signal.SIGKILL)
        sys.exit(128 + signum)
    main = threading.current_thread() is threading.main_thread()  # only there can a handler be set
    old = signal.signal(signal.SIGTERM, on_term) if main else None
    try:
        while p.poll() is None:
            if stop is not None and not stopped and stop():
                stopped = True
                _signal(p, signal.SIGTERM)
                try:
                    p.wait(grace_s)
                except subprocess.TimeoutExpired:
                    _signal(p, signal.SIGKILL)
            time.sleep(poll_s)
    finally:
        if p.poll() is None:  # we are being stopped ourselves: take the group with us
            _signal(p, signal.SIGKILL)
        p.wait()
        _signal(p, signal.SIGKILL)  # anything it left running in its group
        t.join(timeout=10)
        if main:
            signal.signal(signal.SIGTERM, old)
    return Finished(p.returncode, stopped, lines)


def _signal(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
