"""Two processes never write one run's files (qtrain/locks.py, issue 41 item 2), and a run's name follows its
--out-dir (the new user's second fine-tune).

A live run holds an exclusive flock on its checkpoint dir, its out-dir and its log file for its whole life; a
`qtrain export` holds its out-dir's. The live process here is a real `qtrain` held still at a fault point
(tests/reliability/paused.py): each second writer the tester tried (`--start-over`, a second `--continue`, a run
of another --name into the same --out-dir, a second export into one folder) is refused with exit code 2 and one
line naming that process, changes nothing, and the first then finishes intact and can `--continue`.
"""
from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qtrain import locks
from qtrain.cli.main import main
from qtrain.observe.log import read_log
from qtrain.train import checkpoint_io as cio
from tests.reliability.paused import paused_at, wait_stopped
from tests.run_utils import REPO, make_run_root, qtrain_popen, snapshot, subprocess_env, train_argv

HOLD = "import sys, time; from qtrain.locks import hold, Target; hold([Target(sys.argv[1], '--out-dir')]); " \
       "print('held', flush=True); time.sleep(600)"


def _holder(folder: Path) -> subprocess.Popen:
    """Another process that takes `folder`'s lock and keeps it."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], env=subprocess_env(), cwd=REPO,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "held\n"
    return p


# ---- the lock itself -------------------------------------------------------------------------------------------

def test_a_held_folder_is_refused_naming_its_holder_and_a_dead_holders_lock_is_taken_again(tmp_path):
    folder = tmp_path / "out" / "run"
    p = _holder(folder)
    try:
        with pytest.raises(locks.PathInUseError) as e:
            locks.hold([locks.Target(str(folder), "--out-dir")])
        msg = str(e.value)
        assert msg.startswith(f"--out-dir {folder}: in use by qtrain pid {p.pid} on host ")
        assert "started as `" in msg and f"kill -INT {p.pid}" in msg and "--start-over" not in msg
    finally:
        p.kill()
        p.wait()
    assert (folder / locks.LOCK_NAME).exists()  # the kernel released the lock; its file stays, stale
    with locks.hold([locks.Target(str(folder), "--out-dir")]) as held:
        rec = json.loads((folder / locks.LOCK_NAME).read_text())
        assert rec["pid"] == os.getpid() and held.notes == []
        with locks.hold([locks.Target(str(folder), "--checkpoint-dir")]):  # one process, one folder: re-entrant
            pass
        assert (folder / locks.LOCK_NAME).exists()  # still held by the outer one
    assert not (folder / locks.LOCK_NAME).exists()  # a clean release removes it
    assert folder.is_dir()  # the folder existed before this lock (the other process made it)


def test_a_release_removes_the_folders_the_lock_created_while_they_are_empty(tmp_path):
    log = tmp_path / "logs" / "a" / "run.jsonl"
    with locks.hold([locks.Target(str(tmp_path / "ckpt" / "run"), "--checkpoint-dir"),
                     locks.Target(str(log), "--log-file", is_file=True)]):
        assert (tmp_path / "ckpt" / "run" / ".qtrain-lock").is_file()
        assert (log.parent / ".run.jsonl.qtrain-lock").is_file()
        log.write_text("{}\n")
    assert sorted(os.listdir(tmp_path)) == ["logs"] and os.listdir(log.parent) == ["run.jsonl"]


def test_a_second_target_held_elsewhere_releases_the_first(tmp_path):
    p = _holder(tmp_path / "out")
    try:
        with pytest.raises(locks.PathInUseError, match=f"--out-dir {tmp_path / 'out'}: in use by qtrain pid {p.pid}"):
            locks.hold([locks.Target(str(tmp_path / "ckpt"), "--checkpoint-dir"),
                        locks.Target(str(tmp_path / "out"), "--out-dir")])
        assert not (tmp_path / "ckpt").exists()  # taken, then given back and its folder removed
    finally:
        p.kill()
        p.wait()


def test_a_lock_file_that_is_a_link_is_refused_and_a_lock_never_travels(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "elsewhere").write_text("the user's file")
    (tmp_path / "out" / locks.LOCK_NAME).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(locks.FileSystemError, match="is not qtrain's lock file"):
        locks.hold([locks.Target(str(tmp_path / "out"), "--out-dir")])
    assert (tmp_path / "elsewhere").read_text() == "the user's file"
    with locks.hold([locks.Target(str(tmp_path / "ckpt"), "--checkpoint-dir")]) as held:
        with pytest.raises(TypeError, match="stays in the process"):
            pickle.dumps(held)


# ---- a live run and a second writer --------------------------------------------------------------------------

def _signal_when_logged(log: Path, step: int, signum: int) -> threading.Thread:
    """Send `signum` to this process once `log` shows `step` (as tests/train/test_stop.py does)."""
    def watch():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if log.exists() and any(e.get("log") == "step" and e["step"] >= step for e in read_log(log)):
                os.kill(os.getpid(), signum)
                return
            time.sleep(0.01)
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def _steps(log: Path) -> list[int]:
    return [e["step"] for e in read_log(log) if e["log"] == "step"]


def test_a_live_run_refuses_start_over_a_second_continue_and_another_name_in_its_out_dir(tmp_path, capsys):
    """The run is stopped part-way (SIGINT, in this process), then resumed with --continue in a subprocess that
    holds still after its first checkpoint. While it lives, each second writer the tester tried is refused naming
    it and changes nothing (before the lock: --start-over deleted the live run's checkpoints and moved its log
    aside, a second --continue trained into the same checkpoints, another --name replaced its export), and so is
    a run that would append to its log. Then the run finishes intact: each step once after the resume point,
    every checkpoint whole, its own export."""
    root = make_run_root(tmp_path)
    argv = train_argv(root, steps=8, ckpt_interval=2)
    t = _signal_when_logged(root / "logs" / "run.jsonl", 1, signal.SIGINT)
    assert main(argv) == 130
    t.join()
    resumed_at = cio.checkpoint_step(cio.find_checkpoint(root / "ckpt" / "run"))
    p = qtrain_popen(argv + ["--continue"], cwd=root, **paused_at("ckpt.saved", 1))
    pid = wait_stopped(p)
    before = snapshot(root)
    capsys.readouterr()
    seconds = {"--start-over": argv + ["--start-over"], "a second --continue": argv + ["--continue"],
               "another --name into its --out-dir": train_argv(root, steps=8, name="other",
                                                                 out_dir=root / "out" / "run"),
               "another --name into its --log-file": train_argv(root, steps=8, name="other",
                                                                  log_file=root / "logs" / "run.jsonl")}
    for case, second in seconds.items():
        assert main(second) == 2, case
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("qtrain: error: --"), (case, err)
        assert f": in use by qtrain pid {pid} on host " in err[0] and "--start-over" not in err[0], (case, err)
        assert snapshot(root) == before, case  # nothing changed, nothing created (ckpt/other, logs/other.jsonl)
    os.kill(pid, signal.SIGCONT)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    steps = _steps(root / "logs" / "run.jsonl")
    assert steps[steps.index(resumed_at):] == list(range(resumed_at, 8)), steps  # the resume trained each step once
    kept = {s for s, _ in cio.list_checkpoints(root / "ckpt" / "run")}
    assert {2, 4, 6, 8} <= kept <= {2, 4, 6, 8, resumed_at}, kept
    for _, path in cio.list_checkpoints(root / "ckpt" / "run"):
        meta, files = cio.read_checkpoint(path)
        for n in files.names:
            files.load(n)
    run_id = json.loads((root / "ckpt" / "run" / "qtrain-run.json").read_text())["run_id"]
    manifest = json.loads((root / "out" / "run" / "qtrain-export.json").read_text())
    assert manifest["run_id"] == run_id and manifest["complete"] and manifest["step"] == 8
    assert not list(root.rglob("*.qtrain-lock")) and not (root / "ckpt" / "other").exists()
    assert main(argv + ["--continue"]) == 0  # the finished run can still be continued (evaluate, export)


def test_two_exports_into_one_folder(tmp_path, capsys):
    """The first `qtrain export` holds still with the out-dir's lock taken; a second one into the same folder is
    refused naming it (before the lock, the tester once got a manifest of step 4 over step 2's weights). The
    first then writes the export of the checkpoint it was asked for."""
    root = make_run_root(tmp_path)
    assert main(train_argv(root, steps=4, ckpt_interval=2)) == 0
    ckpt, out = root / "ckpt" / "run", root / "exported"
    p = qtrain_popen(["export", "--checkpoint-dir", str(ckpt), "--out-dir", str(out), "--step", "4"], cwd=root,
                     **paused_at("lock.held", 1))
    pid = wait_stopped(p)
    capsys.readouterr()
    assert main(["export", "--checkpoint-dir", str(ckpt), "--out-dir", str(out), "--step", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"qtrain: error: --out-dir {out}: in use by qtrain pid {pid} on host ")
    assert "started as `qtrain export --checkpoint-dir" in err[0]
    assert os.listdir(out) == [locks.LOCK_NAME]  # the refused export wrote nothing
    os.kill(pid, signal.SIGCONT)
    _, perr = p.communicate(timeout=600)
    assert p.returncode == 0, perr[-3000:]
    manifest = json.loads((out / "qtrain-export.json").read_text())
    assert manifest["complete"] and manifest["step"] == 4
    got, want = load_file(out / "model.safetensors"), load_file(root / "out" / "run" / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)  # step 4's, the run's own
    assert not (out / locks.LOCK_NAME).exists()


# ---- the run's name follows --out-dir ---------------------------------------------------------------------------

def test_the_run_name_follows_the_out_dir_unless_given():
    from qtrain.cli.main import build_parser
    from qtrain.cli.options import options_from_args

    def opts(*flags: str):
        return options_from_args(build_parser().parse_args(["train", *flags]))

    assert opts().name == "qtrain-default"  # the embedded default keeps its name
    assert opts("--out-dir", "output/ft-1/").name == "ft-1"
    assert opts("--out-dir", "output/ft-1").expand(opts("--out-dir", "output/ft-1").checkpoint_dir) == "ckpt/ft-1"
    assert opts("--out-dir", "models/my model (v2)").name == "my_model_v2"  # made a valid run name
    assert opts("--out-dir", "output/ft-1", "--name", "mine").name == "mine"  # --name wins
    assert opts("--out-dir", "out/%n").name == "qtrain-default"  # the name makes the folder, not the reverse
    assert opts("--model", "m", "--out-dir", "output/a").name == "a"
    assert opts("--model", "m").name == "qtrain"


def test_two_fine_tunes_into_two_folders_both_run(tmp_path, monkeypatch, capsys):
    """The new user's case: --checkpoint-dir and --log-file left at their defaults, one --out-dir per fine-tune.
    The second used to be refused as the first's outputs (both were named `qtrain`)."""
    root = make_run_root(tmp_path)
    monkeypatch.chdir(root)
    for folder in ("ft-a", "ft-b"):
        rc = main(train_argv(root, steps=2, name=None, checkpoint_dir=None, log_file=None,
                             out_dir=root / "output" / folder))
        assert rc == 0, (folder, capsys.readouterr().err[-2000:])
    for folder in ("ft-a", "ft-b"):
        assert (root / "ckpt" / folder / "step_00000002").is_dir() and (root / "logs" / f"{folder}.jsonl").is_file()
        assert json.loads((root / "output" / folder / "qtrain-export.json").read_text())["name"] == folder
