"""The small pieces the families' blocks share, in plain torch: RMSNorm and the attention backend. (RoPE and SwiGLU
are ops with homes of their own: `kernels/rope.py`, `kernels/swiglu/`.)

RMSNorm follows the operation order of `transformers` (Qwen2/Llama/Qwen3 modeling files) so that fp32
results agree to rounding and bf16 results round at the same places. On the GPU it runs inside a
torch.compile'd block, which fuses it into a few Triton kernels; on the CPU it runs as it is.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from qtrain.kernels.swiglu import swiglu
from qtrain.model.choices import SDPA_BACKENDS  # noqa: F401 (the backends' names, listed by the options)


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
    was checked against flash (tests/kernels/test_attention.py on the H200) and trains 3-4% faster at Qwen2.5-1.5B
    on the H200; elsewhere (and for fp32, which cuDNN's attention does not take) torch's own
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


def swiglu_fused(up_gate: torch.Tensor) -> torch.Tensor:
    """`swiglu(up_gate, "kernel")` (kernels/swiglu/): the name model/moe.py imports."""
    return swiglu(up_gate, "kernel")


def rms_norm_zero_centered(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = (x / sqrt(mean(x^2) + eps)) * (1 + w), in fp32, rounded once (transformers' Qwen3.5 / Qwen3-Next RMSNorm,
    whose gain starts at w = 0): the norm of the families whose config says `zero_centered_norms`."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)


def final_norm_fn(zero_centered: bool):
    """The decoder's final RMSNorm: `rms_norm_zero_centered` for a family whose config says `zero_centered_norms`."""
    return rms_norm_zero_centered if zero_centered else rms_norm
