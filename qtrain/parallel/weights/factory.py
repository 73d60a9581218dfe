"""Which weight source a rank uses, built and filled in one place (the caller names the settings).

    replicated (default; ZeRO-1/2)     full group buffers (parallel/layout.py), parameters are views into them;
                                       `ParamWeights`, wrapped in `QuantizedWeights` when `quantized` names
                                       block matrices whose FP8 copies are kept for a whole step; with a
                                       `compute_dtype` other than `dtype` the buffers are the master and the
                                       model reads `CastWeights`, a copy in the compute dtype (cast.py)
    sharded (ZeRO-3, --shard-weights)  `ShardedWeights`: this rank's shard of every group buffer, blocks
                                       gathered just in time; `quantized` matrices kept as e4m3 shards; with a
                                       `compute_dtype` the trainable shards are the master and each gather casts
                                       them (frozen ones are kept in the compute dtype)

Filling, group by group: a full group buffer is filled from the HF checkpoint (`weights_dir`) or by the
from-scratch initialisation, and with sharded weights only this rank's slice of it is kept. Initialisation
is keyed by tensor name, so the values depend neither on the world size nor on the weights being sharded.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from qtrain.model.hf_io import load_hf_weights
from qtrain.model.init import init_params
from qtrain.model.weights import tensor_specs
from qtrain.parallel.comm import Communicator
from qtrain.parallel.experts import ExpertParallel
from qtrain.parallel.layout import FlatLayout
from qtrain.parallel.weights.cast import CastWeights
from qtrain.parallel.weights.e4m3_base import E4m3BaseWeights, build_e4m3_base
from qtrain.parallel.weights.quantized import QuantizedWeights
from qtrain.parallel.weights.replicated import ParamWeights
from qtrain.parallel.weights.sharded import ShardedWeights


@dataclass(frozen=True)
class RankWeights:
    """This rank's weights: what the model reads (`source`) and what the optimizer updates in place."""
    source: ParamWeights | CastWeights | QuantizedWeights | ShardedWeights | E4m3BaseWeights
    buffers: dict[str, torch.Tensor] | None  # replicated: group key -> full flat buffer (the master); None when sharded
    params: dict[str, torch.Tensor] | None  # replicated: name -> full master parameter (a view into `buffers`)

    @property
    def sharded(self) -> bool:
        return self.buffers is None

    def optimizer_weights(self) -> dict[str, dict[str, torch.Tensor]]:
        """`ShardedAdamW`'s weights argument: the full buffers (`params=`) or this rank's shards (`shards=`)."""
        if self.sharded:
            assert isinstance(self.source, ShardedWeights)
            return {"shards": self.source.shards}
        return {"params": self.buffers}


