"""Expert parallelism (`--expert-parallel N`): each rank holds E/N of every MoE layer's experts, and the tokens
travel to their experts' ranks and back.

Ranks. world = dp x ep; rank r = d ep + e is expert-parallel rank e of token group d (the ep consecutive ranks
[d ep, (d+1) ep), which exchange tokens) and holds experts [e E/ep, (e+1) E/ep) of every stack. The ranks holding
the same experts (e, e + ep, ...: the dp "replicas") share their gradients and optimizer state:

    dense groups (attention, norms, router, embeddings)   replicated on all ranks, averaged over all world ranks
    expert groups (parallel/layout.py, `Group.ep`)         E/ep experts, averaged over the dp replicas, sharded
                                                           over them for the optimizer (ZeRO-1 / -2 over dp)

The gradient managers and the optimizer run their collectives of an expert group on the replicas' communicator
(`ExpertParallel.comm_of`). A rank's expert gradient already sums the tokens of its whole token group (every
rank's loss carries the weight world / tokens), so the mean over the world is the replicas' mean divided by ep:
the managers scale an expert group's fresh gradients by 1/ep (exact for a power of two).

One MoE layer's forward on a rank (`TokenExchange`, called by model/moe.py between the permutation and the
combine):

    counts (E,) of its rows per expert  -- all_gather over the token group -> (ep, E) on every rank
    rows in global expert order          -- all_to_all_single, uneven splits: rank j gets its experts' rows
    received rows (source-major)         -- reordered expert-major, the grouped GEMMs over the E/ep local experts
    outputs                              -- back to source-major, all_to_all_single back, then the combine

Both exchanges are differentiable (the backward of one is the other with the splits swapped). The splits are host
integers: each MoE layer waits once for the counts (a dropless exchange must know the sizes before it moves rows).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from qtrain.parallel.comm import Communicator
from qtrain.parallel.layout import FlatLayout, Group

__all__ = ["ExpertParallel", "ExpertParallelError", "TokenExchange", "check_expert_parallel", "make_expert_parallel",
           "whole_experts"]


# torch >= 2.13 renamed the tensor collectives (the old names warn); older torch has only the old ones
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ExpertParallelError(ValueError):
    """--expert-parallel that does not fit the model or the number of ranks."""


def check_expert_parallel(ep: int, *, num_experts: int | None, world: int, model_type: str = "") -> None:
    """Refuse an --expert-parallel that cannot place whole experts: a dense model (`num_experts` None), a count that
    does not divide the experts or the world."""
    if ep == 1:
        return
    if num_experts is None:
        raise ExpertParallelError(f"--expert-parallel {ep}: {model_type or 'this'} model has no experts (a dense "
                                  f"model); drop --expert-parallel")
    if num_experts % ep:
        raise ExpertParallelError(f"--expert-parallel {ep} must divide the model's {num_experts} experts (each rank "
                                  f"holds the same number of whole experts)")
    if world % ep:
        raise ExpertParallelError(f"--expert-parallel {ep} must divide the number of ranks ({world}): the ranks are "
                                  f"cut into groups of {ep} that exchange tokens")


class _AllToAll(torch.autograd.Function):
    """Rows to ranks by all_to_all_single with uneven splits; the backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        gi = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(gi, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return gi, None, None, None


@dataclass
class Routed:
    """What `TokenExchange.dispatch` hands to the local experts, and what `combine` needs to send results back."""
    rows: torch.Tensor  # (M, C) this rank's experts' rows, expert-major
    offsets: torch.Tensor  # (E/ep,) int32 cumulative row ends per local expert (grouped GEMM `offs`)
    counts: torch.Tensor  # (E/ep,) int64 rows per local expert
    index: torch.Tensor  # (M,) int64: expert-major row i is the received (source-major) row index[i]
    send: list[int]  # rows this rank sent to each rank of its token group
    recv: list[int]  # rows it received from each


class TokenExchange:
    """The token group's all-to-all of an MoE layer (module docstring): what model/moe.py calls `exchange`."""

    def __init__(self, group: dist.ProcessGroup | None, *, ep: int, ep_rank: int):
        self.group, self.ep, self.ep_rank = group, ep, ep_rank

    def local_experts(self, num_experts: int) -> tuple[int, int]:
        """(first, count) of the experts this rank holds."""
        n = num_experts // self.ep
        return self.ep_rank * n, n

    def dispatch(self, xs: torch.Tensor, counts: torch.Tensor) -> Routed:
        """xs (N*k, C) in global expert order with `counts` (E,) rows per expert -> this rank's experts' rows from
        every rank of the token group, expert-major."""
        ep, E = self.ep, counts.numel()
        n = E // ep
        everyone = torch.empty(ep * E, dtype=torch.int64, device=counts.device)
        _all_gather(everyone, counts.to(torch.int64).contiguous(), group=self.group)
        table = everyone.view(ep, E).cpu()  # the one host wait of the layer: the splits
        send = table[self.ep_rank].view(ep, n).sum(1).tolist()
        mine = table[:, self.ep_rank * n:(self.ep_rank + 1) * n]  # (ep sources, n local experts)
        recv = mine.sum(1).tolist()
        received = _AllToAll.apply(xs, recv, send, self.group)  # source-major, each source's rows expert-major
        # expert-major order: for local expert l, the rows of every source s in source order
        starts = torch.cumsum(mine.reshape(-1), 0) - mine.reshape(-1)  # (s, l) block starts, source-major
        blocks_em = mine.t().reshape(-1)  # lengths in (l, s) order
        starts_em = starts.view(ep, n).t().reshape(-1)
        total = int(blocks_em.sum())
        first = torch.repeat_interleave(starts_em - (torch.cumsum(blocks_em, 0) - blocks_em), blocks_em)
        index = (first + torch.arange(total)).to(xs.device)  # expert-major row i <- source-major row index[i]
        local_counts = mine.sum(0)
        offsets = torch.cumsum(local_counts, 0).to(torch.int32).to(xs.device)
        return Routed(received.index_select(0, index), offsets, local_counts.to(xs.device), index, send, recv)

    def combine(self, ys: torch.Tensor, routed: Routed) -> torch.Tensor:
        """The local experts' outputs (M, C), expert-major -> this rank's rows (N*k, C) in global expert order."""
        src = torch.empty_like(routed.index)
        src[routed.index] = torch.arange(routed.index.numel(), device=routed.index.device)
        back = ys.index_select(0, src)  # source-major, as received
        return _AllToAll.apply(back, routed.send, routed.recv, self.group)


@dataclass
class ExpertParallel:
    """This rank's place in expert parallelism (module docstring)."""
    ep: int
    dp: int
    ep_rank: int
    dp_rank: int
    replicas: Communicator  # the dp ranks holding the same experts: an expert group's gradients and optimizer state
    exchange: TokenExchange  # the ep ranks of the token group

    def comm_of(self, group: Group, comm: Communicator) -> Communicator:
        """The communicator of `group`'s collectives: the replicas' for an expert group, else `comm` (the world's)."""
        return self.replicas if group.ep > 1 else comm

    @torch.no_grad()
    def gather_experts(self, params: dict[str, torch.Tensor], layout: FlatLayout,
                       groups: list[Group] | None = None) -> dict[str, torch.Tensor]:
        """Every parameter in full, or those of `groups` (a collective of the token group): the expert stacks gathered
        from its ranks (rank e's experts are the e-th E/ep of each stack; through the replicas' device, then where
        `params` are: sharded weights' gathered copies are in host memory), the others as they are (detached)."""
        out = {}
        dev = self.replicas.device
        for g in layout.groups if groups is None else groups:
            for s in g.segments:
                p = params[s.name].detach()
                if g.ep > 1:
                    full = torch.empty(self.ep * p.numel(), dtype=p.dtype, device=dev)
                    _all_gather(full, p.to(dev).contiguous().view(-1), group=self.exchange.group)
                    p = full.to(p.device).view(self.ep * p.shape[0], *p.shape[1:])
                out[s.name] = p
        return out


def make_expert_parallel(ep: int, *, rank: int, world: int, device: torch.device) -> ExpertParallel | None:
    """The groups of expert parallelism for this rank (every rank must call it: creating a group is collective);
    None without it (ep 1)."""
    if ep == 1:
        return None
    if world % ep:
        raise ExpertParallelError(f"--expert-parallel {ep} must divide the number of ranks ({world})")
    dp = world // ep
    tokens = replicas = None
    for d in range(dp):  # every rank creates every group, in the same order
        pg = dist.new_group(list(range(d * ep, (d + 1) * ep)))
        if rank // ep == d:
            tokens = pg
    if dp == 1:
        replica_comm = Communicator.solo(device)
    else:
        for e in range(ep):
            pg = dist.new_group(list(range(e, world, ep)))
            if rank % ep == e:
                replicas = pg
        replica_comm = Communicator(replicas, device=device)
    return ExpertParallel(ep, dp, rank % ep, rank // ep, replica_comm, TokenExchange(tokens, ep=ep, ep_rank=rank % ep))


def whole_experts(group: Group, shards: list[torch.Tensor], world: int) -> dict[str, torch.Tensor]:
    """An expert group's stacks, every expert, from every rank's shard of it (a checkpoint's, in rank order):
    rank d ep + e holds shard d of expert-parallel rank e's experts (module docstring)."""
    ep = group.ep
    locals_ = [torch.cat([shards[d * ep + e] for d in range(world // ep)]) for e in range(ep)]
    return {s.name: torch.cat([buf[s.start:s.start + s.numel].view(s.shape) for buf in locals_])
            for s in group.segments}
