"""`--debug-time-breakdown` (llm.q's option): how long each micro-step (forward + backward) and the optimizer
update of every step take, as one `time-breakdown` object per step in the run log and a console line.

llm.q times forward, LM head and backward separately with CUDA events; qtrain's micro-step is one call
(`Trainer.micro_step`: forward and backward interleave per block), so the breakdown is per micro-step and
update. On CUDA each call is bracketed by events on the current stream and read once per step, after the
update's end event is reached (one extra wait per step: this is a debugging aid); elsewhere by the wall clock.

    {"log": "time-breakdown", "step": s, "micro_steps": [ms, ...], "update": ms, "total": ms}
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable

__all__ = ["TimeBreakdown"]


class _Timer:
    """Start / stop marks on the device's stream (CUDA events) or the host clock; `ms()` waits for the stop."""

    def __init__(self, cuda: bool):
        import torch
        self.cuda = cuda
        if cuda:
            self.start, self.stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0, self.t1 = time.perf_counter(), 0.0

    def done(self) -> None:
        if self.cuda:
            self.stop.record()
        else:
            self.t1 = time.perf_counter()

    def ms(self) -> float:
        if self.cuda:
            self.stop.synchronize()
            return float(self.start.elapsed_time(self.stop))
        return 1000.0 * (self.t1 - self.t0)


class TimeBreakdown:
    """Wraps a trainer's `micro_step` and `update` (on the instance, so whoever calls them, the run loop or a
    `Trainer` method, is timed) and logs each step's breakdown after its update."""

    def __init__(self, trainer: Any, log: Any, *, cuda: bool):
        self.trainer, self.log, self.cuda = trainer, log, cuda
        self._micro: list[_Timer] = []
        trainer.micro_step = self._wrap(trainer.micro_step, self._micro.append)
        trainer.update = self._wrap(trainer.update, self._after_update)

    def _wrap(self, fn: Callable[..., Any], done: Callable[[_Timer], Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = _Timer(self.cuda)
            out = fn(*args, **kwargs)
            t.done()
            done(t)
            return out
        return timed

    def _after_update(self, t: _Timer) -> None:
        micro = [m.ms() for m in self._micro]
        update = t.ms()
        self._micro.clear()
        step = int(self.trainer.steps_done) - 1  # update() has counted the step it finished
        self.log.log("time-breakdown", step=step, micro_steps=micro, update=update, total=sum(micro) + update)
        self.log._print(f"[Time] step {step:5d} | micro-steps {' '.join(f'{m:.1f}' for m in micro)} ms | "
                        f"update {update:.1f} ms")
