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


def run(ns: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    export_checkpoint(ns.checkpoint_dir, ns.out_dir, step=ns.step)
    return 0
