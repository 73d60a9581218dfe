"""FP8 expert GEMMs (qtrain/kernels/grouped_gemm_fp8.py): row-wise quantization is qtrain's per-tensor recipe applied
per row, the twin is the dequantized matmul, the autograd entry's gradients are the dequantized operands' products,
its error against the model-dtype grouped GEMM is within e4m3's rounding, empty experts get exact zero gradients,
CUDA's shape rules are checked on the CPU; on the GPU the torch._scaled_grouped_mm path against the twin.

Tolerances.
- Twin against dequantize-then-matmul (fp32): the same products, summed in fp32 and scaled before or after the sum:
  a few fp32 ulps of the largest partial sum, rtol 1e-5 with atol 1e-5 x the output scale.
- Exactly representable inputs (e4m3 values times a power of two, each row's and column's abs-max 448 times that
  power, so every row-wise quantization is exact): the FP8 path computes the fp32 products exactly: rtol 1e-6.
- Against the model-dtype GEMM on random inputs: e4m3 keeps 3 mantissa bits, so a round-to-nearest element is off by
  at most 2^-4 of itself, and a row-scaled Gaussian value is (almost never) subnormal. The rounding errors of a
  product's two operands are independent and sum incoherently over the contraction like the products themselves,
  so the output's relative error in norm is that of one product: at most 2^-4 + 2^-4 for the forward and the input
  gradient (two quantized operands), 2^-4 for the weight gradient (x only); measured here 0.034 and 0.024 (the
  rms of a uniform rounding error within a binade, ~2^-4 / sqrt(3) per operand). The test asserts the norm-wise
  bound 2^-4 for one operand and 2^-4 * sqrt(2) for two (the rms of two independent errors each at most 2^-4).
- GPU, the CUDA GEMM against the twin on the same e4m3 operands: both sum exact products; the forward's fast
  accumulation and the bf16 output round: a bf16 ulp (2^-8) relative plus 2^-8 x the output scale absolute, doubled
  for the fast accumulator (Hopper's FP8 MMA accumulates in reduced precision between promotions).
"""
from __future__ import annotations

import pytest
import torch

from tests.triton_interp import needs_cuda
from qtrain.kernels import dispatch
from qtrain.kernels import grouped_gemm_fp8 as gf
from qtrain.kernels.fp8_quant import E4M3, fp8_quantize_torch, quantize_fp8_rowwise
from qtrain.kernels.grouped_gemm import expert_linear
from tests.kernels.test_grouped_gemm import _groups, _problem  # one problem maker for both GEMMs' tests

COUNTS = [0, 3, 5, 0, 1, 40, 0]  # empty experts first, in the middle and last; one large group




def _deq(t):
    q, inv = quantize_fp8_rowwise(t)
    return q.float() * inv.unsqueeze(-1)


def _rel(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def test_rowwise_quantization_is_the_per_tensor_recipe_per_row():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(24, 48, generator=g) * torch.rand(24, 1, generator=g) * 100).to(dtype)
        x[3] = 0  # an all-zero row: zeros and a finite scale
        q, inv = quantize_fp8_rowwise(x)
        assert q.dtype == E4M3 and inv.dtype == torch.float32 and inv.shape == (24,)
        for r in range(24):
            qr, _, ir = fp8_quantize_torch(x[r])
            assert torch.equal(q[r].view(torch.uint8), qr.view(torch.uint8)) and torch.equal(inv[r], ir), r
        assert torch.isfinite(inv).all() and not q[3].float().any()
    w = torch.randn(3, 16, 32, generator=g)
    qt, inv_t = quantize_fp8_rowwise(w.transpose(1, 2))  # the input gradient's per-column weight scales
    assert qt.is_contiguous() and qt.shape == (3, 32, 16) and inv_t.shape == (3, 32)


def test_twin_is_the_dequantized_matmul():
    x, w, _, offsets = _problem(COUNTS, 32, 48)
    xq, x_inv = quantize_fp8_rowwise(x)
    wq, w_inv = quantize_fp8_rowwise(w)
    y = gf.fp8_grouped_linear(xq, x_inv, wq, w_inv, offsets, torch.float32, True)
    for g, (a, b) in enumerate(_groups(COUNTS)):
        want = (xq[a:b].float() * x_inv[a:b, None]) @ (wq[g].float() * w_inv[g][:, None]).t()
        torch.testing.assert_close(y[a:b], want, rtol=1e-5, atol=1e-5 * max(1.0, want.abs().max().item() if b > a
                                                                           else 1.0))


