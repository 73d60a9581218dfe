"""An MoE model's router statistics over a step, for the log: the load-balancing loss and the router z-loss (means over
the step's micro-batches and ranks) and the tokens per expert (each MoE layer's top-k picks over the step's global
batch: their min, mean and max over layers and experts).

    metrics = RouterMetrics(cfg.router, device)          # one per Trainer (None for a dense model)
    metrics.add(model.router_losses, 1 / grad_accumulation)   # after each micro-step: device adds, no host sync
    metrics.all_reduce(ctx)                              # in the update, beside the loss's all-reduce
    fields = metrics.read(world)                         # after the step's host sync: STEP_FIELDS -> float

Dropless routing gives every layer N * k picks per micro-batch of N tokens, so the mean is fixed by the batch; the min
and max say how unevenly the router spreads them (an expert that gets no token shows as min 0).
"""
from __future__ import annotations

import torch

from qtrain.model.config import RouterSpec
from qtrain.model.moe_router import RouterLosses

# the fields a step's log object carries for an MoE model (JSON every step; the console's router line every N steps)
STEP_FIELDS = ("aux_loss", "router_z_loss", "expert_load_min", "expert_load_mean", "expert_load_max")


class RouterMetrics:
    """Sums of one step's router statistics on the device (module docstring)."""

    def __init__(self, router: RouterSpec, device: torch.device):
        self.router = router
        # [load-balancing loss, z-loss, tokens per (layer, expert)...]
        self.sums = torch.zeros(2 + len(router.layers) * router.experts, dtype=torch.float32, device=device)

    def add(self, losses: RouterLosses, weight: float) -> None:
        """A micro-step's statistics; its losses weighted by `weight` (1 / grad_accumulation: the step's mean)."""
        self.sums[:2] += torch.stack([losses.aux_loss(), losses.z_loss()]) * weight
        self.sums[2:] += losses.tokens_per_expert.reshape(-1)

    def all_reduce(self, ctx) -> None:
        """Sum over ranks (a collective every rank calls; nothing to do on one)."""
        if ctx.world > 1:
            ctx.all_reduce_sum(self.sums)

    def read(self, world: int) -> dict[str, float]:
        """The step's fields (STEP_FIELDS), the losses averaged over ranks; then start the next step from zero. A host
        read: call it after the step's own sync."""
        v = self.sums.tolist()
        self.sums.zero_()
        load = v[2:]
        return {"aux_loss": v[0] / world, "router_z_loss": v[1] / world, "expert_load_min": min(load),
                "expert_load_mean": sum(load) / len(load), "expert_load_max": max(load)}
