"""--use-cuda-graphs: the micro-step's forward and backward replayed from CUDA graphs, so that the host stops
setting the pace at small sizes (Qwen2.5-0.5B at micro-batch 4 spent 487 of 509 ms per step queueing kernels).

    graphs = MicroStepGraphs(device, (B, T))
    loss, replayed = graphs.run(fn, inputs, targets, first=..., last=..., loss_scale=...)  # fn(inputs, targets)

One graph per phase of a step, at most three: (first, last) of the micro-step decide what the gradient manager
queues (copy on the first micro-step, SR-add on the others; the last one completes the step's gradients), and
the graph replays exactly what was queued at capture. The first step runs eagerly on the capture stream (warm-up:
torch.compile compiles and autotunes, Triton kernels load, cuBLAS gets its workspace for that stream); from the
second step on, each phase's first micro-step is captured and then replayed, and later ones replay. No warm-up
runs after a capture: the pool keeps what a capture allocated, so an eager micro-step after one needs a second
micro-step's memory beside it (an H100 ran out of memory so in step 0 at Qwen2.5-0.5B 32 x 4, session 32).
Inputs and targets are copied into static buffers first. What must differ between replays of one graph comes from
device memory written before the replay: the batch (static buffers) and the SR keys (the gradient manager's key table,
`GradientManager.use_key_table`, refilled by `start_micro_step`).

The loss scale (world / valid targets of the step) is a GEMM alpha inside the LM head's backward
(kernels/cross_entropy/head.py) and a GEMM takes alpha from the host: a device scalar would change the rounding, and
so the bits, against a run without graphs. The graphs are therefore captured for one loss scale, the first one seen,
which is every step's scale when no targets are masked (pretraining); a micro-step with another scale (masked
targets) runs eagerly, with the same bits, and is counted in `eager_other_scale`; so does a micro-batch of
another shape than the first (the static buffers'), counted in `eager_other_shape`. Where the graphs are on by
default (the option unset), the first such micro-step after a capture ends them for the run: the graphs and their
pool are released and every later micro-step runs eagerly. Masked targets (SFT data with loss masks) change the
scale almost every step, so the graphs would rarely replay while their pool held a micro-step's memory beside the
eager micro-steps' own, which the plan does not count. Given (`--use-cuda-graphs`), they stay.

Bits: a replay runs the kernels of the capture on the same buffers, so losses and weights are bitwise those of
a run without graphs (the GPU tests in tests/train/test_cuda_graphs.py compare them).

Memory: the graphs share one private memory pool, which holds what one micro-step allocates (its activations,
gradients on their way to the manager, workspaces): about the peak of a micro-step without graphs, since the
phases never run at once. The allocator's own cache is emptied before each capture, after the eager first
step. A micro-step that runs eagerly after the capture (another loss scale or shape) allocates outside the pool:
on by default the graphs end there and their pool is released; given, such runs can reserve up to two micro-steps'
activations, and the memory plan assumes the common case (one).

Scope of this round (`plan.resolution.cuda_graph_blockers`, refused by `check_cuda_graphs` there before the model
is built when the option is given): one process, replicated weights (fp32 master through a bf16 copy included),
unsharded gradients, nothing offloaded, no --persistent-quants, no --debug-log-abs-max. On a machine without
CUDA (--device auto) the option does nothing (`status` says so). Unset, the option is on where it was measured
faster (`plan.resolution.cuda_graphs_on`): nothing blocks it, no linear in FP8, a host-bound micro-step. The
run's resolution (`RunResolution.cuda_graphs`) says whether a run uses them.
"""
from __future__ import annotations

import gc
from typing import Callable

import torch

from qtrain.options import Options

__all__ = ["GraphSchedule", "MicroStepGraphs", "status"]

MicroStepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def status(opts: Options, device_type: str, *, on: bool, fp8_linears: bool = False) -> str | None:
    """The log line that says what --use-cuda-graphs does in this run (`on`: the run's `cuda_graphs`). None
    when the option is unset and the graphs are off (the bf16 runs above CUDA_GRAPHS_AUTO_MAX_BLOCK_GFLOP)."""
    if opts.use_cuda_graphs is False or (opts.use_cuda_graphs is None and not on):
        return None
    if device_type != "cuda":
        return "--use-cuda-graphs: no CUDA device, the run does not use CUDA graphs"
    how = "given" if opts.use_cuda_graphs else "auto: one process, a host-bound micro-step, no FP8 linear"
    ends = ("" if opts.use_cuda_graphs else "; released at the first micro-step after a capture that must run "
            "eagerly (masked targets: another loss scale)")
    return (f"--use-cuda-graphs ({how}): the micro-steps' forward and backward are captured in CUDA graphs (one "
            f"per phase of a step, after a first step run eagerly) and replayed{ends}; --no-use-cuda-graphs "
            "turns them off" + (". FP8 linears under capture: one cold-compile start hung on the H200; if step 0 "
                                 "never comes, run without graphs" if fp8_linears else ""))


