"""Signals and a console that goes away never cost a run its work (issue 41 items 12 and 13).

* SIGHUP (the terminal was closed) stops a run like SIGTERM: the step finishes, a checkpoint is written, exit 129;
  in one process and through the `--gpus 2` launcher, which forwards it to its workers.
* SIGUSR1 (Slurm's warning before a preemption) writes a checkpoint after the current step, and training goes on.
* A console that went away (`qtrain train | tee FILE` with tee ended by the Ctrl-C, `qtrain train | head`) is a
  stop request: the step finishes, the checkpoint is written, the JSON log keeps every line, no traceback.

Each run is a real `qtrain` process held still at its first checkpoint (tests/reliability/paused.py), so the
signal, or the reader's end, arrives at a known step. Every run that stopped is resumed with --continue, and its
losses, gradient norms and export are compared bit for bit with an uninterrupted run's.
"""
from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qtrain.cli.main import main
from qtrain.observe.log import read_log
from qtrain.train import checkpoint_io as cio
from qtrain.train.stop import StopSignals
from tests.reliability.paused import paused_at, wait_child_stopped, wait_stopped
from tests.run_utils import make_run_root, qtrain_popen, subprocess_env, train_argv

STEPS = 8
HELD_AT = paused_at("ckpt.saved", 1)  # the checkpoint of step 2 (--ckpt-interval 2): steps 0 and 1 are done


def _argv(root: Path, **flags) -> list[str]:
    return train_argv(root, steps=STEPS, ckpt_interval=2, **flags)


def _outcome(root: Path, name: str = "run") -> tuple[dict[int, tuple[float, float]], dict[str, torch.Tensor]]:
    """Each step's (loss, norm), the last time it ran, and the exported weights."""
    steps = {e["step"]: (e["loss"], e["norm"]) for e in read_log(root / "logs" / f"{name}.jsonl") if e["log"] == "step"}
    return steps, load_file(root / "out" / name / "model.safetensors")


def _assert_same(got, want) -> None:
    assert got[0] == want[0], (got[0], want[0])  # bitwise: floats compared with ==
    assert got[1].keys() == want[1].keys() and all(torch.equal(got[1][k], want[1][k]) for k in want[1])


def _messages(root: Path) -> list[str]:
    return [e["message"] for e in read_log(root / "logs" / "run.jsonl") if e["log"] == "message"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted one-process run: its outcome and what it printed."""
    root = make_run_root(tmp_path_factory.mktemp("ref"))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(_argv(root)) == 0
    return _outcome(root), printed.getvalue().splitlines()


# ---- SIGHUP and SIGUSR1, one process -------------------------------------------------------------------------

def test_sighup_stops_with_a_checkpoint_and_the_resume_is_bitwise_equal(tmp_path, reference):
    """Before: SIGHUP's default action ended the process at once (exit -1), nothing saved since step 2."""
    root = make_run_root(tmp_path)
    p = qtrain_popen(_argv(root), cwd=root, **HELD_AT)
    pid = wait_stopped(p)
    os.kill(pid, signal.SIGHUP)  # pending until it goes on, in step 2
    os.kill(pid, signal.SIGCONT)
    _, err = p.communicate(timeout=600)
    ckpt = root / "ckpt" / "run" / "step_00000003"
    assert p.returncode == 128 + signal.SIGHUP, err[-3000:]
    assert f"qtrain: stopped: SIGHUP at step 3: checkpoint {ckpt} written; resume with the same command and " \
           f"--continue" in err and "Traceback" not in err
    assert (ckpt / "checkpoint.json").is_file() and not (root / "out" / "run" / "model.safetensors").exists()
    assert main(_argv(root) + ["--continue"]) == 0
    _assert_same(_outcome(root), reference[0])


def test_sigusr1_writes_a_checkpoint_and_training_goes_on(tmp_path, reference):
    """Before: SIGUSR1's default action ended the process (exit -10). Now: a checkpoint after step 2 (step_3, which
    no --ckpt-interval 2 writes), the run goes on undisturbed to the end; resuming from that checkpoint gives the
    same run again, bit for bit."""
    root = make_run_root(tmp_path)
    p = qtrain_popen(_argv(root), cwd=root, **HELD_AT)
    pid = wait_stopped(p)
    os.kill(pid, signal.SIGUSR1)
    os.kill(pid, signal.SIGCONT)
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    ckpt = root / "ckpt" / "run" / "step_00000003"
    assert f"SIGUSR1: checkpoint {ckpt} written at step 3; training goes on" in _messages(root)
    assert [s for s, _ in cio.list_checkpoints(root / "ckpt" / "run")] == [2, 3, 4, 6, 8]
    _assert_same(_outcome(root), reference[0])  # the extra checkpoint changed nothing
    assert main(_argv(root) + ["--continue", str(ckpt)]) == 0  # as after a preemption that came right after it
    steps = [e["step"] for e in read_log(root / "logs" / "run.jsonl") if e["log"] == "step"]
    assert steps == list(range(STEPS)) + list(range(3, STEPS))
    _assert_same(_outcome(root), reference[0])


def test_an_ignored_sighup_stays_ignored():
    """`nohup qtrain train &`: the user asked for the run to outlive the terminal."""
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with StopSignals():
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) != signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, old)


