"""The Qwen3.5 family (model_types qwen3_5_text, qwen3_5_moe_text, the multimodal qwen3_5 / qwen3_5_moe read as
their text model, and qwen3_next, the same decoder in an earlier checkpoint layout: next_config.py): the hybrid Gated
DeltaNet + gated full-attention decoder, dense or MoE. `QWEN3_5` is what
`model/registry.py` lists; its parts: config.py (HF config mapping, presets), tensors.py (HF names, shapes, init,
decay), block.py (the block function), linear_attention.py (the Gated DeltaNet mixer), memory.py (what a block keeps
for backward). The delta rule and the convolution are ops in kernels/delta_rule/.
"""
from __future__ import annotations

from typing import Any

from qtrain.model.family import ActivationSettings, ActTerm, BlockFn, BlockOptions, MatmulSpec, TensorSpec
from qtrain.model.qwen3_5 import block, memory, tensors
from qtrain.model.qwen3_5.config import ARCHITECTURES, PRESETS, Qwen35Config
from qtrain.model.qwen3_5.next_config import ARCHITECTURE as NEXT_ARCHITECTURE
from qtrain.model.qwen3_5.next_config import NEXT_TYPE, Qwen3NextConfig
from qtrain.model.qwen3_5.next_config import PRESETS as NEXT_PRESETS


class Qwen35Family:
    """`family.ModelFamily` for Qwen3.5 (module docstring)."""

    name = "qwen3_5"
    architectures = {**ARCHITECTURES, NEXT_TYPE: NEXT_ARCHITECTURE}
    presets = {**PRESETS, **NEXT_PRESETS}
    fp8_matrices = block.FP8_MATRICES

    def config_from_hf(self, d: dict[str, Any], *, source: str) -> Qwen35Config:
        cls = Qwen3NextConfig if d.get("model_type") == NEXT_TYPE else Qwen35Config
        return cls.from_hf_dict(d, source=source)

    def non_block_tensors(self, cfg: Qwen35Config) -> tuple[TensorSpec, ...]:
        return tensors.non_block_tensors(cfg)

    def block_tensors(self, cfg: Qwen35Config, layer: int) -> tuple[TensorSpec, ...]:
        return tensors.block_tensors(cfg, layer)

    def ignored_hf_tensor(self, cfg: Qwen35Config, name: str) -> str | None:
        return tensors.ignored_hf_tensor(cfg, name)

    def make_block_fn(self, cfg: Qwen35Config, options: BlockOptions) -> BlockFn:
        return block.make_block_fn(cfg, options)

    def delta_rule_layers(self, cfg: Qwen35Config) -> int:
        """The layers that run the gated delta rule (its Gated DeltaNet ones): where --delta-rule-precision acts."""
        return sum(cfg.is_linear(layer) for layer in range(cfg.num_hidden_layers))

    def matmuls(self, cfg: Qwen35Config, layer: int) -> dict[str, MatmulSpec]:
        """The block's linears as GEMMs (the MoE experts as grouped GEMMs of top_k / E rows per token each), each
        with the block step that runs it (the experts' and the shared expert's up/gate: 'up', as the dense MLP's)."""
        C = cfg.hidden_size
        if cfg.is_linear(layer):
            mixer = {"in_proj": MatmulSpec(cfg.in_proj_dim, C, step="qkv"), "out": MatmulSpec(C, cfg.linear_value_dim)}
        else:
            mixer = {"qkv": MatmulSpec(cfg.attn_qkv_dim, C, step="qkv"), "o": MatmulSpec(C, cfg.q_dim)}
        if not cfg.is_moe_layer(layer):
            F = cfg.intermediate_size
            return {**mixer, "up": MatmulSpec(2 * F, C, step="up"), "down": MatmulSpec(C, F)}
        E, k, Fm, Fs = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, \
            cfg.shared_expert_intermediate_size
        return {**mixer, "router": MatmulSpec(E, C),
                "experts_up_gate": MatmulSpec(2 * Fm, C, step="up", rows=k / E, count=E),
                "experts_down": MatmulSpec(C, Fm, rows=k / E, count=E), "shared_up": MatmulSpec(2 * Fs, C, step="up"),
                "shared_down": MatmulSpec(C, Fs), "shared_gate": MatmulSpec(1, C)}

    def attention_flops(self, cfg: Qwen35Config, layer: int, seq_len: int) -> int:
        """Full attention: QK^T and PV over seq_len / 2 keys on average, 2 x 2 x (seq_len / 2) x q_dim. Gated
        DeltaNet (chunked form, chunk C = 64, per value head): per token ~ 2 x (C/2)(dk + dv) for the chunk's own
        causal products, 2 x C dk for the triangular systems, 2 x 3 dk dv for the state's read, correction and
        update (fla-core's count): independent of seq_len."""
        if not cfg.is_linear(layer):
            return 2 * seq_len * cfg.q_dim
        C, dk, dv, H = 64, cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_num_value_heads
        return H * (C * (dk + dv) + 2 * C * dk + 6 * dk * dv)

    def activation_terms(self, cfg: Qwen35Config, layer: int, s: ActivationSettings) -> list[ActTerm]:
        return memory.activation_terms(cfg, layer, s)

    def backward_temporaries(self, cfg: Qwen35Config, layer: int, tokens: int, s: ActivationSettings) -> int:
        return memory.backward_temporaries(cfg, layer, tokens, s)


QWEN3_5 = Qwen35Family()
