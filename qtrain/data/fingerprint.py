"""A data file's identity, cheap enough to take at every checkpoint: path, size, mtime, inode and a sampled digest.

    fp = fingerprint("data/train.bin")   # {"path", "size", "mtime_ns", "inode", "digest": "blake2b:..."}
    same_content(fp, fingerprint(path))  # size and sampled digest agree

Why sampled: a training corpus is many gigabytes, read again at every checkpoint a full hash would cost minutes.
The digest hashes the size, the first 64 KiB (the token file header and the first ids) and 64 KiB at each of a few
fixed fractions of the file and at its end: a file replaced, appended to, truncated or rewritten almost surely
changes one of those (a rewrite that keeps the size and leaves every sampled block alone does not; the size and
the mtime still tell such a file apart, which `describe_change` reports). A file only touched or copied (new mtime
or inode, the same bytes sampled) keeps its content.
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, Mapping

SAMPLE_BYTES = 64 * 1024
SAMPLE_FRACTIONS = (0.25, 0.5, 0.75)  # besides the start and the end
DIGEST_ALGO = "blake2b"


def sampled_digest(path: str | os.PathLike, size: int) -> str:
    """`blake2b:<hex>` of the size and the sampled blocks (module docstring)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(size.to_bytes(8, "little"))
    offsets = sorted({0, *(int(size * f) // SAMPLE_BYTES * SAMPLE_BYTES for f in SAMPLE_FRACTIONS),
                      max(size - SAMPLE_BYTES, 0)})
    with open(path, "rb") as f:
        for off in offsets:
            f.seek(off)
            h.update(off.to_bytes(8, "little"))
            h.update(f.read(SAMPLE_BYTES))
    return f"{DIGEST_ALGO}:{h.hexdigest()}"


def fingerprint(path: str | os.PathLike) -> dict[str, Any]:
    """The identity of the file at `path` now (its absolute path, size, mtime, inode, sampled digest)."""
    st = os.stat(path)
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino,
            "digest": sampled_digest(path, st.st_size)}


def same_content(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two fingerprints describe the same bytes as far as the sample tells (size and digest)."""
    return a.get("size") == b.get("size") and a.get("digest") == b.get("digest")


def describe_change(old: Mapping[str, Any], new: Mapping[str, Any]) -> str | None:
    """How a file changed between two fingerprints (of one path, or of its place in a moved folder): 'appended to
    (S -> S' bytes)', 'truncated', 'rewritten in place', 'replaced by another file', 'touched'; None when nothing
    did."""
    if old.get("size") != new.get("size"):
        grew = isinstance(old.get("size"), int) and isinstance(new.get("size"), int) and new["size"] > old["size"]
        return f"{'appended to' if grew else 'truncated'} ({old.get('size')} -> {new.get('size')} bytes)"
    if old.get("digest") != new.get("digest"):
        if old.get("path") != new.get("path"):  # moved: its inode says nothing
            return "changed (same size, other content)"
        return ("replaced by another file of the same size" if old.get("inode") != new.get("inode")
                else "rewritten in place (same size)")
    if old.get("mtime_ns") != new.get("mtime_ns") or old.get("inode") != new.get("inode"):
        return "touched or copied (same size and sampled content)"
    return None
