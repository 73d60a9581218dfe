"""An export is published so that qtrain's readers see the previous export or the new one, never a mix, and
refuse one that was interrupted (its manifest `qtrain-export.json` says `"complete": false`), saying how to
finish it; its files get the permissions of any file the user creates (0666 & ~umask).

A real `qtrain export` over an earlier export is killed with SIGKILL at each moment between two of its file
operations (`qtrain.fsio.fault_point`, armed by QTRAIN_FAULT); then `qtrain eval --model` (in process, through
`qtrain.cli.main.main`) must either refuse with one line and exit 2, or score exactly the old or the new model
(bitwise equal eval loss). Every kill from the manifest that announces the new export to the one that declares it
complete must be refused; running the export again (or `--continue` for a run's own export) finishes it.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from qtrain.cli.main import main
from qtrain.model.hf_io import MANIFEST, save_hf_model
from qtrain.model.weights import param_shapes
from tests.reliability.faults import fault_plan
from tests.run_utils import CFG, make_run_root, qtrain_run, subprocess_env, train_argv

REFUSAL = r"qtrain: error: .*out/[a-z]*: an interrupted export \(qtrain-export.json says it is incomplete; "
# the line names the export's folder (and how to finish it: a command with the test's paths, counted as "ROOT")
MAX_LINE = 400


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A finished 4-step run `run` (checkpoints of steps 2 and 4, its export of step 4 in out/run) and a finished
    run `other` (other weights)."""
    root = make_run_root(tmp_path_factory.mktemp("publish"))
    assert main(train_argv(root, steps=4, name="run")) == 0
    assert main(train_argv(root, steps=2, name="other", lr=3e-3)) == 0
    return root


def export_argv(root: Path, ckpt: str = "run", *extra: str) -> list[str]:
    return ["export", "--checkpoint-dir", str(root / "ckpt" / ckpt), "--out-dir", str(root / "out" / "run"), *extra]


def eval_loss(root: Path, model: Path, capsys) -> tuple[int, float | None, str]:
    """(exit code, eval loss or None, stderr) of `qtrain eval --model model` on the run's eval file."""
    capsys.readouterr()
    rc = main(["eval", "--model", str(model), "--eval-file", str(root / "eval.bin"), "--seq-len", "16", "--json"])
    out, err = capsys.readouterr()
    return rc, (json.loads(out.strip().splitlines()[-1])["loss"] if rc == 0 else None), err


def export_copy(root: Path, dest: Path, *args: str) -> Path:
    """An export made by `qtrain export *args` (in process) into a fresh folder: the reference it must equal."""
    shutil.rmtree(dest, ignore_errors=True)
    argv = [a if a != str(root / "out" / "run") else str(dest) for a in args]
    assert main(argv) == 0
    return dest


def assert_refused(err: str, rc: int, root: Path) -> None:
    assert rc == 2, err
    assert "Traceback" not in err
    line = err.strip()
    assert "\n" not in line and len(line.replace(str(root), "ROOT")) <= MAX_LINE, line
    assert re.search(REFUSAL, line), line


def kill_trial(root: Path, capsys, argv: list[str], fault: tuple[str, int], old: float,
               new: float) -> str:
    """Run `argv` killed at `fault`; then eval must refuse or score exactly `old` or `new`; after a refusal the
    same export run again completes and scores `new`. Returns what eval did: refused | old | new."""
    r = qtrain_run(argv, cwd=root, timeout=120, QTRAIN_FAULT=f"{fault[0]}:{fault[1]}")
    assert r.returncode == -9, f"{fault}: not killed: {r.returncode} {r.stderr[-2000:]}"
    rc, loss, err = eval_loss(root, root / "out" / "run", capsys)
    if rc != 0:
        assert_refused(err, rc, root)
        man = json.loads((root / "out" / "run" / MANIFEST).read_text())
        assert man["complete"] is False
        assert main(argv) == 0, "running the interrupted export again must finish it"
        assert eval_loss(root, root / "out" / "run", capsys)[1] == new
        return "refused"
    assert loss in (old, new), f"{fault}: eval ran on a mix of two exports: loss {loss}, old {old}, new {new}"
    return "old" if loss == old else "new"


