"""A real `qtrain` process held still at a named moment, so a test can act on a live run deterministically.

    env = paused_at("ckpt.saved", 1)                # the process SIGSTOPs itself there (qtrain.fsio.fault_point)
    p = qtrain_popen(argv, cwd=root, **env)
    pid = wait_stopped(p)                          # it is alive, holds what it holds, and does nothing
    ...                                            # a second process, a signal (pending until it goes on)
    os.kill(pid, signal.SIGCONT)

A stopped process keeps its locks, open files and pending signals; SIGCONT lets it go on from where it stood.
"""
from __future__ import annotations

import os
import subprocess
import time


def paused_at(point: str, n: int = 1) -> dict[str, str]:
    """The environment that stops a qtrain process the n-th time it reaches fault point `point`."""
    return {"QTRAIN_FAULT": f"{point}:{n}", "QTRAIN_FAULT_ACTION": "stop"}


def is_stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "State:\tT" in f.read()
    except FileNotFoundError:
        return False


def wait_stopped(p: subprocess.Popen | int, timeout: float = 300) -> int:
    """Wait until the process (a Popen, or a pid of this machine) has stopped itself; returns its pid. Fails when
    it ends first (it never reached the point) or the timeout passes."""
    pid = p if isinstance(p, int) else p.pid
    deadline = time.monotonic() + timeout
    while not is_stopped(pid):
        if isinstance(p, subprocess.Popen) and p.poll() is not None:
            out, err = p.communicate()
            raise AssertionError(f"pid {pid} exited {p.returncode} before stopping: {(out or '')[-1000:]}"
                                 f"{(err or '')[-3000:]}")
        assert time.monotonic() < deadline, f"pid {pid} did not stop within {timeout} s"
        time.sleep(0.02)
    return pid


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(c) for c in out]


def wait_child_stopped(parent: subprocess.Popen, timeout: float = 300) -> int:
    """The pid of the first child of `parent` (a `--gpus N` launcher's worker) that stopped itself."""
    deadline = time.monotonic() + timeout
    while True:
        stopped = [c for c in children(parent.pid) if is_stopped(c)]
        if stopped:
            return stopped[0]
        if parent.poll() is not None:
            out, err = parent.communicate()
            raise AssertionError(f"launcher exited {parent.returncode} before a worker stopped: {(err or '')[-3000:]}")
        assert time.monotonic() < deadline, f"no worker of {parent.pid} stopped within {timeout} s"
        time.sleep(0.05)
