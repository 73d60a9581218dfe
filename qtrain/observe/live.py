"""The observers a training run attaches to its log, per its options (rank 0 logs; every rank calls this):

    --wandb PROJECT               WandbSink: every log object to a live W&B run
    --log-gpu-util N              GpuUtilSink: a `gpu` telemetry object every N steps (NVML)
    --debug-log-allocations MIB   AllocationRecorder: the live allocations >= MIB after the first step (CUDA)
    --debug-time-breakdown        TimeBreakdown: each step's micro-step and update times

The run loop makes one call, `attach_observers`, so it stays free of these concerns.
"""
from __future__ import annotations

from typing import Any

from qtrain.observe.allocations import make_allocation_sink
from qtrain.observe.gpu import make_gpu_sink
from qtrain.observe.log import RunLogger
from qtrain.observe.timing import TimeBreakdown
from qtrain.options import Options

__all__ = ["attach_observers"]


def attach_observers(opts: Options, log: RunLogger, trainer: Any, device: Any) -> None:
    """Register the sinks the options ask for with `log` and wrap `trainer` for the time breakdown."""
    if opts.wandb and log.rank == 0:
        from qtrain.observe.wandb import WandbSink
        sink = WandbSink(opts.wandb, name=opts.name, config=opts.to_dict())
        log.add_sink(sink)
        log.message(f"W&B run {sink.run.name!r} ({sink.run.id}) in {sink.run_dir}", level="info")
    for sink in (make_gpu_sink(log, device, opts.log_gpu_util),
                 make_allocation_sink(log, device, opts.debug_log_allocations)):
        if sink is not None:
            log.add_sink(sink)
    if opts.debug_time_breakdown:
        TimeBreakdown(trainer, log, cuda=getattr(device, "type", "cpu") == "cuda")
