"""--lora-merge: the base with its adapters folded in, W' = W + (alpha / r) B A per target (what peft's
`merge_and_unload` computes), as plain parameters an HF export writes; an MoE layer's expert stacks W_e + (alpha / r)
B_e A_e per expert (peft's `ParamWrapper.get_delta_weight`; the adapters' layout: tensors.py)."""
from __future__ import annotations

import torch

from qtrain.model.config import ModelConfig
from qtrain.model.lora.spec import LoraSpec
from qtrain.model.lora.tensors import ExpertTarget, a_name, adapted, adapted_experts, b_name


EXPERT_CHUNK = 8  # experts merged at a time: one chunk's fp32 work, not a whole stack's


@torch.no_grad()
def merged_params(cfg: ModelConfig, spec: LoraSpec, params: dict[str, torch.Tensor], *,
                  dtype: torch.dtype | None = None, device: torch.device | str | None = None
                  ) -> dict[str, torch.Tensor]:
    """The model's own parameters (the adapted matrices merged, the others as they are); `params`: the base's and
    the adapters' by internal name. Each merged matrix is computed in fp32 and stored at once in `dtype` (None: fp32;
    casting here gives the bits the export's cast would) on `device` (None: where it was; an export: the host), an
    expert stack EXPERT_CHUNK experts at a time: the fp32 work is one matrix (or chunk) at a time, never the whole
    model's (an MoE model's expert stacks are nearly all of it: ~116 GB in fp32 at Qwen3-30B-A3B, on the GPU after
    training)."""
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
            out[name] = w.to(device=device or w.device, dtype=dtype or torch.float32)
        for matrix, t in adapted_experts(cfg, spec, layer).items():
            name = f"layers.{layer}.{matrix}"
            a, b = params[f"layers.{layer}.{a_name(matrix)}"], params[f"layers.{layer}.{b_name(matrix)}"]
            base = out[name]
            merged = torch.empty(base.shape, dtype=dtype or torch.float32, device=device or base.device)
            for e0 in range(0, t.experts, EXPERT_CHUNK):
                e = slice(e0, min(t.experts, e0 + EXPERT_CHUNK))
                merged[e] = base[e].float() + expert_delta(t, r, a, b, e) * s
            out[name] = merged
    return out


def expert_delta(t: ExpertTarget, rank: int, a: torch.Tensor, b: torch.Tensor,
                 experts: slice = slice(None)) -> torch.Tensor:
    """B_e A_e of the experts `experts` (default: all), (e, out, in) fp32 in the stack's row order ([up; gate] for
    gate_up)."""
    r = t.rank(rank)
    b_e = b.view(t.rows, r, t.experts)[:, :, experts].float()
    a_e = a.view(t.experts, r, t.cols)[experts].float()
    delta = torch.einsum("orE,Eri->Eoi", b_e, a_e)
    if t.swapped:
        half = t.rows // 2
        delta = torch.cat([delta[:, half:], delta[:, :half]], dim=1)
    return delta
