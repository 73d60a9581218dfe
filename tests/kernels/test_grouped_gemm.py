"""Grouped expert GEMMs (qtrain/kernels/grouped_gemm.py): the twins against per-expert F.linear, the autograd
entry against autograd through a loop, empty experts, the exact torch._grouped_mm call forms (on the CPU in fp32,
where torch has a kernel for them too), and the CUDA fast path against the twin on the GPU.

Tolerances: fp32 on the CPU, the same per-group products as the references up to GEMM blocking: rtol 1e-6 on
values of order 1 (atol 1e-5 for sums of up to 40 products that cancel). On the GPU, bf16 outputs rounded once
from fp32 accumulators against an fp32 reference: a bf16 ulp (2^-8 relative) plus an absolute floor of
2^-8 x the output scale for entries that cancel.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.triton_interp import needs_cuda
from qtrain.kernels import grouped_gemm as gg

TOL = dict(rtol=1e-6, atol=1e-5)


def _problem(counts, k, n, device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = sum(counts)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    w = (torch.randn(len(counts), n, k, generator=g) / k**0.5).to(dtype).to(device)
    dy = torch.randn(m, n, generator=g).to(dtype).to(device)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32).to(device)
    return x, w, dy, offsets


def _groups(counts):
    ends = torch.tensor(counts).cumsum(0).tolist()
    return list(zip([0] + ends[:-1], ends))


COUNTS = [0, 3, 5, 0, 1, 4, 0]  # empty experts first, in the middle and last


def test_twins_match_per_expert_linear():
    x, w, dy, offsets = _problem(COUNTS, 16, 24)
    y = gg.grouped_linear_twin(x, w, offsets)
    dx = gg.grouped_linear_twin(dy, w.transpose(1, 2), offsets)
    dw = gg.grouped_weight_grad_twin(dy, x, offsets)
    for g, (a, b) in enumerate(_groups(COUNTS)):
        torch.testing.assert_close(y[a:b], F.linear(x[a:b], w[g]), **TOL)
        torch.testing.assert_close(dx[a:b], dy[a:b] @ w[g], **TOL)
        torch.testing.assert_close(dw[g], dy[a:b].t() @ x[a:b], **TOL)
        if a == b:
            assert torch.equal(dw[g], torch.zeros_like(dw[g]))


def test_expert_linear_gradients_match_a_loop():
    x, w, dy, offsets = _problem(COUNTS, 16, 24, seed=1)
    xa, wa = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    gg.expert_linear(xa, wa, offsets).backward(dy)
    xb, wb = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    torch.cat([F.linear(xb[a:b], wb[g]) for g, (a, b) in enumerate(_groups(COUNTS))]).backward(dy)
    torch.testing.assert_close(xa.grad, xb.grad, **TOL)
    torch.testing.assert_close(wa.grad, wb.grad, **TOL)
    for g in (0, 3, 6):  # no rows: an exact zero gradient, not a NaN
        assert torch.equal(wa.grad[g], torch.zeros_like(wa.grad[g]))


def _saved_by_expert_linear(x, w, offsets):
    """Bytes one expert_linear call saves for backward (its operands' storages, counted once each)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = gg.expert_linear(x, w, offsets)
    return y, sum(seen.values())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])])
def test_expert_linear_keeps_its_input_only_for_the_weight_gradient(device):
    """Frozen experts (LoRA): the input is not kept, only the weight (for dx) and the offsets; dx is bitwise the one
    with learning experts, which keep the input too. On the GPU through torch._grouped_mm, on the CPU the twin."""
    if device == "cuda":
        x, w, dy, offsets = _gpu_case([0, 40, 24, 64], 128, 256, seed=4)
    else:
        x, w, dy, offsets = _problem(COUNTS, 16, 24, seed=4)
    kept = {}
    for trains in (True, False):
        xa, wa = x.clone().requires_grad_(True), w.clone().requires_grad_(trains)
        y, kept[trains] = _saved_by_expert_linear(xa, wa, offsets)
        y.backward(dy)
        kept[trains, "dx"] = xa.grad
    assert kept[True] == x.nbytes + w.nbytes + offsets.nbytes
    assert kept[False] == w.nbytes + offsets.nbytes
    assert torch.equal(kept[True, "dx"], kept[False, "dx"])
    xa, wa = x.clone(), w.clone().requires_grad_(True)  # a fixed input: only the weight's gradient, no weight kept
    assert _saved_by_expert_linear(xa, wa, offsets)[1] == x.nbytes + offsets.nbytes


