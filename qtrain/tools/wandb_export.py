"""`qtrain export-wandb LOG --project P`: replay a run's JSON Lines log into a Weights & Biases run
(llm.q's `scripts/export_wandb.py`).

What goes where:

* every field of each `step` object becomes `train/<field>` at W&B step = the log's step (loss, norm, lr,
  tokens_per_s, step_tokens, duration_ms, sol, mfu, epoch and any extras), plus `train/tokens`: training
  tokens seen before that step (see `qtrain.tools` for the axes);
* every field of each `eval` object becomes `eval/<field>` (loss, ppl, eval_tokens, duration_ms,
  train_avg, ...) at its step; an evaluation at step s and the training step s land in the same W&B row
  (both describe the weights after s steps);
* the run's options become the W&B config, with the datasets (`dataset/train/tokens`, ...) and the device
  (`device`); the run name is `name`, else the `name` option.

Resumed runs are merged as `qtrain.tools.load_run` describes (W&B needs steps in increasing order).
Non-finite values are sent as they are (W&B stores NaN / Infinity).

`mode="offline"` (the default) writes the run under `dir/wandb/offline-run-*` and contacts no server;
upload it later with `wandb sync DIR`. `mode="online"` needs a W&B login. In offline mode this also turns
off wandb's own error reporting (WANDB_ERROR_REPORTING=false unless already set), so nothing at all leaves
the machine. Needs the `wandb` package (`pip install wandb`).
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

from . import LogError, history_from_events

__all__ = ["export_wandb", "WandbExport", "add_export_wandb_args", "run_export_wandb"]

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
    from ..train.log import read_log

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


# ---------------------------------------------------------------- CLI

def add_export_wandb_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("log", metavar="LOG", help="JSON Lines log of a qtrain run (--log-file)")
    p.add_argument("--project", required=True, help="W&B project")
    p.add_argument("--name", default=None, help="run name (default: the run's name option)")
    p.add_argument("--entity", default=None, help="W&B entity (user or team)")
    p.add_argument("--tag", dest="tags", action="append", default=None, help="run tag (repeatable)")
    p.add_argument("--mode", choices=("offline", "online"), default="offline",
                   help="offline (default): write the run locally, upload later with `wandb sync`; "
                        "online: upload now (needs `wandb login`)")
    p.add_argument("--dir", default=None, help="directory for the wandb/ folder (default: current directory)")


def run_export_wandb(ns: argparse.Namespace) -> int:
    r = export_wandb(ns.log, project=ns.project, name=ns.name, mode=ns.mode, dir=ns.dir, entity=ns.entity,
                     tags=ns.tags)
    print(f"exported {r.steps} steps and {r.evals} evaluations to W&B run {r.name!r} ({r.run_id}) in {r.run_dir}")
    if ns.mode == "offline":
        print(f"upload with: wandb sync {r.run_dir}")
    return 0
