"""The gated delta rule's GPU path (kernels/delta_rule/gated_delta_rule_triton.py): the chunked form's work on the
chunks as one op pair. The hand-written backward (gated_delta_rule_backward.py) is the gradient of the chunked core
(fp64, with and without documents, an initial state); the op pair differentiates as the chunked twin (fp64, the twins
inside it on the CPU) and traces under torch.compile; the Triton kernels equal their twins one by one, and inside the
whole rule the output and every input's gradient (q, k, v, g, beta), with and without document resets. The Triton
tests run under Triton's interpreter in a child pytest (TRITON_INTERPRET=1, fp32: tests/triton_interp.py) and on a
GPU at Qwen3.5-4B's linear-attention shape (bf16, marked gpu). --delta-rule-precision's two values (the products in
three TF32 passes, fp32; in one, tf32) run under the interpreter too, which multiplies in full fp32 whatever the
precision (np.matmul): there they check that the launchers take the value, not what it computes; the GPU test
`test_gpu_both_precisions_against_fp64` measures that, against an fp64 reference (its docstring argues the bounds).

Tolerances: the kernels compute the twins' fp32 products (full fp32, `input_precision="ieee"`), the sums inside each
product in another order, and invert the chunk's unit-triangular matrix by forward substitution where the twin calls
a triangular solve (rounding ~ sqrt(d) 2^-24 relative per product), carried through a few chunks and, for the
gradients, through the transform's backward: 2e-5 relative in norm against the twin in fp32 (observed below 1e-6
under the interpreter). On the GPU the inputs are bf16 and the twin runs in fp32 on the same values: the outputs
round once to bf16, within 2^-8 relative in norm (one bf16 ulp); the gradients of q and k twice (autograd casts them
to bf16 at the value heads, then sums each key head's two value heads in bf16): within 2^-7.
"""
from __future__ import annotations

import functools

import pytest
import torch

from qtrain.kernels import dispatch
from qtrain.kernels.delta_rule import gated_delta_rule, gated_delta_rule_chunked
from qtrain.kernels.delta_rule.gated_delta_rule import (CHUNK, chunk_core, chunk_decays, chunk_pair_decays,
                                                        chunk_states, chunked_form)
from qtrain.kernels.delta_rule.gated_delta_rule_backward import chunk_core_backward, chunk_intra, chunk_states_reverse
from qtrain.kernels.delta_rule.gated_delta_rule_op import gated_delta_rule_triton
from qtrain.kernels.delta_rule.gated_delta_rule_triton import (_strided, chunk_core_triton, chunk_intra_triton,
                                                               chunk_states_reverse_triton, chunk_states_triton)
from qtrain.kernels.delta_rule.gated_delta_rule_triton_backward import chunk_core_backward_triton
from tests.triton_interp import INTERPRET, interp_only, interpreter_subprocess_test, needs_cuda

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
    r[0, [t for t in (5, 64, 100, 101, T - 7) if 0 <= t < T]] = True
    r[1 % B, [t for t in (30, 130) if t < T]] = True
    return r.to(device)


def _core_inputs(q, k, v, g, beta, resets=None):
    """What the chunked form hands its core for these inputs: q, k, v, g, beta on chunks (prepared), d."""
    seen = []

    def keep(*args):
        seen.append(args)
        return chunk_core(*args)

    chunked_form(q, k, v, g, beta, keep, resets=resets)
    return [t.detach() for t in seen[0][:5]], seen[0][5]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _grads(fn, args, do, resets):
    args = [a.detach().requires_grad_(True) for a in args]
    o = fn(*args, resets=resets)
    return o, torch.autograd.grad(o, args, do)


