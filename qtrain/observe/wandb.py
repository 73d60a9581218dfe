"""`qtrain export-wandb LOG --project P`: replay a run's JSON Lines log into a Weights & Biases run
(llm.q's `scripts/export_wandb.py`).

What goes where:

* every field of each `step` object becomes `train/<field>` at W&B step = the log's step (loss, norm, lr,
  tokens_per_s, step_tokens, duration_ms, sol, mfu, epoch and any extras), plus `train/tokens`: training
  tokens seen before that step (see `qtrain.observe.history` for the axes);
* every field of each `eval` object becomes `eval/<field>` (loss, ppl, eval_tokens, duration_ms,
  train_avg, ...) at its step; an evaluation at step s and the training step s land in the same W&B row
  (both describe the weights after s steps);
* the run's options become the W&B config, with the datasets (`dataset/train/tokens`, ...) and the device
  (`device`); the run name is `name`, else the `name` option.

Resumed runs are merged as `qtrain.observe.history.load_run` describes (W&B needs steps in increasing order).
Non-finite values are sent as they are (W&B stores NaN / Infinity).

`mode="offline"` (the default) writes the run under `dir/wandb/offline-run-*` and contacts no server;
upload it later with `wandb sync DIR`. `mode="online"` needs a W&B login. In offline mode this also turns
off wandb's own error reporting (WANDB_ERROR_REPORTING=false unless already set), so nothing at all leaves
the machine. Needs the `wandb` package (`pip install wandb`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from qtrain.observe.history import LogError, history_from_events

__all__ = ["export_wandb", "WandbExport"]

_SKIP = ("log", "time", "step")  # bookkeeping fields of every log object


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
    from qtrain.observe.log import read_log

    if mode not in ("offline", "online", "disabled"):
        raise LogError(f"export-wandb: --mode must be offline, online or disabled, got {mode!r}")
    p = os.fspath(log_path)
    try:
        events = read_log(p)
    except OSError as e:
        raise LogError(f"{p}: cannot read log ({e.strerror or e})") from None
    except ValueError as e:
        raise LogError(str(e)) from None
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

    if mode != "online":
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
    try:
        import wandb
    except ImportError as e:
        raise ImportError(f"export-wandb needs the wandb package (pip install wandb): {e}") from e

    if dir is not None:
        os.makedirs(dir, exist_ok=True)
    # a replay: no console capture, no git / code / system metrics / machine info of *this* process
    wanted = dict(console="off", disable_git=True, save_code=False, x_disable_stats=True, x_disable_machine_info=True,
                  silent=True)
    known = getattr(wandb.Settings, "model_fields", None)  # pydantic settings (wandb >= 0.19)
    settings = wandb.Settings(**{k: v for k, v in wanted.items() if known is None or k in known})
    run = wandb.init(project=project, entity=entity, name=run_name, config=config, mode=mode,
                     dir=None if dir is None else os.fspath(dir), tags=tags, settings=settings, reinit="create_new")
    try:
        # one row per step: the evaluation before step s, then step s's training metrics
        rows: dict[int, dict[str, Any]] = {}
        for e, tokens in zip(history.step_events, history.tokens):
            rows.setdefault(int(e["step"]), {}).update({**_metrics(e, "train"), "train/tokens": tokens})
        for e, tokens in zip(history.eval_events, history.eval_train_tokens):
            rows.setdefault(int(e["step"]), {}).update({**_metrics(e, "eval"), "eval/tokens": tokens})
        for step in sorted(rows):
            run.log(rows[step], step=step)
        run_dir = os.path.dirname(run.dir) if getattr(run, "dir", None) else ""
        result = WandbExport(run_id=run.id, run_dir=run_dir, name=run_name, steps=len(history.step_events),
                             evals=len(history.eval_events))
    finally:
        run.finish()
        if teardown:
            wandb.teardown()
    return result
