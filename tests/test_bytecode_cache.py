"""qtrain/bytecode_cache.py: where a library's installation holds no bytecode and may not get any (here:
`PYTHONDONTWRITEBYTECODE`), qtrain keeps it under its own folder, so the next process loads it instead of compiling
every module again; nothing is written beside the sources; an installation with its bytecode, or a prefix the user
chose, is left alone. The imports run in fresh interpreters (a prefix lasts for the process)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from qtrain import bytecode_cache

REPO = Path(__file__).resolve().parents[1]


def _library(root: Path) -> Path:
    """A package `libx` with a submodule and no bytecode."""
    pkg = root / "site" / "libx"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from libx import part\nVALUE = part.VALUE + 1\n")
    (pkg / "part.py").write_text("VALUE = 41\n")
    return pkg


def _import(root: Path, folder: Path, **env: str) -> dict:
    """In a fresh interpreter with `PYTHONDONTWRITEBYTECODE`: bytecode_cache.use(folder, probes="libx"), then import
    libx; what happened, as JSON."""
    script = textwrap.dedent(f"""
        import json, os, sys
        from pathlib import Path
        from qtrain import bytecode_cache
        used = bytecode_cache.use(Path({str(folder)!r}), probes="libx")
        import libx, libx.part
        print(json.dumps({{"used": str(used) if used else None, "value": libx.VALUE, "cached": libx.part.__cached__,
                          "prefix": sys.pycache_prefix, "env": os.environ.get("PYTHONPYCACHEPREFIX")}}))
    """)
    base = {k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"}
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**base, "PYTHONPATH": f"{REPO}{os.pathsep}{root / 'site'}",
                              "PYTHONDONTWRITEBYTECODE": "1", **env})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_library_without_bytecode_gets_it_under_qtrains_folder_once(tmp_path):
    pkg = _library(tmp_path)
    folder = tmp_path / "bytecode"
    first = _import(tmp_path, folder)
    assert first["value"] == 42 and first["used"] == first["prefix"] == first["env"] == str(folder)
    cached = Path(first["cached"])
    assert cached.is_file() and folder in cached.parents  # the mirror tree under the folder
    assert not (pkg / "__pycache__").exists()  # nothing beside the sources
    stamp = cached.stat().st_mtime_ns
    second = _import(tmp_path, folder)
    # the second process found torch-less libx's bytecode where the first wrote it and did not write it again
    assert second["cached"] == first["cached"] and cached.stat().st_mtime_ns == stamp and second["value"] == 42
    (pkg / "part.py").write_text("VALUE = 1000\n")  # a changed source (its size differs) is compiled again
    assert _import(tmp_path, folder)["value"] == 1001 and cached.stat().st_mtime_ns != stamp


def test_a_prefix_the_user_chose_is_kept(tmp_path):
    _library(tmp_path)
    theirs = tmp_path / "theirs"
    out = _import(tmp_path, tmp_path / "bytecode", PYTHONPYCACHEPREFIX=str(theirs))
    assert out["used"] is None and out["prefix"] == str(theirs) and not (tmp_path / "bytecode").exists()


def test_an_installation_with_its_bytecode_is_left_alone(tmp_path, monkeypatch):
    pkg = _library(tmp_path)
    import py_compile
    for src in pkg.glob("*.py"):
        py_compile.compile(str(src), doraise=True)  # what pip does at install
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(sys, "pycache_prefix", None)
    assert not bytecode_cache.needed("libx")
    (pkg / "__pycache__").rename(tmp_path / "moved")
    assert bytecode_cache.needed("libx")
    assert bytecode_cache.needed(("no_such_module_here", "libx"))  # any installed probe without bytecode
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "theirs"))
    assert not bytecode_cache.needed("libx")
    assert not bytecode_cache.needed("no_such_module_here")


def test_a_folder_that_cannot_be_made_changes_nothing(tmp_path, monkeypatch):
    _library(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(sys, "pycache_prefix", None)
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a folder")
    assert bytecode_cache.use(blocker / "bytecode", probes="libx") is None
    assert sys.pycache_prefix is None and blocker.read_text() == "a file, not a folder"


def test_stale_bytecode_counts_as_none(tmp_path, monkeypatch):
    """A .pyc whose header names another mtime (an installation copied after it was compiled) is recompiled by
    Python at every import: as good as none."""
    import py_compile
    pkg = _library(tmp_path)
    py_compile.compile(str(pkg / "__init__.py"), doraise=True)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(sys, "pycache_prefix", None)
    assert not bytecode_cache.needed("libx")
    st = (pkg / "__init__.py").stat()
    os.utime(pkg / "__init__.py", ns=(st.st_atime_ns, st.st_mtime_ns + 5 * 10**9))  # copied: a new mtime
    assert bytecode_cache.needed("libx")
    os.utime(pkg / "__init__.py", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert not bytecode_cache.needed("libx")
    cached = Path(__import__("importlib.util").util.cache_from_source(str(pkg / "__init__.py")))
    cached.write_bytes(b"\0" * 16 + cached.read_bytes()[16:])  # another interpreter's magic number
    assert bytecode_cache.needed("libx")
