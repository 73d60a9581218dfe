"""Host <-> device staging: state kept in host memory streams through a few device slots, so the kernels that
read or write it run on the compute device (llm.q `LLamaModel::update`, reference/llmq.md §4.4).

    ring = StagingRing({"m": (n, torch.bfloat16), "v": (n, torch.float32)}, device=dev)  # STAGING_SLOTS slots
    ring.begin()                                          # copies start after the work queued so far
    ring.fetch(0, {"m": m_host[a0:b0], "v": v_host[a0:b0]})
    for i in range(items):
        if i + 1 < items:
            ring.fetch(i + 1, {...})                      # overlaps item i's compute and item i-1's copy-back
        slot = ring.acquire(i)                            # compute waits until item i is in its slot
        ... compute on slot["m"][:b - a], slot["v"][:b - a] ...
        ring.write_back(i, {"m": m_host[a:b], "v": v_host[a:b]})   # slot -> host, after that compute
    ring.end()                                            # later compute waits for the copy-backs
    ring.synchronize()                                    # before host code reads the host tensors

Item i uses slot i % len(slots); a copy moves as many elements as the host tensor has (slots are as large as
the largest item). Users: the optimizer's offloaded update (three slots, overlapped), the gradient managers'
offloaded block shards (one slot, the accumulation's scratch). (`ShardedWeights` copies its offloaded shards
straight into the rank's own slice of each gather buffer.)

Asynchrony. With `overlap` on CUDA, host->device copies run on one side stream and device->host copies on
another, so PCIe carries both directions at once and a pass costs about one direction's traffic, not the sum.
`fetch(i)` first makes its stream wait (an event) for the copy-back of item i - slots, the item that used the
slot before: a slot is refilled only after its last copy-back has finished. `acquire(i)` makes the current
stream wait for fetch(i); `write_back(i)` makes the device->host stream wait for everything queued on the
current stream so far (item i's compute). With three slots item i+1 comes in while item i computes and item
i-1 goes back; with two, fetching i+1 into the slot that i-1 is still writing back from would serialise them.
`end()` makes the current stream wait for the last copy-back (no host sync); `synchronize()` blocks the host.
Without `overlap`, or off CUDA, every copy is a plain stream-ordered copy on the current stream (on the CPU:
a copy), so the order of the calls is the order of the work and nothing else is needed.

Memory: `StagingRing.bytes(sizes, slots)`, the statement the owners' footprints use.
"""
from __future__ import annotations

import contextlib
from typing import Mapping

import torch

STAGING_SLOTS = 3  # one slot fetching, one updating, one writing back

Sizes = Mapping[str, tuple[int, torch.dtype]]  # buffer name -> (elements, dtype) of every slot


class StagingRing:
    """A ring of device slots, each a dict of named 1-D buffers, that host tensors stream through."""

    def __init__(self, sizes: Sizes, *, device: torch.device | str, slots: int = STAGING_SLOTS,
                 overlap: bool = True):
        """Allocates `slots` slots of `sizes` on `device`. overlap: copies on their own CUDA streams (module doc)."""
        self.device = torch.device(device)
        self.slots: list[dict[str, torch.Tensor]] = [{} for _ in range(slots)]
        self._owned = 0  # bytes of the slot buffers this ring allocated
        for name, (numel, dtype) in sizes.items():
            self.add(name, numel, dtype)
        cuda = overlap and self.device.type == "cuda"
        self._h2d = torch.cuda.Stream(self.device) if cuda else None
        self._d2h = torch.cuda.Stream(self.device) if cuda else None
        self._ready: dict[int, torch.cuda.Event] = {}  # item -> it is in its slot (h2d stream)
        self._freed: dict[int, torch.cuda.Event] = {}  # item -> its copy-back has finished (d2h stream)
        self._done: torch.cuda.Event | None = None  # the last pass's copy-backs

    @staticmethod
    def bytes(sizes: Sizes, slots: int = STAGING_SLOTS) -> int:
        """Device bytes of `slots` slots of `sizes`: the memory statement of a ring, without allocating it."""
        return slots * sum(numel * dtype.itemsize for numel, dtype in sizes.values())

    @property
    def nbytes(self) -> int:
        """Device bytes this ring allocated."""
        return self._owned

    def __contains__(self, name: str) -> bool:
        return bool(self.slots) and name in self.slots[0]

    def add(self, name: str, numel: int, dtype: torch.dtype) -> None:
        """Give every slot a buffer `name` of `numel` elements (e.g. one found to be needed at the first pass)."""
        for s in self.slots:
            s[name] = torch.zeros(numel, dtype=dtype, device=self.device)
        self._owned += self.bytes({name: (numel, dtype)}, len(self.slots))

    def slot(self, i: int) -> dict[str, torch.Tensor]:
        """The buffers of item i's slot (no waiting: see `acquire`)."""
        return self.slots[i % len(self.slots)]

    # ---- a pass ----
    def begin(self) -> None:
        """Start a pass over items 0, 1, ...: its copies come after the work queued so far on the current stream
        (e.g. the gradients the update reads)."""
        self._ready.clear()
        self._freed.clear()
        if self._h2d is not None:
            self._h2d.wait_stream(torch.cuda.current_stream(self.device))

    def fetch(self, i: int, sources: Mapping[str, torch.Tensor]) -> None:
        """Copy host tensors into item i's slot (buffer name -> 1-D source), once the slot's previous item has
        gone back to the host."""
        slot = self.slot(i)
        with self._on(self._h2d):
            if self._h2d is not None:
                freed = self._freed.get(i - len(self.slots))
                if freed is not None:
                    self._h2d.wait_event(freed)  # the slot's last user has gone back to the host
            for name, src in sources.items():
                slot[name][:src.numel()].copy_(src, non_blocking=True)
            if self._h2d is not None:
                self._ready[i] = torch.cuda.Event()
                self._ready[i].record(self._h2d)

    def acquire(self, i: int) -> dict[str, torch.Tensor]:
        """Item i's slot, with the current stream ordered after its fetch."""
        ready = self._ready.get(i)
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
        return self.slot(i)

    def write_back(self, i: int, targets: Mapping[str, torch.Tensor]) -> None:
        """Copy item i's slot buffers back to host tensors (buffer name -> 1-D target), after the work queued on
        the current stream so far."""
        slot = self.slot(i)
        if self._d2h is not None:
            self._d2h.wait_stream(torch.cuda.current_stream(self.device))
        with self._on(self._d2h):
            for name, dst in targets.items():
                dst.copy_(slot[name][:dst.numel()], non_blocking=True)
            if self._d2h is not None:
                self._freed[i] = torch.cuda.Event()
                self._freed[i].record(self._d2h)

    def end(self) -> None:
        """End a pass: later work on the current stream sees every copy-back (no host sync)."""
        if self._d2h is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._d2h)
            self._done = torch.cuda.Event()
            self._done.record(self._d2h)

    def synchronize(self) -> None:
        """Block the host until the last pass's copy-backs are done (before host code reads the host tensors)."""
        if self._done is not None:
            self._done.synchronize()

    @staticmethod
    def _on(stream: torch.cuda.Stream | None):
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
