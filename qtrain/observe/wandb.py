"""Weights & Biases: live logging of a run (`--wandb PROJECT`, `WandbSink`) and `qtrain export-wandb LOG
--project P`, which replays a run log (qtrain's JSON Lines or llm.q's JSON array) into a W&B run (llm.q's
`scripts/export_wandb.py`). Both put the same metrics under the same names.

What goes where:

* every field of each `step` object becomes `train/<field>` at W&B step = the log's step (loss, norm, lr,
  tokens_per_s, step_tokens, duration_ms, sol, mfu, epoch and any extras), plus `train/tokens`: training
  tokens seen before that step (see `qtrain.observe.history` for the axes);
* every field of each `eval` object becomes `eval/<field>` (loss, ppl, eval_tokens, duration_ms,
  train_avg, ...) at its step; an evaluation at step s and the training step s land in the same W&B row
  (both describe the weights after s steps);
* every numeric field of each `gpu` object (`--log-gpu-util`) becomes `gpu/<field>`, of each
  `time-breakdown` object `time/<field>`;
* the run's options become the W&B config, with the datasets (`dataset/train/tokens`, ...) and the device
  (`device`); the run name is `name`, else the `name` option.

Resumed runs are merged as `qtrain.observe.history.load_run` describes (W&B needs steps in increasing order).
Non-finite values are sent as they are (W&B stores NaN / Infinity).

Live logging (`WandbSink`, a `RunLogger` sink on rank 0) sends each object as the run writes it; the mode
is wandb's own default (online after `wandb login`), or WANDB_MODE (offline / disabled) from the environment.

`mode="offline"` (the default of the replay) writes the run under `dir/wandb/offline-run-*` and contacts no server;
upload it later with `wandb sync DIR`. `mode="online"` needs a W&B login. In offline mode this also turns
off wandb's own error reporting (WANDB_ERROR_REPORTING=false unless already set), so nothing at all leaves
the machine. Needs the `wandb` package (`pip install wandb`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from qtrain.observe.history import LogError, history_from_events, read_events

__all__ = ["export_wandb", "WandbExport", "WandbSink"]

_SKIP = ("log", "time", "step")  # bookkeeping fields of every log object
PREFIXES = {"step": "train", "eval": "eval", "gpu": "gpu", "time-breakdown": "time"}  # log kind -> W&B prefix


@dataclass
class WandbExport:
    run_id: str
    run_dir: str  # the run's local directory (offline: .../wandb/offline-run-<date>-<id>)
    name: str
    steps: int  # step objects replayed
    evals: int  # eval objects replayed


def _metrics(obj: dict[str, Any], prefix: str) -> dict[str, Any]:
    out = {}
    for k, v in obj.items():
        if k in _SKIP or isinstance(v, (dict, list, str)) or v is None:
            continue
        out[f"{prefix}/{k}"] = float(v) if isinstance(v, bool) else v
    return out


def _start_run(*, project: str, name: str | None, config: dict[str, Any], mode: str | None,
               dir: str | os.PathLike | None, entity: str | None, tags: list[str] | None, replay: bool) -> Any:
    """wandb.init with qtrain's settings; a replay captures nothing of this process (console, git, system)."""
    if mode != "online" and (mode is not None or os.environ.get("WANDB_MODE") in ("offline", "disabled")):
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")  # nothing at all leaves the machine
    try:
        import wandb
    except ImportError as e:
        raise ImportError(f"W&B logging needs the wandb package (pip install wandb): {e}") from e
    if dir is not None:
        os.makedirs(dir, exist_ok=True)
    wanted: dict[str, Any] = dict(silent=True)
    if replay:
        wanted.update(console="off", disable_git=True, save_code=False, x_disable_stats=True,
                      x_disable_machine_info=True)
    known = getattr(wandb.Settings, "model_fields", None)  # pydantic settings (wandb >= 0.19)
    settings = wandb.Settings(**{k: v for k, v in wanted.items() if known is None or k in known})
    return wandb.init(project=project, entity=entity, name=name, config=config, mode=mode,
                      dir=None if dir is None else os.fspath(dir), tags=tags, settings=settings, reinit="create_new")


