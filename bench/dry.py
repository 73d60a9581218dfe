"""--dry-run support: the kinds shrink their cases to something a CPU runs in seconds (same model family, same
options, a tiny model), so CI tests the harness, the suites and the benchmark code without a GPU."""
from __future__ import annotations

from bench.shapes import config_dir, tiny_config


def tiny_model_dir(model: str, **overrides) -> str:
    """A model directory (config.json only, for --from-scratch) of `model`'s family at the tiny shape
    (bench/shapes.py: TINY_SHAPE and the family's own dims shrunk; with `overrides`, e.g. the real vocab_size);
    written once per family under the temp dir."""
    return config_dir(tiny_config(model, **overrides))


def divisor_or_one(n: int, total: int) -> int:
    """A chunk count kept only where it still divides the shrunk size."""
    return n if n >= 1 and total % n == 0 else 1
