"""The communicator: one object that owns the process group and the order in which collectives run.

Modelled on llm.q's `NCCLCommunicator` (`src/utilities/comm.{h,cpp}`): collectives are asynchronous, run
apart from the compute, and hand back something to wait on at the point of need.

* CUDA (NCCL): every collective is bracketed by events. `ready` is recorded on the caller's (compute)
  stream, the communicator's side stream waits for it, the collective is issued on the side stream, and
  `done` is recorded there. `Handle.wait()` makes the caller's current stream wait for `done`: the host
  never blocks and there is no device-wide synchronisation. Work that must follow a collective (e.g. the
  sharded gradient accumulation) can be chained on the side stream with `then`, so it overlaps compute
  too. (ProcessGroupNCCL runs on its own internal stream, which waits for the side stream at launch; with
  `async_op=False` the side stream in turn waits for it, again without blocking the host.)
* CPU (gloo): collectives are issued with `async_op=True`; `Handle.wait()` blocks the host on the gloo
  work and then runs what was chained with `then`.
* A world of one (`Communicator.solo`) needs no process group: every collective is a local copy.

Buffers handed to a collective must stay untouched (no writes, and for outputs no reads) until the
handle has been waited on; the gradient managers own all buffers they communicate, so the caching
allocator never recycles memory that is still in flight.

Averaging: NCCL (>= 2.10) and gloo in recent torch support `ReduceOp.AVG`. Where it is missing the
communicator reduces with SUM and scales by 1/world afterwards (one extra rounding), so callers always ask
for `op="avg"` and never branch on the backend.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

__all__ = ["Communicator", "Handle"]

_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX}

# torch >= 2.13 renamed the tensor collectives (the old names warn); the GPU machine's torch 2.11 has only the old ones
reduce_scatter = _reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Handle:
    """An operation in flight. `wait()` makes its result usable by what the caller runs next: on CUDA by
    ordering the caller's current stream after it (host does not block), on CPU by blocking the host.
    Idempotent; waiting on an already finished handle is free."""

    def __init__(self, *, event: "torch.cuda.Event | None" = None, works: list | None = None,
                 after: list[Callable[[], None]] | None = None):
        self._event = event
        self._works = works or []
        self._after = after or []  # CPU only: host work that runs once `works` have finished

    def wait(self) -> None:
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
            return
        works, after = self._works, self._after
        self._works, self._after = [], []
        for w in works:
            w.wait()
        for fn in after:
            fn()

    @staticmethod
    def done() -> "Handle":
        """A handle with nothing to wait for."""
        return Handle()


class Communicator:
    """Owns the process group (`group`, `rank`, `world`), the compute `device` and, on CUDA, the side
    stream on which all communication runs. Every method is asynchronous: it returns a `Handle` and the
    caller waits on it where the result is needed."""

    def __init__(self, group: dist.ProcessGroup | None = None, *, device: torch.device | str,
                 use_avg: bool | None = None):
        """`group=None` uses the default (world) group, which must be initialised. `use_avg=None` asks the
        backend whether it supports ReduceOp.AVG (a one-element all-reduce, the same on every rank)."""
        self.device = torch.device(device)
        self.group = group
        self._solo = group is None and not dist.is_initialized()
        if self._solo:
            self.rank, self.world, self.backend = 0, 1, "solo"
        else:
            self.rank = dist.get_rank(group)
            self.world = dist.get_world_size(group)
            self.backend = str(dist.get_backend(group))
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.use_avg = self._probe_avg() if use_avg is None else use_avg

    @classmethod
    def solo(cls, device: torch.device | str) -> "Communicator":
        """A world of one: no process group, collectives are local copies (single-GPU training)."""
        c = cls.__new__(cls)
        c.device, c.group, c._solo = torch.device(device), None, True
        c.rank, c.world, c.backend = 0, 1, "solo"
        c.stream = torch.cuda.Stream(c.device) if c.device.type == "cuda" else None
        c.use_avg = True
        return c

    def _probe_avg(self) -> bool:
        if self._solo or self.backend == "nccl":
            return True
        t = torch.zeros(1, device=self.device)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.AVG, group=self.group)
        except (RuntimeError, ValueError):  # raised before any data moves, identically on every rank
            return False
        return True

    # ---- ordering ----
    def _issue(self, launch: Callable[[bool], object | None], post: Callable[[], None] | None = None) -> Handle:
        """Run `launch(async_op)` (issues one collective) after everything already queued on the caller's
        stream; `post` (e.g. a 1/world scale) runs once the collective has finished."""
        if self.stream is not None:
            ready = torch.cuda.Event()
            ready.record()  # current (compute) stream
            self.stream.wait_event(ready)
            with torch.cuda.stream(self.stream):
                launch(False)  # NCCL: orders the side stream after the collective, host not blocked
                if post is not None:
                    post()
                done = torch.cuda.Event()
                done.record(self.stream)
            return Handle(event=done)
        work = launch(True)
        return Handle(works=[work] if work is not None else [], after=[post] if post is not None else [])

    def then(self, handle: Handle, fn: Callable[[], None]) -> Handle:
        """Chain `fn` (which queues device work, e.g. an accumulation of a collective's output) after
        `handle`. CUDA: queued on the side stream now, so it overlaps compute. CPU: runs inside
        `wait()` of the returned handle, i.e. at the point of need. `fn` must only touch buffers the
        caller keeps alive and does not write until the returned handle is waited on."""
        if self.stream is not None:
            ready = torch.cuda.Event()
            ready.record()
            self.stream.wait_event(ready)
            if handle._event is not None:
                self.stream.wait_event(handle._event)
            with torch.cuda.stream(self.stream):
                fn()
                done = torch.cuda.Event()
                done.record(self.stream)
            return Handle(event=done)
        return Handle(works=[handle], after=[fn])

    # ---- collectives ----
    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, *, op: str = "avg") -> Handle:
        """out (n/world) <- this rank's part of the reduction of inp (n) over ranks. In place is allowed:
        `out` may be inp's own slice [rank*n/world, (rank+1)*n/world)."""
        if inp.numel() != out.numel() * self.world:
            raise ValueError(f"reduce_scatter: input has {inp.numel()} elements, output {out.numel()}, "
                             f"world {self.world}")
        if self._solo:
            return self._local_copy(out, inp)
        post = None
        if op == "avg" and not self.use_avg:
            op, scale = "sum", 1.0 / self.world
            post = lambda: out.mul_(scale)  # noqa: E731
        return self._issue(lambda a: _reduce_scatter(out, inp, op=_OPS[op], group=self.group, async_op=a), post)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Handle:
        """out (n) <- concatenation of every rank's inp (n/world), in rank order. In place is allowed."""
        if out.numel() != inp.numel() * self.world:
            raise ValueError(f"all_gather: input has {inp.numel()} elements, output {out.numel()}, world {self.world}")
        if self._solo:
            return self._local_copy(out, inp)
        return self._issue(lambda a: _all_gather(out, inp, group=self.group, async_op=a))

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> Handle:
        """Equal splits: slice j of inp goes to rank j; slice j of out comes from rank j (slice `rank`
        is a copy of the own slice). out and inp must not overlap."""
        if out.numel() != inp.numel() or inp.numel() % self.world:
            raise ValueError(f"all_to_all: sizes {inp.numel()} -> {out.numel()} not equal or not divisible "
                             f"by {self.world}")
        if self._solo:
            return self._local_copy(out, inp)
        return self._issue(lambda a: dist.all_to_all_single(out, inp, group=self.group, async_op=a))

    def all_reduce(self, t: torch.Tensor, *, op: str = "sum") -> Handle:
        """In place reduction over ranks: op in 'sum' | 'avg' | 'max'."""
        if self._solo:
            return Handle.done()
        post = None
        if op == "avg" and not self.use_avg:
            op, scale = "sum", 1.0 / self.world
            post = lambda: t.mul_(scale)  # noqa: E731
        return self._issue(lambda a: dist.all_reduce(t, op=_OPS[op], group=self.group, async_op=a), post)

    def _local_copy(self, out: torch.Tensor, inp: torch.Tensor) -> Handle:
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp.view(out.shape))
        return Handle.done()
