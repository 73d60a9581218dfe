"""`qtrain export`: a training checkpoint -> a Hugging Face model directory (`qtrain.train.export`)."""
from __future__ import annotations

import argparse
from typing import Sequence

from qtrain.train.export import export_checkpoint

HELP = "training checkpoint -> Hugging Face model directory"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an export of another run in --out-dir (files qtrain did not write are never replaced)")


def run(ns: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    path = export_checkpoint(ns.checkpoint_dir, ns.out_dir, step=ns.step, overwrite=ns.overwrite)
    print(f"exported {path} to {ns.out_dir}")
    return 0
