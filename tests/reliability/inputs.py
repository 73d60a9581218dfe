"""Broken token files built byte by byte (not by qtrain's writer, whose checks they must get past)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.run_utils import CFG

HEADER = b"BIN.TOK\n" + np.array([2, 4, 3000, CFG.vocab_size, 0], dtype="<i4").tobytes() + b"\0" * 996


def raw_token_file(path: Path, *, n: int | None = None, magic: bytes = b"BIN.TOK\n", version: int = 2, bpt: int = 4,
                   vocab: int = CFG.vocab_size, masks: int = 0, mask_bytes: int | None = None, cut: int = 0,
                   append: bytes = b"", poke: dict[int, int] | None = None, raw: bytes | None = None) -> Path:
    """A token file of `n` (default 3000) valid ids, then broken as asked: header fields, ids poked at
    offsets, bytes cut off or appended, a short mask section; or `raw` bytes as they are."""
    if raw is not None:
        path.write_bytes(raw)
        return path
    count = 3000 if n is None else n
    ids = np.random.default_rng(3).integers(0, min(vocab, CFG.vocab_size), max(count, 0)).astype("<i4")
    for i, v in (poke or {}).items():
        ids[i] = v
    head = magic + np.array([version, bpt, count, vocab, masks], dtype="<i4").tobytes()
    body = head + b"\0" * (1024 - len(head)) + ids.tobytes()
    if masks:
        body += b"\xff" * ((count + 7) // 8 if mask_bytes is None else mask_bytes)
    body = (body[:-cut] if cut else body) + append
    path.write_bytes(body)
    return path
