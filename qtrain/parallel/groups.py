"""Process groups for hybrid sharding (`--shard-group-size G`): shard within groups of G consecutive ranks,
replicate across them.

Rank r belongs to shard group r // G (ranks [kG, (k+1)G): one node's GPUs when G is the GPUs per node) and
holds shard index r % G there; its replica group is the ranks with the same shard index (r % G, r % G + G,
...). Every sharded component (layout, gradient managers, optimizer, sharded weights) works on the shard
group's `Communicator` exactly as it works on the world's without hybrid sharding: a layout of G ranks, shard
r % G. What hybrid adds is one step: once a step's gradient shards are final in the group, they are averaged
across the replica group (`reduce_replicas`), so every replica updates identically. The managers average over
the G ranks of the group and this over the W/G replicas: the average over all W ranks, as flat sharding gives.

With G = W (or 0) there is one shard group, the world, and no replica group: `shard_comm` is the same
`Communicator` over the default group that flat sharding always used, so that path is unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from qtrain.parallel.comm import Communicator
from qtrain.parallel.layout import FlatLayout


class ShardGroupError(ValueError):
    """A shard group size that does not fit the number of ranks."""


class GradShards(Protocol):
    def grad_shard(self, group_key: str) -> torch.Tensor: ...


@dataclass
class ShardGroups:
    shard: Communicator  # the G ranks that share one copy of the sharded state
    replicas: Communicator | None  # the W/G ranks holding the same shard; None without hybrid sharding
    size: int  # G

    @property
    def hybrid(self) -> bool:
        return self.replicas is not None

    def reduce_replicas(self, layout: FlatLayout, grads: GradShards) -> None:
        """Average every final gradient shard across the replica group (no-op without hybrid sharding)."""
        if self.replicas is None:
            return
        handles = [self.replicas.all_reduce(grads.grad_shard(g.key), op="avg") for g in layout.groups]
        for h in handles:
            h.wait()


def check_group_size(size: int, world: int) -> int:
    """G for `--shard-group-size size` on `world` ranks (0: the world); ShardGroupError when it does not fit."""
    g = size or world
    if g > world or world % g:
        raise ShardGroupError(f"--shard-group-size {size} must divide the number of ranks ({world}): the ranks are "
                              f"cut into groups of that many")
    return g


def make_shard_groups(size: int, *, rank: int, world: int, device: torch.device) -> ShardGroups:
    """The shard and replica groups of this rank (every rank must call it: creating a group is collective)."""
    g = check_group_size(size, world)
    if world == 1:
        return ShardGroups(Communicator.solo(device), None, 1)
    if g == world:
        return ShardGroups(Communicator(device=device), None, g)
    shard = replica = None
    for k in range(world // g):  # every rank creates every group, in the same order
        pg = dist.new_group(list(range(k * g, (k + 1) * g)))
        if rank // g == k:
            shard = pg
    for i in range(g):
        pg = dist.new_group(list(range(i, world, g)))
        if rank % g == i:
            replica = pg
    return ShardGroups(Communicator(shard, device=device), Communicator(replica, device=device), g)
