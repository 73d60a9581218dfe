"""The compile cache's own keys, remembered between runs: a warm start need not hash torch and Triton again.

Every cache lookup of inductor and Triton is keyed by a hash of the installed torch (`torch_key`: its ~2,300 Python
files) and of the installed Triton (`triton_key`: its compiler sources and the 400 MB `libtriton.so`). Each
process computes both once, before its first compiled step can be served from the cache: 0.5-1.6 s of a warm
start measured on a 2-core CPU, more where the library is not in the page cache. Both are pure functions of
those files, so this module keeps them in `keys.json` in the compile-cache folder, each beside a fingerprint of
the files it covers: the path, size and modification time of every file under the package that its key can read
(torch: its .py, .cpp and .ld files; Triton: all; what Python's own .pyc files check of their source: any reinstall
or edit changes it), plus the package version. A run whose
fingerprint matches takes the remembered key; any other run computes the key as torch would, then (re)writes the
file atomically. A folder that cannot be written, or a file that cannot be read, only costs the hashing.

Serving the key uses torch's own `torch_key.set` (torch 2.11+) and, for Triton's `functools.lru_cache`'d
`triton_key`, a replacement in the modules that bound it by name; where either hook is missing (another torch or
Triton) nothing is changed and the keys are computed as before.
"""
from __future__ import annotations

import functools
import hashlib
import os
import sys
from pathlib import Path
from typing import Any, Callable

from qtrain.fsio import atomic_write_json, read_json

FILE = "keys.json"
# the modules that hold Triton's triton_key under that name (bound at their import)
TRITON_KEY_HOLDERS = ("triton.runtime.cache", "triton.runtime.autotuner", "torch._inductor.runtime.triton_compat")


def fingerprint(root: str | os.PathLike, version: str, suffixes: tuple[str, ...] | None = None) -> str:
    """A hash of (relative path, size, mtime_ns) of every file under `root` (those ending in `suffixes`, or
    all), and `version`."""
    h = hashlib.sha256(version.encode())
    root = os.fspath(root)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            if suffixes is not None and not name.endswith(suffixes):
                continue
            path = os.path.join(dirpath, name)
            try:
                st = os.stat(path)
            except OSError:
                continue
            h.update(f"{os.path.relpath(path, root)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def remember(folder: Path) -> list[str]:
    """Serve torch's and Triton's keys from `folder`/keys.json where their fingerprints match, compute and
    record them where not; returns the names of the keys served from the file (for the run log)."""
    memo = read_json(folder / FILE)
    memo = memo if isinstance(memo, dict) else {}
    served, changed = [], False
    for name, (fp, serve, compute) in _keys().items():
        entry = memo.get(name)
        if isinstance(entry, dict) and entry.get("fingerprint") == fp and isinstance(entry.get("key"), str):
            if serve(entry["key"]):
                served.append(name)
            continue
        memo[name] = {"fingerprint": fp, "key": compute()}
        changed = True
    if changed:
        try:
            atomic_write_json(folder / FILE, memo, point="compile_keys")
        except OSError:
            pass  # only the hashing is lost: the next run computes the keys again
    return served


def _keys() -> dict[str, tuple[str, Callable[[str], bool], Callable[[], str]]]:
    """name -> (fingerprint of its files, serve(key) -> whether it took, compute() -> key), for the keys this
    torch and Triton let be served."""
    import torch
    import torch._inductor.codecache as codecache

    keys: dict[str, tuple[str, Callable[[str], bool], Callable[[], str]]] = {}
    torch_key = codecache.torch_key
    if callable(getattr(torch_key, "set", None)):
        fp = fingerprint(os.path.dirname(torch.__file__), torch.__version__, (".py", ".cpp", ".ld"))
        keys["torch"] = (fp, functools.partial(_serve_torch_key, torch_key), lambda: torch_key().hex())
    try:
        import triton
        import triton.runtime.cache as triton_cache
    except ImportError:
        return keys
    original = getattr(triton_cache, "triton_key", None)
    if callable(getattr(original, "cache_clear", None)):  # the lru_cache'd function this module knows
        fp = fingerprint(os.path.dirname(triton.__file__), getattr(triton, "__version__", ""))
        keys["triton"] = (fp, functools.partial(_serve_triton_key, original), original)
    return keys


def _serve_torch_key(torch_key: Any, key: str) -> bool:
    try:
        torch_key.set(bytes.fromhex(key))
    except (AssertionError, RuntimeError, ValueError):  # computed already in this process, or not hex
        return False
    return True


def _serve_triton_key(original: Callable[[], str], key: str) -> bool:
    """Replace Triton's triton_key by one that returns `key`, wherever a module holds the original."""
    @functools.lru_cache()
    def triton_key() -> str:
        return key

    triton_key.__wrapped__ = original  # type: ignore[attr-defined]
    holders = [sys.modules.get(m) for m in TRITON_KEY_HOLDERS]
    for module in holders:
        if module is not None and getattr(module, "triton_key", None) is original:
            module.triton_key = triton_key
    return True