def _representable(shape, gen, scale):
    """e4m3 values whose every last-dim row and every second-to-last column holds +-448: each row-wise quantization
    (either orientation) of them times `scale` (a power of two) is exact."""
    v = (torch.randn(shape, generator=gen) * 100).clamp(-448, 448).to(E4M3).float()
    rows, cols = shape[-2], shape[-1]
    for i in range(max(rows, cols)):
        v[..., i % rows, i % cols] = 448.0 if i % 2 else -448.0
    return v * scale


def test_gradients_are_the_dequantized_products():
    """On exactly representable operands every quantization is exact: the FP8 path's output and both gradients equal
    fp32 autograd of x w^T per expert (what 'the dequantized matmul' is there)."""
    gen = torch.Generator().manual_seed(3)
    counts = [0, 16, 5, 0, 21]
    m, k, n = sum(counts), 32, 48
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    x = _representable((m, k), gen, 2.0**-9).requires_grad_(True)
    w = _representable((len(counts), n, k), gen, 2.0**-12)
    w = w.requires_grad_(True)
    dy = _representable((m, n), gen, 2.0**-5)
    y = gf.fp8_expert_linear(x, w, offsets)
    y.backward(dy)
    xr, wr = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    torch.cat([xr[a:b] @ wr[g].t() for g, (a, b) in enumerate(_groups(counts))]).backward(dy)
    tol = dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y, torch.cat([xr[a:b] @ wr[g].t() for g, (a, b) in enumerate(_groups(counts))]),
                               **tol)
    torch.testing.assert_close(x.grad, xr.grad, **tol)
    torch.testing.assert_close(w.grad, wr.grad, **tol)


