"""TensorBoard output (`--tensorboard DIR`): the run log's metrics as TensorBoard scalars.

`TensorBoardSink.on_event(obj)` takes the objects `RunLogger.log` writes (and returns) and forwards the
metrics through `torch.utils.tensorboard.SummaryWriter`:

    step     train/loss, train/norm, train/lr, train/tokens_per_s (+ train/sol, train/mfu when known; an MoE
             model's router/aux_loss, router/z_loss, router/tokens_per_expert_min, _mean, _max)
    eval     eval/loss, eval/ppl
    memory   memory/allocated_mib, memory/reserved_mib, memory/peak_mib
    options  one text entry "options" (a markdown table)
    message  warnings as text entries "warnings"

Every other kind, and every field that is None, is ignored. Scalars use the log's `step` as their step and
the log's `time` as their wall time, so `replay_log` turns an old log into the same event file a live run
would have written. Only rank 0 should make a sink (only it has a log). The `tensorboard` package must be
installed (`pip install tensorboard`); it is imported when a sink is created, not when this module is.
"""
from __future__ import annotations

import datetime as _dt
import os
from typing import Any, Mapping

__all__ = ["TensorBoardSink", "replay_log"]

STEP_SCALARS = {"loss": "train/loss", "norm": "train/norm", "lr": "train/lr", "tokens_per_s": "train/tokens_per_s",
                "sol": "train/sol", "mfu": "train/mfu",
                # an MoE model's routers (train/router_metrics.py)
                "aux_loss": "router/aux_loss", "router_z_loss": "router/z_loss",
                "expert_load_min": "router/tokens_per_expert_min", "expert_load_mean": "router/tokens_per_expert_mean",
                "expert_load_max": "router/tokens_per_expert_max"}
EVAL_SCALARS = {"loss": "eval/loss", "ppl": "eval/ppl"}
MEMORY_SCALARS = {"allocated": "memory/allocated_mib", "reserved": "memory/reserved_mib", "peak": "memory/peak_mib"}


def _walltime(obj: Mapping[str, Any]) -> float | None:
    t = obj.get("time")
    if not isinstance(t, str):
        return None
    try:
        return _dt.datetime.fromisoformat(t).timestamp()
    except ValueError:
        return None


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


class TensorBoardSink:
    """Writes run-log events to a TensorBoard log directory. Use as a context manager or call close()."""

    def __init__(self, log_dir: str | os.PathLike, *, flush_secs: int = 30):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch raises this when the tensorboard package is missing
            raise ImportError(f"--tensorboard needs the tensorboard package (pip install tensorboard): {e}") from e
        self.log_dir = os.fspath(log_dir)
        self.writer = SummaryWriter(log_dir=self.log_dir, flush_secs=flush_secs)

    def _scalars(self, obj: Mapping[str, Any], names: Mapping[str, str], step: int, wt: float | None,
                 scale: float = 1.0) -> None:
        for field, tag in names.items():
            v = _number(obj.get(field))
            if v is not None:
                self.writer.add_scalar(tag, v * scale, global_step=step, walltime=wt)

    def on_event(self, obj: Mapping[str, Any] | None) -> None:
        """Forward one log object (a dict with `log`, `time`, `step`, ...); unknown kinds are ignored."""
        if not obj or self.writer is None:
            return
        kind = obj.get("log")
        step = int(obj.get("step") or 0)
        wt = _walltime(obj)
        if kind == "step":
            self._scalars(obj, STEP_SCALARS, step, wt)
        elif kind == "eval":
            self._scalars(obj, EVAL_SCALARS, step, wt)
            self.writer.flush()  # evals are rare and the numbers people wait for
        elif kind == "memory":
            self._scalars(obj, MEMORY_SCALARS, step, wt, scale=1.0 / 2**20)
        elif kind == "options" and isinstance(obj.get("options"), Mapping):
            rows = "\n".join(f"| {k} | {_md(v)} |" for k, v in obj["options"].items())
            self.writer.add_text("options", "| option | value |\n|---|---|\n" + rows, global_step=step, walltime=wt)
        elif kind == "message" and obj.get("level") == "warning":
            self.writer.add_text("warnings", str(obj.get("message", "")), global_step=step, walltime=wt)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def __enter__(self) -> "TensorBoardSink":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _md(v: Any) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")


def replay_log(log_path: str | os.PathLike, log_dir: str | os.PathLike) -> int:
    """Write the metrics of an existing JSON Lines log into `log_dir`; returns the number of objects read."""
    from qtrain.observe.log import read_log

    events = read_log(log_path)
    with TensorBoardSink(log_dir) as sink:
        for obj in events:
            sink.on_event(obj)
    return len(events)
