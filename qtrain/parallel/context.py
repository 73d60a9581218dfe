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
             and this rank's rows kept (one reduce-scatter). The
             gathered K/V of the whole sequence are kept for each layer's backward, and SDPA with a mask matrix
             runs without the flash kernels (torchtitan's all-gather variant).
  ring       the key/value blocks passed around the group's ring with send/recv, partial outputs merged by
             log-sum-exp, dK/dV passed back around the ring in backward (`parallel/ring_attention.py`): a rank
             keeps only its own q, k, v, out and lse, with one received block in flight.

Documents (--document-masking): the trainer passes every rank the whole rows' position ids (`Trainer._local`
shards inputs and targets only); `documents` turns them into each token's document index, and a query attends to a
key only inside its document and at or before its position. The RoPE rows of this rank's tokens are then their
positions in their documents (the model's `_tables_and_docs`). Masks and document indices (`SplitAttentionInputs`,
from `documents` or `causal`) are made once per micro-step and reach every block as an input.

Compiled blocks and recompute: the steps that talk to the group (the all-gather and its backward, the ring's forward
and backward) are opaque custom ops (`parallel/context_ops.py`) that call back this object's `gather_kv`,
`reduce_kv`, `ring_forward` and `ring_backward`; eager blocks run the same ops. A recomputed attention
(--recompute-att, --recompute-block) runs its forward op again in backward, every rank of the group at the same point.

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
from qtrain.parallel import context_ops
from qtrain.parallel.comm import reduce_scatter
from qtrain.parallel.ring_attention import MaskOf, Ring, ring_backward, ring_forward

__all__ = ["MODES", "ContextParallel", "SplitAttentionInputs", "check_context_parallel", "chunk_positions", "data_rank",
           "make_context_parallel"]


class ContextParallelError(ValueError):
    """A --context-parallel that does not fit the ranks, the sequence length or the other options."""