def build_weights(layout: FlatLayout, *, comm: Communicator, dtype: torch.dtype, device: torch.device,
                  sharded: bool, offload: bool = False, quantized: tuple[str, ...] = (),
                  offload_quants: bool = False, weights_dir: str | None = None, seed: int = 0,
                  init_proj_to_zero: bool = False, compute_dtype: torch.dtype | None = None,
                  adapters: Callable[[dict[str, torch.Tensor]], None] | None = None,
                  e4m3_base: bool = False, experts: ExpertParallel | None = None) -> RankWeights:
    """Allocate and fill this rank's weights (module docstring). dtype: the master weights'; compute_dtype: what
    the model computes with (None: the same); offload: sharded master weights in host memory; quantized: block
    matrices kept as FP8 copies made once per step (offload_quants: sharded ones in host memory); weights_dir:
    HF safetensors to load, or None for the from-scratch init (seed, init_proj_to_zero); adapters: fills the tensors
    beyond the model's own (a LoRA layout's adapters, `layout.lora`), given them by internal name.

    Frozen groups have no master: with a `compute_dtype` they are kept in it alone, and only the trainable groups
    have a master of `dtype` and a cast copy (a LoRA run's base is never held in fp32). `e4m3_base`: a LoRA layout's
    frozen base block matrices held only as e4m3 codes (e4m3_base.py; replicated, no separate master; with
    `offload_quants` the codes in host memory, two layers on the device). `experts`:
    expert parallelism, whose expert groups sharded weights gather over their replicas."""
    if e4m3_base:
        if sharded or quantized or (compute_dtype is not None and compute_dtype != dtype) or adapters is None:
            raise ValueError("build_weights: an e4m3 base is a LoRA layout's, replicated, without a separate master")
        source = build_e4m3_base(layout, dtype=dtype, device=device, weights_dir=weights_dir, seed=seed,
                                 init_proj_to_zero=init_proj_to_zero, adapters=adapters, offload=offload_quants)
        return RankWeights(source, source.buffers, source.params)
    cast = compute_dtype is not None and compute_dtype != dtype
    if sharded:  # the shards are the master; each gather casts them to the compute dtype
        source = ShardedWeights(layout, comm=comm, dtype=dtype, device=device, offload=offload,
                                quantized=quantized, offload_quants=offload_quants, compute_dtype=compute_dtype,
                                experts=experts)
        weights = RankWeights(source, buffers=None, params=None)
    else:
        frozen = [g for g in layout.groups if not g.trainable]
        buffers = layout.allocate(dtype=dtype, device=device, groups=layout.trainable_groups())
        buffers.update(layout.allocate(dtype=compute_dtype if cast else dtype, device=device, groups=frozen))
        buffers = {g.key: buffers[g.key] for g in layout.groups}  # layout order
        # the model differentiates what requires grad: not a master under a cast copy, nor a frozen group's tensors
        params = {n: v.requires_grad_(not cast and layout.group_of[n].trainable)
                  for n, v in layout.views(buffers).items()}
        plain = CastWeights(layout, buffers, compute_dtype) if cast else ParamWeights(layout.cfg, params)
        weights = RankWeights(QuantizedWeights(plain, quantized) if quantized else plain, buffers, params)
    loaded = load_hf_weights(weights_dir, layout.cfg, dtype=dtype, device="cpu") if weights_dir is not None else None
    shards = weights.source.shards if isinstance(weights.source, ShardedWeights) else None
    _fill(layout, weights.buffers, shards, rank=comm.rank, dtype=dtype, device=device, loaded=loaded, seed=seed,
          init_proj_to_zero=init_proj_to_zero, adapters=adapters)
    return weights


@torch.no_grad()
def _fill(layout: FlatLayout, buffers: dict[str, torch.Tensor] | None, shards: dict[str, torch.Tensor] | None, *,
          rank: int, dtype: torch.dtype, device: torch.device, loaded: dict[str, torch.Tensor] | None, seed: int,
          init_proj_to_zero: bool, adapters: Callable[[dict[str, torch.Tensor]], None] | None = None) -> None:
    """Fill the full `buffers` in place, or, with `shards`, a temporary full buffer per group of which this
    rank keeps its slice; tensors the model's statements do not have go to `adapters`."""
    own = tensor_specs(layout.cfg)
    for g in layout.groups:
        if buffers is None:
            full = torch.zeros(g.padded_numel, dtype=dtype, device=device)  # padding stays zero
        else:
            full = buffers[g.key]
        views = {s.name: full[s.start:s.start + s.numel].view(s.shape) for s in g.segments}
        extra = {n: v for n, v in views.items() if n not in own}
        if extra:
            if adapters is None:
                raise ValueError(f"build_weights: nothing fills {sorted(extra)[:3]} (tensors beyond the model's)")
            adapters(extra)
            views = {n: v for n, v in views.items() if n in own}
        if g.ep > 1:  # expert parallelism: this rank's experts of every stack, filled as the whole stack would be
            views = {n: _whole_stack(v, g.ep) for n, v in views.items()}
        if not views:
            pass
        elif loaded is None:
            init_params(layout.cfg, views, seed=seed, init_proj_to_zero=init_proj_to_zero)
        else:
            for name, t in views.items():
                t.copy_(loaded.pop(name))
        if g.ep > 1:
            for s in g.segments:
                n = s.shape[0]
                full[s.start:s.start + s.numel].view(s.shape).copy_(views[s.name][(rank % g.ep) * n:][:n])
        if shards is not None:
            lo, hi = g.shard_range(rank, layout.world)
            shards[g.key].copy_(full[lo:hi])


def _whole_stack(local: torch.Tensor, ep: int) -> torch.Tensor:
    """A temporary whole stack (ep times the local experts' rows) for a rank's share `local`: the from-scratch
    initialisation draws per tensor and a checkpoint holds every expert; the caller keeps its share."""
    return local.new_zeros((ep * local.shape[0], *local.shape[1:]))
