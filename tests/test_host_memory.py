"""qtrain/host_memory.py: offload buffers of exactly the bytes asked (torch's pinned allocator rounds to a power of
two). On the CPU the registration is a recording stand-in for cudaHostRegister (the map, its tensor views and their
release are real); the GPU test registers with the driver."""
from __future__ import annotations

import gc
import os

import pytest
import torch

from qtrain.host_memory import EXACT_MIN_BYTES, host_buffer, registered_map


def _recorder():
    events: list[tuple] = []

    def register(ptr: int, nbytes: int) -> None:
        events.append(("register", ptr, nbytes))

    def unregister(ptr: int) -> None:
        # the pages must still be mapped here: read them through ctypes (an unmapped page would crash the test)
        import ctypes
        events.append(("unregister", ptr, ctypes.c_uint8.from_address(ptr).value))

    return events, register, unregister


def test_registered_map_is_zeroed_writable_and_released_once_after_the_last_view():
    events, register, unregister = _recorder()
    nbytes = 3 * 4096 + 8  # not a power of two; the map rounds to pages only
    t = registered_map(nbytes, register, unregister)
    assert t.dtype == torch.uint8 and t.numel() == nbytes and not t.any()
    assert events == [("register", t.data_ptr(), nbytes)]
    f = t.view(torch.float32)  # the views the buffers are used through share the storage
    f[0] = 1.5
    rows = f[:16].view(4, 4)
    del t, f
    gc.collect()
    assert len(events) == 1  # a view is still alive: nothing released
    assert rows[0, 0].item() == 1.5
    ptr = rows.data_ptr()
    del rows
    gc.collect()
    # released once, with the map still mapped (the byte read back is the float's first byte, 0 for 1.5)
    assert events[1:] == [("unregister", ptr, 0)]


def test_host_buffer_without_cuda_is_plain_zeroed_memory():
    b = host_buffer((3, 5), torch.bfloat16, pin=True)  # pin asked, no CUDA here: plain memory
    assert b.shape == (3, 5) and b.dtype == torch.bfloat16 and not b.any() and b.device.type == "cpu"
    assert host_buffer(7, torch.float32, pin=False, zero=False).shape == (7,)


def _rss() -> int:
    with open(f"/proc/{os.getpid()}/status", encoding="ascii") as f:
        return next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmRSS:"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_pinned_buffer_takes_its_size_and_copies_asynchronously():
    """A buffer just over a power of two takes its own bytes of host memory (torch's pinned allocator would take
    the next power of two: twice), is pinned, and copies to and from the GPU with non_blocking round-trip exactly."""
    n = (EXACT_MIN_BYTES * 4 + (1 << 20)) // 2  # bf16 elements: 65 MiB
    torch.zeros(1, device="cuda")  # the CUDA context's own host memory (~90 MiB on an H100) is there before
    warm = host_buffer(EXACT_MIN_BYTES, torch.uint8, pin=True)  # and the driver's, for its first registration
    del warm
    gc.collect()
    before = _rss()
    b = host_buffer(n, torch.bfloat16, pin=True)
    grew = _rss() - before
    assert b.is_pinned() and not b.any()
    assert grew <= b.numel() * 2 + (8 << 20), grew  # its pages (locked, resident) and no more
    src = torch.randn(n, device="cuda").bfloat16()
    b.copy_(src, non_blocking=True)
    back = torch.empty_like(src)
    back.copy_(b, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, src)
    # measured from here: the kernels just run loaded their modules into host memory (77 MiB on an H100)
    held, nbytes = _rss(), b.numel() * 2
    del b
    gc.collect()
    assert held - _rss() >= nbytes - (8 << 20)  # unregistered and unmapped: its pages went back


def test_every_large_host_buffer_comes_from_host_memory():
    """torch's `pin_memory=` allocations round up to a power of two: qtrain's buffers go through host_memory (a
    `.pin_memory()` copy of a few bytes, the RNG key table's, is left to torch)."""
    import re
    from pathlib import Path

    import qtrain
    root = Path(qtrain.__file__).parent
    found = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py") if p.name != "host_memory.py"
             for i, line in enumerate(p.read_text("utf-8").splitlines(), 1)
             if re.search(r"pin_memory\s*=", line.split("#")[0])]
    assert found == []
