"""Run a function in N processes joined by a real torch.distributed process group (gloo on CPU).

    results = run_distributed(fn, world_size, *args)   # fn(rank, world_size, *args), picklable (module level)
    results[r]                                        # what rank r's fn returned (through torch.save)

The rendezvous is a FileStore in a fresh temporary directory, so there is no port to pick and no race with
other test runs on the same machine. Each child uses one intra-op thread (the CI machine has few cores
and N processes already compete for them). A failing rank's traceback is re-raised in the parent; a rank
that does not finish within `timeout` seconds fails the call (the children are terminated).
"""
from __future__ import annotations

import datetime
import os
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(fn: Callable, rank: int, world_size: int, backend: str, store_dir: str, args: tuple) -> None:
    out = os.path.join(store_dir, f"result.{rank}")
    try:
        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.FileStore(os.path.join(store_dir, "store"), world_size)
        extra = {"device_id": torch.device("cuda", rank)} if backend == "nccl" else {}
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=120), **extra)
        try:
            result = {"ok": fn(rank, world_size, *args)}
        finally:
            dist.destroy_process_group()
    except BaseException:  # report everything, including assertion errors inside fn
        result = {"error": traceback.format_exc()}
    torch.save(result, out + ".tmp")
    os.replace(out + ".tmp", out)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
                    timeout: float = 300.0) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned ranks; return the per-rank results."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="qtrain_dist_") as d:
        procs = [ctx.Process(target=_entry, args=(fn, r, world_size, backend, d, args), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:
            procs[r].terminate()
            procs[r].join(10)
        results = []
        errors = []
        for r in range(world_size):
            path = os.path.join(d, f"result.{r}")
            if not os.path.exists(path):
                errors.append(f"rank {r}: no result (exit code {procs[r].exitcode}"
                              f"{', timed out' if r in hung else ''})")
                results.append(None)
                continue
            res = torch.load(path, weights_only=False)
            if "error" in res:
                errors.append(f"rank {r} raised:\n{res['error']}")
                results.append(None)
            else:
                results.append(res["ok"])
        if errors:
            raise RuntimeError(f"run_distributed({getattr(fn, '__name__', fn)}, world_size={world_size}) failed:\n"
                               + "\n".join(errors))
        return results


def write_model_dir(root, cfg) -> str:
    """A model directory holding only `cfg` as an HF config.json (for `--model DIR --from-scratch` runs)."""
    import json
    (root / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    return str(root)


def write_model_dirs(root, cfgs: dict) -> dict[str, str]:
    """One `write_model_dir` per named config, each in a folder of its name under `root`."""
    out = {}
    for name, cfg in cfgs.items():
        (root / name).mkdir(exist_ok=True)
        out[name] = write_model_dir(root / name, cfg)
    return out


def random_batch(vocab_size: int, B: int, T: int, step: int, micro: int, rank: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of random tokens, a function of (step, micro-step, rank) only: every run of a
    comparison sees the same data."""
    gen = torch.Generator().manual_seed(7919 * step + 131 * micro + 17 * rank + 3)
    seq = torch.randint(0, vocab_size, (B, T + 1), generator=gen)
    return seq[:, :-1].clone(), seq[:, 1:].clone()


def full_params_cpu(tr) -> dict[str, torch.Tensor]:
    """The trainer's full parameters, copied to host memory (a collective with sharded weights)."""
    return {n: p.detach().to("cpu", copy=True) for n, p in tr.full_params().items()}


def train_steps(tr, steps: range, batch: Callable[[int, int, int], tuple[torch.Tensor, torch.Tensor]],
                grad_accumulation: int, lr: float) -> list[dict]:
    """Run optimizer steps; per step the loss, the gradient norm and the full weights after the update."""
    out = []
    for s in steps:
        for m in range(grad_accumulation):
            tr.micro_step(*batch(s, m, tr.ctx.rank))
        stats = tr.update(lr=lr)
        out.append({"loss": stats["loss"], "norm": stats["norm"], "weights": full_params_cpu(tr)})
    return out
