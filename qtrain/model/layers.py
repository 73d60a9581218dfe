"""The small pieces the families' blocks share, in plain torch: RMSNorm, RoPE tables and rotation, SwiGLU.

Each follows the operation order of `transformers` (Qwen2/Llama/Qwen3 modeling files) so that fp32
results agree to rounding and bf16 results round at the same places. On the GPU these run inside a
torch.compile'd block, which fuses them into a few Triton kernels; on the CPU they run as they are.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from qtrain.kernels.rope import rope_qkv_backward
from qtrain.kernels.swiglu import swiglu_backward
from qtrain.model.choices import SDPA_BACKENDS  # noqa: F401 (the backends' names, listed by the options)
from qtrain.model.config import ModelConfig



@contextlib.contextmanager
def sdpa_backends(name: str) -> Iterator[None]:
    """Restrict F.scaled_dot_product_attention to one backend ('auto': torch's own choice). Works inside
    torch.compile'd code, where the choice is made once at trace time. The block does not take 'cudnn'
    this way: its gradients came out wrong inside compiled graphs on the H200, so the block calls
    kernels/attention.py's op pair for it instead."""
    if name == "auto":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[name]
    with sdpa_kernel(backend):
        yield


def resolve_sdpa_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """'auto' -> 'cudnn' for bf16/fp16 on Hopper GPUs (compute capability 9.x), where qtrain's cuDNN op pair
    was checked against flash (tests/test_attention.py on the H200) and trains 3-4% faster at Qwen2.5-1.5B
    (BENCHMARKS.md, session 5); elsewhere (and for fp32, which cuDNN's attention does not take) torch's own
    choice. Any other name is kept as given."""
    if name == "auto" and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) \
            and torch.cuda.get_device_capability(device)[0] == 9:
        return "cudnn"
    return name


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = w * (x / sqrt(mean(x^2) + eps)); the normalisation in fp32, cast back before the gain (as HF)."""
    return rms_norm_and_rstd(x, weight, eps)[0]


def rms_norm_and_rstd(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(`rms_norm`'s output, its rstd = 1 / sqrt(mean(x^2) + eps) in fp32, shape (..., 1)). A compiled FP8 block
    passes (x, rstd, w) to the next linear (numerics.fp8's `prenorm`), which quantizes the output from them. One
    fp32 copy of x for both (two would add their gradients in x's dtype: one more rounding)."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (xf * rstd).to(x.dtype), rstd


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/hs), with llama3 frequency scaling when configured (fp32); hs: the rotated
    dimensions of a head (`ModelConfig.rotary_dim`)."""
    hs = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hs, 2, dtype=torch.int64).float() / hs))
    sc = cfg.rope_scaling
    if sc:  # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between
        factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old_ctx = sc["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / lo, old_ctx / hi
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_tables(cfg: ModelConfig, seq_len: int, device: torch.device | str, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (T, hs) in the activation dtype; positions 0..T-1 (HF "rotate-half" layout)."""
    inv_freq = rope_inv_freq(cfg).to(device)
    pos = torch.arange(seq_len, device=device, dtype=torch.int64).float()
    freqs = torch.outer(pos, inv_freq)  # (T, hs/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, hs)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (..., hs) with cos/sin broadcasting to it: (B, nh, T, hs) with (T, hs), or (B, T, nh, hs) with
    (T, 1, hs). Rotates pairs (d, d + hs/2)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def swiglu(up_gate: torch.Tensor) -> torch.Tensor:
    """up_gate: (..., 2F) with rows [up; gate] of the fused weight -> up * silu(gate)."""
    up, gate = up_gate.chunk(2, dim=-1)
    return F.silu(gate) * up


class _SwiGLU(torch.autograd.Function):
    """`swiglu` with its backward in one kernel (`qtrain::swiglu_backward`); saves u, as autograd would."""

    @staticmethod
    def forward(ctx, up_gate: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(up_gate)
        return swiglu(up_gate)

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> torch.Tensor:
        (up_gate,) = ctx.saved_tensors
        return swiglu_backward(dout.contiguous(), up_gate)


def split_qkv(qkv: torch.Tensor, nh: int, nkv: int, hs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused QKV output (B, T, q + 2 kv) -> q, k (views) and v (a copy), each (B, T, heads, hs). v is
    copied out because attention saves it: a view would keep the whole fused buffer (pre-RoPE q and k) alive."""
    B, T, _ = qkv.shape
    q, k, v = qkv.split([nh * hs, nkv * hs, nkv * hs], dim=-1)
    return q.view(B, T, nh, hs), k.view(B, T, nkv, hs), v.contiguous().view(B, T, nkv, hs)


class _QKVRope(torch.autograd.Function):
    """The fused QKV output (B, T, q + 2 kv) -> q, k rotated and v copied out, each (B, T, heads, hs), as
    `apply_rope` computes them; the backward is one kernel that also assembles d(qkv)
    (`qtrain::rope_qkv_backward`; qtrain/kernels/rope.py says why)."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, nh: int, nkv: int, hs: int):
        q, k, v = split_qkv(qkv, nh, nkv, hs)
        c, s = cos[:, None], sin[:, None]  # (T, 1, hs)
        ctx.save_for_backward(cos, sin)
        return apply_rope(q, c, s), apply_rope(k, c, s), v

    @staticmethod
    def backward(ctx, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor):
        cos, sin = ctx.saved_tensors
        dqkv = rope_qkv_backward(dq.contiguous(), dk.contiguous(), dv.contiguous(), cos, sin)
        return dqkv, None, None, None, None, None


def qkv_rope_fused(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, nh: int, nkv: int, hs: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) in (B, T, heads, hs) from the fused QKV output: RoPE'd q and k, v copied out. The forward
    is plain torch (the compiler fuses it); the backward is the fused kernel, computed in fp32 from the
    stored gradients and rounded once, so it can differ from autograd's by a unit in the last place."""
    return _QKVRope.apply(qkv, cos, sin, nh, nkv, hs)


def swiglu_fused(up_gate: torch.Tensor) -> torch.Tensor:
    """`swiglu` whose backward is the fused kernel (qtrain/kernels/swiglu.py says why): what the compiled
    block uses. Its gradient is computed in fp32 from the stored inputs and rounded once, so it can differ
    from autograd's (which rounds silu(gate) first) by a unit in the last place."""
    return _SwiGLU.apply(up_gate)
