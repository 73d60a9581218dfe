"""Run log: a JSON Lines file plus llm.q-style console lines (reference/llmq.md §2.2).

llm.q keeps its log a JSON *array*, seeking back over the closing bracket for every object. Here each
object is one line (JSON Lines): appending needs no seek, a killed run leaves every complete line
valid, and `read_log` drops the one partial line a kill can leave. Lines are flushed as they are
written, which is enough to survive a killed process (the data sits in the OS page cache); `os.fsync`,
which only matters if the machine itself goes down, runs at most every `fsync_interval_s` and on
eval, warnings and close, so it costs nothing per step.

Every object has `log` (its type), `time` (ISO 8601, local time with UTC offset, milliseconds) and
`step`. Types: cmd, options, dataset, gpu-model, sol, step, eval, memory, message, abs-maxes, gpu (GPU
telemetry, llm.q's fields and units: `qtrain.observe.gpu`), time-breakdown (`qtrain.observe.timing`),
allocations (`qtrain.observe.allocations`), outputs (where the export, checkpoint and log went). Ratios
(`sol`, `mfu`) are fractions, not percent. A NaN/inf value is written as Python's `NaN`/`Infinity`
token (what `json.loads`, pandas and llm.q's own readers accept) rather than silently turned into null.

Only rank 0 writes or prints. Every rank keeps the loss/norm `OutlierDetector`s (cheap), so their
state is the same everywhere and any rank can put it in a checkpoint.

Sinks (`add_sink`): objects with `on_event(obj)` (and optionally `close()`) that get every object this
logger writes, as it is written: live W&B (`qtrain.observe.wandb.WandbSink`), the GPU telemetry sampler, ...
A sink that raises is dropped with a warning, so a dashboard outage never stops a run.

Console verbosity (as llm.q's EVerbosity): -2 silent, -1 eval lines, warnings and where the results went only
(`qtrain train --quiet`), 0 default (adds step lines and startup summaries), 1 verbose (`--verbose`: adds info
messages, every option and full tables). Console lines go through
`qtrain.console`: when the console goes away (a closed pipe or terminal) they stop, and the file keeps every line.
"""
from __future__ import annotations

import collections
import datetime as _dt
import json
import math
import os
import sys
import time
from typing import IO, Any, Iterable, Mapping

from qtrain import console

SILENT, QUIET, DEFAULT, VERBOSE = -2, -1, 0, 1


def now_iso() -> str:
    return _dt.datetime.now().astimezone().isoformat(timespec="milliseconds")


