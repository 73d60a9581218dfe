"""`family.ModelFamily` for the Mixture-of-Experts decoders, which differ from each other only in data: their config
(`<family>/config.py`), where their checkpoints keep a routed layer's MLP (`MoeNames`) and, for OLMoE, the shape of
the q/k norms. Each MoE family folder makes one `MoeFamily` (`qwen3_moe/family.py`, ...).

A routed layer's tensors, after the Llama block's attention tensors (`llama/tensors.py`: ln1, qkv, [q_norm, k_norm],
o, ln2):
  router           (E, C)       <- {module}gate.weight                        in the block's group
  experts_up_gate  (E, 2F, C)   rows [up; gate] of each expert                a group of its own, 'block.{l}.experts'
                                <- {module}experts.{e}.{up}.weight, {module}experts.{e}.{gate}.weight, e = 0..E-1
  experts_down     (E, C, F)    <- {module}experts.{e}.{down}.weight          'block.{l}.experts'
Both expert tensors are stacks (`TensorSpec.experts` = E: expert e is t[e]), in a layout group of their own, so expert
parallelism can give each rank whole experts of them (`parallel.layout.Group.expert_pieces`) and reduce their
gradients over other ranks than the block's. Those per-expert names are what transformers' save_pretrained writes
for these model types (5.x: its weight converters split its fused parameters back into them) and what export
writes; loading also takes the layouts transformers reads besides (`TensorSpec.hf_alternatives`): the fused
parameters of its modules (`mlp.experts.gate_up_proj` (E, 2F, C) with rows [gate; up], `mlp.experts.down_proj`,
`mlp.gate.weight`) and, for Mixtral, the per-expert names under `mlp.` (transformers renames `block_sparse_moe.`).
A dense layer (Qwen3-MoE's `mlp_only_layers`) has the Llama block's tensors.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from qtrain.model.family import (ActivationSettings, ActTerm, BlockFn, BlockOptions, HfLayout, MatmulSpec, TensorSpec,
                                 decoder_non_block_tensors)
from qtrain.model.llama import LLAMA
from qtrain.model.llama import tensors as llama_tensors
from qtrain.model.llama.block import LlamaBlock
from qtrain.model import moe_block
from qtrain.model.moe_block import EXPERTS_DOWN, EXPERTS_UP_GATE, ROUTER, MoeBlock
from qtrain.model.moe_config import MoeConfig

EXPERTS_GROUP = "experts"  # the layout group of a routed layer's expert stacks: 'block.{l}.experts'


@dataclass(frozen=True)
class MoeNames:
    """Where a family's checkpoint keeps a routed layer's MLP, under `model.layers.{l}.`."""
    module: str  # the MLP module: 'mlp.' (Qwen3-MoE, OLMoE) or 'block_sparse_moe.' (Mixtral)
    up: str  # an expert's up, gate and down projections: 'up_proj' / 'gate_proj' / 'down_proj', Mixtral's w3 / w1 / w2
    gate: str
    down: str
    also_under: tuple[str, ...] = ()  # other MLP modules transformers reads the per-expert tensors under


def _swap_halves(parts: list[torch.Tensor]) -> torch.Tensor:
    """transformers' fused gate_up_proj (E, 2F, C), rows [gate; up] per expert -> qtrain's [up; gate]."""
    (t,) = parts
    F = t.shape[1] // 2
    return torch.cat([t[:, F:], t[:, :F]], dim=1)


def fused_expert_layouts(prefix: str, experts: int, inner: int, hidden: int) -> tuple[HfLayout, HfLayout]:
    """The experts of layer `prefix` ('model.layers.{l}.') as transformers 5 holds them in its modules, which it
    reads from a checkpoint too (`TensorSpec.hf_alternatives`): `mlp.experts.gate_up_proj` (E, 2F, C) with rows
    [gate; up] per expert (qtrain's stack is [up; gate]) and `mlp.experts.down_proj` (E, C, F) as it is; `inner` F,
    `hidden` C. Every MoE family's routed layer takes them (qwen3_5/tensors.py too)."""
    fused = f"{prefix}mlp.experts."
    return (HfLayout(((f"{fused}gate_up_proj", (experts, 2 * inner, hidden)),), _swap_halves),
            HfLayout(((f"{fused}down_proj", (experts, hidden, inner)),)))


def _moe_tensors(cfg: MoeConfig, layer: int, names: MoeNames) -> list[TensorSpec]:
    """A routed layer's router and expert stacks with their HF names (module docstring)."""
    C, F, X = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    prefix = f"{cfg.hf_prefix}layers.{layer}."

    def per_expert(module: str) -> tuple[tuple, tuple]:
        ug = tuple(p for e in range(X) for p in ((f"{prefix}{module}experts.{e}.{names.up}.weight", (F, C)),
                                                  (f"{prefix}{module}experts.{e}.{names.gate}.weight", (F, C))))
        down = tuple((f"{prefix}{module}experts.{e}.{names.down}.weight", (C, F)) for e in range(X))
        return ug, down

    ug, down = per_expert(names.module)
    router_alt = [HfLayout(((f"{prefix}{m}gate.weight", (X, C)),)) for m in (*names.also_under, "mlp.")
                  if m != names.module]
    fused_ug, fused_down = fused_expert_layouts(prefix, X, F, C)
    ug_alt = [HfLayout(per_expert(m)[0]) for m in names.also_under] + [fused_ug]
    down_alt = [HfLayout(per_expert(m)[1]) for m in names.also_under] + [fused_down]
    return [TensorSpec(ROUTER, (X, C), ((f"{prefix}{names.module}gate.weight", (X, C)),),
                       hf_alternatives=tuple(dict.fromkeys(router_alt))),
            TensorSpec(EXPERTS_UP_GATE, (X, 2 * F, C), ug, experts=X, group=EXPERTS_GROUP,
                       hf_alternatives=tuple(ug_alt)),
            TensorSpec(EXPERTS_DOWN, (X, C, F), down, init="residual", experts=X, group=EXPERTS_GROUP,
                       hf_alternatives=tuple(down_alt))]


class MoeFamily:
    """`family.ModelFamily` for a Llama-style decoder with routed MoE MLPs (module docstring). `qk_norm_shapes`:
    the q/k norm gains' shapes when they are not per head (OLMoE's norm the whole projections); `block_cls` and
    `qkv_statement`: a family whose attention differs from the Llama block's says how (olmoe/block.py)."""

    def __init__(self, *, name: str, architectures: Mapping[str, str], presets: Mapping[str, Callable[[], Any]],
                 config_cls: type[MoeConfig], names: MoeNames, fp8_matrices: tuple[str, ...],
                 block_cls: type[MoeBlock] = MoeBlock, qkv_statement: Callable = LlamaBlock.saved_by_qkv,
                 qk_norm_shapes: Callable[[MoeConfig], dict[str, tuple[int, ...]]] | None = None):
        self.name, self.architectures, self.presets = name, architectures, presets
        self.fp8_matrices = fp8_matrices
        self._config_cls, self._names, self._block_cls = config_cls, names, block_cls
        self._qkv_statement, self._qk_norm_shapes = qkv_statement, qk_norm_shapes

    def config_from_hf(self, d: dict[str, Any], *, source: str) -> MoeConfig:
        return self._config_cls.from_hf_dict(d, source=source)

    def non_block_tensors(self, cfg: MoeConfig) -> tuple[TensorSpec, ...]:
        return decoder_non_block_tensors(cfg)

    def ignored_hf_tensor(self, cfg: MoeConfig, name: str) -> str | None:
        """No part of these checkpoints is skipped (the protocol's hook for multimodal checkpoints)."""
        return None

    def block_tensors(self, cfg: MoeConfig, layer: int) -> tuple[TensorSpec, ...]:
        """The Llama block's tensors (its attention, and a dense layer's MLP), or the attention and the routed MLP."""
        specs = list(llama_tensors.block_tensors(cfg, layer))
        if self._qk_norm_shapes is not None:
            shapes = self._qk_norm_shapes(cfg)
            specs = [dataclasses.replace(t, shape=shapes[t.name], hf=((t.hf[0][0], shapes[t.name]),))
                     if t.name in shapes else t for t in specs]
        if layer in cfg.dense_layers:
            return tuple(specs)
        return tuple([t for t in specs if t.name not in ("up", "down")] + _moe_tensors(cfg, layer, self._names))

    def make_block_fn(self, cfg: MoeConfig, options: BlockOptions) -> BlockFn:
        return moe_block.make_block_fn(cfg, options, self._block_cls)

    def matmuls(self, cfg: MoeConfig, layer: int) -> dict[str, MatmulSpec]:
        return moe_block.matmuls(cfg, layer)

    def attention_flops(self, cfg: MoeConfig, layer: int, seq_len: int) -> int:
        return LLAMA.attention_flops(cfg, layer, seq_len)

    def activation_terms(self, cfg: MoeConfig, layer: int, s: ActivationSettings) -> list[ActTerm]:
        return moe_block.activation_terms(cfg, layer, s, qkv=self._qkv_statement)

    def backward_temporaries(self, cfg: MoeConfig, layer: int, tokens: int, s: ActivationSettings) -> int:
        return moe_block.backward_temporaries(cfg, layer, tokens, s)
