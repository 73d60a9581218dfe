"""Numerics built on the kernels: AdamW update rules, stochastic rounding (re-exported from the kernels)."""

from qtrain.kernels.stochastic_rounding import round_to_bf16_sr, sr_add_, sr_copy_
from qtrain.numerics.adamw import AdamWHyper, adamw_update_

__all__ = ["AdamWHyper", "adamw_update_", "round_to_bf16_sr", "sr_add_", "sr_copy_"]
