"""MoE token permutation (qtrain/kernels/moe_permute.py): the expert order, the twins against naive loops, the
autograd entries against autograd through plain indexing, and Triton against the twins (interpreter on the CPU,
and the GPU).

Tolerances: permute and the weighted gradient of ys are copies or one product per element: exact. The k-sum of
unpermute and the dot products of d(weights) run in fp32 in a fixed order in the twin; the naive loops and
autograd's reference sum in other orders, so fp32 results agree to a few ulps (rtol 1e-6 on values of order 1,
atol 1e-6 for sums of k or C terms that cancel). Triton against the twin: the same fp32 operations, but the dot is
a tree reduction in the kernel and a sequential-ish one in torch, and the GPU may fuse a multiply-add: fp32 rtol
1e-6, bf16 one unit in the last place (2^-7 relative) for the rounded outputs.
"""
from __future__ import annotations

import pytest
import torch

from tests.triton_interp import compile_for_hopper, interp_only, interpreter_subprocess_test, needs_cuda
from qtrain.kernels import dispatch
from qtrain.kernels import moe_permute as mp

test_interpreter_subprocess = interpreter_subprocess_test(__file__)


def _routing(n: int, k: int, e: int, seed: int = 0, dead: tuple[int, ...] = ()) -> torch.Tensor:
    """(n, k) distinct expert ids per token, never one of `dead` (experts that get no token)."""
    g = torch.Generator().manual_seed(seed)
    live = torch.tensor([i for i in range(e) if i not in dead])
    rows = [live[torch.randperm(live.numel(), generator=g)[:k]] for _ in range(n)]
    return torch.stack(rows) if rows else torch.zeros(0, k, dtype=torch.long)


def _tensors(n, k, c, dtype, device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, generator=g).to(dtype).to(device)
    ys = torch.randn(n * k, c, generator=g).to(dtype).to(device)
    w = torch.rand(n, k, generator=g).to(device)
    dout = torch.randn(n, c, generator=g).to(dtype).to(device)
    return x, ys, w, dout


def test_sort_by_expert_orders_slots_stably():
    ids = _routing(9, 3, 6, dead=(2,))
    plan = mp.sort_by_expert(ids, 6)
    flat = ids.reshape(-1)
    assert torch.equal(plan.counts, torch.bincount(flat, minlength=6)) and plan.counts[2] == 0
    assert plan.offsets.dtype == torch.int32 and torch.equal(plan.offsets.long(), plan.counts.cumsum(0))
    assert torch.equal(flat[plan.order], flat.sort(stable=True).values)  # rows grouped by expert
    for e in range(6):  # within an expert, slots (so tokens) ascend
        rows = plan.order[plan.offsets[e] - plan.counts[e]:plan.offsets[e]]
        assert torch.equal(rows, rows.sort().values)
    assert torch.equal(plan.inverse[plan.order], torch.arange(flat.numel()))
    assert plan.topk == 3


