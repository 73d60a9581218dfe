"""Fixtures shared by the test packages (each folder mirrors a package of qtrain/).

Helpers that spawned worker processes must import (`run_distributed`, batches, model directories) live in
`tests/dist_utils.py`; tiny HF model builders in `tests/hf_fixtures.py`; the Triton-interpreter harness in
`tests/triton_interp.py`.
"""
from __future__ import annotations

import os
import re
import signal
import tempfile
from pathlib import Path

import pytest

from qtrain.cpu_threads import start_thread_pool
from tests.dist_utils import write_model_dir


# ------------------------------------------------------------------- unit and integration tests
# A test is `integration` when it runs qtrain as a user does (the CLI, several processes, a subprocess, a child
# pytest under Triton's interpreter) or sits in a folder of such tests; every other test is `unit`. Unit tests run
# first, and in CI (CI set in the environment) a failed unit test skips the integration tests after it: a broken
# unit fails in seconds, not after the end-to-end runs it breaks. `pytest -m unit` / `-m integration` select them.
INTEGRATION_FOLDERS = ("reliability", "bench")
_END_TO_END = re.compile(r"from qtrain\.cli\.main import main|qtrain_subprocess|run_distributed|launch_local|"
                         r"subprocess\.(run|Popen)|run_training\(")
_TESTS = Path(__file__).resolve().parent
_module_kind: dict[Path, bool] = {}
_failed_units: list[str] = []


def _is_integration(item: pytest.Item) -> bool:
    path = Path(str(item.fspath)).resolve()
    if item.name.startswith("test_interpreter_subprocess"):
        return True
    if path not in _module_kind:
        folder = path.relative_to(_TESTS).parts[0] if path.is_relative_to(_TESTS) else ""
        _module_kind[path] = folder in INTEGRATION_FOLDERS or bool(_END_TO_END.search(path.read_text("utf-8")))
    return _module_kind[path]


def pytest_configure(config: pytest.Config) -> None:
    """Every test process (the interpreter's child pytest too) starts torch's CPU thread pool before its first op:
    the first parallel region can round wrongly (qtrain/cpu_threads.py)."""
    start_thread_pool()
    # a run started as a background job of a non-interactive shell inherits SIGINT ignored, and so would every
    # process a test starts (tee in tests/reliability/test_signals.py would then outlive its Ctrl-C): a handler here
    # is reset to the default in each child at exec, as an interactive shell's foreground job has it
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker("integration" if _is_integration(item) else "unit")
    items.sort(key=lambda it: it.get_closest_marker("integration") is not None)  # stable: units first


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if report.failed and item.get_closest_marker("unit") is not None:
        _failed_units.append(item.nodeid)
    return report


def pytest_runtest_setup(item: pytest.Item) -> None:
    if os.environ.get("CI") and _failed_units and item.get_closest_marker("integration") is not None:
        pytest.skip(f"a unit test failed ({_failed_units[0]}): CI skips the integration tests")


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
