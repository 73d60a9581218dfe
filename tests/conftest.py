"""Fixtures shared by the test packages (each folder mirrors a package of qtrain/).

Helpers that spawned worker processes must import (`run_distributed`, batches, model directories) live in
`tests/dist_utils.py`; tiny HF model builders in `tests/hf_fixtures.py`; the Triton-interpreter harness in
`tests/triton_interp.py`.
"""
from __future__ import annotations

import pytest

from tests.dist_utils import write_model_dir


@pytest.fixture(scope="module")
def model_dir(request, tmp_path_factory) -> str:
    """A directory holding only the test module's `CFG` (a tiny ModelConfig) as an HF config.json, for
    `Options(model=..., from_scratch=True)` runs."""
    return write_model_dir(tmp_path_factory.mktemp("tiny-model"), request.module.CFG)
