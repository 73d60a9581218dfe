"""--lora-merge: the base with its adapters folded in, W' = W + (alpha / r) B A per target (what peft's
`merge_and_unload` computes), as plain parameters an HF export writes."""
from __future__ import annotations

import torch

from qtrain.model.config import ModelConfig
from qtrain.model.lora.spec import LoraSpec
from qtrain.model.lora.tensors import a_name, adapted, b_name


@torch.no_grad()
def merged_params(cfg: ModelConfig, spec: LoraSpec, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's own parameters (fp32 copies of the adapted matrices, the others as they are) with every adapter
    merged; `params`: the base's and the adapters' by internal name."""
    out = {n: t for n, t in params.items() if "_lora_" not in n}
    r, s = spec.rank, spec.scaling
    for layer in range(cfg.num_hidden_layers):
        for matrix, targets in adapted(cfg, spec, layer).items():
            name = f"layers.{layer}.{matrix}"
            a, b = params[f"layers.{layer}.{a_name(matrix)}"].float(), params[f"layers.{layer}.{b_name(matrix)}"].float()
            w, brow = out[name].float().clone(), 0
            for i, t in enumerate(targets):
                w[t.row:t.row + t.rows] += (b[brow:brow + t.rows] @ a[i * r:(i + 1) * r]) * s
                brow += t.rows
            out[name] = w
    return out
