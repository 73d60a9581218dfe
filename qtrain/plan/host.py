"""Host memory: what a run may use, and the check that refuses a run that cannot fit before it allocates.

On the CPU every buffer of the plan lives in host memory; on CUDA the plan's host column (pinned offload
buffers: optimizer state, gradient or weight shards, block inputs) does. Each local process needs its own,
so the check multiplies by the processes of this machine and compares with what the kernel says is
available (MemAvailable, capped by a cgroup memory limit when there is one).
"""
from __future__ import annotations

import ctypes
import os
from typing import Any

from qtrain.options import OptionsError

GiB = 1 << 30
MMAP_THRESHOLD = 256 << 10  # bytes: blocks at least this large are mapped and unmapped on their own


class HostMemoryError(OptionsError):
    """The run's plan does not fit the host memory that is available; the message gives the numbers."""


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_limit() -> int | None:
    """The memory limit of this process's cgroup minus what it already uses (v2, then v1), or None."""
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_path, encoding="ascii") as f:
                raw = f.read().strip()
            if raw == "max" or int(raw) >= 1 << 60:
                return None
            with open(usage_path, encoding="ascii") as f:
                used = int(f.read().strip())
            return max(0, int(raw) - used)
        except (OSError, ValueError):
            continue
    return None


def available_host_memory() -> int | None:
    """Bytes a new allocation can get without swapping or the OOM killer, or None where it is unknown."""
    found = [n for n in (_meminfo_available(), _cgroup_limit()) if n is not None]
    return min(found) if found else None


def process_rss() -> int:
    """Resident bytes of this process now (what the interpreter and libraries already hold)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def host_bytes(plan: Any) -> int:
    """Host bytes one process of the plan needs: everything on the CPU, the host column on CUDA."""
    on_cpu = plan.settings.get("device") == "cpu"
    return plan.host_total + (plan.device_total if on_cpu else 0)


def merged_export_bytes(num_params: int, dtype_bytes: int, *, weights_sharded: bool) -> int:
    """Host bytes a --lora-merge export adds on rank 0 at the end of a run: the merged matrices in the export dtype
    (about the whole model, `lora/merge.py` puts them on the host), and with sharded weights the gathered model
    beside them (`Trainer.full_params`). An upper bound: untargeted matrices are not copied."""
    return num_params * dtype_bytes * (2 if weights_sharded else 1)


def check_host_memory(plan: Any, procs: int, *, available: int | None = None, baseline: int = 0,
                      merged_export: int = 0) -> None:
    """HostMemoryError when `procs` processes of `plan` (each `baseline` bytes already resident besides the
    plan) need more than the available host memory, or when the `merged_export` bytes of a --lora-merge export
    (`merged_export_bytes`) do not fit beside them at the end of the run (the Linux OOM killer, not an error, would
    stop it there: after the final checkpoint, but with no export)."""
    available = available_host_memory() if available is None else available
    if available is None:
        return
    per = host_bytes(plan) + baseline
    need = per * procs
    if need <= available < need + merged_export:
        raise HostMemoryError(
            f"host memory: --lora-merge holds {merged_export / GiB:.2f} GiB of the merged model in host memory at the "
            f"end of the run, beside the run's {need / GiB:.2f} GiB, but {available / GiB:.2f} GiB are available; "
            f"drop --lora-merge (the adapter is exported; `qtrain export --checkpoint-dir DIR --lora-merge` merges "
            f"a checkpoint later where more memory is free), or --no-memory-check to try anyway")
    if need > available:
        where = "CPU run" if plan.settings.get("device") == "cpu" else "pinned host buffers (offload)"
        raise HostMemoryError(
            f"host memory: the {where} needs {need / GiB:.2f} GiB ({procs} process(es) x {per / GiB:.2f} GiB: "
            f"{plan.summary()}), but {available / GiB:.2f} GiB are available; use a smaller --batch-size or "
            f"model, recomputation (`qtrain plan` proposes settings), or --no-memory-check to try anyway")


def return_freed_memory() -> bool:
    """Make glibc give freed blocks of >= 256 KiB back to the OS at once (mallopt M_MMAP_THRESHOLD, which also
    stops it from raising that threshold as the run goes). Without it a CPU run's resident memory grows past
    what the plan counts, by heap fragmentation (measured on a 20M-parameter model: +22% of the plan, +93%
    with --recompute-block); with it the peak RSS is the plan's within 10% (tests/plan/test_host.py), at no
    measurable cost per step. Linux / glibc only; elsewhere it returns False and changes nothing."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, MMAP_THRESHOLD))  # M_MMAP_THRESHOLD = -3
    except (OSError, AttributeError):
        return False