class GraphSchedule:
    """How each micro-step runs (module docstring), kept apart from the CUDA calls so that the order is tested on
    the CPU: "other-shape" and "other-scale" (eagerly, beside the graphs), "warm-up" (eagerly on the capture
    stream: the whole first step, and a phase first seen later), "capture" (once per phase) or "replay"; with
    `release_on_eager` (the graphs on by default), "release" for the first micro-step after a capture that must run
    eagerly (the caller drops the graphs and runs it so) and "off" for every one after it. Captures start after a
    step whose every micro-step ran as warm-up (one of another shape in the first step leaves it open)."""

    def __init__(self, release_on_eager: bool = False) -> None:
        self.release_on_eager = release_on_eager
        self.released_at: int | None = None  # the micro-step (counted from 0) that ended the graphs
        self.micro_steps = 0
        self.warm: set[tuple[bool, bool]] = set()  # phases that ran their eager warm-up
        self.warm_step_done = False  # a whole step ran as warm-up: captures may start
        self._step_all_warm = True  # every micro-step of the current step so far ran as warm-up
        self.captured: set[tuple[bool, bool]] = set()
        self.loss_scale: float | None = None  # the scale every graph was captured with
        self.captures = self.replays = self.eager_other_scale = self.eager_other_shape = 0

    def next(self, phase: tuple[bool, bool], *, fits: bool, loss_scale: float) -> str:
        self.micro_steps += 1
        if self.released_at is not None:
            return "off"
        if phase[0]:
            self._step_all_warm = True
        how = self._next(phase, fits=fits, loss_scale=loss_scale)
        self._step_all_warm = self._step_all_warm and how == "warm-up"
        self.warm_step_done = self.warm_step_done or (phase[1] and self._step_all_warm)
        eager_after_capture = how.startswith("other-") or how == "warm-up"  # a phase first seen after a capture
        if eager_after_capture and self.release_on_eager and self.captured:
            self.released_at = self.micro_steps - 1
            return "release"
        return how

    def _next(self, phase: tuple[bool, bool], *, fits: bool, loss_scale: float) -> str:
        if not fits:  # the static buffers take one shape: another one runs eagerly
            self.eager_other_shape += 1
            return "other-shape"
        if phase not in self.warm or not self.warm_step_done:
            self.warm.add(phase)
            return "warm-up"
        if self.loss_scale is None:
            self.loss_scale = loss_scale
        if loss_scale != self.loss_scale:
            self.eager_other_scale += 1
            return "other-scale"
        if phase in self.captured:
            self.replays += 1
            return "replay"
        self.captured.add(phase)
        self.captures += 1
        return "capture"


class MicroStepGraphs:
    """Captures and replays a micro-step function per phase (see the module docstring)."""

    def __init__(self, device: torch.device, batch_shape: tuple[int, int], *, release_on_eager: bool = False):
        self.device = device
        self.stream = torch.cuda.Stream(device)  # warm-up and capture stream
        self.pool = torch.cuda.graph_pool_handle()  # shared by the phases: they never run at once
        self.inputs = torch.zeros(batch_shape, dtype=torch.int64, device=device)
        self.targets = torch.zeros(batch_shape, dtype=torch.int64, device=device)
        self.graphs: dict[tuple[bool, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.schedule = GraphSchedule(release_on_eager)

    def run(self, fn: MicroStepFn, inputs: torch.Tensor, targets: torch.Tensor, *, first: bool, last: bool,
            loss_scale: float) -> tuple[torch.Tensor, bool]:
        """Queue one micro-step: `fn(inputs, targets)` eagerly (warm-up, or another loss scale) or captured,
        or a replay of its phase's graph. Returns (the micro-step's loss, whether it was a replay: then `fn`
        was not called and the caller tells the gradient manager `replayed()`)."""
        phase = (first, last)
        how = self.schedule.next(phase, fits=self.fits(inputs, targets), loss_scale=loss_scale)
        if how == "release":
            self.release()
        if how in ("other-shape", "other-scale", "release", "off"):
            return fn(inputs, targets), False
        if how == "warm-up":
            return self._on_stream(fn, inputs, targets), False
        self.inputs.copy_(inputs, non_blocking=True)
        self.targets.copy_(targets, non_blocking=True)
        if how == "replay":
            graph, loss = self.graphs[phase]
            graph.replay()
            return loss, True
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):  # synchronizes first
            loss = fn(self.inputs, self.targets)
        self.graphs[phase] = (graph, loss)
        graph.replay()  # capturing queued nothing: run it
        return loss, False

    def release(self) -> None:
        """Drop the graphs and give their pool's memory back (the run goes on eagerly)."""
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        torch.cuda.synchronize(self.device)
        self.graphs.clear()  # the graphs and their static outputs: the pool's last users
        self.pool = None
        gc.collect()  # as torch.cuda.graph does: a cycle must not keep a graph (and so its pool) alive
        torch.cuda.empty_cache()

    def summary(self) -> str:
        """One line for the run log: how the micro-steps ran."""
        s = self.schedule
        ended = (f"; released at micro-step {s.released_at} (another loss scale or shape: masked targets), "
                 f"{s.micro_steps - s.released_at} micro-steps eagerly since" if s.released_at is not None else "")
        return (f"--use-cuda-graphs: {s.captures} graphs captured, {s.replays} micro-steps replayed, "
                f"{s.eager_other_scale + s.eager_other_shape} run eagerly ({s.eager_other_scale} for another "
                f"loss scale: masked targets; {s.eager_other_shape} for another micro-batch shape){ended}")

    def fits(self, inputs: torch.Tensor, targets: torch.Tensor) -> bool:
        """Whether a micro-batch has the static buffers' shape (batch size x sequence length)."""
        return tuple(inputs.shape) == tuple(self.inputs.shape) and tuple(targets.shape) == tuple(self.targets.shape)

    def _on_stream(self, fn: MicroStepFn, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """`fn` on the capture stream, ordered after and before the caller's stream's work."""
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)
        with torch.cuda.stream(self.stream):
            loss = fn(inputs, targets)
        caller.wait_stream(self.stream)
        loss.record_stream(caller)  # the caller uses it; the allocator must not hand it out on our stream before
        return loss
