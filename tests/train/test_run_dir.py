"""Output ownership (qtrain/train/run_dir.py): paths that cannot work are refused, a new run never starts
into an earlier run's checkpoints, export or log (the message names --continue and --start-over), a resume
never writes into another run's, files qtrain did not write are never taken, and `claim` sweeps leftovers,
carries out --start-over and writes the marker."""
from __future__ import annotations

import json
import os

import pytest
import torch

from qtrain.fsio import FileSystemError
from qtrain.model.hf_io import MANIFEST
from qtrain.train import checkpoint_io as cio
from qtrain.train import run_dir
from qtrain.train.run_dir import LEGACY, RUN_MARKER, RunConflictError, RunPaths


def paths(tmp_path, log="log.jsonl") -> RunPaths:
    return RunPaths(ckpt_dir=str(tmp_path / "ckpt"), out_dir=str(tmp_path / "out"),
                    log_file=str(tmp_path / log) if log else None)


def write_ckpt(ckpt, step, run_id="r1"):
    cio.write_checkpoint(ckpt, step, {"w": {"a": torch.ones(1)}}, {"step": step, "run": {"id": run_id}})


def write_log(path, run_id):
    first = {"log": "run", "run_id": run_id} if run_id else {"log": "cmd", "step": 0}
    path.write_text(json.dumps(first) + "\n" + json.dumps({"log": "step", "step": 0}) + "\n")


def test_fresh_start_into_empty_paths(tmp_path):
    p = paths(tmp_path)
    run_dir.check_paths(p)
    found = run_dir.inspect(p)
    assert found == run_dir.Found()
    run_dir.check_ownership(p, found, run_id=None)
    run_dir.claim(p, found, run_id="abc", name="n", start_over=False)
    assert json.loads((tmp_path / "ckpt" / RUN_MARKER).read_text())["run_id"] == "abc"
    assert not (tmp_path / "out").exists()  # the export creates its folder itself


@pytest.mark.parametrize("held", ["checkpoints", "marker", "export", "log", "legacy-log"])
def test_fresh_start_into_an_earlier_runs_outputs_is_refused(tmp_path, held):
    p = paths(tmp_path)
    if held == "checkpoints":
        write_ckpt(tmp_path / "ckpt", 20)
    elif held == "marker":
        (tmp_path / "ckpt").mkdir()
        (tmp_path / "ckpt" / RUN_MARKER).write_text(json.dumps({"run_id": "r1"}))
    elif held == "export":
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / MANIFEST).write_text(json.dumps({"run_id": "r1", "files": ["config.json"]}))
        (tmp_path / "out" / "config.json").write_text("{}")
    else:
        write_log(tmp_path / "log.jsonl", "r1" if held == "log" else None)
    with pytest.raises(RunConflictError) as e:
        run_dir.check_ownership(p, run_dir.inspect(p), run_id=None)
    msg = str(e.value)
    assert "--continue" in msg and "--start-over" in msg and "--name" in msg
    run_dir.check_ownership(p, run_dir.inspect(p), run_id=None, start_over=True)  # explicit: allowed


def test_start_over_replaces_only_what_the_earlier_run_wrote(tmp_path):
    p = paths(tmp_path)
    write_ckpt(tmp_path / "ckpt", 20)
    write_ckpt(tmp_path / "ckpt", 40)
    (tmp_path / "ckpt" / RUN_MARKER).write_text(json.dumps({"run_id": "r1"}))
    (tmp_path / "ckpt" / "notes.txt").write_text("mine")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")
    (tmp_path / "out" / MANIFEST).write_text(json.dumps({"run_id": "r1", "files": ["config.json"]}))
    (tmp_path / "out" / "README.md").write_text("mine too")
    write_log(tmp_path / "log.jsonl", "r1aaaaaaaa")
    found = run_dir.inspect(p)
    notes = run_dir.claim(p, found, run_id="r2", name="n", start_over=True)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["notes.txt", RUN_MARKER]
    assert json.loads((tmp_path / "ckpt" / RUN_MARKER).read_text())["run_id"] == "r2"
    assert sorted(os.listdir(tmp_path / "out")) == ["README.md"]
    assert not (tmp_path / "log.jsonl").exists()
    kept = tmp_path / "log.r1aaaaaa.jsonl"
    assert kept.read_text().startswith('{"log": "run"')  # the earlier log is kept aside, whole
    assert any("deleted 2 checkpoint" in n for n in notes)


def test_resume_checks_the_run_id(tmp_path):
    p = paths(tmp_path)
    write_ckpt(tmp_path / "ckpt", 20)
    (tmp_path / "ckpt" / RUN_MARKER).write_text(json.dumps({"run_id": "r1"}))
    write_log(tmp_path / "log.jsonl", "r1")
    run_dir.check_ownership(p, run_dir.inspect(p), run_id="r1")  # its own outputs: fine
    with pytest.raises(RunConflictError, match="checkpoint-dir .* holds the outputs of run r1.*log-file .* holds the outputs of run r1"):
        run_dir.check_ownership(p, run_dir.inspect(p), run_id="r2")