# ---- the --gpus 2 launcher -------------------------------------------------------------------------------------

def test_the_gpus_2_launcher_forwards_sigusr1_and_sighup(tmp_path):
    """Signals sent to the launcher alone (before: either one ended it, and its workers with it). SIGUSR1: its
    workers write a checkpoint after their step and go on; that run, never stopped, is the reference. SIGHUP: they
    stop after their step with a checkpoint, exit 129, and --continue (whose workers the launcher's lock does not
    refuse) ends bit-identical to the reference."""
    runs = {}
    for signum in (signal.SIGUSR1, signal.SIGHUP):
        root = make_run_root(tmp_path / signal.Signals(signum).name)
        argv = _argv(root, gpus=2)
        p = qtrain_popen(argv, cwd=root, **HELD_AT)
        worker = wait_child_stopped(p)  # rank 0, committing step 2's checkpoint
        os.kill(p.pid, signum)
        os.kill(worker, signal.SIGCONT)
        _, err = p.communicate(timeout=600)
        ckpt = root / "ckpt" / "run" / "step_00000003"
        if signum == signal.SIGUSR1:
            assert p.returncode == 0, err[-3000:]
            assert f"SIGUSR1: checkpoint {ckpt} written at step 3; training goes on" in _messages(root)
            assert [s for s, _ in cio.list_checkpoints(root / "ckpt" / "run")] == [2, 3, 4, 6, 8]
        else:
            assert p.returncode == 128 + signal.SIGHUP, err[-3000:]
            assert f"qtrain: stopped: SIGHUP at step 3: checkpoint {ckpt} written" in err and "Traceback" not in err
            meta, _ = cio.read_checkpoint(ckpt)
            assert meta["distributed"]["world"] == 2
            assert main(argv + ["--continue"]) == 0
        runs[signum] = _outcome(root)
    _assert_same(runs[signal.SIGHUP], runs[signal.SIGUSR1])


# ---- a console that goes away ----------------------------------------------------------------------------------

def _pipeline(root: Path, argv: list[str], reader: list[str], **env: str) -> tuple[subprocess.Popen, subprocess.Popen]:
    """`qtrain ... | READER` as a shell would start it: one process group (the qtrain process leads it)."""
    r, w = os.pipe()
    qtrain = subprocess.Popen([sys.executable, "-m", "qtrain.cli.main", *argv], cwd=root, env=subprocess_env(**env),
                              stdout=w, stderr=subprocess.PIPE, text=True, process_group=0)
    rd = subprocess.Popen(reader, stdin=r, stdout=subprocess.PIPE, text=True, process_group=qtrain.pid)
    os.close(r)
    os.close(w)
    return qtrain, rd