def test_gradients_on_random_inputs_are_the_quantized_operands_products():
    """Random operands: dx = Qr(dy) Qr(w^T)^T per expert, dw = dy^T Qr(x) (the dequantized saved input), in fp32."""
    x, w, dy, offsets = _problem(COUNTS, 32, 48, seed=5)
    xa, wa = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    gf.fp8_expert_linear(xa, wa, offsets).backward(dy)
    xh, dyh = _deq(x), _deq(dy)
    for g, (a, b) in enumerate(_groups(COUNTS)):
        wth = _deq(w[g].t())  # (K, N): a scale per input column of w
        torch.testing.assert_close(xa.grad[a:b], dyh[a:b] @ wth.t(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(wa.grad[g], dy[a:b].t() @ xh[a:b], rtol=1e-5, atol=1e-5)


def test_close_to_the_model_dtype_gemm_within_e4m3_rounding():
    x, w, dy, offsets = _problem([64, 0, 200, 17, 95], 256, 128, seed=7)
    xa, wa = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = gf.fp8_expert_linear(xa, wa, offsets)
    y.backward(dy)
    xb, wb = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    yb = expert_linear(xb, wb, offsets)
    yb.backward(dy)
    two, one = 2.0**-4 * 2**0.5, 2.0**-4  # module docstring: two quantized operands, one
    assert _rel(y, yb) < two and _rel(xa.grad, xb.grad) < two and _rel(wa.grad, wb.grad) < one, \
        (_rel(y, yb), _rel(xa.grad, xb.grad), _rel(wa.grad, wb.grad))


def test_experts_without_rows_get_zero_gradient_and_nothing_is_nan():
    x, w, dy, offsets = _problem(COUNTS, 16, 32, seed=2)
    xa, wa = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    gf.fp8_expert_linear(xa, wa, offsets).backward(dy)
    for g, (a, b) in enumerate(_groups(COUNTS)):
        if a == b:
            assert torch.equal(wa.grad[g], torch.zeros_like(wa.grad[g]))
    assert torch.isfinite(xa.grad).all() and torch.isfinite(wa.grad).all()
    empty = torch.zeros(0, 16, requires_grad=True)  # no rows at all (every expert empty)
    wz = w.clone().requires_grad_(True)
    y = gf.fp8_expert_linear(empty, wz, torch.zeros(len(COUNTS), dtype=torch.int32))
    y.sum().backward()
    assert y.shape == (0, 32) and torch.equal(wz.grad, torch.zeros_like(wz.grad)) and empty.grad.shape == (0, 16)


def test_frozen_weight_keeps_no_input():
    """LoRA over frozen experts: the weight needs no gradient, so the function keeps neither e4m3 x nor its scales."""
    x, w, dy, offsets = _problem(COUNTS, 16, 32, seed=4)
    xa = x.clone().requires_grad_(True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        y = gf.fp8_expert_linear(xa, w, offsets)
    assert not any(t.dtype == E4M3 for t in kept) and not any(t.shape == (sum(COUNTS),) for t in kept)
    y.backward(dy)
    assert xa.grad is not None


@pytest.mark.parametrize("k,n", [(24, 32), (32, 40)])
def test_cuda_shape_rules_checked_on_the_cpu(k, n):
    x, w, _, offsets = _problem(COUNTS, k, n)
    with pytest.raises(ValueError, match="multiples of 16"):
        gf.fp8_expert_linear(x, w, offsets)
    xq, x_inv = quantize_fp8_rowwise(x)
    wq, w_inv = quantize_fp8_rowwise(w)
    with pytest.raises(ValueError, match="multiples of 16"):
        gf.fp8_grouped_linear(xq, x_inv, wq, w_inv, offsets, torch.float32, True)


# ------------------------------------------------------------------------------------------------------ GPU
def _close_bf16(got, want, factor=1.0):
    scale = want.abs().max().item() if want.numel() else 1.0
    torch.testing.assert_close(got.float(), want.float(), rtol=factor * 2.0**-8, atol=factor * 2.0**-8 * scale)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("gemm", ["grouped", "per-expert"])
@pytest.mark.parametrize("counts", [
    [0, 37, 1, 0, 250, 7, 0, 13],  # group sizes not multiples of 16, empty groups first, inside and last
    [512] * 16,
])
def test_gpu_scaled_grouped_mm_matches_the_twin(counts, gemm, monkeypatch):
    """Both CUDA forms (`grouped_gemm_fp8.GEMM`): torch._scaled_grouped_mm and one row-wise torch._scaled_mm per
    expert."""
    monkeypatch.setattr(gf, "GEMM", gemm)
    x, w, dy, offsets = _problem(counts, 256, 384, "cuda", torch.bfloat16, seed=len(counts))
    assert gf._fast_path_ok(x, w.shape[0])
    xq, x_inv = quantize_fp8_rowwise(x)
    wq, w_inv = quantize_fp8_rowwise(w)
    for fast in (True, False):
        y = gf.fp8_grouped_linear(xq, x_inv, wq, w_inv, offsets, torch.bfloat16, fast)
        want = gf.fp8_grouped_linear_twin(xq, x_inv, wq, w_inv, offsets, torch.float32)
        _close_bf16(y, want, 2.0 if fast else 1.0)
    # the whole autograd entry against itself with the twin forced: the same quantized values, both GEMM paths
    xa, wa = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ya = gf.fp8_expert_linear(xa, wa, offsets)
    ya.backward(dy)
    xb, wb = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    with dispatch.backend("twin"):
        yb = gf.fp8_expert_linear(xb, wb, offsets)
        yb.backward(dy)
    _close_bf16(ya, yb, 2.0)
    _close_bf16(xa.grad, xb.grad)
    _close_bf16(wa.grad, wb.grad)
    for g, (a, b) in enumerate(_groups(counts)):
        if a == b:
            assert torch.equal(wa.grad[g], torch.zeros_like(wa.grad[g]))


@pytest.mark.gpu
@needs_cuda
def test_gpu_compiled_function_matches_eager():
    x, w, dy, offsets = _problem([0, 40, 24, 64], 128, 256, "cuda", torch.bfloat16, seed=3)
    compiled = torch.compile(gf.fp8_expert_linear, fullgraph=True, dynamic=False)
    xa, wa = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    compiled(xa, wa, offsets).backward(dy)
    xb, wb = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    gf.fp8_expert_linear(xb, wb, offsets).backward(dy)
    # inductor's fused quantization may round a scale differently from eager's division: one e4m3 step at most
    assert _rel(xa.grad, xb.grad) < 2.0**-4 and _rel(wa.grad, wb.grad) < 2.0**-4
