"""Triton kernels, each beside a plain-torch twin with the same signature (the twin is the specification).

Which one runs is decided in one place, ``qtrain.kernels.dispatch`` (Triton for CUDA tensors when triton
imports, the twin otherwise). Modules:
* ``rng``: counter-based random bits ``random_u32(key, index)`` and ``rng_key(seed, *ids)``;
* ``stochastic_rounding``: fp32 -> bf16 (and e4m3) stochastic rounding, ``sr_add_`` / ``sr_copy_``;
* ``adamw``: the fused AdamW step used by ``qtrain.numerics.adamw``;
* ``fp8_quant``: abs-max + FP8 quantization (with the transposed copy) used by ``qtrain.numerics.fp8``;
* ``cross_entropy``: single-pass LM-head cross-entropy writing d(logits) in place (opt-in, see its docs).
"""

from qtrain.kernels.rng import random_u32, rng_key
from qtrain.kernels.stochastic_rounding import round_to_bf16_sr, sr_add_, sr_copy_

__all__ = ["random_u32", "rng_key", "round_to_bf16_sr", "sr_add_", "sr_copy_"]
