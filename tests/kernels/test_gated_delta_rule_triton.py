"""The gated delta rule's GPU path (kernels/delta_rule/gated_delta_rule_triton.py): the chunked form with its
recurrence over chunks as an op pair. The backward twin is the gradient of the recurrence's forward twin (fp64); the
op pair differentiates as the chunked twin (fp64, the twins inside it on the CPU); the Triton kernels equal the
twins, alone and inside the whole rule, values and every input's gradient (q, k, v, g, beta), with and without
document resets. The Triton tests run under Triton's interpreter in a child pytest (TRITON_INTERPRET=1, fp32:
tests/triton_interp.py) and on a GPU at Qwen3.5-4B's linear-attention shape (bf16, marked gpu).

Tolerances: the kernels and the twin loop compute the same fp32 products over chunks, the sums inside each product
in a different order (rounding ~ sqrt(d) 2^-24 relative per product), carried through a few chunks and, for the
gradients, through the triangular solves' backward: 2e-5 relative in norm against the twin in fp32 (observed: equal
bit for bit under the interpreter, whose products are numpy's). On the GPU the inputs are bf16 and the twin runs in fp32 on the same values: the outputs and gradients
round once to bf16, within 2^-8 relative in norm (one bf16 ulp); the gradients of q and k twice (autograd casts
them to bf16 at the value heads, then sums each key head's two value heads in bf16): within 2^-7.
"""
from __future__ import annotations

import pytest
import torch

from qtrain.kernels import dispatch
from qtrain.kernels.delta_rule import gated_delta_rule, gated_delta_rule_chunked
from qtrain.kernels.delta_rule.gated_delta_rule import CHUNK, chunk_states, chunked_form
from qtrain.kernels.delta_rule.gated_delta_rule_triton import (chunk_states_backward_triton,
                                                               chunk_states_backward_twin, chunk_states_triton,
                                                               gated_delta_rule_triton)
from tests.triton_interp import compile_for_hopper, interp_only, interpreter_subprocess_test, needs_cuda

test_interpreter_subprocess = interpreter_subprocess_test(__file__)

T_RAGGED = 2 * CHUNK + 17  # two full chunks and a ragged tail


def _inputs(B=2, T=T_RAGGED, Hk=2, H=2, dk=32, dv=32, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    ts = (r(B, T, Hk, dk), r(B, T, Hk, dk), r(B, T, H, dv), -torch.rand(B, T, H, generator=g, dtype=torch.float64),
          torch.rand(B, T, H, generator=g, dtype=torch.float64))
    return [t.to(device=device, dtype=dtype) for t in ts]


def _resets(B, T, device="cpu"):
    """Document starts: each row's first token, one inside a chunk, one on a chunk's first token (64), two adjacent
    ones, one in the ragged tail."""
    r = torch.zeros(B, T, dtype=torch.bool)
    r[:, 0] = True
    r[0, [5, 64, 100, 101, T - 7]] = True
    r[1 % B, [30, 130]] = True
    return r.to(device)


def _terms(q, k, v, g, beta, resets=None):
    """The recurrence's inputs (U, W, k_dec, last) as the chunked form computes them for these inputs."""
    seen = []

    def keep(*args):
        seen.append(args)
        return chunk_states(*args)

    chunked_form(q, k, v, g, beta, keep, resets=resets)
    return seen[0][:4]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _grads(fn, args, do, resets):
    args = [a.detach().requires_grad_(True) for a in args]
    o = fn(*args, resets=resets)
    return o, torch.autograd.grad(o, args, do)


@pytest.mark.parametrize("resets", [False, True])
def test_backward_twin_is_the_gradient_of_the_forward_twin(resets):
    q, k, v, g, beta = _inputs()
    terms = [t.requires_grad_(True) for t in _terms(q, k, v, g, beta, _resets(2, T_RAGGED) if resets else None)]
    gen = torch.Generator().manual_seed(1)
    S0 = torch.randn(2, 2, 32, 32, generator=gen, dtype=torch.float64, requires_grad=True)
    Hs, V, Sf = chunk_states(*terms, S0)
    cot = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in (Hs, V, Sf)]
    want = torch.autograd.grad((Hs, V, Sf), (*terms, S0), cot)
    got = chunk_states_backward_twin(*(t.detach() for t in terms), S0.detach(), *cot)
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=1e-10)


@pytest.mark.parametrize("resets", [False, True])
def test_op_pair_differentiates_as_the_chunked_twin(resets):
    """On the CPU the op pair runs the twins: the same values and gradients as autograd through the chunked twin,
    the final state and an initial state's gradient included (fp64)."""
    args = _inputs()
    r = _resets(2, T_RAGGED) if resets else None
    S0 = torch.randn(2, 2, 32, 32, dtype=torch.float64)
    outs = []
    for fn in (gated_delta_rule_chunked, gated_delta_rule_triton):
        xs = [a.clone().requires_grad_(True) for a in (*args, S0)]
        o, S = fn(*xs[:5], initial_state=xs[5], resets=r)
        outs.append((o, S, torch.autograd.grad((o * o).sum() + (S * S).sum(), xs)))
    (o1, s1, g1), (o2, s2, g2) = outs
    assert torch.equal(o1, o2) and torch.equal(s1, s2)
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-10)


