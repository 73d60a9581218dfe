"""What identifies a token file's contents without reading all of it (size, times, inode and a sampled digest), and
the check, before the model is built, that every token id lies inside the vocabulary, with a per-file cache of the
scan keyed by that identity."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from qtrain.data.token_files import (BYTES_PER_TOKEN, HEADER_BYTES, DataError, PathLike, TokenFile, _open_token_file,
                                     _pread_into)
from qtrain.fsio import user_cache_home


# ----------------------------------------------------------------------------------------------
# Fingerprints: what identifies a file's contents without reading all of it

SAMPLE_BYTES = 4096  # bytes per sample of the sampled digest
SAMPLES = 8  # samples between the head (header + first SAMPLE_BYTES) and the last SAMPLE_BYTES


def _sampled_digest(fd: int, size: int) -> str:
    """sha256 of the size, the header and first bytes, SAMPLES blocks at fixed fractions of the size and the last
    block (the whole file when it is small): ~40 KiB read whatever the size, and any change of the header, of
    the length, or of the bytes at those places shows."""
    h = hashlib.sha256(size.to_bytes(8, "little"))
    whole = HEADER_BYTES + (SAMPLES + 2) * SAMPLE_BYTES
    spans = ([(0, size)] if size <= whole else
             [(0, HEADER_BYTES + SAMPLE_BYTES), *((k * size // (SAMPLES + 1), SAMPLE_BYTES) for k in range(1, SAMPLES + 1)),
              (size - SAMPLE_BYTES, SAMPLE_BYTES)])
    for offset, n in spans:
        buf = np.empty(n, dtype=np.uint8)
        got = _pread_into(fd, buf, offset)
        h.update(buf[:got].tobytes())
    return h.hexdigest()


def _fingerprint(fd: int) -> dict[str, Any]:
    st = os.fstat(fd)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "ino": st.st_ino,
            "dev": st.st_dev, "digest": _sampled_digest(fd, st.st_size)}


def file_fingerprint(path: PathLike) -> dict[str, Any]:
    """What identifies a file's contents, cheaply: `size`, `mtime_ns`, `ctime_ns` (set by the kernel on any
    change, even one whose mtime was put back with `os.utime`), `ino`, `dev` and `digest` (a sampled sha256, ~40
    KiB read: see `_sampled_digest`). A copy elsewhere keeps only its size and digest. Raises DataError when the
    path is not a readable regular file."""
    path = str(path)
    fd = _open_token_file(path)
    try:
        return _fingerprint(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------------------------
# Token id range check (run before the model is built), with a per-file cache of the scan

SCAN_CHUNK_TOKENS = 1 << 24  # tokens per vectorized min/max pass: 64 MiB of int32 at a time
_SCAN_CACHE_VERSION = 2


def token_cache_dir() -> Path:
    """Where per-file scan results live: $QTRAIN_CACHE_DIR, else $XDG_CACHE_HOME/qtrain, else ~/.cache/qtrain."""
    if os.environ.get("QTRAIN_CACHE_DIR"):
        return Path(os.environ["QTRAIN_CACHE_DIR"])
    return user_cache_home() / "qtrain"


def _scan_key(f: TokenFile | PathLike) -> tuple[Path, dict[str, Any]]:
    """(cache file, identity of the file's current contents): its real path and `file_fingerprint` (size, mtime,
    ctime, inode, device and a sampled digest). An edit in place changes the ctime even when the mtime is put
    back, and the digest when it touches a sampled block, so a cached answer never outlives the bytes it is of."""
    f = f if isinstance(f, TokenFile) else TokenFile(f)
    real = os.path.realpath(f.path)
    ident = {"path": real, **_fingerprint(f._fd), "version": _SCAN_CACHE_VERSION}
    name = hashlib.sha256(real.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return token_cache_dir() / "token-ids" / f"{name}.json", ident


def _chunks(f: TokenFile) -> Any:
    """(start, tokens) of the whole file, SCAN_CHUNK_TOKENS at a time, read into one reused buffer."""
    buf = np.empty(min(len(f), SCAN_CHUNK_TOKENS), dtype="<i4")
    for start in range(0, len(f), SCAN_CHUNK_TOKENS):
        yield start, f.read_into(start, buf[:min(SCAN_CHUNK_TOKENS, len(f) - start)])


def scan_token_ids(path: PathLike) -> tuple[int, int] | None:
    """(smallest, largest) token id of a token file, None when it holds no tokens. The file is read and reduced
    in vectorized chunks; the result is cached per file under `token_cache_dir()`, keyed by its path and
    fingerprint (`_scan_key`), so an unchanged file is scanned once."""
    from qtrain.fsio import atomic_write_json, read_json, sweep_temp_files

    f = TokenFile(path)
    try:
        cache, ident = _scan_key(f)
        hit = read_json(cache)
    except OSError:
        cache, ident, hit = None, None, None
    if isinstance(hit, dict) and {k: hit.get(k) for k in ident} == ident and "min" in hit:
        return None if hit["min"] is None else (int(hit["min"]), int(hit["max"]))
    lo = hi = None
    for _, chunk in _chunks(f):
        cmin, cmax = int(chunk.min()), int(chunk.max())
        lo = cmin if lo is None else min(lo, cmin)
        hi = cmax if hi is None else max(hi, cmax)
    if cache is not None:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            sweep_temp_files(cache.parent)  # what a killed writer left
            atomic_write_json(cache, {**ident, "min": lo, "max": hi}, point="token-cache")
        except OSError:
            pass  # an unwritable cache only costs a rescan next time
    return None if lo is None else (lo, hi)


def check_token_ids(path: PathLike, vocab_size: int) -> None:
    """DataError naming the file, the id and its offset when a token id lies outside [0, vocab_size): an id
    the embedding cannot look up would otherwise fail mid-run (a device assert on CUDA) naming nothing."""
    found = scan_token_ids(path)
    if found is None or (found[0] >= 0 and found[1] < vocab_size):
        return
    f = TokenFile(path)
    for start, chunk in _chunks(f):
        bad = np.flatnonzero((chunk < 0) | (chunk >= vocab_size))
        if bad.size:
            i = start + int(bad[0])
            n_bad = int(bad.size) + sum(int(((c < 0) | (c >= vocab_size)).sum()) for s, c in _chunks(f) if s > start)
            raise DataError(f"{f.path}: token id {int(chunk[bad[0]])} at token offset {i} (byte "
                            f"{HEADER_BYTES + BYTES_PER_TOKEN * i}) is outside the model's vocabulary [0, {vocab_size})"
                            f"; {n_bad} such id(s) in the file (ids range over [{found[0]}, {found[1]}])")
