"""The Llama family (model_types llama, qwen2, qwen3): Llama 2/3, Qwen2/2.5 and Qwen3 dense, as one model with config
flags (QKV bias, qk-norm, tied embeddings, llama3 RoPE scaling). `LLAMA` is what `model/registry.py` lists; its
parts live beside it: config.py (HF config mapping, presets), tensors.py (HF weight names, shapes, init, decay),
block.py (the block function and what its steps save for backward).
"""
from __future__ import annotations

from typing import Any

from qtrain.kernels.gated_mlp import backward_weight_temporaries
from qtrain.model.family import (ActivationSettings, ActTerm, BlockFn, BlockOptions, MatmulSpec, TensorSpec,
                                 decoder_non_block_tensors)
from qtrain.model.llama import block, tensors
from qtrain.model.llama.config import ARCHITECTURES, PRESETS, LlamaConfig


class LlamaFamily:
    """`family.ModelFamily` for the Llama family (module docstring)."""

    name = "llama"
    architectures = ARCHITECTURES
    presets = PRESETS
    fp8_matrices = block.FP8_MATRICES

    def config_from_hf(self, d: dict[str, Any], *, source: str) -> LlamaConfig:
        return LlamaConfig.from_hf_dict(d, source=source)

    def non_block_tensors(self, cfg: LlamaConfig) -> tuple[TensorSpec, ...]:
        return decoder_non_block_tensors(cfg)

    def block_tensors(self, cfg: LlamaConfig, layer: int) -> tuple[TensorSpec, ...]:
        return tensors.block_tensors(cfg, layer)

    def ignored_hf_tensor(self, cfg: LlamaConfig, name: str) -> str | None:
        return None  # a text checkpoint: nothing outside the model to skip

    def make_block_fn(self, cfg: LlamaConfig, options: BlockOptions) -> BlockFn:
        return block.make_block_fn(cfg, options)

    def matmuls(self, cfg: LlamaConfig, layer: int) -> dict[str, MatmulSpec]:
        """The four block linears: y (M, N) = x (M, K) W^T with the fused QKV and up/gate matrices."""
        C, F = cfg.hidden_size, cfg.intermediate_size
        return {"qkv": MatmulSpec(cfg.qkv_dim, C, step="qkv"), "o": MatmulSpec(C, cfg.q_dim),
                "up": MatmulSpec(2 * F, C, step="up"), "down": MatmulSpec(C, F)}

    def attention_flops(self, cfg: LlamaConfig, layer: int, seq_len: int) -> int:
        """QK^T and PV over seq_len / 2 keys on average (causal): 2 x 2 x (seq_len / 2) x q_dim."""
        return 2 * seq_len * cfg.q_dim

    def activation_terms(self, cfg: LlamaConfig, layer: int, s: ActivationSettings) -> list[ActTerm]:
        return block.activation_terms(cfg, s)

    def backward_temporaries(self, cfg: LlamaConfig, layer: int, tokens: int, s: ActivationSettings) -> int:
        """The largest saved tensors come back as gradients: F + 2C elements per token in the model dtype, and
        the attention's q_dim in fp32 per attention call (a bound measured on the CPU); with --swiglu-epilogue the
        up/gate weight gradient's interleaved copy (kernels/gated_mlp.py). With --mlp-chunks the larger of one
        slice's MLP phase (F / N) and the attention's backward, which the F term covered before (measured on the CPU
        at 2-8 slices, eager and compiled statements: tests/model/test_mlp_slices.py)."""
        epilogue = backward_weight_temporaries(cfg.hidden_size, cfg.intermediate_size, s.dtype_bytes) \
            if s.swiglu_epilogue else 0
        E, C, attention = s.dtype_bytes, cfg.hidden_size, 4 * cfg.q_dim // s.attn_chunks
        if s.mlp_chunks == 1:
            return tokens * (E * (cfg.intermediate_size + 2 * C) + attention) + epilogue
        # sliced: the larger of one slice's MLP phase and the attention's: fp32 gradients of k and v beside q's (the
        # CPU's attention backward), and eager RMSNorm-1's backward in fp32 (about four (B*T, C) fp32 temporaries)
        kv = 4 * 2 * cfg.kv_dim // s.attn_chunks
        norm = 0 if s.compiled else 16 * C
        return int(tokens * max(E * (cfg.intermediate_size / s.mlp_chunks + 2 * C) + attention,
                                E * 2 * C + attention + kv + norm)) + epilogue


LLAMA = LlamaFamily()