def test_op_pair_traces_under_torch_compile():
    """A compiled block keeps the op opaque (its fake shapes and its autograd formula traced, the kernels launched at
    run time): compiled with full graph, values and gradients as eager (fp32, the twins inside on the CPU)."""
    args = _inputs(dtype=torch.float32)
    r = _resets(2, T_RAGGED)
    do = torch.randn(args[2].shape, generator=torch.Generator().manual_seed(2))

    def rule(*a, resets):
        return gated_delta_rule_triton(*a, resets=resets)[0]

    o1, g1 = _grads(rule, args, do, r)
    torch._dynamo.reset()
    o2, g2 = _grads(torch.compile(rule, backend="aot_eager", fullgraph=True), args, do, r)
    assert _rel(o2, o1) <= 1e-6 and all(_rel(a, b) <= 1e-6 for a, b in zip(g2, g1))


@interp_only
@pytest.mark.parametrize("dk,dv", [(32, 32), (48, 16)])  # dk 48: the state's rows padded to a power of two
def test_interp_state_kernels_match_the_twins_fp32(dk, dv):
    q, k, v, g, beta = _inputs(dk=dk, dv=dv, dtype=torch.float32)
    terms = _terms(q, k, v, g, beta, _resets(2, T_RAGGED))
    gen = torch.Generator().manual_seed(1)
    S0 = torch.randn(2, 2, dk, dv, generator=gen)
    want = chunk_states(*terms, S0)
    got = chunk_states_triton(*terms, S0)
    for a, b in zip(got, want):
        assert a.dtype == torch.float32 and a.shape == b.shape and _rel(a, b) <= 2e-5
    cot = [torch.randn(t.shape, generator=gen) for t in want]
    got = chunk_states_backward_triton(*terms, S0, *cot)
    for a, b in zip(got, chunk_states_backward_twin(*terms, S0, *cot)):
        assert a.dtype == torch.float32 and a.shape == b.shape and _rel(a, b) <= 2e-5


@interp_only
@pytest.mark.parametrize("resets", [False, True])
def test_interp_gated_delta_rule_matches_the_twin_fp32(resets):
    """`gated_delta_rule` through its Triton path (forced: CPU tensors under the interpreter) against the chunked
    twin: the output and the gradients of q, k, v, g and beta."""
    args = _inputs(dtype=torch.float32)
    r = _resets(2, T_RAGGED) if resets else None
    do = torch.randn(args[2].shape, generator=torch.Generator().manual_seed(2))
    with dispatch.backend("triton"):
        o, grads = _grads(gated_delta_rule, args, do, r)
    o_ref, grads_ref = _grads(lambda *a, resets: gated_delta_rule_chunked(*a, resets=resets)[0], args, do, r)
    assert _rel(o, o_ref) <= 2e-5
    for a, b in zip(grads, grads_ref):
        assert _rel(a, b) <= 2e-5


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("resets", [False, True])
def test_gpu_qwen3_5_4b_shape_bf16_matches_the_fp32_twin(resets):
    """Qwen3.5-4B's Gated DeltaNet heads (16 key heads, 32 value heads, dk = dv = 128) at T = 4096: bf16 through
    the Triton path against the chunked twin in fp32 on the same values."""
    args = _inputs(B=1, T=4096, Hk=16, H=32, dk=128, dv=128, dtype=torch.bfloat16, device="cuda")
    r = _resets(1, 4096, "cuda") if resets else None
    do = torch.randn(args[2].shape, device="cuda").bfloat16()
    o, grads = _grads(gated_delta_rule, args, do, r)  # dispatch: Triton on CUDA
    assert o.dtype == torch.bfloat16 and all(t.dtype == torch.bfloat16 for t in grads)
    with dispatch.backend("twin"):
        o_ref, grads_ref = _grads(gated_delta_rule, [a.float() for a in args], do.float(), r)
    assert _rel(o, o_ref) <= 2 ** -8
    for a, b in zip(grads, grads_ref):
        assert _rel(a, b) <= 2 ** -7


@pytest.mark.parametrize("dk", [128, pytest.param(256, marks=pytest.mark.slow)])
def test_kernels_build_for_hopper(dk):
    """The interpreter never compiles: build both kernels for sm_90 with Triton's own ptxas at 4B's head dims and
    at the largest served (256: ~30 s of ptxas, slow)."""
    from qtrain.kernels.delta_rule import gated_delta_rule_triton as m
    c = dict(C=CHUNK, BK=dk, BV=m.BV)
    dims = {"n": "i32", "DK": "i32", "DV": "i32"}
    fwd = ["u_ptr", "w_ptr", "kd_ptr", "last_ptr", "s0_ptr", "hs_ptr", "v_ptr", "sf_ptr"]
    bwd = ["w_ptr", "kd_ptr", "last_ptr", "dhs_ptr", "dv_ptr", "dsf_ptr", "dh_ptr", "du_ptr", "ds0_ptr"]
    assert ".entry" in compile_for_hopper(m._states_fwd_kernel, {**{p: "*fp32" for p in fwd}, **dims},
                                          {**c, "HAS_S0": False}, num_warps=m.NUM_WARPS)
    assert ".entry" in compile_for_hopper(m._states_bwd_kernel, {**{p: "*fp32" for p in bwd}, **dims}, c,
                                          num_warps=m.NUM_WARPS)
