"""AdamW with optimizer state sharded across ranks (ZeRO-1), on the flat group layout.

Each rank owns the slice [r*n/W, (r+1)*n/W) of every group buffer (see `layout.py`): it keeps Adam's m
and v only for that slice, updates the weights of that slice from its gradient shard, and then the full
weights are re-assembled with one all-gather per group. With one rank this is plain fused AdamW.

Weight decay is decided per tensor (`weights.is_decayed`), so the update walks the *pieces* of a shard
(the parts of tensors it contains) and runs the fused kernel once per piece. The stochastic-rounding
counter of an element is its index inside its tensor and the key names (seed, step, group, tensor), so
an update gives the same bits whatever the number of ranks.
"""
from __future__ import annotations

import math
from typing import Protocol

import torch

from ..kernels.rng import rng_key
from ..model.weights import is_decayed
from ..numerics.adamw import AdamWHyper, adamw_update_
from .layout import FlatLayout

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class GradShards(Protocol):
    def grad_shard(self, group_key: str) -> torch.Tensor: ...


class ShardedAdamW:
    def __init__(self, layout: FlatLayout, params: dict[str, torch.Tensor], *, rank: int = 0, comm=None,
                 m_dtype: str = "fp32", v_dtype: str = "fp32", seed: int = 0):
        """`params`: full group buffers (key -> 1-D tensor), updated in place. `comm`: an object with
        `all_gather_into_tensor(out, inp)` (None when world == 1)."""
        self.layout, self.params, self.rank, self.comm, self.seed = layout, params, rank, comm, seed
        self.world = layout.world
        device = next(iter(params.values())).device
        self.m = layout.allocate(dtype=DTYPES[m_dtype], device=device, shard=True)
        self.v = layout.allocate(dtype=DTYPES[v_dtype], device=device, shard=True)
        self.step_count = 0  # completed updates; Adam's bias correction uses step_count + 1

    def param_shard(self, key: str) -> torch.Tensor:
        lo, hi = self.layout.by_key[key].shard_range(self.rank, self.world)
        return self.params[key][lo:hi]

    @torch.no_grad()
    def grad_norm(self, grads: GradShards) -> torch.Tensor:
        """Global L2 norm of the gradient (fp32 device scalar): sum of squares of this rank's shards,
        summed over ranks. Padding is zero, so it does not count."""
        shards = [grads.grad_shard(g.key) for g in self.layout.groups]
        sq = torch.stack([torch.linalg.vector_norm(s, dtype=torch.float32) for s in shards]).pow(2).sum()
        if self.comm is not None and self.world > 1:
            self.comm.all_reduce_sum(sq)
        return sq.sqrt()

    @torch.no_grad()
    def step(self, grads: GradShards, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
             grad_scale: float = 1.0) -> torch.Tensor:
        """One AdamW update of this rank's shards, then all-gather of the weights. Returns the abs-max of
        the updated weights on this rank (fp32 device scalar), for FP8 weight scaling."""
        t = self.step_count + 1
        hp = AdamWHyper(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=t,
                        grad_scale=grad_scale)
        amaxes = []
        for g in self.layout.groups:
            p, gs = self.param_shard(g.key), grads.grad_shard(g.key)
            m, v = self.m[g.key], self.v[g.key]
            for piece in g.shard_pieces(self.rank, self.world):
                sl = slice(piece.shard_offset, piece.shard_offset + piece.numel)
                seg_index = g.segments.index(piece.segment)
                amaxes.append(adamw_update_(p[sl], gs[sl], m[sl], v[sl], hp=hp, decay=is_decayed(piece.segment.name),
                                            key=rng_key(self.seed, t, g.index, seg_index),
                                            offset=piece.tensor_offset))
            if self.comm is not None and self.world > 1:
                self.comm.all_gather_into_tensor(self.params[g.key], p)
        self.step_count = t
        return torch.stack(amaxes).max() if amaxes else torch.zeros(())

    # ---- checkpoints: this rank's shards ----
    def state_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        return {"adam.m": dict(self.m), "adam.v": dict(self.v)}

    def load_state_tensors(self, state: dict[str, dict[str, torch.Tensor]], step_count: int) -> None:
        for name, bufs in (("adam.m", self.m), ("adam.v", self.v)):
            for k, t in bufs.items():
                src = state[name][k]
                if src.shape != t.shape:
                    raise ValueError(f"checkpoint {name}[{k}]: shape {tuple(src.shape)} != {tuple(t.shape)} "
                                     f"(was it written with another world size?)")
                t.copy_(src)
        self.step_count = step_count

    def state_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.m, self.v) for t in d.values())


def clip_factor(norm: float, clip: float) -> float:
    """Standard clipping: scale = clip / norm when norm > clip (llm.q compares the squared norm: a quirk)."""
    if clip <= 0 or not math.isfinite(norm) or norm <= clip:
        return 1.0
    return clip / norm
