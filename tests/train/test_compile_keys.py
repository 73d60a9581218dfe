"""The compile cache's keys remembered between runs (train/compile_keys.py): a matching fingerprint serves the
remembered key to torch and Triton, through the paths inductor's cache lookups take; a stale, corrupt or missing
file is replaced by the real keys; a folder that cannot be written costs nothing but the hashing. Each case that
serves a key runs in a fresh interpreter: a served key lasts for the process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from qtrain.train.compile_keys import FILE, fingerprint

REPO = Path(__file__).resolve().parents[2]


def _run(*parts: str) -> dict:
    """Run the script of `parts` (each dedented) in a fresh interpreter; it prints one JSON line last."""
    script = "\n".join(textwrap.dedent(p) for p in parts)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# what a process's keys are, seen where inductor and Triton read them
PROBE = """
    import json
    import triton.runtime.autotuner, triton.runtime.cache
    from torch._inductor import codecache
    from torch._inductor.runtime import triton_compat
    keys = {"torch": codecache.torch_key().hex(), "triton": triton.runtime.cache.triton_key(),
            "autotuner": triton.runtime.autotuner.triton_key(), "compat": triton_compat.triton_key(),
            "inductor": getattr(codecache, "triton_key", triton_compat.triton_key)()}  # torch 2.13: its own cache
"""


def test_the_fingerprint_follows_size_mtime_names_and_version(tmp_path):
    (tmp_path / "pkg").mkdir()
    a = tmp_path / "pkg" / "a.py"
    a.write_text("x = 1\n")
    (tmp_path / "notes.txt").write_text("not hashed with a suffix filter")
    base = fingerprint(tmp_path, "1.0", (".py",))
    assert fingerprint(tmp_path, "1.0", (".py",)) == base
    (tmp_path / "notes.txt").write_text("changed")
    assert fingerprint(tmp_path, "1.0", (".py",)) == base  # filtered out
    assert fingerprint(tmp_path, "1.1", (".py",)) != base
    st = a.stat()
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert fingerprint(tmp_path, "1.0", (".py",)) != base  # the same bytes, touched
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert fingerprint(tmp_path, "1.0", (".py",)) == base
    a.write_text("x = 2\n")  # the same size: restore the time to see the content alone is not what counts
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert fingerprint(tmp_path, "1.0", (".py",)) == base  # what .pyc validation accepts too
    a.write_text("x = 22\n")
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert fingerprint(tmp_path, "1.0", (".py",)) != base  # size
    (tmp_path / "pkg" / "b.py").write_text("")
    assert fingerprint(tmp_path, "1.0", (".py",)) != fingerprint(tmp_path, "1.0", (".pyx",))


def test_a_stale_file_is_replaced_by_the_real_keys_then_they_are_served(tmp_path):
    """Run 1 finds a file whose fingerprints are stale and keys false: it computes the real keys and rewrites
    it. Run 2 is served them from the file, everywhere inductor and Triton read them."""
    folder = tmp_path / "compile"
    folder.mkdir()
    (folder / FILE).write_text(json.dumps({n: {"fingerprint": "stale", "key": "ab"} for n in ("torch", "triton")}))
    first = _run(f"""
        from pathlib import Path
        from qtrain.train.compile_keys import remember
        served = remember(Path({str(folder)!r}))
    """, PROBE, """
        real = {"torch": (codecache.torch_key.clear(), codecache.torch_key())[1].hex(),
                "triton": triton.runtime.cache.triton_key.__wrapped__()}
        print(json.dumps({"served": served, "keys": keys, "real": real}))
    """)
    assert first["served"] == []
    memo = json.loads((folder / FILE).read_text())
    assert {n: memo[n]["key"] for n in ("torch", "triton")} == first["real"]
    assert first["keys"]["torch"] == first["real"]["torch"] and first["real"]["triton"].startswith("3.")
    assert {first["keys"][k] for k in ("triton", "autotuner", "compat", "inductor")} == {first["real"]["triton"]}

    # run 2: the real fingerprints, marked keys: what it serves is what the file says
    memo["torch"]["key"], memo["triton"]["key"] = "00" * 32, "served-from-the-file"
    (folder / FILE).write_text(json.dumps(memo))
    second = _run(f"""
        from pathlib import Path
        from qtrain.train.compile_keys import remember
        served = remember(Path({str(folder)!r}))
    """, PROBE, """
        print(json.dumps({"served": served, "keys": keys}))
    """)
    assert sorted(second["served"]) == ["torch", "triton"]
    assert second["keys"]["torch"] == "00" * 32
    assert {second["keys"][k] for k in ("triton", "autotuner", "compat", "inductor")} == {"served-from-the-file"}
    assert json.loads((folder / FILE).read_text()) == memo  # a hit writes nothing


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b'{"torch": 3, "triton": {"fingerprint": 1}}'])
def test_a_corrupt_file_is_rewritten(tmp_path, content):
    (tmp_path / FILE).write_bytes(content)
    out = _run(f"""
        from pathlib import Path
        from qtrain.train.compile_keys import remember
        import json; print(json.dumps(remember(Path({str(tmp_path)!r}))))
    """)
    assert out == []
    memo = json.loads((tmp_path / FILE).read_text())
    assert set(memo) >= {"torch", "triton"} and all(len(memo[n]["fingerprint"]) == 64 for n in ("torch", "triton"))


def test_a_folder_that_cannot_be_written_costs_only_the_hashing(tmp_path):
    """A file where keys.json's folder would be (what root cannot write through either): no error, no file."""
    blocker = tmp_path / "blocker"
    blocker.write_text("a file")
    out = _run(f"""
        from pathlib import Path
        from qtrain.train.compile_keys import remember
        served = remember(Path({str(blocker)!r}) / "compile")
    """, PROBE, """
        print(json.dumps({"served": served, "keys": keys}))
    """)
    assert out["served"] == [] and out["keys"]["triton"].startswith("3.")
    assert blocker.read_text() == "a file"


def test_the_compile_cache_remembers_its_keys(tmp_path, monkeypatch):
    """--compile-cache DIR: DIR/keys.json once the run's cache is set up; a folder that is not there (use() could
    not make it) gets none; --compile-cache none, none anywhere."""
    from qtrain.train import compile_cache
    for var in compile_cache.ENV.values():
        monkeypatch.delenv(var, raising=False)
    compile_cache.use(str(tmp_path / "cache"))
    compile_cache.remember_keys(str(tmp_path / "cache"))
    memo = json.loads((tmp_path / "cache" / FILE).read_text())
    assert {"torch", "triton"} <= set(memo)
    compile_cache.remember_keys(str(tmp_path / "absent"))
    assert not (tmp_path / "absent").exists()
    compile_cache.remember_keys("none")


def test_a_run_the_preflight_refuses_does_not_wait_for_the_keys(tmp_path, monkeypatch, capsys):
    """The keys are served (or computed: inductor's import, seconds on the GPU machine) after the preflight, so a
    compiled run with a missing train file is refused first and its cache folder gets no keys.json."""
    from qtrain.cli.main import main
    from qtrain.train import compile_cache
    from tests.run_utils import make_run_root, train_argv
    for var in compile_cache.ENV.values():
        monkeypatch.delenv(var, raising=False)
    root = make_run_root(tmp_path / "run")
    (root / "train.bin").unlink()
    rc = main(train_argv(root, steps=1, compile="on", compile_cache=tmp_path / "cache"))
    err = capsys.readouterr().err
    assert rc == 2 and "train.bin" in err
    assert (tmp_path / "cache" / "inductor").is_dir() and not (tmp_path / "cache" / FILE).exists()
