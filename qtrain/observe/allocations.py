"""`--debug-log-allocations MIB` (llm.q's option): which device allocations of at least MIB MiB are live after
the first optimizer step, with the code that made each, as one `allocations` object in the run log and a
console table.

torch's caching allocator records a stack per allocation once `torch.cuda.memory._record_memory_history` is
on (the mechanism behind https://pytorch.org/docs/stable/torch_cuda_memory.html); recording starts when the
trainer is built, so its own buffers (weights, gradients, optimizer state) show as "before recording" and
everything made by the first step (activations, workspaces, lazily created state) with its frames. Recording
stops after the report. CUDA only: on other devices the option says so once and does nothing.

A step that runs out of device memory logs the allocator's state at that moment (`allocator_state`: its largest
free block, the free bytes and the segments, and the largest live allocations, with their code when this option
recorded it), so a plan that fits but a run that does not can be told apart: fragments, or more live memory than
planned.

    {"log": "allocations", "step": 0, "min_bytes": N, "total_bytes": T,
     "allocations": [{"bytes": b, "where": "qtrain/model/transformer.py:123 forward_backward"}, ...]}
"""
from __future__ import annotations

from typing import Any

__all__ = ["AllocationRecorder", "allocator_state", "in_private_pool", "make_allocation_sink", "live_allocations"]

MIB = 1 << 20


def _where(frames: list[dict[str, Any]]) -> str:
    """The innermost frame in qtrain's own code (else the innermost Python frame) as 'file:line function'."""
    py = [f for f in frames if str(f.get("filename", "")).endswith(".py")]
    mine = [f for f in py if "/qtrain/" in str(f.get("filename", ""))]
    f = (mine or py or [None])[0]
    if f is None:
        return "before recording"
    path = str(f["filename"])
    path = path[path.rfind("/qtrain/") + 1:] if "/qtrain/" in path else path
    return f"{path}:{f.get('line')} {f.get('name')}"


def live_allocations(snapshot: dict[str, Any], min_bytes: int) -> list[dict[str, Any]]:
    """The live blocks of a `torch.cuda.memory._snapshot()` of at least `min_bytes`, largest first."""
    out = [{"bytes": int(b["size"]), "where": _where(b.get("frames") or [])}
           for seg in snapshot.get("segments", []) for b in seg.get("blocks", [])
           if b.get("state") == "active_allocated" and int(b["size"]) >= min_bytes]
    return sorted(out, key=lambda a: -a["bytes"])


def allocator_state(snapshot: dict[str, Any], top: int = 20) -> dict[str, Any]:
    """What a `torch.cuda.memory._snapshot()` says of the caching allocator: its segments (what it reserved from the
    device), the free blocks inside them (the largest outside private pools is the biggest request it can serve
    without asking the device for more), the free bytes of those in private pools (CUDA graphs': only their graphs'
    captures can use them; an H100 step ran out of memory beside 39.4 GiB of them, session 32) and its `top` largest
    live allocations."""
    segments = snapshot.get("segments", [])
    free = [(int(b["size"]), in_private_pool(seg)) for seg in segments for b in seg.get("blocks", [])
            if b.get("state") == "inactive"]
    return {"segments": len(segments), "reserved_bytes": sum(int(seg.get("total_size", 0)) for seg in segments),
            "free_bytes": sum(n for n, _ in free),
            "largest_free_bytes": max((n for n, private in free if not private), default=0),
            "private_pool_free_bytes": sum(n for n, private in free if private),
            "allocations": live_allocations(snapshot, 0)[:top]}


def in_private_pool(segment: dict[str, Any]) -> bool:
    """Whether a snapshot's segment belongs to a private pool (a pool id other than the default (0, 0))."""
    return any(int(i) for i in segment.get("segment_pool_id") or (0, 0))


class AllocationRecorder:
    """A run-log sink: records allocation stacks from its creation to the first `step` object, then logs the
    live allocations of at least `min_mib` MiB and stops recording."""

    def __init__(self, log: Any, min_mib: int):
        import torch
        self.log, self.min_bytes, self.done = log, int(min_mib) * MIB, False
        torch.cuda.memory._record_memory_history(max_entries=100_000)

    def on_event(self, obj: dict[str, Any]) -> None:
        if self.done or obj.get("log") != "step":
            return
        import torch
        self.done = True
        allocs = live_allocations(torch.cuda.memory._snapshot(), self.min_bytes)
        torch.cuda.memory._record_memory_history(enabled=None)
        total = sum(a["bytes"] for a in allocs)
        self.log.log("allocations", step=int(obj["step"]), min_bytes=self.min_bytes, total_bytes=total,
                     allocations=allocs)
        lines = [f"  {a['bytes'] / MIB:10.1f} MiB  {a['where']}" for a in allocs]
        self.log._print(f"[Allocations >= {self.min_bytes // MIB} MiB after step {obj['step']}: {len(allocs)}, "
                        f"{total / MIB:.1f} MiB]\n" + "\n".join(lines))

    def close(self) -> None:
        if not self.done:
            import torch
            torch.cuda.memory._record_memory_history(enabled=None)
            self.done = True


def make_allocation_sink(log: Any, device: Any, min_mib: int) -> AllocationRecorder | None:
    if min_mib <= 0:
        return None
    if getattr(device, "type", "cpu") != "cuda":
        log.message(f"--debug-log-allocations: only CUDA allocations are recorded; nothing to log on {device}",
                    level="warning")
        return None
    return AllocationRecorder(log, min_mib)