def test_legacy_outputs_resume_but_do_not_start_fresh(tmp_path):
    """Checkpoints and a log written before run ids: --continue resumes them, a fresh start is refused."""
    p = paths(tmp_path)
    write_ckpt(tmp_path / "ckpt", 20)
    write_log(tmp_path / "log.jsonl", None)
    found = run_dir.inspect(p)
    assert found.ckpt_run == LEGACY and found.log_run == LEGACY
    run_dir.check_ownership(p, found, run_id="new")
    with pytest.raises(RunConflictError):
        run_dir.check_ownership(p, found, run_id=None)


def test_files_qtrain_did_not_write_are_never_taken(tmp_path):
    p = paths(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.safetensors").write_bytes(b"the user's model")
    (tmp_path / "log.jsonl").write_text("a shopping list\n")
    found = run_dir.inspect(p)
    for run_id, start_over in ((None, False), (None, True), ("r1", False)):
        with pytest.raises(RunConflictError, match="no qtrain export wrote them"):
            run_dir.check_ownership(p, found, run_id=run_id, start_over=start_over)
    (tmp_path / "out" / "model.safetensors").unlink()
    with pytest.raises(RunConflictError, match="is not a qtrain log"):
        run_dir.check_ownership(p, run_dir.inspect(p), run_id=None, start_over=True)


@pytest.mark.parametrize("case,match", [
    ("ckpt-is-file", "--checkpoint-dir .*exists and is not a directory"),
    ("out-is-file", "--out-dir .*exists and is not a directory"),
    ("out-under-file", "--out-dir .*is a file, so the directory cannot be created"),
    ("log-is-dir", "--log-file .*is a directory, not a file"),
    ("log-is-out", "--log-file .*is the --out-dir itself"),
    ("log-is-ckpt", "--log-file .*is the --checkpoint-dir itself"),
    ("log-on-export-file", "--log-file .*the export writes its config.json there"),
    ("log-on-marker", "--log-file .*collides with the checkpoints' qtrain-run.json"),
    ("log-in-checkpoint", "--log-file .*lies inside a checkpoint"),
    ("out-is-checkpoint", "--out-dir .*is a checkpoint directory"),
])
def test_paths_that_cannot_work(tmp_path, case, match):
    ckpt, out, log = tmp_path / "ckpt", tmp_path / "out", tmp_path / "log.jsonl"
    if case == "ckpt-is-file":
        ckpt.write_text("x")
    elif case == "out-is-file":
        out.write_text("x")
    elif case == "out-under-file":
        (tmp_path / "f").write_text("x")
        out = tmp_path / "f" / "out"
    elif case == "log-is-dir":
        log.mkdir()
    elif case == "log-is-out":
        log = out
    elif case == "log-is-ckpt":
        log = ckpt
    elif case == "log-on-export-file":
        log = out / "config.json"
    elif case == "log-on-marker":
        log = ckpt / RUN_MARKER
    elif case == "log-in-checkpoint":
        log = ckpt / "step_00000010" / "log.jsonl"
    elif case == "out-is-checkpoint":
        out = ckpt / "step_00000100"
    with pytest.raises(FileSystemError, match=match):
        run_dir.check_paths(RunPaths(ckpt_dir=str(ckpt), out_dir=str(out), log_file=str(log)))


def test_claim_sweeps_leftovers_of_dead_writers(tmp_path):
    p = paths(tmp_path)
    write_ckpt(tmp_path / "ckpt", 10)
    (tmp_path / "ckpt" / "step_00000020.tmp-deadhost-1").mkdir()
    (tmp_path / "ckpt" / "step_00000020.tmp-deadhost-1" / "weights.safetensors").write_bytes(b"half")
    (tmp_path / "ckpt" / "step_00000005.del-deadhost-1").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / ".model.safetensors.tmp-deadhost-1").write_bytes(b"half")
    notes = run_dir.claim(p, run_dir.inspect(p), run_id="r", name="n", start_over=False)
    assert sorted(os.listdir(tmp_path / "ckpt")) == [RUN_MARKER, "step_00000010"]
    assert os.listdir(tmp_path / "out") == []
    assert "3 leftover(s)" in notes[0]


def test_checkpoint_renamed_aside_by_a_kill_is_put_back(tmp_path):
    """A kill between 'old checkpoint renamed aside' and 'new one renamed in' loses nothing."""
    write_ckpt(tmp_path / "ckpt", 10)
    aside = tmp_path / "ckpt" / "step_00000010.old-deadhost-7"
    os.replace(tmp_path / "ckpt" / "step_00000010", aside)
    (tmp_path / "ckpt" / "step_00000010.tmp-deadhost-7").mkdir()
    cio.remove_stale(tmp_path / "ckpt")
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step_00000010"]
    assert cio.read_checkpoint(tmp_path / "ckpt" / "step_00000010")[0]["step"] == 10
