"""Start torch's CPU thread pool before any result depends on it.

On torch 2.13's CPU build (OpenMP), the first parallel region of a process sometimes runs its worker threads as if
under another floating-point rounding mode: the workers' share of that first op comes out wrong (sqrt one ulp low,
exp and log off by ~1.5e-4, tanh by ~5e-5), every later op is right. Measured on a 2-thread
machine: 2-10% of fresh processes, any op that splits across threads (a (7, 1000) fp32 exp, say), AVX2 and AVX-512
alike; it broke a specification's logsumexp in CI. Running one throwaway parallel region first makes every later
one exact (60 of 60 processes, against 2-5 of 60 wrong without). qtrain's CPU path is the specification of every
GPU kernel and promises bitwise resume across processes, so every training, eval and generate process starts the
pool as it picks its device (`parallel.dist.init_distributed`, `train.evaluate.resolve_device`), and so does every
test process (tests/conftest.py). Not at `import qtrain`: `qtrain --help` imports no torch.
"""
from __future__ import annotations

import torch

# Large enough that ATen splits it over every thread (its grain is 32,768 elements).
_WARMUP_ELEMENTS = 1 << 16


def start_thread_pool() -> None:
    """Run one parallel elementwise op whose result is dropped, so that the pool's threads exist and are set up."""
    if torch.get_num_threads() > 1:
        torch.empty(_WARMUP_ELEMENTS).fill_(1.0).add_(1.0)
