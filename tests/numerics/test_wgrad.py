"""Weight-gradient GEMMs split along the token reduction (numerics/wgrad.py): the rule, the slice bounds, and that
a split gradient is the unsplit one up to fp32 summation order, for bf16 (through autograd, bias included) and FP8.

Tolerances: the split sums the same fp32 products in another order; with M <= 512 terms per output the two fp32
sums differ by a few fp32 ulps of the largest partial sum (~1e-6 relative), far below the one rounding both then
take to bf16 (2^-9 relative): outputs may differ by one bf16 ulp where the sum lands near a rounding boundary,
so the bars are 1 bf16 ulp per element (2^-8 relative to the element) and 1e-3 norm-wise; a wrong slice (a slice
counted twice or missed) moves the norm-wise error by > 10%.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qtrain.numerics.fp8 import quantize_fp8, scaled_mm, wgrad_scaled_mm
from qtrain.numerics.wgrad import MAX_SPLITS, split_bounds, split_wgrad_linear, wgrad_splits

CUDA = torch.cuda.is_available()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_rule_splits_only_small_outputs_on_cuda_with_long_reductions():
    assert wgrad_splits(1536, 1536, 65536, "cpu") == 1  # never off CUDA
    assert wgrad_splits(1536, 1536, 65536, "cuda") > 1  # 1.5B's O projection: 72 tiles
    assert wgrad_splits(17920, 1536, 65536, "cuda") == 1  # 1.5B's up projection: 840 tiles
    assert wgrad_splits(1536, 1536, 8192, "cuda") == 1  # slices would be shorter than MIN_SLICE
    assert all(wgrad_splits(n, n, m, "cuda") <= MAX_SPLITS for n in (64, 896, 1536) for m in (2**16, 2**20))


@pytest.mark.parametrize("m,s", [(65536, 2), (65536, 4), (1000, 3), (48, 2)])
def test_split_bounds_cover_the_rows_in_aligned_slices(m, s):
    b = split_bounds(m, s)
    assert b[0] == 0 and b[-1] == m and len(b) == s + 1
    assert all(lo <= hi for lo, hi in zip(b, b[1:]))
    assert all(x % 16 == 0 for x in b[1:-1])


@pytest.mark.parametrize("s", [2, 4])
def test_bf16_split_linear_gradients_equal_autograd_linear(s):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, 96, generator=g).to(torch.bfloat16)
    w = (torch.randn(80, 96, generator=g) * 0.1).to(torch.bfloat16)
    b = torch.randn(80, generator=g).to(torch.bfloat16)
    dy = torch.randn(4, 64, 80, generator=g).to(torch.bfloat16)
    grads = []
    for fn in (lambda *a: F.linear(*a), lambda *a: split_wgrad_linear(*a, splits=s)):
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
        y = fn(xs, ws, bs)
        y.backward(dy)
        grads.append((y.detach(), xs.grad, ws.grad, bs.grad))
    (y0, dx0, dw0, db0), (y1, dx1, dw1, db1) = grads
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1) and torch.equal(db0, db1)
    # dW: the CPU's bf16 mm rounds through its own path; the split rounds once from the fp32 sum
    exact = (dy.reshape(-1, 80).double().t() @ x.reshape(-1, 96).double())
    assert rel(dw1, exact) <= 2.0**-8 and rel(dw0, exact) <= 2.0**-8
    assert ((dw1.double() - exact).abs() <= exact.abs() * 2.0**-8 + 1e-30).all()


def test_bf16_split_linear_runs_plain_linear_without_a_split_or_grad():
    x, w = torch.randn(32, 16), torch.randn(8, 16, requires_grad=True)
    assert split_wgrad_linear(x, w, splits=1).grad_fn.name().startswith(("Mm", "Addmm", "Linear", "View", "Unsafe"))
    with torch.no_grad():
        assert split_wgrad_linear(x, w, splits=4).grad_fn is None


@pytest.mark.parametrize("s", [2, 3, 4])
def test_fp8_split_wgrad_equals_one_gemm_up_to_summation_order(s):
    g = torch.Generator().manual_seed(1)
    dy = torch.randn(512, 48, generator=g)
    x = torch.randn(512, 64, generator=g)
    (dq, di), (xq, xi) = quantize_fp8(dy), quantize_fp8(x)
    dqt, xqt = dq.t().contiguous(), xq.t().contiguous()
    one = scaled_mm(dqt, xqt.t(), di, xi, out_dtype=torch.float32)
    split = wgrad_scaled_mm(dqt, xqt, di, xi, torch.float32, splits=s)
    assert rel(split, one) < 1e-5
    bf = wgrad_scaled_mm(dqt, xqt, di, xi, torch.bfloat16, splits=s)
    assert bf.dtype == torch.bfloat16 and ((bf.float() - one).abs() <= one.abs() * 2.0**-8 + 1e-30).all()
    # a missing or doubled slice is caught: the bar above is far below one slice's share
    assert rel(scaled_mm(dqt[:, 16:], xqt[:, 16:].t(), di, xi, out_dtype=torch.float32), one) > 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("n,k", [(1536, 1536), (2048, 1536), (896, 896)])
def test_gpu_split_wgrads_match_one_gemm(n, k):
    """On the H200: bf16 (bmm with fp32 out) and e4m3 (scaled_mm per slice) splits at Qwen2.5's small
    projections against one cuBLAS GEMM: 1 bf16 ulp per element from the two fp32 sums' different orders."""
    g = torch.Generator(device="cuda").manual_seed(0)
    m = 16384
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    one = (dy.t() @ x).float()
    for s in (2, 4):
        xs = x.clone().requires_grad_()
        split_wgrad_linear(xs, w, splits=s).backward(dy)
        assert ((w.grad.float() - one).abs() <= one.abs() * 2.0**-7).all() and rel(w.grad, one) < 1e-3
        w.grad = None
    (dq, di), (xq, xi) = quantize_fp8(dy), quantize_fp8(x)
    dqt, xqt = dq.t().contiguous(), xq.t().contiguous()
    ref = scaled_mm(dqt, xqt.t(), di, xi, out_dtype=torch.float32)
    for s in (2, 4):
        got = wgrad_scaled_mm(dqt, xqt, di, xi, torch.float32, splits=s)
        assert rel(got, ref) < 1e-5


def test_bf16_split_linear_compiles_to_the_eager_gradients():
    """The blocks are torch.compile'd: the Function's backward traced by dynamo gives eager's gradients."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 32, 48, generator=g).to(torch.bfloat16)
    w = (torch.randn(64, 48, generator=g) * 0.1).to(torch.bfloat16)
    dy = torch.randn(2, 32, 64, generator=g).to(torch.bfloat16)
    fn = lambda a, b: split_wgrad_linear(a, b, splits=2)  # noqa: E731
    out = []
    for f in (fn, torch.compile(fn, dynamic=False)):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        f(xs, ws).backward(dy)
        out.append((xs.grad, ws.grad))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