# Every moment between the manifest that announces the new export (complete: false) and the one that declares it
# complete: the three renames of config.json, generation_config.json and model.safetensors, the second manifest
# written but not renamed in.
BETWEEN = [("export.manifest.done", 1), ("export.rename", 1), ("export.rename", 2), ("export.rename", 3),
           ("export.manifest.tmp", 2)]


@pytest.mark.parametrize("fault", [("export.rename", 1), ("export.rename", 2), ("export.rename", 3)],
                         ids=lambda f: f"{f[0]}-{f[1]}")
def test_kill_at_each_rename_is_refused_then_reexport_finishes(base, tmp_path, capsys, fault):
    """`qtrain export --step 2` over the run's step-4 export, killed after the k-th rename: eval refuses (it ran
    on the step-4 weights before), and the export run again completes to step 2's weights."""
    root = tmp_path / "root"
    shutil.copytree(base, root)
    argv = export_argv(root, "run", "--step", "2")
    old = eval_loss(root, root / "out" / "run", capsys)[1]
    new = eval_loss(root, export_copy(root, tmp_path / "ref", *argv), capsys)[1]
    assert old is not None and new is not None and old != new
    assert kill_trial(root, capsys, argv, fault, old, new) == "refused"


def test_overwrite_export_killed_is_refused(base, tmp_path, capsys):
    """`qtrain export --overwrite` of another run, killed between its renames: eval ran on the first run's model
    before; now it refuses, and so do generate, train --model and plan; an export of the first run is refused
    without --overwrite (naming the interrupted export of the other run); the interrupted export run again
    completes."""
    root = tmp_path / "root"
    shutil.copytree(base, root)
    argv = export_argv(root, "other", "--overwrite")
    old = eval_loss(root, root / "out" / "run", capsys)[1]
    new = eval_loss(root, export_copy(root, tmp_path / "ref", *argv), capsys)[1]
    r = qtrain_run(argv, cwd=root, timeout=120, QTRAIN_FAULT="export.rename:2")
    assert r.returncode == -9, r.stderr[-2000:]
    rc, _, err = eval_loss(root, root / "out" / "run", capsys)
    assert_refused(err, rc, root)
    for reader in (["generate", "--model", str(root / "out" / "run"), "--prompt", "hi", "--tokenizer", "gpt2"],
                   train_argv(root, name="ft", model=root / "out" / "run", extra=("--no-from-scratch",)),
                   ["plan", "--model", str(root / "out" / "run"), "--gpu-memory", "80GiB"]):
        capsys.readouterr()
        rc = main(reader)
        assert_refused(capsys.readouterr().err, rc, root)  # every reader of a model directory refuses it
    assert re.search(r"run `qtrain export --checkpoint-dir .*ckpt/other/step_00000002 --out-dir .*out/run` again",
                     err), err  # how to finish it: the same export again
    capsys.readouterr()
    assert main(export_argv(root, "run")) == 2
    err = capsys.readouterr().err
    assert re.search(r"holds an interrupted export of another run", err), err
    assert main(argv) == 0
    assert eval_loss(root, root / "out" / "run", capsys)[1] == new != old


def test_killed_run_export_is_refused_until_continue(base, tmp_path, capsys):
    """A training run killed between the renames of its own export: eval refuses and names --continue;
    `--continue` finishes the export, which eval then reads."""
    root = tmp_path / "root"
    shutil.copytree(base, root)
    argv = train_argv(root, steps=2, name="fresh")
    r = qtrain_run(argv, cwd=root, timeout=300, QTRAIN_FAULT="export.rename:3")
    assert r.returncode == -9, r.stderr[-2000:]
    rc, _, err = eval_loss(root, root / "out" / "fresh", capsys)
    assert_refused(err, rc, root)
    assert re.search(r"to finish it, resume run fresh \(`qtrain train ... --continue`\)", err), err
    assert main(argv + ["--continue"]) == 0
    rc, loss, err = eval_loss(root, root / "out" / "fresh", capsys)
    assert rc == 0 and loss is not None, err


