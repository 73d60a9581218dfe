"""Ring attention (`--context-parallel-mode ring`): context parallelism's attention without gathering the sequence.

Each rank of a context group holds its queries, keys and values (B, heads, t, hs) of t = T / N tokens. The key/value
blocks travel around the ring (rank r sends to r + 1 and receives from r - 1, one block in flight while the current
one is computed), so after N - 1 passes every rank's queries have met every block:

    forward    per block: softmax attention of this rank's queries over the block's keys under its mask (causal over
               global positions, and inside each document with --document-masking), as (out_b, lse_b); merged by
               log-sum-exp, out = sum_b exp(lse_b - lse) out_b with lse = logsumexp_b lse_b (the online softmax)
    backward   flash attention's backward per block from the merged (out, lse): P = exp(S - lse),
               dV_b = P^T dO, dS = P (dO V_b^T - rowsum(dO * out)), dQ += dS K_b, dK_b = dS^T Q; the blocks pass
               around the ring again with their dK, dV accumulators, which after N passes are back at their owner

A rank keeps for backward only its own q, k, v, out and the (B, nh, t) fp32 log-sum-exp: no gathered K/V and no
(t, T) mask (the all-gather mode's price, `parallel/context.py`); in flight, one received block and, in backward,
its fp32 gradient accumulators. Plain torch in fp32 (GQA by expanding the key/value heads), on every device: the
math is the specification; a fused kernel would be the GPU's form. The query rows go through each block in slices
whose fp32 scores take at most SCORE_BYTES (`row_slices`), so the transient does not grow with (T/N)^2.
Scale 1/sqrt(hs), no dropout. `ring_forward` and `ring_backward` are the two halves; autograd and torch.compile
reach them through one opaque op (`parallel/context_ops.py`), which keeps (q, k, v, out, lse) between them.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist

__all__ = ["SCORE_BYTES", "MaskOf", "Ring", "ring_backward", "ring_forward", "row_slices"]

# (source rank of a block) -> (B or 1, 1, t, t_block) bool, True where this rank's query may attend to the key
MaskOf = Callable[[int], torch.Tensor]
SCORE_BYTES = 256 << 20  # the fp32 scores of a slice of query rows against one block: the ring's largest transient


class Ring:
    """The ring of a context group: this rank's place and its neighbours' global ranks."""

    def __init__(self, rank: int, ranks: list[int], group: dist.ProcessGroup | None):
        self.rank, self.parts, self.group = rank, len(ranks), group
        self.next, self.prev = ranks[(rank + 1) % len(ranks)], ranks[(rank - 1) % len(ranks)]

    def source(self, step: int) -> int:
        """Whose block this rank holds after `step` passes."""
        return (self.rank - step) % self.parts

    def start_pass(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list]:
        """Send `tensors` to the next rank and receive the previous rank's (same shapes); wait on the requests."""
        tensors = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in received]
        return received, dist.batch_isend_irecv(ops)


def _expand(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t.repeat_interleave(groups, dim=1) if groups > 1 else t


def _scores(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    return (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, -math.inf)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (rows that saw no key yet) as 0, so that exp(-inf - 0) = 0 rather than NaN."""
    return lse.masked_fill(torch.isinf(lse), 0.0)


def row_slices(rows: int, bytes_per_row: int) -> list[slice]:
    """This rank's query rows in slices whose fp32 scores against one block take at most SCORE_BYTES."""
    step = max(1, min(rows, SCORE_BYTES // max(1, bytes_per_row)))
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)]


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, mask_of: MaskOf
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of this rank's queries q (B, nh, t, hs) over the keys and values (B, nkv, t, hs) of every rank of
    the ring, each block under `mask_of(its source rank)`: (out (B, nh, t, hs) in q's dtype and layout, its fp32
    log-sum-exp (B, nh, t)), what `ring_backward` takes."""
    B, nh, t, _ = q.shape
    groups, scale = nh // k.shape[1], 1.0 / math.sqrt(q.shape[-1])
    qf = q.float()
    out = torch.zeros_like(qf)
    lse = torch.full(q.shape[:-1], -math.inf, dtype=torch.float32, device=q.device)
    block = [k, v]
    for step in range(ring.parts):
        pending = ring.start_pass(block) if step < ring.parts - 1 else None
        kb, vb = (_expand(x.float(), groups) for x in block)
        mask = mask_of(ring.source(step))
        for r in row_slices(t, 4 * B * nh * kb.shape[2]):
            s = _scores(qf[:, :, r], kb, mask[:, :, r], scale)
            lse_b = torch.logsumexp(s, -1)
            out_b = torch.exp(s - _finite(lse_b)[..., None]) @ vb
            merged = torch.logaddexp(lse[:, :, r], lse_b)
            m = _finite(merged)[..., None]
            out[:, :, r] = (out[:, :, r] * torch.exp(lse[:, :, r, None] - m)
                            + out_b * torch.exp(lse_b[..., None] - m))
            lse[:, :, r] = merged
        if pending is not None:
            block, requests = pending
            for req in requests:
                req.wait()
    return torch.empty_like(q).copy_(out), lse


def ring_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  dout: torch.Tensor, ring: Ring, mask_of: MaskOf) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of q, k, v (in their dtypes and layouts) from `ring_forward`'s (out, lse) and out's gradient;
    the other ranks' key and value gradients come back around the ring."""
    B, nh, t, _ = q.shape
    groups, scale = nh // k.shape[1], 1.0 / math.sqrt(q.shape[-1])
    qf, do = q.float(), dout.float()
    delta = (do * out.float()).sum(-1, keepdim=True)  # rowsum(dO * O)
    dq = torch.zeros_like(qf)
    block = [k, v, torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)]
    _, nkv, tk, hs = k.shape
    for step in range(ring.parts):
        kb, vb = (_expand(x.float(), groups) for x in block[:2])
        mask = mask_of(ring.source(step))
        for r in row_slices(t, 4 * B * nh * tk):
            p = torch.exp(_scores(qf[:, :, r], kb, mask[:, :, r], scale) - lse[:, :, r, None])
            ds = p * (do[:, :, r] @ vb.transpose(-1, -2) - delta[:, :, r])
            dq[:, :, r] += ds @ kb * scale
            block[2] += (ds.transpose(-1, -2) @ qf[:, :, r] * scale).view(B, nkv, groups, tk, hs).sum(2)
            block[3] += (p.transpose(-1, -2) @ do[:, :, r]).view(B, nkv, groups, tk, hs).sum(2)
        if ring.parts == 1:
            break
        # the last pass returns each block's gradients to their owner; the keys and values are no longer needed
        block, requests = ring.start_pass(block if step < ring.parts - 1 else block[2:])
        for req in requests:
            req.wait()
    dk, dv = block[-2:]
    return (torch.empty_like(q).copy_(dq), torch.empty_like(k).copy_(dk), torch.empty_like(v).copy_(dv))
