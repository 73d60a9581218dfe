"""Full and read-only disks, for real: a small tmpfs (where this machine lets the tests mount one) and
`ulimit -f` (RLIMIT_FSIZE, anywhere). Each case asserts the message and exit code, that no temp files or
half-written checkpoints are left, and that the checkpoints already there are untouched."""
from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from qtrain.cli.main import main
from tests.run_utils import make_run_root, snapshot, subprocess_env, train_argv


@pytest.fixture
def small_fs(tmp_path):
    """A mount point factory: `small_fs(size, ro=False)` mounts a tmpfs of `size` under tmp_path."""
    mounted = []

    def mount(size: str, *, ro: bool = False) -> Path:
        d = tmp_path / f"fs{len(mounted)}"
        d.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}" + (",ro" if ro else ""), "tmpfs", str(d)],
                           capture_output=True)
        if r.returncode != 0:
            pytest.skip("cannot mount a tmpfs here (needs root): " + r.stderr.decode().strip())
        mounted.append(d)
        return d

    yield mount
    for d in mounted:
        subprocess.run(["umount", str(d)], capture_output=True)


def leftovers(*dirs: Path) -> list[str]:
    return [str(p) for d in dirs if d.exists() for p in d.rglob("*") if re.search(r"\.(tmp|old|del)-", p.name)]


def test_checkpoint_dir_full_names_need_and_free(tmp_path, small_fs, capsys):
    root = make_run_root(tmp_path)
    fs = small_fs("64k")
    rc = main(train_argv(root, steps=4, checkpoint_dir=fs / "ckpt"))
    err = capsys.readouterr().err
    assert rc == 2, err
    m = re.search(r"qtrain: error: the checkpoint of step 2 \(1 rank\(s\)\) needs ([\d.]+ \w+), but (\S+) has only "
                  r"([\d.]+ \w+) free", err)
    assert m and m.group(2) == str(fs / "ckpt"), err
    assert sorted(os.listdir(fs / "ckpt")) == ["qtrain-run.json"] and not leftovers(fs)


def test_out_dir_full_loses_nothing(tmp_path, small_fs, capsys):
    """The export fails on a full disk, after the final checkpoint: `qtrain export` turns that checkpoint into
    the export later, bit for bit what the run would have written."""
    root = make_run_root(tmp_path)
    fs = small_fs("16k")
    (fs / "keep.txt").write_text("the user's")
    rc = main(train_argv(root, steps=4, out_dir=fs))
    err = capsys.readouterr().err
    assert rc == 2, err
    assert re.search(r"qtrain: error: the export to \S+ needs [\d.]+ \w+, but \S+ has only [\d.]+ \w+ free", err), err
    assert (root / "ckpt" / "run" / "step_00000004" / "checkpoint.json").is_file()
    assert os.listdir(fs) == ["keep.txt"] and (fs / "keep.txt").read_text() == "the user's"
    assert main(["export", "--checkpoint-dir", str(root / "ckpt" / "run"), "--out-dir", str(root / "exported")]) == 0


@pytest.mark.parametrize("which", ["checkpoint-dir", "out-dir", "log-file"])
def test_read_only_filesystem_is_refused_before_anything(tmp_path, small_fs, capsys, which):
    root = make_run_root(tmp_path)
    fs = small_fs("64k", ro=True)
    target = {"checkpoint-dir": fs / "ckpt", "out-dir": fs / "out", "log-file": fs / "log.jsonl"}[which]
    before = snapshot(root)
    rc = main(train_argv(root, steps=4, **{which.replace("-", "_"): target}))
    err = capsys.readouterr().err
    assert rc == 2
    assert f"qtrain: error: --{which} {target}" in err and "not writable" in err, err
    assert snapshot(root) == before


def _limited(nbytes: int):
    def set_limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, resource.RLIM_INFINITY))
    return set_limit


def test_file_size_limit_during_a_checkpoint(tmp_path):
    """`ulimit -f`: the checkpoint write fails with EFBIG half-way; its temp directory is removed, the
    checkpoints written before stay as they were, and the message names the checkpoint and the cause."""
    root = make_run_root(tmp_path)
    assert main(train_argv(root, steps=4)) == 0
    ckpt = root / "ckpt" / "run"
    before = snapshot(ckpt)
    shard = (ckpt / "step_00000004" / "weights.shard_000_of_001.safetensors").stat().st_size
    r = subprocess.run([sys.executable, "-m", "qtrain.cli.main", *train_argv(root, steps=8), "--continue"], cwd=root,
                       env=subprocess_env(), capture_output=True, text=True, preexec_fn=_limited(shard // 2), timeout=600)
    assert r.returncode == 2, r.stderr[-3000:]
    assert re.search(r"qtrain: error: writing the checkpoint of step 6 to \S+step_00000006\.tmp-\S+ failed: File too "
                     r"large", r.stderr), r.stderr[-3000:]
    assert snapshot(ckpt) == before and not leftovers(ckpt)
    # with the limit gone, the same command resumes from step 4 and finishes
    assert main(train_argv(root, steps=8) + ["--continue"]) == 0
    assert sorted(p.name for p in ckpt.iterdir()) == ["qtrain-run.json", "step_00000002", "step_00000004",
                                                      "step_00000006", "step_00000008"]


def _fill(d: Path) -> None:
    """Write into `d` until its file system is full."""
    with open(d / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass


@pytest.mark.parametrize("fs", ["read-only", "full"])
def test_the_start_caches_on_a_full_or_read_only_file_system(tmp_path, small_fs, fs):
    """The bytecode folder (qtrain/bytecode_cache.py) and the compile keys (train/compile_keys.py) only save time:
    on a read-only or full file system the imports still work and the keys are still the real ones, nothing
    raises, and nothing is left behind but what fit."""
    from tests.test_bytecode_cache import _import, _library
    d = small_fs("64k", ro=fs == "read-only")
    if fs == "full":
        _fill(d)
    _library(tmp_path)
    out = _import(tmp_path, d)  # the folder exists: Python's writes there fail and are ignored
    assert out["value"] == 42 and out["used"] == str(d)
    script = ("import json; from pathlib import Path; import triton.runtime.cache as c; "
              "from qtrain.train.compile_keys import remember; s = remember(Path(%r)); "
              "print(json.dumps([s, c.triton_key() == c.triton_key.__wrapped__()]))" % str(d))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=subprocess_env(),
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [[], True]
    assert not (d / "keys.json").exists() and leftovers(d) == []
    files = [p for p in d.rglob("*") if p.is_file() and p.name != "filler"]
    assert files == [] if fs == "read-only" else all(p.suffix == ".pyc" for p in files), files  # no temp left