def chunk_positions(seq_len: int, parts: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The positions of `rank`'s tokens in a sequence of `seq_len` split over `parts` ranks: chunks rank and
    2 parts - 1 - rank of 2 parts equal chunks (int64, ascending)."""
    c = seq_len // (2 * parts)
    late = 2 * parts - 1 - rank
    return torch.cat((torch.arange(rank * c, (rank + 1) * c, device=device),
                      torch.arange(late * c, (late + 1) * c, device=device)))


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


class SplitAttentionInputs(NamedTuple):
    """What a split sequence's attention reads beside q, k, v, made once per micro-step (`ContextParallel.causal`,
    `ContextParallel.documents`) and passed to every block as an input, so a compiled block neither builds it per
    layer nor keeps a copy per layer: with documents each token's document index (B, T) in sequence order, on the
    device (None for whole sequences); with the all-gather mode this rank's mask over the whole sequence's keys,
    (t, T) causal or (B, 1, t, T) inside each document, key at or before the query (None for the ring, whose
    blocks' masks are made in its op)."""
    doc: torch.Tensor | None = None
    mask: torch.Tensor | None = None


class ContextParallel:
    """This rank's part of each sequence and attention over the whole of it (`model.sequence_split.SequenceSplit`).
    Its communicating steps run as context_ops's opaque ops, which call back `gather_kv`, `reduce_kv`,
    `ring_forward` and `ring_backward` here."""

    def __init__(self, parts: int, rank: int, group: dist.ProcessGroup | None, *, mode: str = "allgather",
                 ranks: list[int] | None = None):
        if mode not in MODES:
            raise ValueError(f"context parallel mode must be one of {MODES}, got {mode!r}")
        self.parts, self.rank, self.group, self.mode = parts, rank, group, mode
        self.ring = Ring(rank, ranks if ranks is not None else list(range(parts)), group)
        self._causal: dict[tuple, torch.Tensor] = {}
        self.handle = context_ops.register(self)

    def positions(self, local_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
        return chunk_positions(local_len * self.parts, self.parts, self.rank, device)

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids or targets -> this rank's (B, T / N), in position order."""
        return x[:, self.positions(x.shape[1] // self.parts, x.device)].contiguous()

    def causal(self, local_len: int, device: torch.device | str) -> SplitAttentionInputs:
        """What `attention` takes for whole sequences (no documents): the all-gather mode's causal (t, T) mask over
        global positions (made once per length)."""
        if self.mode == "ring":
            return SplitAttentionInputs()
        key = (local_len, str(device))
        if key not in self._causal:
            keys = torch.arange(local_len * self.parts, device=device)
            self._causal[key] = keys[None, :] <= self.positions(local_len, device)[:, None]
        return SplitAttentionInputs(mask=self._causal[key])

    def documents(self, positions: torch.Tensor, device: torch.device | str) -> SplitAttentionInputs:
        """The whole rows' position ids (B, T) of documents (kernels/document_attention.py's) -> what `attention` takes.
        A ValueError when they are no documents' positions."""
        why = positions_error(positions.detach().cpu().numpy())
        if why:
            raise ValueError(f"context parallel documents: {why}")
        doc = (positions.to(device) == 0).cumsum(1)  # (B, T) document index within its row
        if self.mode == "ring":
            return SplitAttentionInputs(doc)
        t = positions.shape[1] // self.parts
        mine = self.shard(doc)  # (B, t)
        mask = (mine[:, :, None] == doc[:, None, :]) & self.causal(t, doc.device).mask
        return SplitAttentionInputs(doc, mask.unsqueeze(1))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  inputs: SplitAttentionInputs | None = None) -> torch.Tensor:
        if inputs is None:
            inputs = self.causal(q.shape[2], q.device)
        if self.mode == "ring":
            return context_ops.ring_attention(q, k, v, inputs.doc, self.handle)
        k_all, v_all = context_ops.gather_kv(k, v, self.handle)
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=inputs.mask,
                                              enable_gqa=q.shape[1] != k.shape[1])

    # ---- the communicating steps (context_ops's ops call these) ----
    def gather_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V (B, nkv, t, hs) of this rank -> the group's (B, nkv, t N, hs) each, in sequence order (one
        all-gather for both)."""
        B, H, t, hs = k.shape
        parts = [torch.empty(2, B, H, t, hs, dtype=k.dtype, device=k.device) for _ in range(self.parts)]
        dist.all_gather(parts, torch.stack((k, v)), group=self.group)
        k_all, v_all = (k.new_empty(B, H, t * self.parts, hs) for _ in range(2))
        for r, part in enumerate(parts):
            at = chunk_positions(t * self.parts, self.parts, r, k.device)
            k_all[:, :, at], v_all[:, :, at] = part[0], part[1]
        return k_all, v_all

    def reduce_kv(self, dk: torch.Tensor, dv: torch.Tensor) -> torch.Tensor:
        """dK, dV (B, nkv, T, hs) this rank's queries produced -> (2, B, nkv, t, hs): this rank's rows of each, summed
        over the group (one reduce-scatter)."""
        B, H, T, hs = dk.shape
        t = T // self.parts
        # rank-major: rank r's rows of the whole sequence at [r t, (r + 1) t)
        order = torch.cat([chunk_positions(T, self.parts, r, dk.device) for r in range(self.parts)])
        by_rank = torch.stack((dk, dv)).index_select(3, order)  # (2, B, H, T, hs)
        stacked = by_rank.view(2, B, H, self.parts, t, hs).permute(3, 0, 1, 2, 4, 5).contiguous()  # rank r's at [r]
        mine = dk.new_empty(2, B, H, t, hs)
        reduce_scatter(mine.view(-1), stacked.view(-1), group=self.group)  # flat: gloo checks the leading dims
        return mine

    def ring_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        return ring_forward(q, k, v, self.ring, self._block_mask(q.shape[2], q.device, doc))

    def ring_backward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                      dout: torch.Tensor, doc: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return ring_backward(q, k, v, out, lse, dout, self.ring, self._block_mask(q.shape[2], q.device, doc))

    def _block_mask(self, t: int, device: torch.device, doc: torch.Tensor | None) -> MaskOf:
        """The ring's mask of the block from each source rank: (1 or B, 1, t, t), causal over global positions and,
        with documents (`doc`: the whole rows' document indices), inside each document."""
        mine = self.positions(t, device)
        doc_mine = None if doc is None else self.shard(doc)

        def mask_of(source: int) -> torch.Tensor:
            theirs = chunk_positions(t * self.parts, self.parts, source, device)
            allowed = (theirs[None, :] <= mine[:, None])[None, None]
            if doc is None:
                return allowed
            same = doc_mine[:, :, None] == doc[:, theirs][:, None, :]  # (B, t, t)
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