def _stopped_cleanly(err: str) -> None:
    for bad in ("Traceback", "Broken pipe", "BrokenPipeError", "Exception ignored", "qtrain: error"):
        assert bad not in err, err[-3000:]


def test_ctrl_c_on_a_run_piped_through_tee(tmp_path, reference):
    """SIGINT to the pipeline's process group: tee dies at once, qtrain finishes its step, whose line meets a
    closed pipe (before: `qtrain: error: [Errno 32] Broken pipe`, exit 2, no checkpoint). Now: the checkpoint,
    exit 130, the stop in the JSON log; tee's file has what was printed before."""
    root = make_run_root(tmp_path)
    qtrain, tee = _pipeline(root, _argv(root), ["tee", str(root / "console.txt")], **HELD_AT)
    pid = wait_stopped(qtrain)
    os.killpg(pid, signal.SIGINT)
    assert tee.wait(timeout=60) == -signal.SIGINT
    os.kill(pid, signal.SIGCONT)
    _, err = qtrain.communicate(timeout=600)
    ckpt = root / "ckpt" / "run" / "step_00000003"
    assert qtrain.returncode == 128 + signal.SIGINT, err[-3000:]
    _stopped_cleanly(err)
    stop = f"SIGINT at step 3: checkpoint {ckpt} written; resume with the same command and --continue"
    assert stop in err and stop in _messages(root)
    assert [e["step"] for e in read_log(root / "logs" / "run.jsonl") if e["log"] == "step"] == [0, 1, 2]
    assert "[T] step     1" in (root / "console.txt").read_text()
    assert main(_argv(root) + ["--continue"]) == 0
    _assert_same(_outcome(root), reference[0])


def test_a_run_piped_into_head(tmp_path, reference):
    """`qtrain train | head -n N`, head ending after step 1's line: step 2's line meets the closed pipe, which stops
    the run like a signal (SIGPIPE's exit code, 141) with a checkpoint, and the console's last words go to the log
    and stderr only."""
    printed = reference[1]
    n = next(i for i, line in enumerate(printed) if line.startswith("[T] step     1")) + 1
    root = make_run_root(tmp_path)
    qtrain, head = _pipeline(root, _argv(root), ["head", "-n", str(n)], **HELD_AT)
    pid = wait_stopped(qtrain)
    shown, _ = head.communicate(timeout=60)
    assert head.returncode == 0 and shown.splitlines()[-1].startswith("[T] step     1")
    os.kill(pid, signal.SIGCONT)
    _, err = qtrain.communicate(timeout=600)
    ckpt = root / "ckpt" / "run" / "step_00000003"
    assert qtrain.returncode == 128 + signal.SIGPIPE, err[-3000:]
    _stopped_cleanly(err)
    stop = (f"the console went away (stdout (broken pipe)) at step 3: checkpoint {ckpt} written; resume with the "
            f"same command and --continue")
    assert stop in err and stop in _messages(root)
    assert main(_argv(root) + ["--continue"]) == 0
    _assert_same(_outcome(root), reference[0])


def test_head_5(tmp_path, reference):
    """The tester's `qtrain train | head -5`: head is gone during the header, so the run stops before its first or
    second step (whichever line first meets the closed pipe), saying so in one line; a --continue then runs the
    whole run, bit for bit."""
    root = make_run_root(tmp_path)
    qtrain, head = _pipeline(root, _argv(root), ["head", "-5"])
    _, err = qtrain.communicate(timeout=600)
    head.wait(timeout=60)
    assert qtrain.returncode == 128 + signal.SIGPIPE, err[-3000:]
    _stopped_cleanly(err)
    assert "qtrain: stopped: the console went away (stdout (broken pipe)) at step " in err
    assert [e["step"] for e in read_log(root / "logs" / "run.jsonl") if e["log"] == "step"] in ([], [0])
    assert main(_argv(root) + ["--continue"]) == 0
    _assert_same(_outcome(root), reference[0])
