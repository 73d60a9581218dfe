"""Why a run stops before its last step, and how it tells the user: a signal, or a streak of non-finite steps.

* SIGINT (Ctrl-C), SIGTERM (a cluster's preemption notice) and SIGHUP (the terminal was closed; torchelastic treats
  it the same): the first one lets the current step finish, the run writes a checkpoint and exits with a message
  that says how to resume (exit code 128 + signal). SIGINT and SIGTERM are reset to the default at once, so a second
  one ends the process immediately; a SIGHUP that is ignored when the run starts (`nohup`) stays ignored.
* A console that went away (`qtrain train | head`, a `tee` ended by the same Ctrl-C: `qtrain.console`) is a stop
  request too, reported as SIGPIPE (exit code 141): the step finishes, the checkpoint is written, and the run goes
  on writing its JSON log only.
* SIGUSR1 (Slurm's warning before a preemption, `--signal=USR1@90`): the current step finishes, a checkpoint is
  written, and training goes on.
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

from qtrain import console

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
    """Installs the run's signal handlers for its span (main thread only; elsewhere a no-op): see the module
    docstring. `requested` is the first stop signal's number (SIGPIPE once the console went away), or None;
    SIGUSR1s are counted, and `agree` / `take_checkpoint_request` turn them into one checkpoint each."""

    STOP = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    ESCALATE = (signal.SIGINT, signal.SIGTERM)  # a second one of these ends the process at once
    CHECKPOINT = signal.SIGUSR1

    def __init__(self, *, announce: bool = True) -> None:
        self._requested: int | None = None
        self.checkpoint_asks = 0  # SIGUSR1s this process got
        self._asks_agreed = 0  # the most any rank (or the launcher) has seen, as of the last `agree`
        self._asks_served = 0
        self.announce = announce  # rank 0 says what happens; the other ranks stay quiet
        self._old: dict[int, Any] = {}

    @property
    def requested(self) -> int | None:
        return self._requested or (signal.SIGPIPE if console.lost() else None)

    @requested.setter
    def requested(self, signum: int | None) -> None:
        self._requested = signum

    def _say(self, text: str) -> None:
        if self.announce:
            console.write(f"qtrain: {text}\n", sys.stderr)

    def _stop(self, signum: int, frame: Any) -> None:
        if self._requested is None:
            self._requested = signum
        if signum not in self.ESCALATE:  # closing the terminal is no request to hurry
            self._say(f"{signal.Signals(signum).name}: finishing the current step, then writing a checkpoint")
            return
        for s in self.ESCALATE:  # a second signal: the default action, i.e. the process ends at once
            signal.signal(s, signal.SIG_DFL)
        self._say(f"{signal.Signals(signum).name}: finishing the current step, then writing a checkpoint "
                  f"(send it again to stop at once)")

    def _checkpoint(self, signum: int, frame: Any) -> None:
        self.checkpoint_asks += 1
        self._say("SIGUSR1: writing a checkpoint after the current step; training goes on")

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for s in self.STOP:
                if s == signal.SIGHUP and signal.getsignal(s) == signal.SIG_IGN:
                    continue  # nohup: the user asked for the run to outlive the terminal
                self._old[s] = signal.signal(s, self._stop)
            self._old[self.CHECKPOINT] = signal.signal(self.CHECKPOINT, self._checkpoint)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()

    def agree(self, ctx: Any) -> None:
        """Make every rank's view the same, once per step, in one host-side all-reduce (`ctx.max_int`): a stop
        when any rank got a stop signal or the launcher forwarded one (`ctx.stop_signal()`), and the number of
        checkpoint requests the job has seen (this process's SIGUSR1s, or the launcher's: `ctx.checkpoint_requests()`;
        the larger, since Slurm signals the launcher and its workers alike). A stop needs no agreement on requests:
        it writes a checkpoint anyway."""
        signum = int(self.requested or ctx.stop_signal() or 0)
        asks = max(self.checkpoint_asks, ctx.checkpoint_requests())
        agreed = ctx.max_int(signum << 32 | asks)
        if agreed >> 32:
            self._requested = agreed >> 32
        self._asks_agreed = max(self._asks_agreed, agreed & 0xFFFFFFFF)

    def take_checkpoint_request(self) -> bool:
        """Whether a SIGUSR1 asks for a checkpoint not written yet (after `agree`: the same answer on every rank);
        it counts as served from now on."""
        due = self._asks_agreed > self._asks_served
        self._asks_served = self._asks_agreed
        return due


def _reason(signum: int | None) -> str:
    if signum == signal.SIGPIPE:
        return f"the console went away ({', '.join(console.lost()) or 'broken pipe'})"
    return signal.Signals(signum).name if signum else "a stop request"


def stopped_by_signal(signum: int | None, step: int, checkpoint: str | None) -> RunStopped:
    where = (f"checkpoint {checkpoint} written; resume with the same command and --continue" if checkpoint else
             "no step was done since the start, so there is nothing new to save; run the same command again")
    return RunStopped(f"{_reason(signum)} at step {step}: {where}", 128 + int(signum or signal.SIGTERM))


def stopped_after_last_step(signum: int | None, checkpoint: str | None) -> RunStopped:
    saved = f"the final checkpoint {checkpoint} is written; " if checkpoint else ""
    return RunStopped(f"{_reason(signum)} after the last step: {saved}run the same command with --continue for the "
                      f"final evaluation and export", 128 + int(signum or signal.SIGTERM))


def checkpoint_on_request(step: int, checkpoint: str) -> str:
    """The log line of a checkpoint that SIGUSR1 asked for."""
    return f"SIGUSR1: checkpoint {checkpoint} written at step {step}; training goes on"


def out_of_memory(step: int, error: BaseException, plan: str, fragments: int | None,
                  checkpoint: str | None, rank: int | None = None, peak: int | None = None,
                  largest_free: int | None = None, pool_free: int | None = None,
                  switches: tuple[str, ...] = ()) -> RunStopped:
    """The report of a step that ran out of device memory. `plan`: the memory plan's summary; `fragments`: bytes the
    allocator held reserved but unallocated when it failed (None: unknown), said only where torch's message does not
    already say it; `peak`: the most bytes the allocator had allocated in the run (its peak against the plan tells a
    wrong plan from fragmentation); `largest_free`: the allocator's largest free block (below the request while
    fragments are larger: the free memory is cut up). Measured on an H200: a plan right about the allocated peak, and
    8.3% of activations + workspace held in fragments. `rank`: which rank ran out, when there are several.
    `pool_free`: free bytes in CUDA graphs' private pools (only their captures can use them: not fragments that
    expandable segments would give back, so they are taken out of `fragments` here); `switches`: the options that turn
    off what this run spends memory on for speed (its automatic choices: `--no-use-cuda-graphs`, ...)."""
    gib = 1 << 30
    what = _torch_oom_facts(error)
    if fragments is not None and pool_free:
        fragments = max(0, fragments - pool_free)
    frag = (f"; the allocator held {fragments / gib:.2f} GiB reserved but unallocated (fragments): "
            f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True may give it back"
            if fragments and "reserved by PyTorch but unallocated" not in what else "")
    peaked = f"; the allocator's peak in this run: {peak / gib:.2f} GiB allocated" if peak else ""
    if largest_free is not None and fragments:
        peaked += f", its largest free block {largest_free / gib:.2f} GiB"
    if pool_free:
        peaked += (f"; {pool_free / gib:.2f} GiB of the free memory sat in CUDA graphs' private pools, which only "
                   "their captures use")
    turn_off = "".join(f"{s}, " for s in switches)
    resume = (f"the newest checkpoint is {checkpoint}: resume from it with --continue and one of those changes"
              if checkpoint else "no checkpoint was written yet")
    who = f"rank {rank} ran " if rank is not None else ""
    return RunStopped(f"{who}out of device memory in step {step} ({what}); memory plan "
                      f"{plan}{frag}{peaked}. Use less: {turn_off}more --lmhead-chunks, a smaller --batch-size with "
                      f"more --grad-accumulation, --recompute-*, or offload (`qtrain plan` shows each choice's bytes); "
                      f"{resume}", OUT_OF_MEMORY_EXIT, label="out of memory")


# where torch's out-of-memory message turns from its numbers to its advice (qtrain's report gives its own)
_TORCH_OOM_ADVICE = (" If reserved but unallocated memory is large", " See documentation for Memory Management")


def _torch_oom_facts(error: BaseException) -> str:
    """The first line of torch's message, its numbers whole (the request, what was free, what PyTorch held allocated
    and reserved: a cut at a fixed length lost the last two, the ones that tell fragmentation from a full device),
    without its advice."""
    what = (str(error).strip().splitlines() or [type(error).__name__])[0]
    for advice in _TORCH_OOM_ADVICE:
        what = what.split(advice)[0]
    return what.strip()[:600]


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
