"""Fixtures shared by the test packages (each folder mirrors a package of qtrain/).

Helpers that spawned worker processes must import (`run_distributed`, batches, model directories) live in
`tests/dist_utils.py`; tiny HF model builders in `tests/hf_fixtures.py`; the Triton-interpreter harness in
`tests/triton_interp.py`.
"""
from __future__ import annotations

import os
import tempfile

import pytest

from tests.dist_utils import write_model_dir


@pytest.fixture(scope="module")
def model_dir(request, tmp_path_factory) -> str:
    """A directory holding only the test module's `CFG` (a tiny ModelConfig) as an HF config.json, for
    `Options(model=..., from_scratch=True)` runs."""
    return write_model_dir(tmp_path_factory.mktemp("tiny-model"), request.module.CFG)


@pytest.fixture(autouse=True, scope="session")
def _token_scan_cache():
    """Token-id scan results (data/token_files.py) go to a cache of this session, not the user's ~/.cache;
    subprocesses inherit it through the environment."""
    old = os.environ.get("QTRAIN_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="qtrain-test-cache-") as d:
        os.environ["QTRAIN_CACHE_DIR"] = d
        yield d
    if old is None:
        os.environ.pop("QTRAIN_CACHE_DIR", None)
    else:
        os.environ["QTRAIN_CACHE_DIR"] = old


@pytest.fixture(autouse=True)
def fresh_compile_caches(request):
    """GPU tests compare compiled runs bit for bit; torch.compile's per-function cache (8 entries by default)
    fills up across a session's Trainers of different dtypes and options, after which dynamo runs the block
    eagerly without a word, and one run of a pair would be compiled while the other is not. Each GPU test
    starts with an empty cache, so its runs compile alike whatever ran before."""
    if request.node.get_closest_marker("gpu") is not None:
        import torch
        torch._dynamo.reset()
    yield
