"""From-scratch initialisation, in one place; each family says which scheme each of its tensors takes
(`TensorSpec.init`).

Scheme (llm.q's, GPT-2 style): embeddings, the untied LM head and the block matrices are N(0, 0.02) ("normal");
the projections that write into the residual stream (attention output, MLP down: "residual") are
N(0, 0.02 / sqrt(2 L)) so the residual's variance does not grow with depth, or exactly zero with
`init_proj_to_zero` (each block then starts as the identity); norm gains are 1 ("ones") and biases 0 ("zeros");
a Gated DeltaNet's decay rates A_log are log(U(1, 16)) ("log_uniform", fla-core's and transformers' range).

Each tensor draws from its own generator seeded by (seed, tensor name), so a tensor's values do not
depend on the order of initialisation, on which tensors exist, or on the number of ranks.
"""
from __future__ import annotations

import hashlib
import math

import torch

from qtrain.model.config import ModelConfig
from qtrain.model.weights import tensor_specs

INIT_STD = 0.02


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_std(cfg: ModelConfig, scheme: str, *, init_proj_to_zero: bool = False) -> float | None:
    """Standard deviation of a tensor initialised by `scheme`, or None for tensors filled with a constant."""
    if scheme == "residual":
        return 0.0 if init_proj_to_zero else INIT_STD / math.sqrt(2 * cfg.num_hidden_layers)
    if scheme == "normal":
        return INIT_STD
    return None


@torch.no_grad()
def init_params(cfg: ModelConfig, params: dict[str, torch.Tensor], *, seed: int = 0,
                init_proj_to_zero: bool = False) -> None:
    """Fill `params` in place (any dtype/device); sampling happens in fp32 on the tensor's device."""
    specs = tensor_specs(cfg)
    for name, t in params.items():
        scheme = specs[name].init
        std = init_std(cfg, scheme, init_proj_to_zero=init_proj_to_zero)
        if scheme == "log_uniform":
            gen = torch.Generator(device=t.device).manual_seed(_tensor_seed(seed, name))
            t.copy_(torch.empty(t.shape, dtype=torch.float32, device=t.device).uniform_(1.0, 16.0, generator=gen).log_())
        elif std is None:
            t.fill_(0.0 if scheme == "zeros" else 1.0)
        elif std == 0.0:
            t.zero_()
        else:
            gen = torch.Generator(device=t.device).manual_seed(_tensor_seed(seed, name))
            t.copy_(torch.empty(t.shape, dtype=torch.float32, device=t.device).normal_(0.0, std, generator=gen))
