"""Gradient managers: where a micro-step's weight gradients go, how they are averaged over ranks and summed
over micro-steps, and which shard of the result each rank keeps for the optimizer.

Seed: llm.q `src/training/gradients.{h,cpp}` and `src/models/llama_gradients.cpp` (see
`reference/llmq.md` §4.2). Three strategies, chosen with `make_gradient_manager(kind, ...)`:

  kind              persistent state per rank               communication
  'unsharded'       full gradient of every group (ZeRO-1)   reduce-scatter(avg) of each group, last micro-step only
  'reduce-scatter'  non-block groups full, block shards     blocks: reduce-scatter(avg) every micro-step;
                    + 2 full block staging buffers (ZeRO-2)  non-block groups as 'unsharded'
  'all-to-all'      as 'reduce-scatter', staging = one       blocks: all-to-all every micro-step, reduced
                    send + one receive block buffer          in fp32 by the owner; non-block as 'unsharded'

The protocol (the model's `GradientSink` plus the trainer's brackets), per micro-step:

    grads.start_micro_step(step=s, micro_step=m, num_micro_steps=n)
    model.forward_backward(..., grads=grads)   # accumulate_non_block({'norm'[, 'lm_head']}),
                                               # accumulate_block(L-1) ... accumulate_block(0),
                                               # accumulate_non_block({'embed'})
    grads.end_micro_step()                     # after m == n-1: every shard is final
    ... optimizer reads grads.grad_shard(group_key) for each group ...

Accumulation over micro-steps. The model hands over fresh tensors (owned by the manager), so the first
micro-step of a step *sets* every buffer (copy) and later ones *add* with stochastic rounding when the
buffers are bf16 (an exact fp32 add otherwise). Nothing is ever zeroed: llm.q zeroes the tensors its
kernels accumulate into by `+=` from the start (norm weights, biases, the untied embedding), which cannot
happen here. Group padding is zero from allocation and never written (the first micro-step's piecewise
copy re-zeroes a shard's padding tail explicitly), so padding contributes nothing to norms. Frozen groups
(`Group.trainable` False) have no buffers here: the model hands over no gradients for them.

Random bits. Every SR of tensor t (position `t` in its group) of group g at (step, micro-step) uses
`rng_key(seed, step, micro_step, g.index, t)` with the element's index *in the tensor* as counter
(`Piece.tensor_offset` where a shard cuts through a tensor), so a rank's shard draws the same bits for an
element whatever the world size. llm.q reuses one key for every micro-step of a step (a quirk); we
include the micro-step.

Key table (CUDA graphs, `use_key_table`). A micro-step replayed from a CUDA graph cannot take its SR keys as
kernel scalars (the capture bakes them in). In this mode every SR launch of the manager reads its key from a
device table (`qtrain.kernels.rng.KeyTable`, one slot per tensor of every group) that `start_micro_step`
refills for (step, micro-step) with one stream-ordered copy: the same keys, so the same bits, as the scalar
path. After a replay, `replayed()` stands in for the accumulate calls the graph's kernels did.
Unsharded gradients on one rank only (the collectives of the other kinds stay outside this round).

Asynchrony (see `comm.py`). Calls never block the host on CUDA: collectives and the work chained after
them run on the communicator's side stream, bracketed by events, and "wait" means the compute stream
waits. On CPU (gloo) collectives are async work handles and the host blocks at the point of need.
  - accumulate_block(l): returns once block l's gradients have been copied (stream-ordered) into
    manager buffers; the caller may drop the tensors. Its communication runs in the background and
    overlaps the backward of the blocks below.
  - accumulate_non_block: the same; on the last micro-step it starts that group's reduce-scatter.
  - end_micro_step: on a non-last micro-step it returns at once (the last blocks' communication may
    overlap the next micro-step's forward); on the last it waits (CUDA: the current stream waits) until
    every shard is final. Host code that reads a CUDA or offloaded shard directly must synchronise the
    current stream first.
"""
from __future__ import annotations

import torch

from qtrain.parallel.comm import Communicator
from qtrain.parallel.experts import ExpertParallel
from qtrain.parallel.footprint import Footprint
from qtrain.parallel.gradients.block_sharded import AllToAllGradients, ReduceScatterGradients
from qtrain.parallel.gradients.manager import (KINDS, OFFLOAD_NEEDS_SHARDING, GradientManager, UnshardedGradients,
                                              _with_key_table)
from qtrain.parallel.layout import FlatLayout

__all__ = ["KINDS", "OFFLOAD_NEEDS_SHARDING", "GradientManager", "UnshardedGradients", "ReduceScatterGradients",
           "AllToAllGradients", "make_gradient_manager", "gradient_footprint"]


def _manager_class(kind: str, offload: bool) -> type[GradientManager]:
    classes = {"unsharded": UnshardedGradients, "reduce-scatter": ReduceScatterGradients,
               "all-to-all": AllToAllGradients}
    if kind not in classes:
        raise ValueError(f"unknown gradient manager kind {kind!r}; choose one of {', '.join(KINDS)}")
    if offload and kind == "unsharded":
        raise ValueError(OFFLOAD_NEEDS_SHARDING)
    return classes[kind]


def make_gradient_manager(kind: str, layout: FlatLayout, *, comm: Communicator, dtype: torch.dtype,
                          device: torch.device | str, seed: int, offload: bool = False,
                          experts: ExpertParallel | None = None) -> GradientManager:
    """Build the gradient manager `kind` ('unsharded' | 'reduce-scatter' | 'all-to-all'). `offload` keeps
    the block shards in (pinned, when CUDA is available) host memory and needs a sharded kind. `experts`: expert
    parallelism (the layout's expert groups are averaged over their replicas)."""
    cls = _manager_class(kind, offload)
    common = dict(comm=comm, dtype=dtype, device=device, seed=seed, experts=experts)
    return cls(layout, **common) if kind == "unsharded" else cls(layout, offload=offload, **common)


def gradient_footprint(kind: str, layout: FlatLayout, *, dtype: torch.dtype, device: torch.device | str,
                       offload: bool = False, key_table: bool = False) -> Footprint:
    """What `make_gradient_manager` with these arguments allocates per rank, without allocating it
    (`key_table`: and `use_key_table`, which CUDA graphs call)."""
    fp = _manager_class(kind, offload).footprint_of(layout, dtype=dtype, device=device, offload=offload)
    return _with_key_table(fp, layout) if key_table else fp

