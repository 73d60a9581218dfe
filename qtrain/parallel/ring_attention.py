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
math is the specification; a fused kernel would be the GPU's form. Scale 1/sqrt(hs), no dropout.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist

__all__ = ["Ring", "ring_attention"]

# (source rank of a block) -> (B or 1, 1, t, t_block) bool, True where this rank's query may attend to the key
MaskOf = Callable[[int], torch.Tensor]


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


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, mask_of: MaskOf
                ) -> torch.Tensor:
        groups, scale = q.shape[1] // k.shape[1], 1.0 / math.sqrt(q.shape[-1])
        qf = q.float()
        out = torch.zeros_like(qf)
        lse = torch.full(q.shape[:-1], -math.inf, dtype=torch.float32, device=q.device)
        block = [k, v]
        for step in range(ring.parts):
            pending = ring.start_pass(block) if step < ring.parts - 1 else None
            kb, vb = (_expand(t.float(), groups) for t in block)
            s = _scores(qf, kb, mask_of(ring.source(step)), scale)
            lse_b = torch.logsumexp(s, -1)
            out_b = torch.exp(s - _finite(lse_b)[..., None]) @ vb
            merged = torch.logaddexp(lse, lse_b)
            m = _finite(merged)[..., None]
            out = out * torch.exp(lse[..., None] - m) + out_b * torch.exp(lse_b[..., None] - m)
            lse = merged
            if pending is not None:
                block, requests = pending
                for r in requests:
                    r.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.mask_of = ring, mask_of
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        ring, mask_of = ctx.ring, ctx.mask_of
        groups, scale = q.shape[1] // k.shape[1], 1.0 / math.sqrt(q.shape[-1])
        qf, do = q.float(), dout.float()
        delta = (do * out.float()).sum(-1, keepdim=True)  # rowsum(dO * O)
        dq = torch.zeros_like(qf)
        block = [k, v, torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)]
        B, nkv, tk, hs = k.shape
        for step in range(ring.parts):
            kb, vb = (_expand(t.float(), groups) for t in block[:2])
            p = torch.exp(_scores(qf, kb, mask_of(ring.source(step)), scale) - lse[..., None])
            ds = p * (do @ vb.transpose(-1, -2) - delta)
            dq += ds @ kb * scale
            block[2] = block[2] + (ds.transpose(-1, -2) @ qf * scale).view(B, nkv, groups, tk, hs).sum(2)
            block[3] = block[3] + (p.transpose(-1, -2) @ do).view(B, nkv, groups, tk, hs).sum(2)
            # the last pass returns each block's gradients to their owner; the keys and values are no longer needed
            block, requests = ring.start_pass(block if step < ring.parts - 1 else block[2:])
            for r in requests:
                r.wait()
        dk, dv = block[-2:]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, mask_of: MaskOf) -> torch.Tensor:
    """Attention of this rank's queries q (B, nh, t, hs) over the keys and values (B, nkv, t, hs) of every rank of
    the ring, each block under `mask_of(its source rank)`: (B, nh, t, hs) in q's dtype, differentiable in q, k, v
    (the other ranks' key and value gradients come back around the ring)."""
    return _RingAttention.apply(q, k, v, ring, mask_of)
