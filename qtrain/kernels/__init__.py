"""The ops, each in one home (a module, or a small package for an op with several kernels), and the Triton machinery
they share. An op's home holds its Triton kernels, each beside a plain-torch twin with the same signature (the twin is
the specification and the CPU path), the custom ops a torch.compile'd graph calls, its autograd function, its state and
what it saves for backward; the model calls one entry per op. Which of a kernel and its twin runs is decided in one
place, ``qtrain.kernels.dispatch`` (Triton for CUDA tensors when triton imports, the twin otherwise).

Shared machinery: ``dispatch``; ``rng`` (counter-based random bits ``random_u32(key, index)``, ``rng_key``);
``stochastic_rounding`` (fp32 -> bf16 (and e4m3) stochastic rounding, ``sr_add_`` / ``sr_copy_``, and the fp32 load
and store helpers the kernels share).

Ops: ``fp8_quant`` (FP8 quantization: ``quantize_fp8``, with a transposed copy for GEMM operands); ``scaled_mm`` (the
FP8 GEMM, torch._scaled_mm or its emulation, and an FP8 linear's operand rules); ``swiglu/`` (SwiGLU in the model
dtype and straight to FP8, the FP8 MLP around it, the one-pass kernels' scale hints); ``cross_entropy/`` (the chunked
LM head and its loss, in-place d(logits), the FP8 head backward); ``rope`` (tables, rotation, the fused backward);
``attention`` (cuDNN's fused attention as an op pair); ``adamw`` (the fused AdamW step under ``qtrain.numerics.adamw``);
``grouped_gemm`` and ``moe_permute`` (the MoE experts' GEMMs and token permutation).
"""

from qtrain.kernels.rng import random_u32, rng_key
from qtrain.kernels.stochastic_rounding import round_to_bf16_sr, sr_add_, sr_copy_

__all__ = ["random_u32", "rng_key", "round_to_bf16_sr", "sr_add_", "sr_copy_"]
