"""Several processes when something goes wrong (qtrain/parallel/dist.py), with real gloo workers started by
`qtrain train --gpus 2` or by `launch_local`: a user error is one line and exit code 2, as in one process; a
stopped (SIGSTOP) rank makes the others fail after --collective-timeout with an error naming it; a killed
rank is named by its signal; killing the launcher takes its workers along; SIGTERM to the launcher stops the
workers with a checkpoint."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from qtrain.observe.log import read_log
from qtrain.options import OptionsError
from qtrain.parallel import dist
from tests.run_utils import make_run_root, qtrain_popen, qtrain_run, train_argv


def _raise_on_rank_1() -> None:
    if os.environ["RANK"] == "1":
        raise OptionsError("--lr: a user error seen by rank 1")


def _crash_on_rank_0() -> None:
    if os.environ["RANK"] == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # rank 1 would wait: the launcher must not


def _oom_on_rank_1_after_rank_0_reports_losing_it() -> None:
    from qtrain.train.stop import OUT_OF_MEMORY_EXIT, RunStopped
    if os.environ["RANK"] == "0":  # what a rank's diagnosis says when its peer stopped answering: first to arrive
        raise dist.RankFailure("rank 1 stopped responding")
    time.sleep(0.5)
    raise RunStopped("rank 1 ran out of device memory in step 3", OUT_OF_MEMORY_EXIT, label="out of memory")


def test_launcher_prefers_a_ranks_own_stop_to_the_reports_of_losing_it():
    """A rank that ran out of memory (or stopped on a non-finite streak) is the cause; the others' RankFailure
    (exit code 1) follows from it and may reach the launcher first: the launcher reports the cause, its code."""
    with pytest.raises(dist.ReportedExit, match="rank 1 ran out of device memory in step 3") as e:
        dist.launch_local(_oom_on_rank_1_after_rank_0_reports_losing_it, 2, grace_s=10)
    assert e.value.exit_code == 4 and e.value.label == "out of memory"


def test_launcher_reports_a_workers_user_error_once():
    with pytest.raises(dist.LaunchError, match="a user error seen by rank 1"):
        dist.launch_local(_raise_on_rank_1, 2, grace_s=2)


def test_launcher_names_a_killed_worker_and_stops_the_rest():
    t0 = time.monotonic()
    with pytest.raises(dist.RankFailure, match="rank 0 was killed by SIGKILL"):
        dist.launch_local(_crash_on_rank_0, 2, grace_s=1)
    assert time.monotonic() - t0 < 50  # rank 1 was stopped, not waited for


def test_user_error_under_gpus_is_one_line_exit_2(tmp_path):
    root = make_run_root(tmp_path)
    one = qtrain_run(train_argv(root, gpus=1, extra=("--continue", "7")), cwd=root)
    two = qtrain_run(train_argv(root, gpus=2, extra=("--continue", "7")), cwd=root)
    for r in (one, two):
        assert r.returncode == 2, r.stderr[-3000:]
        assert r.stderr.strip().count("\n") == 0, r.stderr  # one line
        assert r.stderr.startswith("qtrain: error: --continue 7: no checkpoint of step 7 in ")
    assert one.stderr == two.stderr


def _wait_for_step(log, step, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while not (log.exists() and any(e["log"] == "step" and e["step"] >= step for e in read_log(log))):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.1)


def _workers(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out if "spawn_main" in _cmdline(int(p))]  # not the resource tracker


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "State:\tZ" in f.read()  # a zombie waits for its reaper, but it runs no more
    except FileNotFoundError:
        return True


def _wait_gone(pids, timeout=30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(_gone(p) for p in pids):
            return True
        time.sleep(0.2)
    return False


def test_stopped_rank_is_named_after_the_collective_timeout(tmp_path):
    root = make_run_root(tmp_path, tokens=40000)
    p = qtrain_popen(train_argv(root, steps=100000, gpus=2, collective_timeout=4, ckpt_interval=100000), cwd=root)
    try:
        _wait_for_step(root / "logs" / "run.jsonl", 2, p)
        workers = _workers(p.pid)
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGSTOP)
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 1, err[-3000:]
    m = re.search(r"qtrain: error: rank (\d) stopped responding \(no heartbeat.*rank (\d) gave up at step \d+", err)
    assert m and m.group(1) != m.group(2), err[-3000:]
    assert _wait_gone(workers)  # the stopped one too: the launcher killed it


def test_killing_the_launcher_takes_the_workers_along(tmp_path):
    root = make_run_root(tmp_path, tokens=40000)
    p = qtrain_popen(train_argv(root, steps=100000, gpus=2, ckpt_interval=100000), cwd=root)
    try:
        _wait_for_step(root / "logs" / "run.jsonl", 1, p)
        workers = _workers(p.pid)
        assert len(workers) == 2
        p.kill()
        p.wait()
        assert _wait_gone(workers, timeout=20)
    finally:
        p.kill()


def test_sigterm_to_the_launcher_stops_the_workers_with_a_checkpoint(tmp_path):
    root = make_run_root(tmp_path, tokens=40000)
    argv = train_argv(root, steps=100000, gpus=2, ckpt_interval=100000)
    p = qtrain_popen(argv, cwd=root)
    _wait_for_step(root / "logs" / "run.jsonl", 1, p)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, err[-3000:]
    m = re.search(r"qtrain: stopped: SIGTERM at step (\d+): checkpoint (\S+) written; resume with the same command "
                  r"and --continue", err)
    assert m, err[-3000:]
    assert os.path.isfile(os.path.join(m.group(2), "checkpoint.json"))
    assert sorted(os.listdir(m.group(2))) == ["adam.m.shard_000_of_002.safetensors", "adam.m.shard_001_of_002.safetensors",
                                              "adam.v.shard_000_of_002.safetensors", "adam.v.shard_001_of_002.safetensors",
                                              "checkpoint.json", "weights.shard_000_of_002.safetensors",
                                              "weights.shard_001_of_002.safetensors"]


def test_shutdown_stops_and_joins_the_heartbeat_before_leaving_the_group():
    """A rank's heartbeat thread (its own store client) is stopped and joined by `shutdown`, so no store call of it
    is in flight while the process exits (a torchrun rank 0 once aborted at exit, 'terminate called without an
    active exception', after a finished run)."""
    import datetime

    import torch.distributed as tdist

    master = tdist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))
    dist._start_heartbeat("127.0.0.1", master.port, rank=3)
    stop, thread = dist._HEARTBEAT[-1]
    assert thread.is_alive() and master.check(["qtrain/alive/3"])
    dist.shutdown()
    assert not thread.is_alive() and not dist._HEARTBEAT