@pytest.mark.parametrize("resets", [False, True])
def test_backward_twin_is_the_gradient_of_the_chunked_core(resets):
    r = _resets(2, T_RAGGED) if resets else None
    if r is not None:
        r[1, 0] = False  # row 1 starts inside the initial state's document: dS0 is not all zero
    xs, d = _core_inputs(*_inputs(), resets=r)
    gen = torch.Generator().manual_seed(1)
    S0 = torch.randn(2, 2, 32, 32, generator=gen, dtype=torch.float64)
    leaves = [t.clone().requires_grad_(True) for t in (*xs, S0)]
    o, S = chunk_core(*leaves[:5], d, leaves[5])
    do, dS = torch.randn(o.shape, generator=gen, dtype=torch.float64), torch.randn(S.shape, generator=gen,
                                                                                    dtype=torch.float64)
    want = torch.autograd.grad((o, S), leaves, (do, dS))
    got = chunk_core_backward(*xs, d, S0, do, dS)
    for a, b in zip(got, want):
        assert a.shape == b.shape and b.abs().max() > 0 and torch.allclose(a, b, rtol=0, atol=1e-12)


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
def test_interp_kernels_match_their_twins_fp32(dk=48, dv=16):
    """Each kernel against its twin on the same inputs: the chunks' transform (Ai, U, W), the states (Hs, V', the
    final state), the whole forward (o, the final state), the reverse recurrence (dH, dU, dS0), the whole backward
    (dq, dk, dv, dg, dbeta, dS0); with documents, an initial state, and dk = 48, dv = 16 (the tiles' rows padded to
    a power of two, one dv tile; the whole-rule tests below run 32)."""
    r = _resets(2, T_RAGGED)
    r[1, 0] = False  # row 1 starts inside the initial state's document: dS0 is not all zero
    (q, k, v, g, beta), d = _core_inputs(*_inputs(dk=dk, dv=dv, dtype=torch.float32), resets=r)
    gen = torch.Generator().manual_seed(1)
    S0 = torch.randn(2, 2, dk, dv, generator=gen)
    G, Gexp, last, k_scale = chunk_decays(g, d)
    intra = chunk_intra(k, v, beta, chunk_pair_decays(G, d), Gexp)
    _, U, W = intra
    k_dec = k * k_scale[..., None]
    states = chunk_states(U, W, k_dec, last, S0)
    cot = [torch.randn(t.shape, generator=gen) for t in states]
    pairs = [(chunk_intra_triton(k, v, beta, G, d), intra),
             (chunk_states_triton(U, W, k_dec, last, S0), states),
             (chunk_core_triton(q, k, v, g, beta, d, S0), chunk_core(q, k, v, g, beta, d, S0)),
             (chunk_states_reverse_triton(W, k_dec, last, *cot), chunk_states_reverse(W, k_dec, last, *cot))]
    do, dS = torch.randn(v.shape, generator=gen), torch.randn(S0.shape, generator=gen)
    pairs.append((chunk_core_backward_triton(q, k, v, g, beta, d, S0, do, dS),
                  chunk_core_backward(q, k, v, g, beta, d, S0, do, dS)))
    for got, want in pairs:
        for a, b in zip(got, want):
            assert a.dtype == torch.float32 and a.shape == b.shape and _rel(a, b) <= 2e-5


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """x (B, H, n, C[, d]) with the same values as a heads-first view of a (B, n, C, H[, d]) tensor: the layout
    `chunked_form` hands the op pair under torch.compile (the model's (B, T, H, d) transposed)."""
    order = (0, 2, 3, 1, 4)[:x.dim()]
    inverse = [order.index(i) for i in range(x.dim())]
    return x.permute(order).contiguous().permute(inverse)


def test_strided_inputs_are_read_in_place():
    """A heads-first view reaches the kernels as it is, with its strides (no contiguous copy: 25 a layer and
    micro-step on the GPU before); only a tensor whose last dimension is not unit-stride is copied."""
    x = _heads_first(torch.randn(2, 3, 4, 64, 8))
    got = _strided(x)
    assert not x.is_contiguous() and got[0].data_ptr() == x.data_ptr() and got[1:] == list(x.stride()[:4])
    y = torch.randn(2, 3, 4, 64, 8).transpose(-1, -2)
    assert _strided(y)[0].is_contiguous()


@interp_only
@pytest.mark.parametrize("resets", [False, True])
def test_interp_kernels_read_strided_inputs_as_contiguous_ones(resets, dk=48, dv=16):
    """The forward and backward kernels on heads-first strided q, k, v, beta and dO give exactly what they give on
    contiguous copies of the same values (the same arithmetic in the same order: bitwise)."""
    r = _resets(2, T_RAGGED) if resets else None
    (q, k, v, g, beta), d = _core_inputs(*_inputs(dk=dk, dv=dv, dtype=torch.float32), resets=r)
    do = torch.randn(v.shape, generator=torch.Generator().manual_seed(3))
    dS = torch.randn(2, 2, dk, dv, generator=torch.Generator().manual_seed(4))
    flat = (q, k, v, g, beta)
    strided = [_heads_first(t) for t in flat]
    assert not any(t.is_contiguous() for t in strided)
    for got, want in ((chunk_core_triton(*strided, d, None), chunk_core_triton(*flat, d, None)),
                      (chunk_core_backward_triton(*strided, d, None, _heads_first(do), dS),
                       chunk_core_backward_triton(*flat, d, None, do, dS))):
        for a, b in zip(got, want):
            assert torch.equal(a, b)


