"""Host buffers for offload: pinned (page-locked) where CUDA runs, of exactly the bytes asked.

torch's `pin_memory=True` allocates through its caching host allocator, which rounds every request up to the next
power of two (torch 2.11; newer releases can turn that off with `pinned_max_round_threshold_mb`): the 1.2 GB Adam
moment of one Qwen3-30B-A3B layer's experts takes 2 GiB, and a run whose plan fits the host (100 GiB of 128) was
killed by the kernel's OOM killer. So a large buffer here is an anonymous memory map of exactly its pages, registered
with the CUDA driver (`cudaHostRegister`): copies from and to the GPU run asynchronously as from torch's pinned
memory, `is_pinned()` holds, and the pages come zeroed. The registration ends when the last tensor viewing the
buffer goes (after the device has finished its queued work), before the map is unmapped. Buffers under
EXACT_MIN_BYTES keep torch's allocator: rounding them up costs little, and its cache reuses them.

Without CUDA (or for a CPU run) a buffer is plain host memory: `torch.zeros` / `torch.empty`.
"""
from __future__ import annotations

import math
import mmap
import weakref
from typing import Callable

import torch

__all__ = ["EXACT_MIN_BYTES", "host_buffer", "zeros"]

EXACT_MIN_BYTES = 16 << 20  # smaller pinned buffers keep torch's (rounding, caching) allocator


def _cuda_register(ptr: int, nbytes: int) -> None:
    rc = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    if int(rc) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes of host memory failed (CUDA error {int(rc)}): "
                           f"the driver could not lock that much memory (ulimit -l, or the host is short of it)")


def _cuda_unregister(ptr: int) -> None:
    torch.cuda.synchronize()  # no copy may still read or write the pages
    torch.cuda.cudart().cudaHostUnregister(ptr)


def registered_map(nbytes: int, register: Callable[[int, int], None] = _cuda_register,
                   unregister: Callable[[int], None] = _cuda_unregister) -> torch.Tensor:
    """A uint8 tensor over an anonymous map of `nbytes` (zeroed), registered by `register(ptr, nbytes)`;
    `unregister(ptr)` runs once, when the last tensor over it is gone and while the map is still mapped.

    The tensor's storage holds a memoryview of the map (torch.frombuffer keeps its exporter); the finalizer of that
    memoryview holds the map itself, so the order on release is: storage freed, memoryview freed, unregister, the
    map's last reference dropped, munmap."""
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(mm)
    t = torch.frombuffer(view, dtype=torch.uint8)
    ptr = t.data_ptr()
    register(ptr, nbytes)
    # the finalizer's arguments keep the map; at exit the process's end releases both
    weakref.finalize(view, _release, unregister, ptr, mm).atexit = False
    return t


def _release(unregister: Callable[[int], None], ptr: int, mm: mmap.mmap) -> None:
    """`mm`: held until this returns, so the pages are still mapped while they are unregistered."""
    unregister(ptr)


def host_buffer(shape: int | tuple[int, ...] | torch.Size, dtype: torch.dtype, *, pin: bool,
                zero: bool = True) -> torch.Tensor:
    """A host tensor of `shape` and `dtype`: pinned (module docstring) when `pin` and CUDA is available, zeroed
    when `zero` (a registered map always is)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    pin = pin and torch.cuda.is_available()
    nbytes = math.prod(shape) * dtype.itemsize
    if pin and nbytes >= EXACT_MIN_BYTES:
        return registered_map(nbytes).view(dtype).view(shape)
    make = torch.zeros if zero else torch.empty
    return make(shape, dtype=dtype, pin_memory=pin)


def zeros(shape: int | tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device | str, *,
          pin: bool = False) -> torch.Tensor:
    """Zeros on `device`; on the host through `host_buffer` (pinned, exactly sized, when `pin`)."""
    if torch.device(device).type == "cpu":
        return host_buffer(shape, dtype, pin=pin)
    return torch.zeros(shape, dtype=dtype, device=device)