def read_log(path: str | os.PathLike) -> list[dict]:
    """All objects of a JSON Lines log. A partial last line (killed mid-write) is dropped; a bad line
    anywhere else is corruption and raises ValueError with its line number."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    out: list[dict] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            if all(not rest.strip() for rest in lines[i + 1:]):
                break  # truncated final line
            raise ValueError(f"{os.fspath(path)}:{i + 1}: not a JSON object ({e})") from None
    return out


class OutlierDetector:
    """Rolling z-score of the last `window` values (llm.q: window 100, warn above z = 10).

    `update(x)` returns the z-score of `x` against the window *before* adding it, or None while the
    window is still filling (early-training losses fall too fast for a meaningful spread). Only spikes
    (positive z) count as outliers. Non-finite values are reported by the caller and never enter the
    window, so one NaN does not poison the statistics for 100 steps.
    """

    def __init__(self, window: int = 100, threshold: float = 10.0) -> None:
        self.window = window
        self.threshold = threshold
        self.values: collections.deque[float] = collections.deque(maxlen=window)

    def update(self, x: float) -> float | None:
        x = float(x)
        if not math.isfinite(x):
            return None
        z = self.zscore(x)
        self.values.append(x)
        return z

    def zscore(self, x: float) -> float | None:
        n = len(self.values)
        if n < self.window:
            return None
        mean = math.fsum(self.values) / n
        std = math.sqrt(math.fsum((v - mean) ** 2 for v in self.values) / n)
        if std == 0.0:
            return 0.0 if x == mean else math.copysign(math.inf, x - mean)
        return (x - mean) / std

    def is_outlier(self, z: float | None) -> bool:
        return z is not None and z > self.threshold

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window, "threshold": self.threshold, "values": list(self.values)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.window = int(state["window"])
        self.threshold = float(state["threshold"])
        self.values = collections.deque((float(v) for v in state["values"]), maxlen=self.window)


def format_tokens_per_s(tps: float) -> str:
    if tps < 1e3:
        return f"{tps:5.0f}"
    if tps < 1e6:
        return f"{tps / 1e3:5.1f}k"
    return f"{tps / 1e6:5.2f}M"


def format_duration_ms(ms: float) -> str:
    return f"{ms:4.0f} ms" if ms < 10_000 else f"{ms / 1000:4.1f}  s" if ms < 1_000_000 else f"{ms / 1000:4.0f}  s"


def format_eta(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class RunLogger:
    """Writes the run log and the console lines; see the module docstring for the format."""

    def __init__(self, path: str | os.PathLike | None, *, rank: int = 0, verbosity: int = DEFAULT,
                 total_steps: int | None = None, stream: IO[str] | None = None, progress: bool | None = None,
                 fsync_interval_s: float = 10.0, outlier_window: int = 100, outlier_threshold: float = 10.0,
                 router_every: int = 10):
        self.rank = rank
        self.verbosity = verbosity if rank == 0 else SILENT
        self.total_steps = total_steps
        self.stream = stream if stream is not None else sys.stdout
        if progress is None:
            progress = bool(getattr(self.stream, "isatty", lambda: False)())
        self.progress = progress and self.verbosity >= DEFAULT
        self.fsync_interval_s = fsync_interval_s
        self.router_every = router_every  # an MoE model's router line on the console every N steps (`_router_line`)
        self.loss_outliers = OutlierDetector(outlier_window, outlier_threshold)
        self.norm_outliers = OutlierDetector(outlier_window, outlier_threshold)
        self.step = 0  # last step seen; stamped on step-less events
        self.ns_per_token: float | None = None  # set by log_sol: per-step SOL
        self.mfu_flops_per_token: float | None = None  # set by log_sol: per-step MFU
        self.mfu_peak_flops: float | None = None
        self._train_loss_sum = 0.0
        self._train_loss_n = 0
        self._step_ms_ema: float | None = None
        self._bar_shown = False
        self._last_fsync = time.monotonic()
        self._file: IO[str] | None = None
        self.path = os.fspath(path) if path is not None else None
        if rank == 0 and path is not None:
            self._file = self._open(os.fspath(path))
        self._sinks: list[Any] = []

    # ---- file ----
    @staticmethod
    def _open(path: str) -> IO[str]:
        """Append (a resumed run continues its log); first cut off a partial line left by a kill."""
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        if os.path.exists(path):
            with open(path, "rb+") as f:
                data = f.read()
                if data and not data.endswith(b"\n"):
                    f.truncate(data.rfind(b"\n") + 1)
        return open(path, "a", encoding="utf-8")

    def log(self, kind: str, *, step: int | None = None, sync: bool = False, **fields: Any) -> dict[str, Any]:
        """Write one object of type `kind`; returns it (also on ranks that do not write)."""
        obj = {"log": kind, "time": now_iso(), "step": self.step if step is None else int(step), **fields}
        if self._file is not None:
            self._file.write(json.dumps(obj, allow_nan=True, default=_json_default) + "\n")
            self._file.flush()
            if sync or time.monotonic() - self._last_fsync >= self.fsync_interval_s:
                os.fsync(self._file.fileno())
                self._last_fsync = time.monotonic()
        for sink in list(self._sinks):
            try:
                sink.on_event(obj)
            except Exception as e:  # noqa: BLE001 -- a dashboard must not end a training run
                self._sinks.remove(sink)
                self.message(f"{type(sink).__name__} stopped: {type(e).__name__}: {e}", level="warning")
        return obj

    def add_sink(self, sink: Any) -> None:
        """Forward every later object to `sink.on_event(obj)` (rank 0 only; other ranks drop it)."""
        if self.rank == 0:
            self._sinks.append(sink)

    def close(self) -> None:
        for sink in self._sinks:
            if hasattr(sink, "close"):
                sink.close()
        self._sinks = []
        self._clear_bar()
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def __enter__(self) -> "RunLogger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- console ----
    def _print(self, line: str, *, level: int = DEFAULT) -> None:
        if self.verbosity < level:
            return
        console.write(self._take_bar() + line + "\n", self.stream)

    def _take_bar(self) -> str:
        """The escape that erases the progress bar, when one is shown (the next step draws it again)."""
        if not self._bar_shown:
            return ""
        self._bar_shown = False
        return "\r\x1b[K"

    def _clear_bar(self) -> None:
        if clear := self._take_bar():
            console.write(clear, self.stream)

    def _draw_bar(self, step: int) -> None:
        if not self.progress or not self.total_steps:
            return
        done = min(step + 1, self.total_steps)
        width = 30
        filled = width * done // self.total_steps
        eta = ""
        if self._step_ms_ema is not None:
            eta = f" | ETA {format_eta(self._step_ms_ema * (self.total_steps - done) / 1000)}"
        self._bar_shown = console.write(f"\r\x1b[K[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total_steps}"
                                        f"{eta}", self.stream)

    def _progress(self, done: int, epoch: float | None) -> str:
        """`done` optimizer steps of the run as a percentage (never above 100: the final evaluation runs after the
        last step), else the position in the epoch."""
        if self.total_steps:
            return f" [{100.0 * min(max(done, 0), self.total_steps) / self.total_steps:5.1f}%]"
        if epoch is not None:
            return f" [{100.0 * (epoch % 1.0):5.1f}%]"
        return ""

    # ---- events ----
    def log_cmd(self, argv: Iterable[str] | None = None) -> None:
        self.log("cmd", cmd=list(sys.argv if argv is None else argv), sync=True)

    def log_options(self, options: Mapping[str, Any]) -> None:
        """Every option into the log; on the console only when verbose (they are ~90 lines)."""
        opts = dict(options)
        self.log("options", options=opts, sync=True)
        if opts and self.verbosity >= VERBOSE:
            width = max(len(k) for k in opts)
            self._print("[Options]\n" + "\n".join(f"  {k:<{width}}: {v}" for k, v in opts.items()) + "\n")

    def log_dataset(self, split: str, *, files: int, tokens: int, **extra: Any) -> None:
        self.log("dataset", split=split, files=files, tokens=tokens, **extra)
        self._print(f"[Dataset] {split}: {files} file(s), {tokens:,} tokens")

    def log_device(self, *, name: str, **info: Any) -> None:
        """One `gpu-model` object per device (llm.q's name; also used for CPU runs)."""
        self.log("gpu-model", name=name, **info)
        self._print(f"[System] {name}" + (f" (rank {info['rank']})" if "rank" in info else ""))

    def log_sol(self, *, blocks: int, lm_head: int, attention: int, ns_per_token: float | None,
                peaks: Mapping[str, float | None] | None = None, mfu_flops_per_token: float | None = None,
                bf16_peak_tflops: float | None = None, world: int = 1) -> None:
        """Record the SOL model; later steps then carry `sol` and `mfu`. ns_per_token=None: unknown device."""
        self.ns_per_token = ns_per_token
        self.mfu_flops_per_token = mfu_flops_per_token
        self.mfu_peak_flops = None if bf16_peak_tflops is None else bf16_peak_tflops * 1e12 * world
        tps = None if not ns_per_token else 1e9 / ns_per_token
        self.log("sol", blocks=blocks, lm_head=lm_head, attention=attention, tps=tps, world=world,
                 **{f"{k}_peak": v for k, v in (peaks or {}).items()})
        if tps is None:
            self._print("[Speed of Light] unknown device: no SOL estimate")
        else:
            self._print(f"[Speed of Light]\n  Blocks:    {blocks / 1e6:10.1f} MFLOP/token\n"
                        f"  LM-Head:   {lm_head / 1e6:10.1f} MFLOP/token\n"
                        f"  Attention: {attention / 1e6:10.1f} MFLOP/token\n  SOL:       {tps:10.0f} tok/s\n")

    def log_step(self, step: int, *, step_tokens: int, duration_ms: float, norm: float, loss: float, lr: float,
                 epoch: float | None = None, **extra: Any) -> dict[str, Any]:
        """One optimizer step (`step` 0-based, as the LR schedule). `extra`: lse_max, lse_mean, loss_1k..., an MoE
        model's router fields (aux_loss, router_z_loss, expert_load_min / _mean / _max: printed every `router_every`
        steps as the router line)."""
        self.step = step
        tps = step_tokens * 1000.0 / duration_ms if duration_ms > 0 else None
        sol = mfu = None
        if self.ns_per_token and duration_ms > 0:
            sol = self.ns_per_token * step_tokens * 1e-6 / duration_ms
        if self.mfu_flops_per_token and self.mfu_peak_flops and tps is not None:
            mfu = tps * self.mfu_flops_per_token / self.mfu_peak_flops
        fields: dict[str, Any] = dict(step_tokens=step_tokens, duration_ms=duration_ms, norm=norm, loss=loss,
                                      lr=lr, tokens_per_s=tps, sol=sol, mfu=mfu)
        if epoch is not None:
            fields["epoch"] = epoch
        obj = self.log("step", step=step, **fields, **extra)

        if math.isfinite(loss):
            self._train_loss_sum += loss
            self._train_loss_n += 1
        if duration_ms > 0:
            self._step_ms_ema = duration_ms if self._step_ms_ema is None else \
                0.9 * self._step_ms_ema + 0.1 * duration_ms
        line = (f"[T] step {step:5d}{self._progress(step + 1, epoch)} | time: {format_duration_ms(duration_ms)} | "
                f"norm {norm:8.4f} | loss {loss:8.4f} | tps {format_tokens_per_s(tps or 0.0)}")
        if sol is not None:
            line += f" | sol {100 * sol:4.1f}%"
        self._print(line)
        if "aux_loss" in extra and step % self.router_every == 0:
            self._print(self._router_line(step, extra))
        self._check_outliers(step, loss=loss, norm=norm)
        if self.verbosity >= DEFAULT:
            self._draw_bar(step)
        return obj

    @staticmethod
    def _router_line(step: int, f: Mapping[str, Any]) -> str:
        """An MoE model's routers in the step (train/router_metrics.py): the load-balancing loss and the router
        z-loss (without their weights), and the tokens per expert of a layer over the step's batch."""
        def get(k: str) -> float:
            return float(f.get(k, math.nan))

        return (f"[R] step {step:5d} | aux loss {get('aux_loss'):8.4f} | z-loss {get('router_z_loss'):8.3f} | "
                f"tokens/expert min {get('expert_load_min'):.0f} mean {get('expert_load_mean'):.0f} "
                f"max {get('expert_load_max'):.0f}")

    def _check_outliers(self, step: int, *, loss: float, norm: float) -> None:
        for what, value, det in (("loss", loss, self.loss_outliers), ("norm", norm, self.norm_outliers)):
            if not math.isfinite(value):
                self.message(f"step {step}: {what} is {value}", step=step, level="warning")
                continue
            z = det.update(value)
            if det.is_outlier(z):
                self.message(f"step {step}: {what} {value:.4f} is an outlier (z-score {z:.1f} over the last "
                             f"{det.window} steps)", step=step, level="warning")

    def log_eval(self, step: int, *, loss: float, eval_tokens: int, duration_ms: float,
                 epoch: float | None = None, **extra: Any) -> dict[str, Any]:
        """An evaluation; the console line also shows the mean training loss since the previous eval."""
        self.step = step
        ppl = math.exp(loss) if loss < 700 else math.inf
        train_avg = self._train_loss_sum / self._train_loss_n if self._train_loss_n else None
        self._train_loss_sum, self._train_loss_n = 0.0, 0
        obj = self.log("eval", step=step, loss=loss, eval_tokens=eval_tokens, duration_ms=duration_ms, ppl=ppl,
                       train_avg=train_avg, **({"epoch": epoch} if epoch is not None else {}), **extra, sync=True)
        tps = eval_tokens * 1000.0 / duration_ms if duration_ms > 0 else 0.0
        train = f"{train_avg:8.4f}" if train_avg is not None else "       -"
        # an evaluation logged at step s runs before step s: s steps are done
        self._print(f"[V] step {step:5d}{self._progress(step, epoch)} | time: {format_duration_ms(duration_ms)} | "
                    f"eval loss {loss:8.4f} | ppl {ppl:9.3f} | train avg {train} | "
                    f"tps {format_tokens_per_s(tps)}", level=QUIET)
        return obj

    def log_memory(self, *, allocated: int, reserved: int, peak: int, step: int | None = None,
                   **extra: Any) -> None:
        """Device memory in bytes (torch.cuda.memory_allocated / memory_reserved / max_memory_allocated)."""
        self.log("memory", step=step, allocated=allocated, reserved=reserved, peak=peak, **extra)
        mib = 1 << 20
        self._print(f"[M] allocated {allocated // mib} MiB | reserved {reserved // mib} MiB | "
                    f"peak {peak // mib} MiB", level=VERBOSE)

    def message(self, text: str, *, step: int | None = None, level: str = "info", on_console: bool = True,
                **extra: Any) -> None:
        """Free-form message (`level` info | warning); warnings are fsync'ed and shown even when quiet.
        on_console=False: the log file only (a line the console gets another way)."""
        warn = level == "warning"
        self.log("message", step=step, level=level, message=text, sync=warn, **extra)
        if on_console:
            self._print(("[!] " if warn else "[I] ") + text, level=QUIET if warn else VERBOSE)

    def log_gpu(self, sample: Mapping[str, Any], *, step: int | None = None) -> None:
        """One GPU telemetry sample (`qtrain.observe.gpu.GpuMonitor.sample`: llm.q's `gpu` fields and units)."""
        self.log("gpu", step=step, **sample)
        mw = sample.get("power")
        self._print(f"[GPU {sample.get('id', 0)}] util {sample.get('gpu_util', '?')}% | "
                    f"power {'?' if mw is None else f'{mw / 1000:.0f}'} W | clock {sample.get('clock', '?')} MHz | "
                    f"{sample.get('temperature', '?')} C | throttle {sample.get('throttle') or 'none'}", level=VERBOSE)

    def log_outputs(self, **where: str | None) -> None:
        """Where the run's results are (export=..., checkpoint=..., log_file=...): logged, and printed at the end of
        a run. Empty values are left out."""
        if {"log", "time", "step"} & where.keys():
            raise ValueError(f"log_outputs: {sorted({'log', 'time', 'step'} & where.keys())} are log object fields")
        found = {k: v for k, v in where.items() if v}
        self.log("outputs", sync=True, **found)
        self._print("[Done] " + " | ".join(f"{k.replace('_', ' ')}: {v}" for k, v in found.items()), level=QUIET)

    def log_abs_maxes(self, step: int, abs_maxes: Mapping[str, float]) -> None:
        self.log("abs-maxes", step=step, abs_maxes=[{"name": k, "value": float(v)} for k, v in abs_maxes.items()])

    # ---- checkpoint state ----
    def state_dict(self) -> dict[str, Any]:
        return {"loss_outliers": self.loss_outliers.state_dict(), "norm_outliers": self.norm_outliers.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.loss_outliers.load_state_dict(state["loss_outliers"])
        self.norm_outliers.load_state_dict(state["norm_outliers"])


def _json_default(o: Any) -> Any:
    """Tensors / numpy scalars and paths that slip into log fields."""
    if hasattr(o, "item") and getattr(o, "ndim", 0) == 0:
        return o.item()
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, os.PathLike):
        return os.fspath(o)
    return str(o)
