"""File-system helpers shared by every layer that writes files atomically (HF exports, checkpoints)."""
from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or directory: a rename is only durable once the bytes and the directory entries are."""
    fd = os.open(Path(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