def test_no_rows_at_all():
    x, w, dy, offsets = _problem([0, 0, 0], 8, 8)
    xa, wa = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = gg.expert_linear(xa, wa, offsets)
    assert y.shape == (0, 8)
    y.backward(dy)
    assert xa.grad.shape == (0, 8) and torch.equal(wa.grad, torch.zeros_like(w))


def test_grouped_mm_call_forms_on_cpu():
    """The fast path's exact torch._grouped_mm calls (w^T as a view; the k-grouped weight gradient with dy^T as a
    column-major view) give the twins' results: the layouts are right. torch runs them on the CPU in fp32."""
    x, w, dy, offsets = _problem(COUNTS, 16, 24, seed=2)
    torch.testing.assert_close(gg._grouped_mm_linear(x, w, offsets), gg.grouped_linear_twin(x, w, offsets), **TOL)
    torch.testing.assert_close(gg._grouped_mm_linear(dy, w.transpose(1, 2), offsets),
                               gg.grouped_linear_twin(dy, w.transpose(1, 2), offsets), **TOL)
    torch.testing.assert_close(gg._grouped_mm_weight_grad(dy, x, offsets),
                               gg.grouped_weight_grad_twin(dy, x, offsets), **TOL)


def test_bad_shapes_are_refused():
    x, w, dy, offsets = _problem([2, 3], 8, 8)
    with pytest.raises(ValueError, match="w \\(G, N, K\\)"):
        gg.grouped_linear_twin(x, w[:, :, :4], offsets)
    with pytest.raises(ValueError, match="int32"):
        gg.grouped_linear_twin(x, w, offsets.long())
    with pytest.raises(ValueError, match="dy \\(M, N\\)"):
        gg.grouped_weight_grad_twin(dy[:3], x, offsets)


def test_fast_path_needs_cuda_bf16():
    x, w, _, _ = _problem([2, 3], 8, 8)
    assert not gg._fast_path_ok(x, w)  # CPU: the twin


# --------------------------------------------------------------------------------- GPU
def _gpu_case(counts, k, n, seed):
    x, w, dy, offsets = _problem(counts, k, n, "cuda", torch.bfloat16, seed)
    assert gg._fast_path_ok(x, w) and gg._fast_path_ok(dy, x) and gg._fast_path_ok(dy, w.transpose(1, 2))
    return x, w, dy, offsets


def _close_bf16(got, want):
    scale = want.abs().max().item() if want.numel() else 1.0
    torch.testing.assert_close(got.float(), want.float(), rtol=2.0**-8, atol=2.0**-8 * scale)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("counts", [
    [0, 37, 1, 0, 250, 7, 0, 13],  # group sizes not multiples of 8, empty groups first, inside and last
    [512] * 16,
])
def test_gpu_grouped_mm_matches_fp32_twin(counts):
    x, w, dy, offsets = _gpu_case(counts, 256, 384, seed=len(counts))
    xf, wf, dyf = x.float(), w.float(), dy.float()
    xa, wa = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = gg.expert_linear(xa, wa, offsets)
    y.backward(dy)
    _close_bf16(y, gg.grouped_linear_twin(xf, wf, offsets))
    _close_bf16(xa.grad, gg.grouped_linear_twin(dyf, wf.transpose(1, 2), offsets))
    _close_bf16(wa.grad, gg.grouped_weight_grad_twin(dyf, xf, offsets))
    for g, c in enumerate(counts):
        if c == 0:
            assert torch.equal(wa.grad[g], torch.zeros_like(wa.grad[g])), f"expert {g} has no rows"
    assert torch.isfinite(wa.grad).all() and torch.isfinite(xa.grad).all()


@pytest.mark.gpu
@needs_cuda
def test_gpu_compiled_graph_keeps_the_op():
    """Under torch.compile the ops are opaque (no graph break from the twin's host loop): gradients equal eager."""
    x, w, dy, offsets = _gpu_case([0, 40, 24, 64], 128, 256, seed=3)
    fn = torch.compile(lambda a, b: gg.expert_linear(a, b, offsets), fullgraph=True)
    xa, wa = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    xb, wb = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    fn(xa, wa).backward(dy)
    gg.expert_linear(xb, wb, offsets).backward(dy)
    assert torch.equal(xa.grad, xb.grad) and torch.equal(wa.grad, wb.grad)