def test_twins_match_naive_loops():
    n, k, c = 7, 3, 10
    plan = mp.sort_by_expert(_routing(n, k, 5, dead=(4,)), 5)
    x, ys, w, dout = _tensors(n, k, c, torch.float32)
    order, inverse = plan.order.tolist(), plan.inverse.tolist()

    xs = mp.permute_twin(x, plan.order, k)
    assert torch.equal(xs, torch.stack([x[s // k] for s in order]))

    for weights in (w, None):
        want = torch.stack([sum((w[t, j] if weights is not None else 1.0) * ys[inverse[t * k + j]] for j in range(k))
                            for t in range(n)])
        torch.testing.assert_close(mp.unpermute_twin(ys, plan.inverse, k, weights), want, rtol=1e-6, atol=1e-6)

    dys, dw = mp.unpermute_backward_twin(dout, ys, plan.order, w)
    want_dys = torch.stack([w.view(-1)[s] * dout[s // k] for s in order])
    want_dw = torch.zeros(n * k)
    for i, s in enumerate(order):
        want_dw[s] = (dout[s // k] * ys[i]).sum()
    assert torch.equal(dys, want_dys)
    torch.testing.assert_close(dw, want_dw.view(n, k), rtol=1e-6, atol=1e-6)


def test_autograd_entries_match_autograd_through_indexing():
    """permute_tokens -> (some per-row op) -> unpermute_tokens: output and the gradients of x, the rows and the
    weights equal autograd through plain index_select / multiply / sum."""
    n, k, c = 6, 2, 8
    plan = mp.sort_by_expert(_routing(n, k, 4, seed=3), 4)
    x, _, w, dout = _tensors(n, k, c, torch.float32, seed=4)
    scale = torch.linspace(0.5, 2.0, n * k)[:, None]  # a per-row op between the two, so rows differ

    def run(permute, unpermute):
        xa, wa = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out = unpermute(permute(xa) * scale, wa)
        out.backward(dout)
        return out, xa.grad, wa.grad

    got = run(lambda t: mp.permute_tokens(t, plan), lambda ys, wa: mp.unpermute_tokens(ys, wa, plan))
    want = run(lambda t: t.index_select(0, plan.order // k),
               lambda ys, wa: (ys.index_select(0, plan.inverse).view(n, k, c) * wa[..., None]).sum(1))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_bad_inputs_are_refused():
    plan = mp.sort_by_expert(_routing(4, 2, 3), 3)
    x, ys, w, dout = _tensors(4, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="contiguous"):
        mp.permute_twin(x.t().contiguous().t(), plan.order, 2)
    with pytest.raises(ValueError, match="int64 index of 12"):
        mp.permute_twin(x, plan.order, 3)
    with pytest.raises(ValueError, match="fp32"):
        mp.unpermute_twin(ys, plan.inverse, 2, w.double())
    with pytest.raises(ValueError, match="dout"):
        mp.unpermute_backward_twin(dout[:3], ys, plan.order, w)


# ---------------------------------------------------------------------------------- Triton vs twin
F32, BF16 = torch.float32, torch.bfloat16
CASES = [  # (N, k, E, C, dead experts, block_c, dtypes); small: the interpreter runs each program in Python
    (5, 3, 5, 40, (1,), 16, (F32, BF16)),  # C spans three tiles, the last partial; an expert without a token
    (4, 1, 4, 24, (), 1024, (F32,)),       # top-1, one partial tile
    (3, 8, 12, 36, (0, 11), 32, (F32,)),   # top-8 (Qwen3-MoE, OLMoE)
    (0, 2, 4, 16, (), 16, (F32,)),         # no tokens at all
]


def _check_triton_vs_twin(device, cases=CASES):
    for n, k, e, c, dead, block_c, dtypes in cases:
        plan = mp.sort_by_expert(_routing(n, k, e, dead=dead).to(device), e)
        for dtype in dtypes:
            x, ys, w, dout = _tensors(n, k, c, dtype, device, seed=n + k)
            tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2.0**-7, atol=1e-3)
            assert torch.equal(mp.permute_triton(x, plan.order, k, block_c=block_c), mp.permute_twin(x, plan.order, k))
            for weights in (w, None):
                got = mp.unpermute_triton(ys, plan.inverse, k, weights, block_c=block_c)
                torch.testing.assert_close(got, mp.unpermute_twin(ys, plan.inverse, k, weights), **tol)
            dys, dw = mp.unpermute_backward_triton(dout, ys, plan.order, w, block_c=block_c)
            want_dys, want_dw = mp.unpermute_backward_twin(dout, ys, plan.order, w)
            torch.testing.assert_close(dys, want_dys, **tol)
            torch.testing.assert_close(dw, want_dw, rtol=1e-5, atol=1e-5)  # fp32 dots of C bf16/fp32 products


@interp_only
def test_interp_triton_matches_twin():
    _check_triton_vs_twin("cpu")


@interp_only
def test_interp_ops_dispatch_to_triton():
    """The custom ops with the Triton backend forced run the kernels and agree with the autograd reference."""
    plan = mp.sort_by_expert(_routing(3, 2, 3, seed=7), 3)
    x, _, w, dout = _tensors(3, 2, 12, torch.float32, seed=8)
    with dispatch.backend("triton"):
        xa, wa = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        mp.unpermute_tokens(mp.permute_tokens(xa, plan), wa, plan).backward(dout)
    # out[t] = sum_j w[t, j] x[t]: d x = dout * sum_j w, d w[t, j] = <dout[t], x[t]>
    torch.testing.assert_close(xa.grad, dout * w.sum(1, keepdim=True), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(wa.grad, (dout * x).sum(1, keepdim=True).expand(3, 2), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not dispatch.HAS_TRITON, reason="no triton")
def test_kernels_build_for_hopper():
    """Both kernels compile for sm_90 in their bf16 launch forms (int16 pointers): the interpreter never compiles."""
    common = {"order_ptr": "*i64", "w_ptr": "*fp32", "C": "i32"}
    compile_for_hopper(mp._permute_kernel, {**common, "src_ptr": "*i16", "dst_ptr": "*i16", "ys_ptr": "*i16",
                                            "dw_ptr": "*fp32"},
                       {"TOPK": 8, "KIND": 1, "BACKWARD": True, "BLOCK_C": mp.BLOCK_C}, num_warps=mp.NUM_WARPS)
    compile_for_hopper(mp._unpermute_kernel, {"src_ptr": "*i16", "inv_ptr": "*i64", "w_ptr": "*fp32",
                                              "dst_ptr": "*i16", "C": "i32"},
                       {"TOPK": 8, "KIND": 1, "WEIGHTED": True, "BLOCK_C": mp.BLOCK_C}, num_warps=mp.NUM_WARPS)


@pytest.mark.gpu
@needs_cuda
def test_gpu_triton_matches_twin():
    _check_triton_vs_twin("cuda", [case[:-1] + ((F32, BF16),) for case in CASES])
    n, k, e, c = 8192, 8, 128, 2048  # Qwen3-30B-A3B's routing at 8k tokens
    plan = mp.sort_by_expert(_routing(n, k, e, dead=(5,)).cuda(), e)
    x, ys, w, dout = _tensors(n, k, c, torch.bfloat16, "cuda")
    assert torch.equal(mp.permute(x, plan.order, k), mp.permute_twin(x, plan.order, k))
    torch.testing.assert_close(mp.unpermute(ys, plan.inverse, k, w), mp.unpermute_twin(ys, plan.inverse, k, w),
                               rtol=2.0**-7, atol=1e-3)
    got, want = mp.unpermute_backward(dout, ys, plan.order, w), mp.unpermute_backward_twin(dout, ys, plan.order, w)
    torch.testing.assert_close(got[0], want[0], rtol=2.0**-7, atol=1e-3)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-3)