SINGLE_FILE_EXPORT = textwrap.dedent("""
    import sys, torch
    from qtrain.model.hf_io import save_hf_model
    from tests.reliability.test_export_publish import random_params
    from tests.run_utils import CFG
    save_hf_model(sys.argv[1], CFG, random_params(2), dtype=torch.float32)
""")


def random_params(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) * 0.02 for n, s in param_shapes(CFG).items()}


def test_sharded_export_replaced_by_single_file_killed_while_removing_old_shards(tmp_path, capsys):
    """A sharded export replaced by a one-file export, killed while the old shards and index are removed: the
    index no longer belongs to the export, so a reader must not take it (or what is left of the old shards)."""
    make_run_root(tmp_path)
    out = tmp_path / "out" / "run"
    save_hf_model(out, CFG, random_params(1), dtype=torch.float32, max_shard_bytes=40_000)
    assert (out / "model.safetensors.index.json").exists()
    killed = subprocess.run([sys.executable, "-c", SINGLE_FILE_EXPORT, str(out)], capture_output=True, text=True,
                            timeout=120, env=subprocess_env(QTRAIN_FAULT="export.unlink:1"))
    assert killed.returncode == -9, killed.stderr
    rc, _, err = eval_loss(tmp_path, out, capsys)
    assert_refused(err, rc, tmp_path)


@pytest.mark.slow
def test_kill_at_every_export_point(base, tmp_path, capsys):
    """Every fault point of an export over an earlier one: eval refuses or reads exactly the old or the new
    export; every point between the two manifests is refused."""
    root = tmp_path / "trace-root"
    shutil.copytree(base, root)
    argv = export_argv(root, "run", "--step", "2")
    trace = tmp_path / "trace.txt"
    assert qtrain_run(argv, cwd=root, timeout=120, QTRAIN_FAULT_TRACE=str(trace)).returncode == 0
    plan = fault_plan(trace.read_text().split())
    assert set(BETWEEN) <= set(plan), plan
    seen = {}
    for i, fault in enumerate(plan):
        root = tmp_path / f"root{i}"
        shutil.copytree(base, root)
        argv = export_argv(root, "run", "--step", "2")
        old = eval_loss(root, root / "out" / "run", capsys)[1]
        new = eval_loss(root, export_copy(root, tmp_path / f"ref{i}", *argv), capsys)[1]
        seen[fault] = kill_trial(root, capsys, argv, fault, old, new)
    assert all(seen[f] == "refused" for f in BETWEEN), seen
    assert seen[plan[-1]] == "new" and seen[plan[0]] == "old", seen


# ---------------------------------------------------------------------------------------------- file modes

@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002], ids=oct)
def test_export_files_get_the_users_default_mode(base, tmp_path, umask):
    """Every file of an export (weights included; safetensors writes 0600 on its own) gets 0666 & ~umask, as
    any file the user creates."""
    old = os.umask(umask)
    try:
        out = tmp_path / "out"
        assert main(["export", "--checkpoint-dir", str(base / "ckpt" / "run"), "--out-dir", str(out)]) == 0
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert "model.safetensors" in modes and MANIFEST in modes
    assert modes == {n: 0o666 & ~umask for n in modes}, {n: oct(m) for n, m in modes.items()}


def test_plain_hf_directory_without_manifest_is_read_as_before(base, tmp_path, capsys):
    """A model directory that no qtrain export wrote (no manifest) is read as it is."""
    d = tmp_path / "plain"
    shutil.copytree(base / "out" / "run", d)
    (d / MANIFEST).unlink()
    rc, loss, err = eval_loss(base, d, capsys)
    assert rc == 0 and loss == eval_loss(base, base / "out" / "run", capsys)[1], err
