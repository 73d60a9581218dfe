"""SwiGLU backward kernel (qtrain/kernels/swiglu/activation.py): twin against autograd in float64, Triton against the
twin (interpreter on CPU, and the GPU), and `swiglu`'s "kernel" mode, the autograd Function the compiled block uses.

Tolerances: the twin computes in fp32 from the stored inputs and rounds once, so against a float64
reference it is within fp32 rounding in fp32 (rel 1e-6) and within one bf16 rounding (2^-8 relative,
element-wise, plus an absolute floor for values near zero) in bf16. Triton's exp differs from torch's by
an ulp or two of fp32, which can flip a bf16 rounding: Triton vs twin allows one bf16 ulp (2^-7 relative).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.triton_interp import compile_for_hopper, interp_only, interpreter_subprocess_test, needs_cuda
from qtrain.kernels import dispatch
from qtrain.kernels.swiglu import activation as act
from qtrain.kernels.swiglu import swiglu
from qtrain.kernels.swiglu.activation import MODES, swiglu_backward, swiglu_backward_twin

test_interpreter_subprocess = interpreter_subprocess_test(__file__)


def _inputs(shape_mf, dtype, device="cpu", seed=0):
    M, Fd = shape_mf
    g = torch.Generator().manual_seed(seed)
    u = (torch.randn(M, 2 * Fd, generator=g) * 3).to(dtype).to(device)
    d = torch.randn(M, Fd, generator=g).to(dtype).to(device)
    return d, u


def _reference(d, u):
    u64 = u.double().requires_grad_(True)
    up, gate = u64.chunk(2, -1)
    (F.silu(gate) * up).backward(d.double())
    return u64.grad


@pytest.mark.parametrize("dtype,rtol,atol", [(torch.float32, 1e-6, 1e-7), (torch.bfloat16, 2.0**-8, 1e-3)])
def test_twin_matches_float64_autograd(dtype, rtol, atol):
    d, u = _inputs((37, 96), dtype)
    torch.testing.assert_close(swiglu_backward_twin(d, u).double(), _reference(d, u), rtol=rtol, atol=atol)


def test_fused_function_matches_plain_swiglu():
    """The "kernel" mode's forward is the "autograd" mode's bit for bit; its backward is the op (twin on CPU)."""
    d, u = _inputs((2 * 5, 64), torch.float32, seed=1)
    u3 = u.view(2, 5, 128)
    a = u3.clone().requires_grad_(True)
    b = u3.clone().requires_grad_(True)
    ya, yb = swiglu(a, "kernel"), swiglu(b)
    assert torch.equal(ya, yb)
    ya.backward(d.view(2, 5, 64))
    yb.backward(d.view(2, 5, 64))
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)
    assert MODES == ("autograd", "kernel")
    with pytest.raises(ValueError, match="mode must be one of"):
        swiglu(a, "fused")


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="2F"):
        swiglu_backward_twin(torch.zeros(3, 5), torch.zeros(3, 9))
    with pytest.raises(TypeError, match="dtype"):
        swiglu_backward_twin(torch.zeros(3, 4), torch.zeros(3, 8, dtype=torch.bfloat16))


def _check_triton_vs_twin(device):
    for dtype in (torch.float32, torch.bfloat16):
        for shape in ((1, 16), (19, 300), (33, 8)):
            d, u = _inputs(shape, dtype, device, seed=shape[0])
            with dispatch.backend("triton"):
                got = swiglu_backward(d, u)
            want = swiglu_backward_twin(d, u)
            tol = 1e-6 if dtype == torch.float32 else 2.0**-7
            torch.testing.assert_close(got, want, rtol=tol, atol=1e-6 if dtype == torch.float32 else 1e-3)


@interp_only
def test_interp_triton_matches_twin():
    _check_triton_vs_twin("cpu")


# ------------------------------------------------------------------------- sm_90 build, on the CPU
@pytest.mark.skipif(not dispatch.HAS_TRITON, reason="no triton")
def test_kernel_builds_for_hopper():
    """The backward kernel compiles for sm_90 as launched (bf16 through int16 pointers, the default tile), with the
    abs-max partials the FP8 MLP asks for: both halves of du and the partial max are stored."""
    sig = {"dout_ptr": "*i16", "u_ptr": "*i16", "du_ptr": "*i16", "amax_ptr": "*fp32", "M": "i32", "F": "i32"}
    ptx = compile_for_hopper(act._swiglu_bwd_kernel, sig, {"KIND": 1, "AMAX": True, "BLOCK_M": act.BLOCK_M,
                                                           "BLOCK_F": act.BLOCK_F}, num_warps=act.NUM_WARPS)
    assert ptx.count("st.global") > 2


@pytest.mark.gpu
@needs_cuda
def test_gpu_triton_matches_twin():
    _check_triton_vs_twin("cuda")
    d, u = _inputs((16384, 8960), torch.bfloat16, "cuda")  # Qwen2.5-1.5B shape
    got, want = swiglu_backward(d, u), swiglu_backward_twin(d, u)
    torch.testing.assert_close(got, want, rtol=2.0**-7, atol=1e-3)


@pytest.mark.gpu
@needs_cuda
def test_gpu_compiled_block_uses_the_op():
    """Inside torch.compile the op is opaque and runs the kernel: gradients equal the eager Function's."""
    d, u = _inputs((64, 256), torch.bfloat16, "cuda", seed=3)
    a = u.clone().requires_grad_(True)
    b = u.clone().requires_grad_(True)
    torch.compile(lambda t: swiglu(t, "kernel"), fullgraph=True)(a).backward(d)
    swiglu(b, "kernel").backward(d)
    assert torch.equal(a.grad, b.grad)
