"""quack-kernels, the optional `[hopper]` extra: Dao-AILab's CuTe-DSL GEMMs for Hopper GPUs with fused epilogues
(a SwiGLU written by the up/gate GEMM, its backward by the down projection's input-gradient GEMM). The one place
that imports it and says whether a device can run it; `kernels/gated_mlp.py` calls it.

quack needs nvidia-cutlass-dsl, whose `cutlass` package sits in a folder its wheel adds to sys.path through a .pth
file; a `pip install --target` folder on PYTHONPATH has its .pth files unread, so that folder is added here as the
.pth would. quack fingerprints the Python functions an epilogue reaches by their source and globals unless they
live under a `site-packages` path, and cutlass-dsl's hold a Logger it cannot fingerprint: install both into a
folder whose path holds `/site-packages/` (bench/hopper_wheels.sh does).
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
from types import SimpleNamespace

import torch

__all__ = ["hopper_device", "quack", "quack_missing"]


@functools.lru_cache(maxsize=1)
def _load() -> tuple[SimpleNamespace | None, str]:
    try:
        spec = importlib.util.find_spec("nvidia_cutlass_dsl")
        if spec is not None and importlib.util.find_spec("cutlass") is None:
            for base in spec.submodule_search_locations or ():
                if os.path.isdir(os.path.join(base, "dsl_packages")):
                    sys.path.insert(0, os.path.join(base, "dsl_packages"))
                    break
        gemm = importlib.import_module("quack.gemm_interface")
        # the module, not the package's attribute of the same name (quack/__init__ exports the function rmsnorm)
        rmsnorm = importlib.import_module("quack.rmsnorm")
    except Exception as e:  # noqa: BLE001 - any failure (missing package, a .so that does not load) is the reason
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return None, f"{type(e).__name__}: {first}"[:300]
    return SimpleNamespace(gemm=gemm, rmsnorm=rmsnorm), ""


def quack() -> SimpleNamespace | None:
    """quack's modules (.gemm = quack.gemm_interface, .rmsnorm = quack.rmsnorm), imported once; None when they do
    not import (`quack_missing` says why). The first import takes ~10 s (cutlass-dsl's MLIR libraries)."""
    return _load()[0]


def quack_missing() -> str:
    """Why quack does not import ('' when it does)."""
    return _load()[1]


def hopper_device(device: torch.device | str | None = None) -> bool:
    """Whether `device` (default: the current CUDA device) is a Hopper GPU (sm90), the one quack's kernels here
    are built for."""
    if not torch.cuda.is_available():
        return False
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda":
        return False
    return torch.cuda.get_device_capability(dev)[0] == 9
