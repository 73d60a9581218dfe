"""RoPE scaling for long context: the inverse frequencies and the attention factor of each `rope_type` of a Hugging
Face config that qtrain trains (`llama3`, `yarn`, `linear`, `dynamic`), and the keys each type reads.

Every formula follows transformers 5.x `modeling_rope_utils.py` (`_compute_*_parameters`) step by step, in its
order of operations and dtypes, so the fp32 tables agree with HF's to rounding at every position, including
positions past `original_max_position_embeddings`. The attention factor multiplies cos and sin (HF's
`attention_scaling`, YaRN's "mscale"), which scales q.k by its square; it is 1 for every type but yarn.

`dynamic` (NTK-aware) grows the base with the sequence: HF recomputes it from the longest position of the forward,
and keeps the grown frequencies cached for later shorter calls until one falls under `max_position_embeddings`.
A training step always sees whole sequences of one length, so qtrain computes the frequencies of the length being
trained (`seq_len`): the same as HF's first call at that length.
"""
from __future__ import annotations

import math
from typing import Any, Protocol

import torch

__all__ = ["SCALING_KEYS", "ScaledRopeConfig", "attention_factor", "base_inv_freq", "scaled_context",
           "scaled_inv_freq"]

# rope_type -> (required keys, optional keys) of the scaling dict (besides rope_type and rope_theta), as
# transformers' `_validate_<type>_rope_parameters` lists them
SCALING_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "linear": (("factor",), ()),
    "dynamic": (("factor",), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
}


class ScaledRopeConfig(Protocol):
    """What the scaling reads of a model config (`model.config.ModelConfig` has them)."""
    rotary_dim: int  # the rotated dimensions of a head
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict[str, Any] | None  # {"rope_type": one of SCALING_KEYS, its keys}, or None for plain RoPE


def base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    """Plain RoPE: theta^(-2i/dim), i < dim/2 (fp32)."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _linear(cfg: ScaledRopeConfig, sc: dict[str, Any], seq_len: int) -> torch.Tensor:
    """Position interpolation: every frequency divided by `factor`."""
    inv_freq = base_inv_freq(cfg.rope_theta, cfg.rotary_dim)
    inv_freq /= sc["factor"]
    return inv_freq


def _dynamic(cfg: ScaledRopeConfig, sc: dict[str, Any], seq_len: int) -> torch.Tensor:
    """NTK-aware: theta grows by (factor T / max_pos - (factor - 1))^(dim / (dim - 2)) once T passes max_pos. HF
    computes the grown base from a tensor length (fp32 arithmetic), and at or below max_pos from Python numbers."""
    dim, factor, max_pos = cfg.rotary_dim, sc["factor"], cfg.max_position_embeddings
    length: Any = max_pos
    if seq_len > max_pos:
        length = torch.tensor(seq_len, dtype=torch.int64)
    base = cfg.rope_theta * ((factor * length / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_factor(cfg: ScaledRopeConfig, sc: dict[str, Any]) -> float:
    """YaRN's factor; a null one is max_position_embeddings / original_max_position_embeddings (as HF)."""
    f = sc.get("factor")
    return cfg.max_position_embeddings / sc["original_max_position_embeddings"] if f is None else f


def _yarn(cfg: ScaledRopeConfig, sc: dict[str, Any], seq_len: int) -> torch.Tensor:
    """YaRN: high frequencies (more than beta_fast rotations over the original context) kept, low ones (fewer than
    beta_slow) interpolated by `factor`, a linear ramp over the dimensions in between."""
    dim, base = cfg.rotary_dim, cfg.rope_theta
    factor, old_ctx = _yarn_factor(cfg, sc), sc["original_max_position_embeddings"]
    beta_fast, beta_slow = sc.get("beta_fast") or 32, sc.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over old_ctx
        return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if sc.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: avoid the singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # the share of each dimension's original frequency
    return interpolation * (1 - keep) + extrapolation * keep


def _llama3(cfg: ScaledRopeConfig, sc: dict[str, Any], seq_len: int) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between."""
    inv_freq = base_inv_freq(cfg.rope_theta, cfg.rotary_dim)
    factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
    old_ctx = sc["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / lo, old_ctx / hi
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


_INV_FREQ = {"linear": _linear, "dynamic": _dynamic, "yarn": _yarn, "llama3": _llama3}
assert _INV_FREQ.keys() == SCALING_KEYS.keys()


def scaled_inv_freq(cfg: ScaledRopeConfig, seq_len: int) -> torch.Tensor:
    """The inverse frequencies (rotary_dim / 2, fp32) for sequences of `seq_len` tokens (only `dynamic` reads it)."""
    sc = cfg.rope_scaling
    if not sc:
        return base_inv_freq(cfg.rope_theta, cfg.rotary_dim)
    return _INV_FREQ[sc["rope_type"]](cfg, sc, seq_len)


def attention_factor(cfg: ScaledRopeConfig) -> float:
    """The factor on cos and sin: YaRN's `attention_factor`, given or from `factor` (and `mscale`, `mscale_all_dim`
    when both are given); 1 for the other types."""
    sc = cfg.rope_scaling
    if not sc or sc["rope_type"] != "yarn":
        return 1.0
    if sc.get("attention_factor") is not None:
        return sc["attention_factor"]
    factor, mscale, mscale_all_dim = _yarn_factor(cfg, sc), sc.get("mscale"), sc.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def scaled_context(cfg: ScaledRopeConfig) -> int:
    """The positions the scaled model is made for: `factor` times the original context (llama3, yarn:
    `original_max_position_embeddings`; linear, dynamic: `max_position_embeddings`), and never fewer than
    `max_position_embeddings` (Qwen2.5's YaRN keeps max_position_embeddings 32768 and extends it fourfold)."""
    sc = cfg.rope_scaling
    if not sc:
        return cfg.max_position_embeddings
    factor = _yarn_factor(cfg, sc) if sc["rope_type"] == "yarn" else sc["factor"]
    original = sc.get("original_max_position_embeddings", cfg.max_position_embeddings)
    return max(cfg.max_position_embeddings, int(factor * original))
