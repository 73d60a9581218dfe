"""`fp8_quantize_rmsnorm_transposed` (qtrain/kernels/fp8_quant.py): an RMSNorm's output quantized to FP8 (q and q^T)
from the norm's input, rstd and gain, without the output in memory.

The specification (`fp8_quantize_rmsnorm_torch`) is the norm as `model.layers.rms_norm` computes it, given its rstd,
then `fp8_quantize_torch`: so the property that matters is that the op and "norm, then quantize" give the same
bits. The Triton kernel must equal the twin bit for bit on the GPU (native bf16 loads and rounding); under the
interpreter (`test_interpreter_subprocess`) it must equal the quantize kernel run on the norm's output.
"""
from __future__ import annotations

import pytest
import torch

from qtrain.kernels.fp8_quant import (FP8_MAX, fp8_quantize_rmsnorm_torch, fp8_quantize_rmsnorm_transposed,
                                      fp8_quantize_rmsnorm_triton, fp8_quantize_torch)
from qtrain.model.layers import rms_norm, rms_norm_and_rstd
from tests.triton_interp import interp_only, interpreter_subprocess_test, needs_cuda

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
test_interpreter_subprocess = interpreter_subprocess_test(__file__)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def same(a, b) -> bool:
    return torch.equal(bits(a[0]), bits(b[0])) and torch.equal(bits(a[1]), bits(b[1])) and torch.equal(a[2], b[2])


def _norm_inputs(M: int, N: int, dtype: torch.dtype, device="cpu", seed=0):
    """x with rows of very different size (rstd spans ~3 binades), a gain around 1 with a few large entries, and
    h = rms_norm(x) with its rstd and abs-max."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, N, generator=g) * torch.logspace(-1, 2, M)[:, None]).to(dtype).to(device)
    w = (1 + 0.3 * torch.randn(N, generator=g)).to(dtype).to(device)
    w[::7] *= 4
    h, rstd = rms_norm_and_rstd(x, w, 1e-6)
    return x, rstd.reshape(-1), w, h, h.float().abs().amax()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_twin_is_norm_then_quantize(dtype, fp8):
    """The same bits as quantizing `rms_norm`'s output (the path it replaces), with h's exact abs-max and with a
    smaller amax (elements beyond it saturate, as `fp8_quantize_torch`'s)."""
    x, rstd, w, h, amax = _norm_inputs(37, 96, dtype)
    assert torch.equal(h, rms_norm(x, w, 1e-6))
    for a in (amax, amax / 3):
        got = fp8_quantize_rmsnorm_torch(x, rstd, w, a, fp8)
        assert same(got, fp8_quantize_torch(h, fp8, a, transpose=True))
    assert float(got[0].float().abs().max()) == FP8_MAX[fp8]  # saturated at amax / 3


def test_op_on_cpu_is_the_twin():
    x, rstd, w, h, amax = _norm_inputs(19, 48, torch.bfloat16)
    assert same(fp8_quantize_rmsnorm_transposed(x, rstd, w, amax, E4M3),
                fp8_quantize_rmsnorm_torch(x, rstd, w, amax, E4M3))


def test_bad_arguments_are_named():
    x, rstd, w, _, amax = _norm_inputs(8, 32, torch.bfloat16)
    cases = [((x, rstd[:4], w, amax, E4M3), "rstd"), ((x, rstd.double(), w, amax, E4M3), "rstd"),
             ((x, rstd, w[:16], amax, E4M3), "weight"), ((x, rstd, w.float(), amax, E4M3), "weight"),
             ((x.t(), rstd, w, amax, E4M3), "x"), ((x, rstd, w, amax, torch.bfloat16), "dtype"),
             ((x[0], rstd, w, amax, E4M3), "2-D")]
    for args, word in cases:
        with pytest.raises((ValueError, TypeError), match=word):
            fp8_quantize_rmsnorm_torch(*args)


@interp_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_interp_kernel_equals_norm_then_quantize_kernel(dtype):
    """Against the quantize kernel run on the norm's output: the interpreter's fp32 -> FP8 cast mis-rounds near binade
    edges (tests/numerics/test_fp8.py), the same way in both kernels, so this isolates the norm's arithmetic and
    rounding, the indexing and the masks (the GPU test compares with the twin). Shapes that do not divide the tiles
    (64 x 256), one row, and a row stride wider than the row."""
    from qtrain.kernels.fp8_quant import fp8_quantize_triton

    for M, N in ((1, 16), (37, 96), (70, 272)):
        x, rstd, w, h, amax = _norm_inputs(M, N, dtype, seed=M)
        for fp8 in (E4M3, E5M2):
            assert same(fp8_quantize_rmsnorm_triton(x, rstd, w, amax, fp8),
                        fp8_quantize_triton(h, fp8, amax, transpose=True)), (M, N, fp8)
    wide = torch.zeros(37, 128, dtype=dtype)
    x, rstd, w, h, amax = _norm_inputs(37, 96, dtype)
    wide[:, :96] = x
    assert same(fp8_quantize_rmsnorm_triton(wide[:, :96], rstd, w, amax, E4M3),
                fp8_quantize_triton(h, E4M3, amax, transpose=True))


def test_kernel_builds_for_hopper():
    """The kernel compiles for sm_90 as launched on the GPU (bf16 x and gain read natively, the hardware's rounding,
    e4m3 codes and their transpose)."""
    pytest.importorskip("triton")
    import qtrain.kernels.fp8_quant as fq
    from tests.triton_interp import compile_for_hopper
    sig = {"x_ptr": "*bf16", "rstd_ptr": "*fp32", "w_ptr": "*bf16", "q_ptr": "*fp8e4nv", "qt_ptr": "*fp8e4nv",
           "amax_ptr": "*fp32", "inv_scale_ptr": "*fp32", "M": "i32", "N": "i32", "stride_xm": "i32"}
    const = {"KIND": 1, "LOAD_KIND": 0, "NATIVE": True, "FMAX": 448.0, "AMAX_FLOOR": fq.AMAX_FLOOR,
             "BLOCK_M": fq.QUANT_BLOCK_M, "BLOCK_N": fq.QUANT_BLOCK_N}
    ptx = compile_for_hopper(fq._quantize_rmsnorm_kernel, sig, const, num_warps=fq.QUANT_WARPS)
    assert "e4m3" in ptx and ptx.count("st.global") > 1


@pytest.mark.gpu
@needs_cuda
def test_gpu_kernel_equals_twin():
    """bf16 (what FP8 training runs) at a 1.5B-like shape and an odd one; native loads and hardware rounding."""
    for M, N in ((4096, 1536), (333, 400)):
        x, rstd, w, _, amax = _norm_inputs(M, N, torch.bfloat16, "cuda", seed=N)
        for fp8 in (E4M3, E5M2):
            assert same(fp8_quantize_rmsnorm_transposed(x, rstd, w, amax, fp8),
                        fp8_quantize_rmsnorm_torch(x, rstd, w, amax, fp8)), (M, N, fp8)
