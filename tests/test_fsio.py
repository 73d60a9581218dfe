"""qtrain/fsio.py: atomic writes leave the old file or the new one; temp files of dead writers are swept and
those of live ones kept; the free-space check names both numbers; the fault hook kills at the N-th point."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from qtrain import fsio


def test_atomic_write_replaces_whole_file_and_cleans_up_on_error(tmp_path):
    p = tmp_path / "a.json"
    fsio.atomic_write_json(p, {"v": 1})
    assert fsio.read_json(p) == {"v": 1}

    def broken(tmp):
        tmp.write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        fsio.atomic_write(p, broken)
    assert fsio.read_json(p) == {"v": 1}  # untouched
    assert sorted(x.name for x in tmp_path.iterdir()) == ["a.json"]  # no temp left behind


def test_temp_names_carry_host_and_pid(tmp_path):
    t = fsio.temp_path(tmp_path / "model.safetensors")
    assert t.parent == tmp_path and t.name.startswith(".model.safetensors.tmp-")
    assert t.name.endswith(f"-{os.getpid()}")


def test_sweep_removes_dead_writers_temp_files_only(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    host = fsio.owner_tag().rsplit("-", 1)[0]
    live_proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        names = {f".config.json.tmp-{host}-{dead}": "dead", f".model.safetensors.tmp-{host}-{live_proc.pid}": "live",
                 f".x.tmp-otherhost-{live_proc.pid}": "other host", "config.json": "the user's",
                 ".hidden.tmp-nothing": "not ours (no tag)"}
        for n, text in names.items():
            (tmp_path / n).write_text(text)
        removed = fsio.sweep_temp_files(tmp_path)
        assert sorted(p.name for p in removed) == sorted([f".config.json.tmp-{host}-{dead}",
                                                          f".x.tmp-otherhost-{live_proc.pid}"])
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [f".model.safetensors.tmp-{host}-{live_proc.pid}", "config.json", ".hidden.tmp-nothing"])
    finally:
        live_proc.kill()
        live_proc.wait()


def test_free_space_check_names_need_and_free(tmp_path):
    free = fsio.free_bytes(tmp_path)
    fsio.ensure_free_space(tmp_path / "not" / "yet", 1, "a tiny write")  # nearest existing ancestor counts
    with pytest.raises(fsio.DiskSpaceError) as e:
        fsio.ensure_free_space(tmp_path, free + (1 << 40), "the checkpoint of step 7")
    msg = str(e.value)
    assert "the checkpoint of step 7 needs" in msg and str(tmp_path) in msg and "free" in msg


def test_writable_checks(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(fsio.FileSystemError, match="exists and is not a directory"):
        fsio.check_writable_dir(tmp_path / "file", "--out-dir")
    with pytest.raises(fsio.FileSystemError, match="is a file, so the directory cannot be created"):
        fsio.check_writable_dir(tmp_path / "file" / "sub", "--out-dir")
    with pytest.raises(fsio.FileSystemError, match="is a directory, not a file"):
        fsio.check_writable_file(tmp_path, "--log-file")
    fsio.check_writable_dir(tmp_path / "new" / "deep", "--out-dir")  # creatable: fine, nothing created
    assert not (tmp_path / "new").exists()


def test_remove_tree_deletes_everything(tmp_path):
    d = tmp_path / "t"
    (d / "a" / "b").mkdir(parents=True)
    (d / "a" / "b" / "f").write_text("1")
    (d / "g").write_text("2")
    fsio.remove_tree(d)
    assert not d.exists()


@pytest.mark.parametrize("where", ["inside", "dir-inside", "top"])
def test_remove_tree_refuses_a_tree_with_a_link_and_deletes_nothing(tmp_path, where):
    """A symbolic link is the user's (qtrain makes none): neither followed nor removed, and nothing around it."""
    users = tmp_path / "users"
    users.mkdir()
    (users / "README").write_text("mine")
    d = tmp_path / "t"
    (d / "a").mkdir(parents=True)
    (d / "a" / "f").write_text("1")
    target = tmp_path / "t-link" if where == "top" else d / "a" / "link"
    os.symlink(users / "README" if where == "inside" else users, target)
    with pytest.raises(fsio.FileSystemError, match="is a symbolic link"):
        fsio.remove_tree(target if where == "top" else d)
    assert (users / "README").read_text() == "mine" and os.path.islink(target) and (d / "a" / "f").read_text() == "1"


@pytest.mark.parametrize("spec,expect_killed", [("demo.*:2", True), ("demo.b:1", True), ("demo.c:1", False)])
def test_fault_point_kills_at_the_nth_match(tmp_path, spec, expect_killed):
    trace = tmp_path / "trace"
    code = ("from qtrain.fsio import fault_point\n"
            "for n in ('demo.a', 'demo.b', 'demo.a'): fault_point(n)\n"
            "print('survived')\n")
    env = {**os.environ, "QTRAIN_FAULT": spec, "QTRAIN_FAULT_TRACE": str(trace),
           "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if expect_killed:
        assert r.returncode == -9 and "survived" not in r.stdout
        assert trace.read_text().split() == ["demo.a", "demo.b"]  # traced up to the kill
    else:
        assert r.returncode == 0 and "survived" in r.stdout
        assert trace.read_text().split() == ["demo.a", "demo.b", "demo.a"]


@pytest.mark.parametrize("text,depth", [
    ("", 0), ("1", 0), ("{}", 1), ('[1, [2, {"a": [3]}]]', 4),
    ('{"a": "[[[[{{{{"}', 1),  # brackets inside strings do not count
    ('["\\"[[[", [1]]', 2),  # nor after an escaped quote inside a string
    ('"[[[', 0),  # an unterminated string runs to the end (the parser refuses the text anyway)
    ("[" * 100_000 + "]" * 100_000, 100_000)])
def test_json_nesting_counts_brackets_outside_strings(text, depth):
    assert fsio.json_nesting(text) == depth


def test_json_inputs_are_bounded(tmp_path):
    """Too deep (refused before the recursive parser), too large, not a regular file, not JSON: one InputError
    each, naming the file; a marker that is any of these reads as missing."""
    p = tmp_path / "c.json"
    for text, match in [("[" * 65 + "]" * 65, "nested more than 64 levels"), ("{", "not valid JSON"),
                        ("x" * 2000, "is larger than")]:
        p.write_text(text)
        with pytest.raises(fsio.InputError, match=match):
            fsio.read_json_input(p, "", 1000)
        assert fsio.read_json(p) is None
    p.write_text('{"a": ' * 64 + "1" + "}" * 64)
    assert fsio.data_nesting(fsio.read_json_input(p, "", 1000)) == 64
    os.unlink(p)
    os.mkfifo(p)
    with pytest.raises(fsio.InputError, match="not a regular file"):
        fsio.read_json_input(p, "--x", 1000)
    assert fsio.read_json(p) is None  # never blocks


def test_default_file_mode_follows_the_umask():
    old = os.umask(0o027)
    try:
        assert fsio.default_file_mode() == 0o640
    finally:
        os.umask(old)
