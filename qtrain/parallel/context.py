"""Context parallelism (`--context-parallel N`): each sequence split across N ranks, so a rank holds T/N of its
tokens' activations.

Load balance: a sequence of T tokens is cut into 2N chunks of T/2N; rank i of a context group holds chunks i and
2N-1-i (an early chunk, whose queries see few keys, with a late one, which see many), so every rank does the same
attention work under the causal mask. Its tokens run through the blocks as a sequence of T/N with their global
positions (the RoPE tables' rows, `positions`), and attention meets every rank's keys and values in one of two
modes (`--context-parallel-mode`, `MODES`):

  allgather  K, V (B, nkv, T/N, hs) all-gathered over the group -> (B, nkv, T, hs) in sequence order; this rank's
             queries attend to the keys at positions <= their own (an explicit mask over global positions, made
             once per local length). Backward: the full dK, dV this rank's queries produced, summed over the group,
             and this rank's rows kept (a reduce-scatter on NCCL; an all-reduce on gloo, which has none). The
             gathered K/V of the whole sequence are kept for each layer's backward, and SDPA with a mask matrix
             runs without the flash kernels (torchtitan's all-gather variant).
  ring       the key/value blocks passed around the group's ring with send/recv, partial outputs merged by
             log-sum-exp, dK/dV passed back around the ring in backward (`parallel/ring_attention.py`): a rank
             keeps only its own q, k, v, out and lse, with one received block in flight.

Documents (--document-masking): the trainer passes every rank the whole rows' position ids (`Trainer._local`
shards inputs and targets only); `documents` turns them into each token's document index (`SplitDocuments`), and
a query attends to a key only inside its document and at or before its position. The RoPE rows of this rank's
tokens are then their positions in their documents (the model's `_tables_and_docs`).

Groups: world = data-parallel replicas x N; the context group is N consecutive ranks (one node's GPUs first), and
the data order is per replica (`data_rank`): the ranks of a group read the same sequences and each keeps its part
(`shard`). The gradient managers, the optimizer and the loss need nothing else: every rank's loss covers its own
tokens with `Trainer.loss_scale` of the step's tokens over all ranks, and the managers average over all ranks, so
the sum is the gradient of the global batch's mean loss, as one process computes it.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from qtrain.kernels.document_attention import positions_error
from qtrain.model.choices import CONTEXT_PARALLEL_MODES as MODES
from qtrain.parallel.ring_attention import MaskOf, Ring, ring_attention

__all__ = ["MODES", "ContextParallel", "SplitDocuments", "check_context_parallel", "chunk_positions", "data_rank",
           "make_context_parallel"]


class ContextParallelError(ValueError):
    """A --context-parallel that does not fit the ranks, the sequence length or the other options."""


def chunk_positions(seq_len: int, parts: int, rank: int) -> torch.Tensor:
    """The positions of `rank`'s tokens in a sequence of `seq_len` split over `parts` ranks: chunks rank and
    2 parts - 1 - rank of 2 parts equal chunks (int64, ascending)."""
    c = seq_len // (2 * parts)
    late = 2 * parts - 1 - rank
    return torch.cat((torch.arange(rank * c, (rank + 1) * c), torch.arange(late * c, (late + 1) * c)))


def check_context_parallel(parts: int, *, world: int, seq_len: int) -> None:
    """One-line errors for a split that cannot work: the ranks must be whole groups, the sequence 2N equal chunks."""
    if parts < 1:
        raise ContextParallelError(f"--context-parallel must be >= 1, got {parts}")
    if world % parts:
        raise ContextParallelError(f"--context-parallel {parts} must divide the number of ranks ({world}): each "
                                   f"sequence is split over a group of that many")
    if seq_len % (2 * parts):
        raise ContextParallelError(f"--context-parallel {parts}: --seq-len {seq_len} must be a multiple of "
                                   f"{2 * parts} (each sequence is cut into 2 x {parts} equal chunks)")


def data_rank(rank: int, world: int, parts: int) -> tuple[int, int]:
    """(replica, replicas): which data-parallel replica a rank belongs to, and how many there are."""
    return rank // parts, world // parts


class _GatherSequence(torch.autograd.Function):
    """(B, H, t, hs) per rank -> (B, H, t x N, hs) in sequence order; backward: the group's summed gradient of this
    rank's rows."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cp: "ContextParallel") -> torch.Tensor:
        ctx.cp = cp
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(cp.parts)]
        dist.all_gather(parts, x, group=cp.group)
        B, H, t, hs = x.shape
        full = x.new_empty(B, H, t * cp.parts, hs)
        for r, part in enumerate(parts):
            full[:, :, chunk_positions(t * cp.parts, cp.parts, r).to(x.device)] = part
        return full

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cp = ctx.cp
        t = grad.shape[2] // cp.parts
        # rank-major: rank r's rows of the full gradient at [r t, (r + 1) t)
        order = torch.cat([chunk_positions(grad.shape[2], cp.parts, r) for r in range(cp.parts)]).to(grad.device)
        by_rank = grad.index_select(2, order).contiguous()
        if dist.get_backend(cp.group) == "nccl":
            B, H, _, hs = grad.shape
            stacked = by_rank.view(B, H, cp.parts, t, hs).permute(2, 0, 1, 3, 4).contiguous()  # (N, B, H, t, hs)
            mine = grad.new_empty(B, H, t, hs)
            dist.reduce_scatter_tensor(mine, stacked, group=cp.group)
            return mine, None
        dist.all_reduce(by_rank, group=cp.group)
        return by_rank[:, :, cp.rank * t:(cp.rank + 1) * t].contiguous(), None


