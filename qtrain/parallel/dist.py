"""Process groups and launching: one object that knows this rank, the world and the device.

`qtrain train --gpus N` starts N local worker processes itself (`launch_local`): NCCL on GPUs, gloo on
CPU (how CI tests data parallelism). Under `torchrun` (one node or several) the launcher's environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) is used as it is.

What happens when a rank fails (tests/parallel/test_dist.py):

* A hung or dead rank: every collective has a timeout (`--collective-timeout`). Each rank records its
  progress (`mark_progress`) and a heartbeat in the rendezvous store, so the ranks that time out name the
  rank that stopped answering (`RankFailure`), instead of waiting forever.
* `launch_local` hosts the store itself (a dead rank 0 does not take it along), watches its workers, and
  when one exits abnormally stops the others and reports the first failure once: a user error
  (`ValueError` of qtrain) as the same one-line message a single process gives, a killed rank by its signal.
* Workers die with their launcher (Linux `PR_SET_PDEATHSIG`, and a check of the parent at start): killing
  `qtrain train --gpus N` never leaves orphans training on.
* SIGINT / SIGTERM / SIGHUP to the launcher reach the workers through the store (`stop_signal`); a second
  SIGINT or SIGTERM kills them at once. SIGUSR1 asks them for a checkpoint after their step, and they go on
  (`checkpoint_requests`), as torchelastic's agent forwards signals to its workers.
"""
from __future__ import annotations

import ctypes
import datetime
import json
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from qtrain import console
from qtrain.cpu_threads import start_thread_pool

DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
STORE_ENV = "QTRAIN_STORE"  # host:port of a store hosted by `launch_local` (workers connect as clients)
HEARTBEAT_S = 2.0
_KEY = "qtrain/"


class DeviceError(ValueError):
    """A device that was asked for and is not there (e.g. --device cuda on a machine without CUDA)."""


class RankFailure(RuntimeError):
    """Another rank failed, hung or died; the message names it. Not a user error: exit code 1."""
    exit_code = 1


class LaunchError(ValueError):
    """A user error that a launched worker reported (the same message one process would print)."""


