"""--lora-merge: the base with its adapters folded in, W' = W + (alpha / r) B A per target (what peft's
`merge_and_unload` computes), as plain parameters an HF export writes; an MoE layer's expert stacks W_e + (alpha / r)
B_e A_e per expert (peft's `ParamWrapper.get_delta_weight`; the adapters' layout: tensors.py)."""
from __future__ import annotations

import torch

from qtrain.model.config import ModelConfig
from qtrain.model.lora.spec import LoraSpec
from qtrain.model.lora.tensors import ExpertTarget, a_name, adapted, adapted_experts, b_name


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
        for matrix, t in adapted_experts(cfg, spec, layer).items():
            name = f"layers.{layer}.{matrix}"
            out[name] = out[name].float() + expert_delta(t, r, params[f"layers.{layer}.{a_name(matrix)}"],
                                                         params[f"layers.{layer}.{b_name(matrix)}"]) * s
    return out


def expert_delta(t: ExpertTarget, rank: int, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """B_e A_e of every expert, (E, out, in) fp32 in the stack's row order ([up; gate] for gate_up)."""
    r = t.rank(rank)
    delta = torch.einsum("orE,Eri->Eoi", b.float().view(t.rows, r, t.experts), a.float().view(t.experts, r, t.cols))
    if t.swapped:
        half = t.rows // 2
        delta = torch.cat([delta[:, half:], delta[:, :half]], dim=1)
    return delta