class WandbSink:
    """`--wandb PROJECT`: a `RunLogger` sink that logs the run to W&B as it trains (see the module docstring).
    `train/tokens` counts the training tokens seen before each step, as the replay does."""

    def __init__(self, project: str, *, name: str | None, config: dict[str, Any], mode: str | None = None,
                 dir: str | os.PathLike | None = None, entity: str | None = None):
        self.run = _start_run(project=project, name=name, config=config, mode=mode, dir=dir, entity=entity,
                              tags=None, replay=False)
        self.tokens = 0.0

    def on_event(self, obj: dict[str, Any]) -> None:
        prefix = PREFIXES.get(str(obj.get("log")))
        if prefix is None or self.run is None:
            return
        row = _metrics(obj, prefix)
        if prefix == "train":
            row["train/tokens"] = self.tokens
            self.tokens += float(obj.get("step_tokens") or 0)
        elif prefix == "eval":
            row["eval/tokens"] = self.tokens
        self.run.log(row, step=int(obj["step"]))

    @property
    def run_dir(self) -> str:
        return os.path.dirname(self.run.dir) if getattr(self.run, "dir", None) else ""

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def export_wandb(log_path: str | os.PathLike, *, project: str, name: str | None = None, mode: str = "offline",
                 dir: str | os.PathLike | None = None, entity: str | None = None,
                 tags: list[str] | None = None, teardown: bool = True) -> WandbExport:
    """Replay the JSON Lines log at `log_path` into a new W&B run (see the module docstring).

    `dir`: where the `wandb/` folder goes (default: W&B's default, the current directory or $WANDB_DIR).
    `teardown`: after finishing the run, stop wandb's service process (`wandb.teardown()`). Only that
    guarantees the run's files are complete on return: `run.finish()` can return while wandb's core is
    still writing the offline `.wandb` file (seen with wandb 0.31, about one run in 20). It also finishes
    any other W&B run of this process, so pass False if there is one (the files then complete shortly
    after, or at the latest when the process exits). Returns the run's id and local directory."""
    if mode not in ("offline", "online", "disabled"):
        raise LogError(f"export-wandb: --mode must be offline, online or disabled, got {mode!r}")
    p = os.fspath(log_path)
    events = read_events(p)
    history = history_from_events(events, path=p)
    run_name = name or history.name

    config: dict[str, Any] = dict(history.options)
    for e in events:
        if e.get("log") == "dataset" and e.get("split"):
            for k in ("files", "tokens", "seed"):
                if k in e:
                    config[f"dataset/{e['split']}/{k}"] = e[k]
        elif e.get("log") == "gpu-model" and e.get("name") and "device_name" not in config:
            config["device_name"] = e["name"]
            if "world" in e:
                config["world"] = e["world"]

    run = _start_run(project=project, name=run_name, config=config, mode=mode, dir=dir, entity=entity, tags=tags,
                     replay=True)
    try:
        # one row per step: the evaluation before step s, then step s's training metrics (and its telemetry)
        rows: dict[int, dict[str, Any]] = {}
        for e, tokens in zip(history.step_events, history.tokens):
            rows.setdefault(int(e["step"]), {}).update({**_metrics(e, "train"), "train/tokens": tokens})
        for e, tokens in zip(history.eval_events, history.eval_train_tokens):
            rows.setdefault(int(e["step"]), {}).update({**_metrics(e, "eval"), "eval/tokens": tokens})
        for e in events:  # telemetry of the steps kept
            kind = str(e.get("log"))
            if kind in ("gpu", "time-breakdown") and int(e.get("step", -1)) in rows:
                rows[int(e["step"])].update(_metrics(e, PREFIXES[kind]))
        for step in sorted(rows):
            run.log(rows[step], step=step)
        run_dir = os.path.dirname(run.dir) if getattr(run, "dir", None) else ""
        result = WandbExport(run_id=run.id, run_dir=run_dir, name=run_name, steps=len(history.step_events),
                             evals=len(history.eval_events))
    finally:
        run.finish()
        if teardown:
            import wandb
            wandb.teardown()
    return result