@dataclass
class DistContext:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    store: Any = field(default=None, repr=False)  # client of the rendezvous store (None: one process)
    control: Any = field(default=None, repr=False)  # a gloo group for small host-side agreements

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    # ---- the few collectives the trainer itself needs (managers, weights and optimizer use comm.Communicator) ----
    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    def all_gather_into_tensor(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        """Gather equal shards into `out`; `shard` may be a view into `out` at this rank's slice."""
        if self.world > 1:
            dist.all_gather_into_tensor(out, shard.clone() if _overlaps(out, shard) and out.device.type == "cpu"
                                        else shard)

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def broadcast_object(self, obj: Any) -> Any:
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (host-side, over the control group: no device sync)."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def max_int(self, value: int) -> int:
        """The largest `value` over the ranks, on every rank (host-side; e.g. a signal that reached only some)."""
        if self.world == 1:
            return value
        t = torch.tensor([int(value)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        return int(t.item())

    # ---- failure handling ----
    def mark_progress(self, step: int) -> None:
        """Record that this rank reached `step` (read by `diagnose` on the other ranks)."""
        if self.store is not None:
            self.store.set(f"{_KEY}progress/{self.rank}", str(step))

    def stop_signal(self) -> int | None:
        """The signal the launcher got (SIGINT / SIGTERM / SIGHUP) when it asked the workers to stop, else None."""
        if self.store is None or not self.store.check([f"{_KEY}stop"]):
            return None
        return int(self.store.get(f"{_KEY}stop").decode())

    def checkpoint_requests(self) -> int:
        """How many SIGUSR1s the launcher got (each asks for a checkpoint after the step; training goes on)."""
        if self.store is None:
            return 0
        return int(self.store.add(f"{_KEY}checkpoint", 0))

    def diagnose(self, error: BaseException) -> RankFailure:
        """A RankFailure naming the ranks that stopped answering (stale heartbeat) or fell behind."""
        return RankFailure(describe_failure(self.store, self.rank, self.world, error))


def describe_failure(store: Any, rank: int, world: int, error: BaseException) -> str:
    what = " ".join(str(error).split())
    what = re.sub(r"^\[[^\]]*\]\s*", "", what)[:200]
    if store is None:
        return f"rank {rank}: a collective operation failed ({what})"
    silent, progress = [], {}
    deadline = time.monotonic() + 5 * HEARTBEAT_S  # a peer that just died: wait until its heartbeat is stale
    try:
        while True:
            now = time.time()
            silent = [r for r in range(world) if r != rank and _stale(store, r, now)]
            if silent or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        for r in range(world):
            if r != rank:
                p = _get(store, f"{_KEY}progress/{r}")
                progress[r] = int(p) if p is not None else -1
    except Exception:  # the store itself is gone (its host died)
        return f"rank {rank}: a collective operation failed and the rendezvous store does not answer ({what})"
    mine = _get(store, f"{_KEY}progress/{rank}")
    mine = int(mine) if mine is not None else -1
    if silent:
        who = ", ".join(f"rank {r}" for r in silent)
        return (f"{who} stopped responding (no heartbeat for over {4 * HEARTBEAT_S:.0f} s: stopped, hung or dead); "
                f"rank {rank} gave up at step {mine} ({what})")
    behind = [r for r, p in progress.items() if p < mine]
    if behind:
        who = ", ".join(f"rank {r} (at step {progress[r]})" for r in behind)
        return f"{who} did not reach step {mine} within the collective timeout ({what})"
    return f"rank {rank}: a collective operation failed at step {mine} ({what})"


def _stale(store: Any, r: int, now: float) -> bool:
    beat = _get(store, f"{_KEY}alive/{r}")
    return beat is None or now - float(beat) > 4 * HEARTBEAT_S


def _get(store: Any, key: str) -> str | None:
    if not store.check([key]):
        return None
    return store.get(key).decode()


def is_collective_error(e: BaseException) -> bool:
    """A failure of the communication backend (timeout, closed connection), as opposed to a bug or user error."""
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    return isinstance(e, RuntimeError) and bool(re.search(
        r"gloo|nccl|timed out|timeout|connection (closed|reset|refused)|broken pipe|pair closure", str(e), re.I))


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def check_device(requested: str) -> None:
    """DeviceError for a device that is not there (before anything is built)."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise DeviceError("--device cuda: no CUDA device is visible (use --device cpu, or check CUDA_VISIBLE_DEVICES "
                          "and the driver)")


def pick_device(requested: str, local_rank: int) -> torch.device:
    check_device(requested)
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise DeviceError(f"local rank {local_rank} has no GPU: {torch.cuda.device_count()} visible")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_distributed(requested_device: str = "auto", *,
                     timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> DistContext:
    """Join the process group described by the environment, or run as a single process. Collectives time
    out after `timeout_s` seconds (then `DistContext.diagnose` names the rank that stopped answering)."""
    start_thread_pool()  # before any op whose result matters (cpu_threads.py says why)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    device = pick_device(requested_device, local_rank)
    store = control = None
    if world > 1:
        timeout = datetime.timedelta(seconds=timeout_s)
        backend = "nccl" if device.type == "cuda" else "gloo"
        kw: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
        if os.environ.get(STORE_ENV):  # launched by launch_local: its store, this process a client
            host, port = os.environ[STORE_ENV].rsplit(":", 1)
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
            pg_store = dist.PrefixStore("pg", store)
            if not dist.is_initialized():
                dist.init_process_group(backend=backend, store=pg_store, rank=rank, world_size=world,
                                        timeout=timeout, **kw)
        else:
            if not dist.is_initialized():
                dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=timeout, **kw)
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=timeout)
        control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
        _start_heartbeat(store.host, store.port, rank)
    return DistContext(rank=rank, world=world, local_rank=local_rank, device=device, store=store, control=control)


_HEARTBEAT: list[tuple[threading.Event, threading.Thread]] = []  # this process's, stopped by `shutdown`


def _start_heartbeat(host: str, port: int, rank: int) -> None:
    """A daemon thread that stamps `alive/<rank>` every HEARTBEAT_S through its own store connection: a
    stopped or dead rank's stamp goes stale. `shutdown` stops and joins it, so no store call of it is in flight
    while the process tears down its process group and exits."""
    key = f"{_KEY}alive/{rank}"
    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=30))
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            try:
                store.set(key, repr(time.time()))
            except Exception:
                return
            stop.wait(HEARTBEAT_S)

    store.set(key, repr(time.time()))
    thread = threading.Thread(target=beat, name="qtrain-heartbeat", daemon=True)
    thread.start()
    _HEARTBEAT.append((stop, thread))


def shutdown() -> None:
    """The end of a rank's run: stop the heartbeat, then leave the process group."""
    while _HEARTBEAT:
        stop, thread = _HEARTBEAT.pop()
        stop.set()
        thread.join(timeout=2 * HEARTBEAT_S)
    if dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_launcher() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


# ---------------------------------------------------------------------------------------------- launch_local

USER_ERROR_EXIT = 2  # the exit code of a user error (what `qtrain` returns for a qtrain ValueError)


class ReportedExit(RuntimeError):
    """A worker's failure or stop, raised again by the launcher with the worker's message, label and exit code
    (a stop after a signal, a non-finite streak, a rank failure)."""

    def __init__(self, message: str, exit_code: int, label: str = "error") -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.label = label


def _die_with_parent(parent: int) -> None:
    """Ask Linux to SIGKILL this process when its parent (the launcher) dies; and if it is already gone, go."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    if os.getppid() != parent:
        os._exit(1)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _worker(local_rank: int, world: int, store: str, parent: int, errdir: str, fn: Callable[..., Any],
            args: tuple) -> None:
    _die_with_parent(parent)
    host, port = store.rsplit(":", 1)
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world), MASTER_ADDR=host,
                      MASTER_PORT=port)
    os.environ[STORE_ENV] = store
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    code = 0
    try:
        fn(*args)
    except BaseException as e:  # what the launcher needs to print one line, then exit with a code
        user = isinstance(e, ValueError) and type(e).__module__.startswith("qtrain.")
        code = USER_ERROR_EXIT if user else int(getattr(e, "exit_code", 1))
        report = {"code": code, "label": getattr(e, "label", "error"), "message": str(e),
                  "expected": user or hasattr(e, "exit_code")}
        with open(os.path.join(errdir, f"rank{local_rank}.json"), "w", encoding="utf-8") as f:
            json.dump(report, f)
        if not report["expected"]:
            console.write(traceback.format_exc(), sys.stderr)
    console.flush_standard_streams()
    os._exit(code)


def launch_local(fn: Callable[..., Any], nprocs: int, *args: Any, grace_s: float = 10.0) -> None:
    """Run fn(*args) in `nprocs` fresh processes that form one process group (spawn, so CUDA is safe).

    Returns when all exit 0. Otherwise, once the first worker fails, the others get `grace_s` seconds to
    fail the same way (a user error is usually seen by every rank), then are killed, and the first failure
    is raised once: LaunchError for a user error, ReportedExit for a worker's stop or failure, RankFailure
    for a worker that died without a word (killed, out of memory).
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    server = dist.TCPStore("127.0.0.1", 0, nprocs + 1, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=60))
    store = f"127.0.0.1:{server.port}"
    with tempfile.TemporaryDirectory(prefix="qtrain-launch-") as errdir:
        procs = [ctx.Process(target=_worker, args=(r, nprocs, store, os.getpid(), errdir, fn, args))
                 for r in range(nprocs)]
        signals = _forward_signals(server, procs)
        try:
            for p in procs:
                p.start()
            failed_at = None
            while any(p.exitcode is None for p in procs):
                time.sleep(0.1)
                if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                    failed_at = time.monotonic()
                if failed_at is not None and time.monotonic() - failed_at > grace_s:
                    break
        finally:
            _restore_signals(signals)
            killed = set()
            for r, p in enumerate(procs):
                if p.exitcode is None:
                    p.kill()
                    killed.add(r)
                p.join(30)
        if signals["count"] >= 2:
            raise ReportedExit("stopped at once by a second signal; the last checkpoint written resumes the run with "
                               "--continue", 128 + signal.SIGINT, "stopped")
        _raise_first_failure(procs, errdir, killed)


def _raise_first_failure(procs: list, errdir: str, killed: set[int]) -> None:
    """Raise the first failure of the workers (see launch_local); `killed` are the ranks the launcher ended."""
    if all(p.exitcode == 0 for p in procs):
        return
    reports = {}
    for r in range(len(procs)):
        path = os.path.join(errdir, f"rank{r}.json")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                reports[r] = json.load(f)
    # the cause first: a user error (the rest follows from it), then a rank that died without a word (the
    # others only report losing it), then the reports in rank order
    for r, rep in sorted(reports.items()):
        if rep["code"] == USER_ERROR_EXIT:
            raise LaunchError(rep["message"])
    for r, p in enumerate(procs):
        if r not in reports and r not in killed and p.exitcode is not None and p.exitcode < 0:
            raise RankFailure(f"rank {r} was killed by {signal.Signals(-p.exitcode).name}"
                              + (" (out of memory?)" if -p.exitcode == signal.SIGKILL else ""))
    # a rank's own stop (out of memory, a non-finite streak, a signal) before the reports of losing a rank (code 1):
    # the others' RankFailure can reach the launcher first and would hide the cause
    for r, rep in sorted(reports.items()):
        if rep["expected"] and rep["code"] != RankFailure.exit_code:
            raise ReportedExit(rep["message"], rep["code"], rep["label"])
    for r, rep in sorted(reports.items()):
        if rep["expected"]:
            raise ReportedExit(rep["message"], rep["code"], rep["label"])
        raise RankFailure(f"rank {r} failed: {rep['message'] or 'unexpected error'} (its traceback is above)")
    r, code = next(((r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0 and r not in killed),
                   next((r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0))
    raise RankFailure(f"rank {r} exited with code {code}" if code >= 0 else
                      f"rank {r} was killed by {signal.Signals(-code).name}")


def _forward_signals(server: Any, procs: list) -> dict[str, Any]:
    """SIGINT / SIGTERM / SIGHUP to the launcher: the first asks the workers to stop after their step (the store key
    `stop`), a second SIGINT or SIGTERM kills them (a SIGHUP ignored at the start, `nohup`, stays ignored). SIGUSR1
    asks them for a checkpoint after their step (the store key `checkpoint` counts them), and they go on. Returns
    what `_restore_signals` needs."""
    state: dict[str, Any] = {"count": 0, "old": {}}

    def say(text: str) -> None:
        console.write(f"qtrain: {text}\n", sys.stderr)

    def stop(signum: int, frame: Any) -> None:
        if signum == signal.SIGHUP and state["count"]:
            return  # closing the terminal is no request to hurry
        state["count"] += 1
        if state["count"] == 1:
            server.set(f"{_KEY}stop", str(signum))
            say(f"{signal.Signals(signum).name}: the workers finish their step, write a checkpoint and exit"
                + (" (send it again to stop at once)" if signum != signal.SIGHUP else ""))
        else:
            for p in procs:
                if p.is_alive():
                    p.kill()

    def checkpoint(signum: int, frame: Any) -> None:
        server.add(f"{_KEY}checkpoint", 1)
        say("SIGUSR1: the workers write a checkpoint after their step and go on")

    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            if s == signal.SIGHUP and signal.getsignal(s) == signal.SIG_IGN:
                continue
            state["old"][s] = signal.signal(s, stop)
        state["old"][signal.SIGUSR1] = signal.signal(signal.SIGUSR1, checkpoint)
    return state


def _restore_signals(state: dict[str, Any]) -> None:
    for s, old in state["old"].items():
        signal.signal(s, old)
