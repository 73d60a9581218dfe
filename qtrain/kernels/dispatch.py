"""The one place that decides whether a kernel call runs Triton or its plain-torch twin.

Rule: Triton when the tensor lives on CUDA and ``triton`` imports; the twin otherwise, and the twin inside a
graph that torch.compile is tracing (inductor then generates the kernel itself and fuses it with its
neighbours: a quantization next to the SwiGLU that produced its input, say, instead of a separate launch). Tests can force a
path by setting ``BACKEND`` (or with the ``backend(...)`` context manager). Forcing ``"triton"`` on CPU
tensors only works under Triton's interpreter, which must be switched on (``TRITON_INTERPRET=1``) before
``qtrain.kernels`` is imported, because ``triton.jit`` decides at decoration time.

Triton is optional: without it every call runs the twin, and kernel modules still import (``jit`` becomes
a no-op and ``tl`` a stub whose ``constexpr`` only keeps kernel signatures evaluable).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
    INTERPRET = bool(triton.knobs.runtime.interpret)
except ImportError:  # CPU-only install: twins only
    triton = None
    tl = SimpleNamespace(constexpr=None)
    HAS_TRITON = False
    INTERPRET = False

__all__ = ["BACKEND", "HAS_TRITON", "INTERPRET", "backend", "jit", "tl", "triton", "use_triton"]

BACKEND: str = "auto"
""""auto": Triton for CUDA tensors when available; "twin": always the twin; "triton": always Triton."""

_BACKENDS = ("auto", "twin", "triton")


def jit(fn=None, **kwargs):
    """``triton.jit`` when Triton is installed, else the identity (the kernel is never launched)."""
    if not HAS_TRITON:
        return fn if fn is not None else (lambda f: f)
    return triton.jit(fn, **kwargs) if fn is not None else triton.jit(**kwargs)


def use_triton(t: torch.Tensor) -> bool:
    """True when a call on tensor ``t`` should launch the Triton kernel."""
    if BACKEND == "twin":
        return False
    if BACKEND == "triton":
        if not HAS_TRITON:
            raise RuntimeError("qtrain.kernels.dispatch.BACKEND='triton' but triton is not installed")
        if not t.is_cuda and not INTERPRET:
            raise RuntimeError(
                "BACKEND='triton' on a CPU tensor needs Triton's interpreter: set TRITON_INTERPRET=1 "
                "before importing qtrain.kernels"
            )
        return True
    if BACKEND != "auto":
        raise ValueError(f"qtrain.kernels.dispatch.BACKEND must be one of {_BACKENDS}, got {BACKEND!r}")
    return HAS_TRITON and t.is_cuda and not torch.compiler.is_compiling()


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    """Temporarily force a backend: ``with backend("twin"): ...``."""
    global BACKEND
    if name not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {name!r}")
    old, BACKEND = BACKEND, name
    try:
        yield
    finally:
        BACKEND = old