class SplitDocuments(NamedTuple):
    """A micro-batch's documents as a split sequence's attention reads them: each token's document index (B, T) in
    sequence order, on the device, and with the all-gather mode this rank's (B, 1, T/N, T) mask (same document, key
    at or before the query), made once per micro-step."""
    doc: torch.Tensor
    mask: torch.Tensor | None = None


class ContextParallel:
    """This rank's part of each sequence and attention over the whole of it (`model.sequence_split.SequenceSplit`)."""

    def __init__(self, parts: int, rank: int, group: dist.ProcessGroup | None, *, mode: str = "allgather",
                 ranks: list[int] | None = None):
        if mode not in MODES:
            raise ValueError(f"context parallel mode must be one of {MODES}, got {mode!r}")
        self.parts, self.rank, self.group, self.mode = parts, rank, group, mode
        self.ring = Ring(rank, ranks if ranks is not None else list(range(parts)), group)
        self._causal: dict[tuple, torch.Tensor] = {}

    def positions(self, local_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
        return chunk_positions(local_len * self.parts, self.parts, self.rank).to(device)

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids or targets -> this rank's (B, T / N), in position order."""
        return x[:, chunk_positions(x.shape[1], self.parts, self.rank).to(x.device)].contiguous()

    def documents(self, positions: torch.Tensor, device: torch.device | str) -> SplitDocuments:
        """The whole rows' position ids (B, T) of documents (kernels/document_attention.py's) -> `SplitDocuments`.
        A ValueError when they are no documents' positions."""
        why = positions_error(positions.detach().cpu().numpy())
        if why:
            raise ValueError(f"context parallel documents: {why}")
        doc = (positions.to(device) == 0).cumsum(1)  # (B, T) document index within its row
        if self.mode == "ring":
            return SplitDocuments(doc)
        t = positions.shape[1] // self.parts
        mine = self.shard(doc)  # (B, t)
        mask = (mine[:, :, None] == doc[:, None, :]) & self._causal_mask(t, doc.device)
        return SplitDocuments(doc, mask.unsqueeze(1))

    def _causal_mask(self, t: int, device: torch.device) -> torch.Tensor:
        """(t, T) bool: this rank's query i may attend to global key j <= its position (made once per length)."""
        key = (t, str(device))
        if key not in self._causal:
            keys = torch.arange(t * self.parts, device=device)
            self._causal[key] = keys[None, :] <= self.positions(t, device)[:, None]
        return self._causal[key]

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  docs: SplitDocuments | None = None) -> torch.Tensor:
        t = q.shape[2]
        if self.mode == "ring":
            return ring_attention(q, k, v, self.ring, self._block_mask(t, q.device, docs))
        k_all, v_all = _GatherSequence.apply(k, self), _GatherSequence.apply(v, self)
        mask = self._causal_mask(t, q.device) if docs is None else docs.mask
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])

    def _block_mask(self, t: int, device: torch.device, docs: SplitDocuments | None) -> MaskOf:
        """The ring's mask of the block from each source rank: (1 or B, 1, t, t), causal over global positions and,
        with documents, inside each document."""
        mine = self.positions(t, device)
        doc_mine = None if docs is None else self.shard(docs.doc)

        def mask_of(source: int) -> torch.Tensor:
            theirs = chunk_positions(t * self.parts, self.parts, source).to(device)
            allowed = (theirs[None, :] <= mine[:, None])[None, None]
            if docs is None:
                return allowed
            same = doc_mine[:, :, None] == docs.doc[:, theirs][:, None, :]  # (B, t, t)
            return allowed & same[:, None]
        return mask_of


def make_context_parallel(parts: int, *, rank: int, world: int, mode: str = "allgather") -> ContextParallel | None:
    """The context group of this rank (consecutive ranks [g N, (g + 1) N)); None for N = 1. Every rank creates
    every group (torch.distributed's rule for new_group)."""
    if parts <= 1:
        return None
    mine, members = None, None
    for g in range(world // parts):
        ranks = list(range(g * parts, (g + 1) * parts))
        group = None if parts == world else dist.new_group(ranks)
        if rank in ranks:
            mine, members = group, ranks
    return ContextParallel(parts, rank % parts, mine, mode=mode, ranks=members)
