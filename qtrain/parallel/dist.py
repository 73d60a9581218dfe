"""Process groups and launching: one object that knows this rank, the world and the device.

`qtrain train --gpus N` starts N local worker processes itself (`launch_local`): NCCL on GPUs, gloo on
CPU (how CI tests data parallelism). Under `torchrun` (one node or several) the launcher's environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) is used as it is.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist


@dataclass
class DistContext:
    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    # ---- the few collectives the trainer itself needs (managers, weights and optimizer use comm.Communicator) ----
    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    def all_gather_into_tensor(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        """Gather equal shards into `out`; `shard` may be a view into `out` at this rank's slice."""
        if self.world > 1:
            dist.all_gather_into_tensor(out, shard.clone() if _overlaps(out, shard) and out.device.type == "cpu"
                                        else shard)

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def broadcast_object(self, obj: Any) -> Any:
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_distributed(requested_device: str = "auto") -> DistContext:
    """Join the process group described by the environment, or run as a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    device = pick_device(requested_device, local_rank)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kw = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend=backend, rank=rank, world_size=world, **kw)
    return DistContext(rank=rank, world=world, local_rank=local_rank, device=device)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(local_rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    fn(*args)


def launch_local(fn: Callable[..., Any], nprocs: int, *args: Any) -> None:
    """Run fn(*args) in `nprocs` fresh processes that form one process group (spawn, so CUDA is safe)."""
    import torch.multiprocessing as mp
    mp.spawn(_worker, args=(nprocs, free_port(), fn, args), nprocs=nprocs, join=True)


def under_launcher() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ
