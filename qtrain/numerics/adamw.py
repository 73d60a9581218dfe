"""AdamW update rule (llm.q ``adamw.cu`` / reference/llmq.md §3.4) on top of the fused kernel.

``adamw_update_`` validates dtypes and layout, turns ``AdamWHyper`` into the kernel's scalars (bias
corrections ``1 - beta**t`` computed in float64 on the host; the kernel multiplies by their reciprocals, each
rounded once to fp32: ``qtrain.kernels.adamw.bias_reciprocals``), derives the random streams of the stored
states from the caller's key, and calls ``qtrain.kernels.adamw.adamw_step`` (Triton on CUDA, the twin
elsewhere).

Differences from llm.q, on purpose:
* m's stochastic rounding uses a stream of the caller's key (llm.q uses the fixed seed 51245 for m, so the
  same dither repeats every step, reference/llmq.md §3.3 [quirk]); param and m get independent streams
  ``rng_key(key, PARAM_STREAM | M_STREAM)``; v takes the unused high half of m's 32-bit word when m and v are
  both bf16 (one hash for the two: ``qtrain.kernels.adamw`` says why the halves are independent), else its own
  ``rng_key(key, V_STREAM)`` (llm.q rotates the param's word for v, overlapping 4 of its bits).
* No divisibility requirement on the length; element ``i`` uses counter ``offset + i``, so a rank that
  updates a slice with ``offset = slice start`` gets the unsharded bits (for e4m3 m also the slice must
  start on a 128-element boundary, because the m scales are per 128 elements of the slice).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from qtrain.kernels.adamw import M_BLOCK, adamw_step
from qtrain.kernels.rng import rng_key

__all__ = ["AdamWHyper", "M_STREAM", "PARAM_STREAM", "V_STREAM", "adamw_update_", "m_scales_numel"]

PARAM_STREAM, M_STREAM, V_STREAM = 1, 2, 3  # rng_key(key, stream) per stored tensor


@dataclass(frozen=True, kw_only=True)
class AdamWHyper:
    """Scalars of one AdamW step (defaults are llm.q's CLI defaults)."""

    lr: float
    """Learning rate of this step (after the schedule)."""
    step: int
    """1-based step t used in the bias corrections 1 - beta**t."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    """Added to sqrt(v_hat), as in torch.optim.AdamW."""
    weight_decay: float = 0.1
    """Decoupled and lr-scaled: p -= lr * wd * p (only where the caller passes decay=True)."""
    grad_scale: float | torch.Tensor = 1.0
    """Multiplies the gradient before anything else (clipping factor, or 1/loss-scale). A 0-dim fp32 tensor
    on the parameters' device is read by the kernel (no host sync); NaN there skips the update."""

    def __post_init__(self) -> None:
        if self.step < 1:
            raise ValueError(f"AdamWHyper.step is 1-based, got {self.step}")
        for name in ("beta1", "beta2"):
            b = getattr(self, name)
            if not 0.0 <= b < 1.0:
                raise ValueError(f"AdamWHyper.{name} must be in [0, 1), got {b}")
        for name in ("lr", "eps", "weight_decay", "grad_scale"):
            x = getattr(self, name)
            if isinstance(x, torch.Tensor) and name == "grad_scale":
                continue  # a device value: checked where the kernel reads it
            if not math.isfinite(x) or x < 0:
                raise ValueError(f"AdamWHyper.{name} must be finite and >= 0, got {x}")


def m_scales_numel(n: int) -> int:
    """Number of fp32 scales an e4m3 m of n elements needs (one per 128, last block partial)."""
    return -(-n // M_BLOCK)


_P_DTYPES = (torch.float32, torch.bfloat16)
_G_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_M_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn)
_V_DTYPES = (torch.float32, torch.bfloat16)


def _validate(param, grad, m, v, m_scales) -> None:
    bad = (
        param.dtype not in _P_DTYPES or grad.dtype not in _G_DTYPES
        or m.dtype not in _M_DTYPES or v.dtype not in _V_DTYPES
    )
    if bad:
        raise TypeError(
            f"adamw_update_: unsupported dtypes. Got param={param.dtype}, grad={grad.dtype}, m={m.dtype}, "
            f"v={v.dtype}; param fp32|bf16, grad fp32|bf16|fp16, m fp32|bf16|float8_e4m3fn, v fp32|bf16"
        )
    n = param.numel()
    for name, t in (("grad", grad), ("m", m), ("v", v)):
        if t.numel() != n:
            raise ValueError(f"adamw_update_: param has {n} elements, {name} has {t.numel()}")
    tensors = [("param", param), ("grad", grad), ("m", m), ("v", v)]
    if m.dtype == torch.float8_e4m3fn:
        if m_scales is None:
            raise ValueError("adamw_update_: m is float8_e4m3fn, pass m_scales (fp32, one per 128 elements)")
        if m_scales.dtype != torch.float32 or m_scales.numel() != m_scales_numel(n):
            raise ValueError(
                f"adamw_update_: m_scales must be fp32 with {m_scales_numel(n)} elements, "
                f"got {m_scales.dtype} with {m_scales.numel()}"
            )
        tensors.append(("m_scales", m_scales))
    elif m_scales is not None:
        raise ValueError(f"adamw_update_: m_scales is only for a float8_e4m3fn m, m is {m.dtype}")
    for name, t in tensors:
        if not t.is_contiguous():
            raise ValueError(f"adamw_update_: {name} must be contiguous (no hidden copies)")
        if t.device != param.device:
            raise ValueError(f"adamw_update_: {name} on {t.device}, param on {param.device}")


def adamw_update_(
    param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *,
    hp: AdamWHyper, decay: bool, key: int, offset: int = 0, m_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fused AdamW step in place on param, m, v (and m_scales for an e4m3 m).

    Reads grad, m, v, param once and writes param, m, v once. All arithmetic in fp32; bf16/e4m3 writes are
    stochastically rounded (streams derived from ``key``; element i uses counter ``offset + i``).
    ``decay=False`` means weight decay 0 (norm weights, biases). Returns a 0-dim fp32 tensor: the abs-max
    of the new param as stored (for FP8 weight scaling).
    """
    _validate(param, grad, m, v, m_scales)
    if offset < 0:
        raise ValueError(f"adamw_update_: offset must be >= 0, got {offset}")
    return adamw_step(
        param, grad, m, v, m_scales,
        lr=hp.lr, beta1=hp.beta1, one_minus_beta1=1.0 - hp.beta1, beta2=hp.beta2, one_minus_beta2=1.0 - hp.beta2,
        bias_corr1=1.0 - hp.beta1**hp.step, bias_corr2=1.0 - hp.beta2**hp.step,
        eps=hp.eps, weight_decay=hp.weight_decay if decay else 0.0, grad_scale=hp.grad_scale,
        key_param=rng_key(key, PARAM_STREAM), key_m=rng_key(key, M_STREAM), key_v=rng_key(key, V_STREAM),
        offset=offset,
    )