@interp_only
@pytest.mark.parametrize("resets,T,Hk,precision", [(False, 2 * CHUNK, 2, "fp32"), (True, T_RAGGED, 1, "fp32"),
                                                   (True, 5, 2, "fp32"), (True, T_RAGGED, 1, "tf32")])
def test_interp_gated_delta_rule_matches_the_twin_fp32(resets, T, Hk, precision):
    """`gated_delta_rule` through its Triton path (forced: CPU tensors under the interpreter) against the chunked
    twin: the output and the gradients of q, k, v, g and beta; whole chunks, a ragged tail with one key head for
    both value heads, one short chunk; the ragged tail again at --delta-rule-precision tf32 (the interpreter's
    products are fp32 at either: the same bound)."""
    args = _inputs(T=T, Hk=Hk, dtype=torch.float32)
    r = _resets(2, T) if resets else None
    do = torch.randn(args[2].shape, generator=torch.Generator().manual_seed(2))
    with dispatch.backend("triton"):
        o, grads = _grads(functools.partial(gated_delta_rule, precision=precision), args, do, r)
    o_ref, grads_ref = _grads(lambda *a, resets: gated_delta_rule_chunked(*a, resets=resets)[0], args, do, r)
    assert _rel(o, o_ref) <= 2e-5
    for a, b in zip(grads, grads_ref):
        assert _rel(a, b) <= 2e-5


@interp_only
def test_interp_qwen3_5_model_with_the_triton_delta_rule_equals_transformers(monkeypatch):
    """The whole Qwen3.5 model (tiny, fp32) with its delta rule through the Triton kernels (the rest as on the CPU):
    logits, loss and every parameter's gradient equal transformers' own (tests/model/test_qwen3_5.py's check)."""
    pytest.importorskip("transformers")
    from qtrain.kernels import delta_rule
    from qtrain.kernels.delta_rule import gated_delta_rule_op
    from tests.model.test_qwen3_5 import check_against_hf, tiny_cfg
    calls = []

    def triton_here(t):
        calls.append(t.shape)
        return True

    monkeypatch.setattr(delta_rule, "use_triton", triton_here)  # the model's entry: the Triton path, here too
    monkeypatch.setattr(gated_delta_rule_op, "use_triton", triton_here)  # the op: its kernels (interpreted)
    check_against_hf(tiny_cfg(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"),
                              linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=32,
                              linear_value_head_dim=32))  # heads the Triton path serves (TRITON_HEAD_DIM_MIN)
    assert calls


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("resets", [False, True])
@pytest.mark.parametrize("B,T", [(1, 4096), (2, 1000)])
def test_gpu_qwen3_5_4b_shape_bf16_matches_the_fp32_twin(B, T, resets):
    """Qwen3.5-4B's Gated DeltaNet heads (16 key heads, 32 value heads, dk = dv = 128) at T = 4096 (and two rows of
    1000, a ragged tail): bf16 through the Triton path against the chunked twin in fp32 on the same values."""
    args = _inputs(B=B, T=T, Hk=16, H=32, dk=128, dv=128, dtype=torch.bfloat16, device="cuda")
    r = _resets(B, T, "cuda") if resets else None
    do = torch.randn(args[2].shape, device="cuda").bfloat16()
    o, grads = _grads(gated_delta_rule, args, do, r)  # dispatch: Triton on CUDA
    assert o.dtype == torch.bfloat16 and all(t.dtype == torch.bfloat16 for t in grads)
    with dispatch.backend("twin"):
        o_ref, grads_ref = _grads(gated_delta_rule, [a.float() for a in args], do.float(), r)
    assert _rel(o, o_ref) <= 2 ** -8
    for a, b in zip(grads, grads_ref):
        assert _rel(a, b) <= 2 ** -7


