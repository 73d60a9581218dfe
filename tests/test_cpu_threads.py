"""The CPU thread pool starts before a training process's first op (qtrain/cpu_threads.py says why)."""
from __future__ import annotations

import subprocess
import sys

from tests.run_utils import subprocess_env

_COUNT_THREADS = """
import os, sys
def threads():
    return len(os.listdir('/proc/self/task'))
import torch
before = threads()
{call}
print(before, threads())
"""


def _threads_before_and_after(call: str) -> tuple[int, int]:
    """Threads of a fresh two-thread process before and after `call` (a new process: the pool starts once)."""
    env = {**subprocess_env(), "OMP_NUM_THREADS": "2"}
    r = subprocess.run([sys.executable, "-c", _COUNT_THREADS.format(call=call)], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    before, after = map(int, r.stdout.split())
    return before, after


def test_start_thread_pool_starts_the_workers():
    """Importing torch starts no worker; start_thread_pool does (the worker that the first region would create)."""
    before, after = _threads_before_and_after("from qtrain.cpu_threads import start_thread_pool; start_thread_pool()")
    assert after == before + 1


def test_a_training_process_starts_the_pool_as_it_sets_up():
    before, after = _threads_before_and_after("from qtrain.parallel.dist import init_distributed; init_distributed('cpu')")
    assert after >= before + 1


def test_an_import_alone_starts_nothing():
    """The control: without the call the pool is not running, so the two tests above can fail."""
    before, after = _threads_before_and_after("import qtrain.cpu_threads, qtrain.parallel.dist")
    assert after == before


def test_an_eval_or_generate_process_starts_the_pool_as_it_picks_its_device():
    before, after = _threads_before_and_after("from qtrain.train.evaluate import resolve_device; resolve_device('cpu')")
    assert after >= before + 1
