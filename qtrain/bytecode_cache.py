"""Python bytecode for the libraries a run imports, kept where the installation keeps none.

A run imports some 2,400 modules of torch, inductor and Triton before its first step. pip compiles their bytecode
when it installs them, but an environment installed without it (`--no-compile`, images that set
`PYTHONDONTWRITEBYTECODE`, site-packages the user cannot write) has no `__pycache__` there and can never write
one: every process compiles every module from source again. On the GPU machine's image that was ~2.4k calls of
`compile()` in a warm start's profile, seconds of its ~10 (docs/start-time.md).

So when torch's, Triton's or sympy's package has no bytecode for its `__init__.py` that Python would load (none, or stale: a copied
installation's files get new mtimes) and no one chose a prefix, qtrain points Python's
bytecode cache at a folder of its own (`sys.pycache_prefix`, and `PYTHONPYCACHEPREFIX` for the processes it
starts) and lets it be written there even under `PYTHONDONTWRITEBYTECODE`: nothing is written beside any source
file, only under qtrain's cache folder, which holds only what Python can make again. Where the installation has
its bytecode (pip's default), or `PYTHONPYCACHEPREFIX` / `-X pycache_prefix` is set, nothing changes. Python
validates each cached file against its source's size and mtime, so a changed library is compiled again.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from qtrain.fsio import user_cache_home

ENV = "PYTHONPYCACHEPREFIX"
# the packages whose bytecode says whether the installation compiled its modules: torch, and two that torch.compile
# imports (a run imports ~2,400 modules of the three and their kin)
PROBES = ("torch", "triton", "sympy")


def default_dir() -> Path:
    """`$XDG_CACHE_HOME/qtrain/bytecode`, else `~/.cache/qtrain/bytecode`."""
    return user_cache_home() / "qtrain" / "bytecode"


def needed(probes: str | tuple[str, ...] = PROBES) -> bool:
    """Whether the installation of any of `probes` (installed ones) lacks valid bytecode, and no prefix was chosen."""
    if sys.pycache_prefix is not None:
        return False
    return any(_lacks_bytecode(p) for p in ((probes,) if isinstance(probes, str) else probes))


def _lacks_bytecode(package: str) -> bool:
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return False
    origin = getattr(spec, "origin", None) if spec is not None else None
    if not origin or not origin.endswith(".py"):
        return False  # not installed, or not from source
    return not _valid_bytecode(origin, importlib.util.cache_from_source(origin))


def _valid_bytecode(source: str, cached: str) -> bool:
    """Whether `cached` is bytecode Python would load for `source` (PEP 552's header: this interpreter's magic
    number; a timestamp .pyc must name the source's mtime and size, a hash-based one is taken as valid). A copied
    installation whose files got new mtimes has .pyc files that Python recompiles at every import."""
    try:
        with open(cached, "rb") as f:
            header = f.read(16)
        st = os.stat(source)
    except OSError:
        return False
    if len(header) < 16 or header[:4] != importlib.util.MAGIC_NUMBER:
        return False
    flags = int.from_bytes(header[4:8], "little")
    if flags & 0b1:  # hash-based (checked or not): the source's hash, not its stat, decides
        return True
    mtime, size = int.from_bytes(header[8:12], "little"), int.from_bytes(header[12:16], "little")
    return mtime == (int(st.st_mtime) & 0xFFFFFFFF) and size == (st.st_size & 0xFFFFFFFF)


def use(folder: Path | None = None, probes: str | tuple[str, ...] = PROBES) -> Path | None:
    """Keep bytecode under `folder` (default_dir()) when `needed(probes)`; returns the folder, or None when
    nothing changed."""
    if not needed(probes):
        return None
    folder = Path(folder or default_dir())
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # imports compile as they did
    sys.pycache_prefix = str(folder)
    sys.dont_write_bytecode = False  # it writes only under `folder` now (module docstring)
    os.environ[ENV] = str(folder)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    return folder