# --delta-rule-precision's bounds against fp64 (`test_gpu_both_precisions_against_fp64`): (output, gradients)
PRECISION_BOUNDS = {"fp32": (2e-5, 1e-4), "tf32": (2 ** -8, 2 ** -7)}
TF32_SEEN = 1e-5  # tf32's output error is at least this (20x fp32's measured 4.7e-7): the option reached the kernels


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_gpu_both_precisions_against_fp64(precision):
    """Qwen3.5-4B's Gated DeltaNet heads at T = 4096, the gates as the model makes them (g = -softplus, beta =
    sigmoid: the kernels case's inputs), fp32 values through the Triton path at each --delta-rule-precision against
    the chunked twin in fp64 on the same values: the output and the gradients of q, k, v, g and beta, relative in norm.

    fp32 (three TF32 passes a product): fp32's accuracy, the sums in the kernels' order and the chunk's inverse by
    forward substitution (measured on one H100, the core's output: 4.7e-7): the output within 2e-5 (this file's fp32
    bound), the gradients within 1e-4 (their chains are longer: the transform recomputed and differentiated through
    the inverse twice, dA = -Ai^T dAi Ai^T, and g's gradient is a difference of row and column sums).
    tf32 (one pass): each operand of each product rounds to 10 mantissa bits (2^-11 relative), carried through the
    inverse and the state's recurrence: measured 1.8e-3 on the core's output. A bf16 model rounds that output to 8
    bits anyway (2^-8 relative in norm at most, one ulp): the output within 2^-8 (2.2x the measured), the gradients
    within 2^-7, what the bf16 test above allows (they round twice in bf16 in the model). And tf32's output error
    exceeds TF32_SEEN, which three passes never reach: the value reached the kernels."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    B, T, Hk, H, d = 1, 4096, 16, 32, 128
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    args = [r(B, T, Hk, d), r(B, T, Hk, d), r(B, T, H, d), -torch.nn.functional.softplus(r(B, T, H)),
            torch.sigmoid(r(B, T, H))]
    do = r(B, T, H, d)
    o, grads = _grads(functools.partial(gated_delta_rule, precision=precision), args, do, None)
    with dispatch.backend("twin"):
        o_ref, grads_ref = _grads(gated_delta_rule, [a.double() for a in args], do.double(), None)
    errs = {"o": _rel(o, o_ref), **{f"d{n}": _rel(a, b) for n, a, b in zip("qkvgb", grads, grads_ref)}}
    print(f"--delta-rule-precision {precision}: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()), flush=True)
    out_bound, grad_bound = PRECISION_BOUNDS[precision]
    assert errs["o"] <= out_bound and all(e <= grad_bound for k, e in errs.items() if k != "o"), errs
    if precision == "tf32":
        assert errs["o"] > TF32_SEEN, errs


H100_SHARED = 232448  # bytes of shared memory a Hopper block may use (227 KiB)


def _build_for_hopper(kernel, signature: dict[str, str], constexprs: dict[str, object], **options):
    """`compile_for_hopper`'s build, returning the compiled kernel (its PTX and its shared memory)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    if INTERPRET:
        pytest.skip("compiles for the GPU: not under the interpreter")
    src = ASTSource(fn=kernel, signature={**signature, **{k: "constexpr" for k in constexprs}}, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


@pytest.mark.parametrize("dk,precision", [(128, "fp32"), pytest.param(256, "fp32", marks=pytest.mark.slow),
                                          pytest.param(128, "tf32", marks=pytest.mark.slow)])
def test_kernels_build_for_hopper_within_its_shared_memory(dk, precision):
    """The interpreter never compiles: build the ten kernels for sm_90 with Triton's own ptxas at 4B's head dims
    and at the largest served (256: slow), with the launchers' options; each fits a Hopper block's shared memory (a
    launch past it fails on the GPU only); and at --delta-rule-precision tf32 (slow: one TF32 pass a product)."""
    from qtrain.kernels.delta_rule import gated_delta_rule_triton as fwd, gated_delta_rule_triton_backward as bwd
    tune = fwd.launch_for(precision)
    constexprs = dict(C=CHUNK, BK=dk, BV=tune.bv, BKT=bwd.BKT, PREC=tune.prec, HAS_DOCS=True, HAS_S0=True)
    kernels = [fwd._kkt_kernel, fwd._invert_kernel, fwd._wu_kernel, fwd._states_fwd_kernel, fwd._output_kernel,
               fwd._states_bwd_kernel, bwd._bwd_reads_kernel, bwd._bwd_dq_kernel, bwd._bwd_dw_kernel,
               bwd._bwd_dk_kernel]
    for kernel in kernels:
        consts = {p.name: constexprs[p.name] for p in kernel.params if p.is_constexpr}
        sig = {p.name: "*i32" if p.name == "d_ptr" else "*fp32" if p.name.endswith("_ptr") else "i32"
               for p in kernel.params if not p.is_constexpr}
        launch = {**fwd._launch(dk, tune),
                  **({"num_warps": fwd.INVERT_WARPS} if kernel is fwd._invert_kernel else {})}
        built = _build_for_hopper(kernel, sig, consts, **launch)
        assert ".entry" in built.asm["ptx"] and built.metadata.shared <= H100_SHARED, (kernel, built.metadata.shared)
