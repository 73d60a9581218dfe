"""`qtrain export-wandb`: replay a run log into a Weights & Biases run (`qtrain.observe.wandb`)."""
from __future__ import annotations

import argparse
from typing import Sequence

from qtrain.observe.wandb import export_wandb


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("log", metavar="LOG", help="run log: qtrain's JSON Lines (--log-file) or llm.q's JSON")
    p.add_argument("--project", required=True, help="W&B project")
    p.add_argument("--name", default=None, help="run name (default: the run's name option)")
    p.add_argument("--entity", default=None, help="W&B entity (user or team)")
    p.add_argument("--tag", dest="tags", action="append", default=None, help="run tag (repeatable)")
    p.add_argument("--mode", choices=("offline", "online"), default="offline",
                   help="offline (default): write the run locally, upload later with `wandb sync`; "
                        "online: upload now (needs `wandb login`)")
    p.add_argument("--dir", default=None, help="directory for the wandb/ folder (default: current directory)")


def run(ns: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    r = export_wandb(ns.log, project=ns.project, name=ns.name, mode=ns.mode, dir=ns.dir, entity=ns.entity,
                     tags=ns.tags)
    print(f"exported {r.steps} steps and {r.evals} evaluations to W&B run {r.name!r} ({r.run_id}) in {r.run_dir}")
    if ns.mode == "offline":
        print(f"upload with: wandb sync {r.run_dir}")
    return 0
