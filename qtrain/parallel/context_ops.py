"""Context parallelism's communicating steps as opaque custom ops, so that a torch.compile'd block can hold them.

Why: dynamo cannot trace a process group's all_gather, all_reduce or send/recv on gloo or NCCL into a graph, and
inductor must not reorder or recompute them on its own. Each step that talks to the other ranks of a context group is
therefore a `torch.library.custom_op` with a fake (shape-only) implementation and a registered autograd formula:
compiled, the block's graph calls the op as one opaque node, forward and backward, and fuses everything around it
(norms, RoPE, SwiGLU, residual adds); eager, the same ops run, so both paths compute the same numbers.

    cp_gather_kv     K, V (B, nkv, t, hs) -> the whole sequence's (B, nkv, t N, hs) each, in sequence order
    cp_reduce_kv     its backward: dK, dV of the whole sequence summed over the group, this rank's rows kept
    cp_ring_fwd      ring attention (parallel/ring_attention.py): (out, lse) of this rank's queries
    cp_ring_bwd      its backward: dq, dk, dv

A custom op takes tensors and plain values only, so the process group, the rank's place and its chunk positions stay
in the `ContextParallel` object (parallel/context.py), which `register` files under an int handle that the ops take.
Its methods do the work (`Communicating`). The all-gather mode's attention itself (SDPA over the gathered K/V with a
mask) is not inside an op: the compiler sees and picks its kernel as for any other SDPA call.

Recompute (--recompute-att, --recompute-block) reruns an op's forward in backward: the gather or the ring's passes
happen again, on every rank of the group at the same point of its backward, so the collectives still pair up.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Protocol

import torch

__all__ = ["Communicating", "gather_kv", "register", "ring_attention"]


class Communicating(Protocol):
    """What the ops call on the registered object (parallel/context.ContextParallel)."""
    parts: int

    def gather_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def reduce_kv(self, dk: torch.Tensor, dv: torch.Tensor) -> torch.Tensor: ...

    def ring_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def ring_backward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                      dout: torch.Tensor, doc: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


# weak: a split that nothing uses any more (tests build many) takes its process group's handle with it
_SPLITS: "weakref.WeakValueDictionary[int, Communicating]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


def register(split: Communicating) -> int:
    """File `split` for the ops; the handle its attention passes them."""
    handle = next(_HANDLES)
    _SPLITS[handle] = split
    return handle


def _split(handle: int) -> Communicating:
    return _SPLITS[handle]


# ---------------------------------------------------------------------------------------------- all-gather
@torch.library.custom_op("qtrain::cp_gather_kv", mutates_args=())
def _gather_kv(k: torch.Tensor, v: torch.Tensor, handle: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _split(handle).gather_kv(k, v)


@_gather_kv.register_fake
def _(k, v, handle):
    B, H, t, hs = k.shape
    n = _split(handle).parts
    return k.new_empty(B, H, t * n, hs), v.new_empty(B, H, t * n, hs)


@torch.library.custom_op("qtrain::cp_reduce_kv", mutates_args=())
def _reduce_kv(dk: torch.Tensor, dv: torch.Tensor, handle: int) -> torch.Tensor:
    return _split(handle).reduce_kv(dk, dv)


@_reduce_kv.register_fake
def _(dk, dv, handle):
    B, H, T, hs = dk.shape
    return dk.new_empty(2, B, H, T // _split(handle).parts, hs)


def _gather_setup(ctx, inputs, output) -> None:
    ctx.handle = inputs[2]


def _gather_backward(ctx, dk: torch.Tensor, dv: torch.Tensor):
    mine = _reduce_kv(dk, dv, ctx.handle)  # (2, B, nkv, t, hs): one collective for both
    return mine[0], mine[1], None


_gather_kv.register_autograd(_gather_backward, setup_context=_gather_setup)


def gather_kv(k: torch.Tensor, v: torch.Tensor, handle: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's K, V (B, nkv, t, hs) -> the group's whole sequence (B, nkv, t N, hs) each, contiguous, in sequence
    order; differentiable (the backward sums the group's gradients of this rank's rows)."""
    return _gather_kv(k, v, handle)


# ---------------------------------------------------------------------------------------------- ring
@torch.library.custom_op("qtrain::cp_ring_fwd", mutates_args=())
def _ring_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: torch.Tensor | None, handle: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    return _split(handle).ring_forward(q, k, v, doc)


@_ring_fwd.register_fake
def _(q, k, v, doc, handle):
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("qtrain::cp_ring_bwd", mutates_args=())
def _ring_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
              dout: torch.Tensor, doc: torch.Tensor | None, handle: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _split(handle).ring_backward(q, k, v, out, lse, dout, doc)


@_ring_bwd.register_fake
def _(q, k, v, out, lse, dout, doc, handle):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _ring_setup(ctx, inputs, output) -> None:
    q, k, v, doc, ctx.handle = inputs
    ctx.has_doc = doc is not None
    ctx.save_for_backward(q, k, v, *output, *((doc,) if doc is not None else ()))
    ctx.set_materialize_grads(False)  # lse has no gradient


def _ring_backward(ctx, dout: torch.Tensor, _dlse: torch.Tensor | None):
    q, k, v, out, lse, *doc = ctx.saved_tensors
    dq, dk, dv = _ring_bwd(q, k, v, out, lse, dout, doc[0] if ctx.has_doc else None, ctx.handle)
    return dq, dk, dv, None, None


_ring_fwd.register_autograd(_ring_backward, setup_context=_ring_setup)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: torch.Tensor | None, handle: int
                   ) -> torch.Tensor:
    """Ring attention of this rank's queries q (B, nh, t, hs) over the group's keys and values (B, nkv, t, hs each
    here), causal over global positions and, with `doc` (the whole rows' (B, T) document indices), inside each
    document: (B, nh, t, hs) in q's dtype and layout; differentiable in q, k, v."""
    return _ring_fwd(q, k, v, doc, handle)[0]
