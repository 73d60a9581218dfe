"""Why a run stops before its last step, and how it tells the user: a signal, or a streak of non-finite steps.

* SIGINT (Ctrl-C) and SIGTERM (a cluster's preemption notice): the first one lets the current step finish,
  the run writes a checkpoint and exits with a message that says how to resume (exit code 128 + signal).
  The handlers are reset to the default at once, so a second signal ends the process immediately.
* A non-finite loss or gradient norm: the step's update is skipped (the trainer does that) and reported;
  after `--max-nonfinite-steps` of them in a row the run stops with exit code 3. Checkpoints record the
  streak they were written in, and keep-n never deletes the newest one written after a finite step.
* A step that runs out of device memory (`out_of_memory`): the run stops with exit code 4 and one message that
  names the newest checkpoint (the step's state is not saved: it ended half-done), the plan's numbers and how much
  the allocator held in fragments, and what to change.
* A token file that changes under the run (cut short in place, ids written out of range: the loader's
  DataChangedError, `data/loader.py`): the run stops as on a signal, with a checkpoint of the last good step and one
  message naming the file and the token offset (exit code 5).
* A step that does not end (`--debug-stack-dump-after SECONDS`, `StackDump`): the run does not stop, but every
  thread's Python stack goes to stderr once the step has run that long, so a stall says where it waits.
"""
from __future__ import annotations

import faulthandler
import math
import signal
import sys
import threading
from typing import Any

NONFINITE_EXIT = 3
OUT_OF_MEMORY_EXIT = 4
DATA_CHANGED_EXIT = 5


class RunStopped(Exception):
    """The run stopped early on purpose; the message says what happened and how to go on."""

    def __init__(self, message: str, exit_code: int, label: str = "stopped") -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.label = label


class StopSignals:
    """Installs the SIGINT / SIGTERM handlers for the span of a run (main thread only; elsewhere a no-op).
    `requested` is the first signal's number, or None."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, *, announce: bool = True) -> None:
        self.requested: int | None = None
        self.announce = announce  # rank 0 says what happens; the other ranks stay quiet
        self._old: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        self.requested = signum
        for s in self.SIGNALS:  # a second signal: the default action, i.e. the process ends at once
            signal.signal(s, signal.SIG_DFL)
        if self.announce:
            print(f"qtrain: {signal.Signals(signum).name}: finishing the current step, then writing a checkpoint "
                  f"(send it again to stop at once)", file=sys.stderr, flush=True)

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()


def stopped_by_signal(signum: int | None, step: int, checkpoint: str | None) -> RunStopped:
    name = signal.Signals(signum).name if signum else "a stop request"
    where = (f"checkpoint {checkpoint} written; resume with the same command and --continue" if checkpoint else
             "no step was done since the start, so there is nothing new to save; run the same command again")
    return RunStopped(f"{name} at step {step}: {where}", 128 + int(signum or signal.SIGTERM))


def stopped_after_last_step(signum: int | None, checkpoint: str | None) -> RunStopped:
    name = signal.Signals(signum).name if signum else "a stop request"
    saved = f"the final checkpoint {checkpoint} is written; " if checkpoint else ""
    return RunStopped(f"{name} after the last step: {saved}run the same command with --continue for the final "
                      f"evaluation and export", 128 + int(signum or signal.SIGTERM))


def out_of_memory(step: int, error: BaseException, plan: str, fragments: int | None,
                  checkpoint: str | None, rank: int | None = None) -> RunStopped:
    """The report of a step that ran out of device memory. `plan`: the memory plan's summary; `fragments`: bytes the
    allocator held reserved but unallocated when it failed (None: unknown). Measured on an H200 (BENCHMARKS.md,
    session 15): a plan right about the allocated peak, and 8.3% of activations + workspace held in fragments.
    `rank`: which rank ran out, when there are several."""
    gib = 1 << 30
    frag = (f"; the allocator held {fragments / gib:.2f} GiB reserved but unallocated (fragments): "
            f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True may give it back" if fragments else "")
    resume = (f"the newest checkpoint is {checkpoint}: resume from it with --continue and one of those changes"
              if checkpoint else "no checkpoint was written yet")
    what = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    who = f"rank {rank} ran " if rank is not None else ""
    return RunStopped(f"{who}out of device memory in step {step} ({what}); memory plan "
                      f"{plan}{frag}. Use less: more --lmhead-chunks, a smaller --batch-size with more "
                      f"--grad-accumulation, --recompute-*, --no-fp8-keep-transposes, or offload (`qtrain plan` "
                      f"shows each choice's bytes); {resume}", OUT_OF_MEMORY_EXIT, label="out of memory")


def data_changed(error: BaseException, step: int, checkpoint: str | None) -> RunStopped:
    """The report of a token file that changed under the run at `step` (`error` names the file and offset);
    `checkpoint`: the one written of the last good step (None: no step since the start, or several ranks)."""
    where = (f"checkpoint {checkpoint} of the last good step written; restore the file (or point --train-file / "
             f"--eval-file at a good copy) and resume with --continue" if checkpoint else
             "no checkpoint written now (no step since the start, or several ranks): restore the file and resume "
             "from the newest checkpoint with --continue")
    return RunStopped(f"at step {step}: {error}; {where}", DATA_CHANGED_EXIT)


class NonFiniteGuard:
    """Counts steps in a row whose loss or gradient norm is not finite."""

    def __init__(self, limit: int) -> None:
        self.limit = limit  # 0: never stop
        self.streak = 0
        self.first_bad: int | None = None

    def update(self, step: int, loss: float, norm: float) -> str | None:
        """A warning for a non-finite step (None for a finite one, which ends a streak)."""
        if math.isfinite(loss) and math.isfinite(norm):
            self.streak, self.first_bad = 0, None
            return None
        self.streak += 1
        if self.first_bad is None:
            self.first_bad = step
        return (f"step {step}: non-finite {'loss' if not math.isfinite(loss) else 'gradient norm'} (loss {loss}, "
                f"norm {norm}), update skipped ({self.streak} in a row"
                + (f", the run stops at {self.limit})" if self.limit else ")"))

    @property
    def exceeded(self) -> bool:
        return self.limit > 0 and self.streak >= self.limit

    def error(self, step: int, newest_finite: str | None) -> RunStopped:
        keep = (f"the newest checkpoint written after a finite step is {newest_finite}; resume from it with "
                f"--continue {newest_finite}" if newest_finite else "no checkpoint of a finite step exists")
        return RunStopped(f"{self.streak} steps in a row with a non-finite loss or gradient norm (steps "
                          f"{self.first_bad}..{step}); {keep}, perhaps with a lower --lr or --grad-clip "
                          f"(--max-nonfinite-steps sets the limit)", NONFINITE_EXIT, label="error")


class StackDump:
    """--debug-stack-dump-after: `arm` before a step (re)starts faulthandler's timer, which writes every thread's
    Python stack to stderr if the step is still running `seconds` later (the run goes on); `disarm` stops it.
    A stall in native code (a CUDA graph capture, a compile worker, a collective) shows the Python call it is
    in. One timer per process (faulthandler has one)."""

    def __init__(self, seconds: int):
        self.seconds = seconds

    def arm(self) -> None:
        if self.seconds > 0:
            faulthandler.dump_traceback_later(self.seconds, repeat=False, file=sys.stderr)

    def disarm(self) -> None:
        if self.seconds > 0:
            faulthandler.cancel_dump_traceback_later()
