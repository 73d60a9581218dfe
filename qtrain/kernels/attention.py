"""Causal attention through cuDNN as one opaque op pair, forward and backward, with fixed output layouts.

Why: on the H200, cuDNN's fused attention runs the Qwen2.5 shapes 1.6-1.9x faster than the flash backend
that torch picks by default (bench/bench_attention.py: forward ~430 vs ~240 TFLOP/s at 1.5B). Reached
through F.scaled_dot_product_attention inside a torch.compile'd block, however, its gradients came out
wrong (relative error ~1.6 against flash, while the same call run eagerly agrees to bf16 rounding): the
compiled graph and the kernel disagree about a layout. Here forward and backward are each a custom op
that the compiler cannot see into, every output has one documented layout, and the kernel gets its
inputs exactly as given.

Layouts: q (B, nh, T, hs), k and v (B, nkv, T, hs), any strides with unit innermost stride (the block
passes transposed views of its (B, T, heads, hs) projection). out, dq, dk and dv are "BTHD": shape
(B, heads, T, hs) over memory laid out as (B, T, heads, hs), which is what the output projection reads
(out.transpose(1, 2) is contiguous) and what the QKV projection's gradient is assembled in. GQA: query
head h uses key/value head h // (nh / nkv). Scale 1/sqrt(hs), no dropout, no mask but the causal one.

The plain-torch twin (`causal_attention_twin`, `causal_attention_backward_twin`) is the specification
and the implementation off CUDA: softmax attention in fp32 with the log-sum-exp saved, and the standard
backward from it (dP = dO V^T, D = rowsum(dO * O), dS = P * (dP - D)). `lse` is an implementation detail
passed from forward to backward; only out and the gradients are compared between implementations.
"""
from __future__ import annotations

import math

import torch

__all__ = ["causal_attention", "causal_attention_twin", "causal_attention_backward_twin"]


def _bthd_empty(like: torch.Tensor, heads: int | None = None) -> torch.Tensor:
    B, h, T, hs = like.shape
    return torch.empty(B, T, heads or h, hs, dtype=like.dtype, device=like.device).transpose(1, 2)


def _as_bthd(t: torch.Tensor) -> torch.Tensor:
    """t itself when it already has the BTHD layout, else a BTHD copy."""
    B, h, T, hs = t.shape
    if t.stride() == (T * h * hs, hs, h * hs, 1):
        return t
    return _bthd_empty(t).copy_(t)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:] \
            or q.shape[1] % k.shape[1]:
        raise ValueError(f"causal_attention: q must be (B, nh, T, hs) and k, v (B, nkv, T, hs) with nkv | nh, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")


# ---------------------------------------------------------------------------------------------- twin
def _expand_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t.repeat_interleave(groups, dim=1) if groups > 1 else t


def _probs(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax probabilities P (fp32) of the causal scores and their log-sum-exp per query row."""
    T, hs = q.shape[2], q.shape[3]
    s = (q.float() @ _expand_kv(k, q.shape[1] // k.shape[1]).float().transpose(-1, -2)) / math.sqrt(hs)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    if lse is None:
        lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse.unsqueeze(-1)), lse


def causal_attention_twin(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The specification of the forward: (out in q's dtype and BTHD layout, lse (B, nh, T) fp32)."""
    _check(q, k, v)
    p, lse = _probs(q, k)
    out = p @ _expand_kv(v, q.shape[1] // v.shape[1]).float()
    return _bthd_empty(q).copy_(out), lse


def causal_attention_backward_twin(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                                   lse: torch.Tensor, dout: torch.Tensor
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The specification of the backward: dq, dk, dv in the inputs' dtype, BTHD layout (fp32 math)."""
    g = q.shape[1] // k.shape[1]
    p, _ = _probs(q, k, lse)
    do = dout.float()
    dp = do @ _expand_kv(v, g).float().transpose(-1, -2)
    ds = p * (dp - (do * out.float()).sum(-1, keepdim=True)) / math.sqrt(q.shape[3])
    dq = ds @ _expand_kv(k, g).float()
    B, nkv, T, hs = k.shape
    dk = (ds.transpose(-1, -2) @ q.float()).view(B, nkv, g, T, hs).sum(2)
    dv = (p.transpose(-1, -2) @ do).view(B, nkv, g, T, hs).sum(2)
    return _bthd_empty(q).copy_(dq), _bthd_empty(k).copy_(dk), _bthd_empty(v).copy_(dv)


# ---------------------------------------------------------------------------------------------- ops
@torch.library.custom_op("qtrain::causal_attention_fwd", mutates_args=())
def _attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return causal_attention_twin(q, k, v)


@_attention_fwd.register_kernel("cuda")
def _attention_fwd_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check(q, k, v)
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"causal_attention: cuDNN takes bf16 or fp16 q, k, v on CUDA, got {q.dtype}, {k.dtype}, "
                        f"{v.dtype} (fp32 runs: --sdpa-backend auto or flash/math)")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        raise ValueError("causal_attention: q, k, v need unit innermost stride")
    B, nh, T, _ = q.shape
    r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False)
    return _as_bthd(r[0]), r[1].reshape(B, nh, T)


@_attention_fwd.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    B, nh, T, _ = q.shape
    return _bthd_empty(q), q.new_empty(B, nh, T, dtype=torch.float32)


@torch.library.custom_op("qtrain::causal_attention_bwd", mutates_args=())
def _attention_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return causal_attention_backward_twin(q, k, v, out, lse, dout)


_SEEDS: dict[torch.device, torch.Tensor] = {}


def _no_dropout_seed(device: torch.device) -> torch.Tensor:
    if device not in _SEEDS:
        _SEEDS[device] = torch.zeros(1, dtype=torch.int64, device=device)
    return _SEEDS[device]


@_attention_bwd.register_kernel("cuda")
def _attention_bwd_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                         dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T = q.shape[2]
    unused = _no_dropout_seed(q.device)  # philox seed / offset: read only with dropout
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        _as_bthd(dout), q, k, v, out, lse.unsqueeze(-1), unused, unused, None, None, None, T, T, 0.0, True)
    return _as_bthd(dq), _as_bthd(dk), _as_bthd(dv)


@_attention_bwd.register_fake
def _(q, k, v, out, lse, dout):
    return _bthd_empty(q), _bthd_empty(k), _bthd_empty(v)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs, *output)
    ctx.set_materialize_grads(False)  # lse has no gradient: no zeros for it in every layer's backward


def _backward(ctx, dout: torch.Tensor, _dlse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v, out, lse = ctx.saved_tensors
    return _attention_bwd(q, k, v, out, lse, dout)


_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention, (B, nh, T, hs) x (B, nkv, T, hs)^2 -> (B, nh, T, hs) in the BTHD layout:
    cuDNN on CUDA, the twin elsewhere; differentiable; opaque to torch.compile."""
    return _attention_fwd(q, k, v)[0]
