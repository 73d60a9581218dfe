"""`qtrain train`: parse the options, then run `qtrain.train.loop.run_training` in this process, in N
spawned local workers (`--gpus N`), or under torchrun's ranks."""
from __future__ import annotations

import argparse
from typing import Sequence

from qtrain.cli.options import add_train_args, options_from_args
from qtrain.options import Options


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_train_args(p)


def run(ns: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    opts = options_from_args(ns)
    from qtrain.parallel.dist import check_device, launch_local, under_launcher
    check_device(opts.device)
    nprocs = opts.gpus
    if nprocs == 0:
        import torch
        nprocs = torch.cuda.device_count() if (torch.cuda.is_available() and opts.device != "cpu") else 1
    if under_launcher() or nprocs == 1:
        run_worker(opts, list(argv))
    else:
        from qtrain.train.preflight import preflight
        prep = preflight(opts, world=nprocs)  # every check once, here, before any worker starts
        try:  # the launcher holds the output paths' lock for the whole job (its workers need none)
            launch_local(run_worker, nprocs, opts, list(argv), prep.shareable())
        finally:
            prep.lock.release()
    return 0


def run_worker(opts: Options, argv: list[str], prep=None) -> None:
    """One rank's whole run (also the entry point of spawned workers)."""
    from qtrain.parallel.dist import shutdown
    from qtrain.train.loop import run_training
    try:
        run_training(opts, argv, prep=prep)
    finally:
        shutdown()
