"""Compute weights cast from a master of another dtype (--model-dtype bf16 --master-dtype fp32): the model runs on
a bf16 copy of the fp32 master weights, made once per optimizer step.

The master stays in the flat fp32 group buffers that the optimizer updates (and, with several ranks, all-gathers)
in place; `CastWeights` keeps a second set of flat buffers in the compute dtype with the same layout, whose views
are the leaves the model differentiates. The copy is refreshed lazily, on the first `block` / `non_block` after
`invalidate()` (the trainer calls it after every update and load): one cast of all weights per optimizer step,
not one per micro-step. So everything downstream of the weights runs in bf16 exactly as with bf16 weights
(embedding, activations, cuDNN/flash attention, the LM head; FP8 linears quantize the bf16 copy), and with the
same bf16 weights a micro-step's loss and gradients are bit-identical to the bf16-weights path. The gradients
leave the model in bf16 and the gradient manager, built in the master dtype, accumulates them in fp32 (exact
copy, then fp32 adds), which is what the optimizer reads.

Cost: the copy (2 bytes per parameter) besides the master (4) and fp32 gradients (4); one elementwise cast pass
over the weights per step. Each rank casts its full (all-gathered) fp32 master; all-gathering a bf16 copy of the
shards instead would halve those bytes (not done: ZeRO-1 gathers the master for checkpoints and export anyway).
"""
from __future__ import annotations

import torch

from qtrain.parallel.footprint import Footprint
from qtrain.parallel.layout import FlatLayout
from qtrain.parallel.weights.replicated import ParamWeights


class CastWeights(ParamWeights):
    """A WeightSource over `master` (group key -> full flat buffer, e.g. fp32) that hands out a copy in `dtype`."""

    def __init__(self, layout: FlatLayout, master: dict[str, torch.Tensor], dtype: torch.dtype):
        self.master = master
        device = next(iter(master.values())).device
        # a group already held in `dtype` (a frozen base has no master: factory.build_weights) is read as it is
        copied = [g for g in layout.groups if master[g.key].dtype != dtype]
        self.buffers = {**layout.allocate(dtype=dtype, device=device, groups=copied),
                        **{g.key: master[g.key] for g in layout.groups if master[g.key].dtype == dtype}}
        self._copied = [g.key for g in copied]
        super().__init__(layout.cfg, {n: v.requires_grad_(layout.group_of[n].trainable)
                                      for n, v in layout.views(self.buffers).items()})
        self.fresh = False  # the copy holds the master's current values
        self.casts = 0  # refreshes done: one per weights version that the model used

    @torch.no_grad()
    def _refresh(self) -> None:
        if not self.fresh:
            for key in self._copied:
                self.buffers[key].copy_(self.master[key])  # round to nearest (bf16 of fp32); padding stays zero
            self.fresh = True
            self.casts += 1

    def block(self, layer: int) -> dict[str, torch.Tensor]:
        self._refresh()
        return super().block(layer)

    def non_block(self) -> dict[str, torch.Tensor]:
        self._refresh()
        return super().non_block()

    def invalidate(self) -> None:
        self.fresh = False

    @staticmethod
    def footprint_of(layout: FlatLayout, dtype: torch.dtype) -> Footprint:
        """The compute copy: every trainable group's full buffer in the compute dtype (the master is counted apart;
        frozen groups have no master, only this dtype)."""
        return Footprint({"compute_copy": sum(g.padded_numel for g in layout.trainable_groups()) * dtype.itemsize})
