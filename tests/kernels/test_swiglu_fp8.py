"""The fused FP8 SwiGLU MLP (`kernels.swiglu.mlp.fp8_swiglu_mlp`) and the kernels it adds: the SwiGLU backward
with its abs-max fused in (`kernels.swiglu.activation.swiglu_backward_amax`), the SwiGLU forward straight to FP8
(`kernels.swiglu.fp8`), and the quantize-with-transpose op (`kernels.fp8_quant.fp8_quantize_transposed`).

The fused MLP is a re-arrangement, not a new numerical recipe, so on the CPU (twins, emulated GEMMs) it must
equal the three-call composition fp8_linear -> swiglu -> fp8_linear bit for bit, forward and every
gradient. On the GPU its Triton SwiGLU computes exp with Triton's own exp, which can flip a bf16 rounding of
silu(gate) against torch's: there the bar is "as close to bf16 as the composition".
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.triton_interp import compile_for_hopper, interp_only, interpreter_subprocess_test, needs_cuda
from qtrain.kernels import dispatch
from qtrain.kernels.fp8_quant import E4M3, E5M2, fp8_quantize_torch, fp8_quantize_transposed
from qtrain.kernels.swiglu import fp8_swiglu_mlp, swiglu
from qtrain.kernels.swiglu.activation import swiglu_backward_amax, swiglu_backward_amax_twin, swiglu_backward_twin
from qtrain.kernels.swiglu.fp8 import swiglu_fp8, swiglu_fp8_twin
from qtrain.numerics.fp8 import fp8_linear

test_interpreter_subprocess = interpreter_subprocess_test(__file__)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16) if t.element_size() == 2 else t


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref.double()).norm() / ref.double().norm())


def _mlp_inputs(dtype, device="cpu", B=2, T=24, C=96, Fd=160, seed=0):
    """Sizes that are multiples of 16 (FP8 GEMMs) but not powers of two; weights at init scale."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=g).to(dtype).to(device)
    w_up = (0.08 * torch.randn(2 * Fd, C, generator=g)).to(dtype).to(device)
    w_down = (0.05 * torch.randn(C, Fd, generator=g)).to(dtype).to(device)
    dy = torch.randn(B, T, C, generator=g).to(dtype).to(device)
    return x, w_up, w_down, dy


def _composition(x, w_up, w_down, grad_dtype):
    lin = lambda a, w: fp8_linear(a, w, None, grad_dtype=grad_dtype).to(a.dtype)  # noqa: E731 (the trainer's)
    return lin(swiglu(lin(x, w_up), "kernel"), w_down)


def _run(fn, x, w_up, w_down, dy, **kw):
    ts = [t.clone().requires_grad_(True) for t in (x, w_up, w_down)]
    y = fn(*ts, **kw)
    return [y.detach()] + list(torch.autograd.grad(y, ts, dy))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_dtype", [E4M3, E5M2])
def test_mlp_equals_composition_bitwise(dtype, grad_dtype):
    """Same quantized operands, same GEMMs, same roundings: identical output and gradients (CPU, bf16, the
    FP8 training dtype). With fp32 activations the composition rounds d(up output) to bf16 once more (the
    backward of its `.to(fp32)` after the bf16 GEMM) before quantizing it, the fused MLP does not: there
    dx and dW_up may differ by that rounding, 2^-8 relative per element before the FP8 quantization,
    which can move an e4m3 code (1/16 relative) on a few elements: a few tenths of a percent norm-wise."""
    x, w_up, w_down, dy = _mlp_inputs(dtype)
    fused = _run(fp8_swiglu_mlp, x, w_up, w_down, dy, grad_dtype=grad_dtype)
    comp = _run(_composition, x, w_up, w_down, dy, grad_dtype=grad_dtype)
    for name, a, b in zip(("y", "dx", "dw_up", "dw_down"), fused, comp):
        assert a.dtype == b.dtype == dtype, name
        if dtype == torch.float32 and name in ("dx", "dw_up"):
            assert rel_err(a, b) < 2e-2, name
        else:
            assert torch.equal(bits(a), bits(b)), f"{name}: max diff {(a.float() - b.float()).abs().max()}"
    # and it is FP8, not bf16: the gradients differ from the exact ones by FP8's error, a few percent
    ref = _run(lambda a, wu, wd: F.linear(swiglu(F.linear(a, wu)), wd), *(t.double() for t in (x, w_up, w_down, dy)))
    for name, a, r in zip(("y", "dx", "dw_up", "dw_down"), fused, ref):
        assert 1e-3 < rel_err(a, r) < 0.15, name


def test_mlp_with_cached_weights_and_transposes_is_identical():
    """The weight source's e4m3 copies (`Fp8WeightCache.get`) with or without their cached transposes
    (`.transposed`, what --persistent-quants hands the block) give the numbers of quantizing in the call."""
    from qtrain.numerics.fp8 import Fp8WeightCache
    x, w_up, w_down, dy = _mlp_inputs(torch.bfloat16, seed=2)
    plain = _run(fp8_swiglu_mlp, x, w_up, w_down, dy)
    cache = Fp8WeightCache()
    pairs = {"up_fp8": cache.get(w_up), "down_fp8": cache.get(w_down)}
    triples = {"up_fp8": (*cache.get(w_up), cache.transposed(w_up)),
               "down_fp8": (*cache.get(w_down), cache.transposed(w_down))}
    for kw in (pairs, triples):
        got = _run(lambda a, wu, wd: fp8_swiglu_mlp(a, wu, wd, **kw), x, w_up, w_down, dy)
        for name, a, b in zip(("y", "dx", "dw_up", "dw_down"), got, plain):
            assert torch.equal(bits(a), bits(b)), name
    # the backward reads the transposes it is given: zeroed stand-ins zero what flows through them only
    zero_up = {**triples, "up_fp8": (*cache.get(w_up), torch.zeros_like(cache.transposed(w_up)))}
    y, dx, dwu, dwd = _run(lambda a, wu, wd: fp8_swiglu_mlp(a, wu, wd, **zero_up), x, w_up, w_down, dy)
    assert dx.abs().max() == 0 and torch.equal(bits(dwu), bits(plain[2])) and torch.equal(bits(dwd), bits(plain[3]))
    zero_down = {**triples, "down_fp8": (*cache.get(w_down), torch.zeros_like(cache.transposed(w_down)))}
    y, dx, dwu, dwd = _run(lambda a, wu, wd: fp8_swiglu_mlp(a, wu, wd, **zero_down), x, w_up, w_down, dy)
    assert dx.abs().max() == 0 and dwu.abs().max() == 0 and torch.equal(bits(dwd), bits(plain[3]))
    assert torch.equal(bits(y), bits(plain[0])) and plain[1].abs().max() > 0 and plain[2].abs().max() > 0


def test_mlp_frozen_weights_and_no_grad():
    x, w_up, w_down, dy = _mlp_inputs(torch.bfloat16, seed=1)
    xi = x.clone().requires_grad_(True)
    y = fp8_swiglu_mlp(xi, w_up, w_down)  # weights without grad: only dx
    (dx,) = torch.autograd.grad(y, [xi], dy)
    xc = x.clone().requires_grad_(True)
    (dx_c,) = torch.autograd.grad(_composition(xc, w_up, w_down, E4M3), [xc], dy)
    assert torch.equal(dx, dx_c)
    with torch.no_grad():
        assert torch.equal(fp8_swiglu_mlp(x, w_up, w_down), y.detach())


def test_mlp_validates_shapes():
    x, w_up, w_down, _ = _mlp_inputs(torch.float32)
    with pytest.raises(ValueError, match="w_up must be"):
        fp8_swiglu_mlp(x, w_up[:-16], w_down)
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_swiglu_mlp(x[..., :90], w_up[:, :90], w_down)
    with pytest.raises(ValueError, match="grad_dtype"):
        fp8_swiglu_mlp(x, w_up, w_down, grad_dtype=torch.bfloat16)


def test_block_with_fused_mlp_equals_unfused_block():
    """The model's switch: make_block_fn(mlp=...) gives the block the composition gives (CPU, bf16, bitwise), and
    recomputing the SwiGLU falls back to the separate steps."""
    from qtrain.model.llama import LlamaConfig
    from qtrain.model.init import init_params
    from qtrain.kernels.rope import rope_tables
    from qtrain.model.transformer import allocate_params, make_block_fn

    cfg = LlamaConfig(model_type="qwen2", vocab_size=256, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-6,
                      tie_word_embeddings=True, attention_bias=True)
    params = allocate_params(cfg, dtype=torch.bfloat16, device="cpu")  # FP8 trains bf16 weights
    with torch.no_grad():
        init_params(cfg, params, seed=0)
    w = {k.split(".", 2)[2]: v for k, v in params.items() if k.startswith("layers.0.")}
    cos, sin = rope_tables(cfg, 16, "cpu", torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    x, dy = (torch.randn(2, 16, 64, generator=g).bfloat16() for _ in range(2))
    lin = lambda a, wt, b: fp8_linear(a, wt, b).to(a.dtype)  # noqa: E731
    mlp = lambda a, wu, wd, qu=None, qd=None, hint=None: fp8_swiglu_mlp(a, wu, wd, up_fp8=qu, down_fp8=qd)  # noqa: E731

    def run(fn):
        xi = x.clone().requires_grad_(True)
        y = fn(xi, w, cos, sin)
        return [y.detach()] + list(torch.autograd.grad(y, [xi] + list(w.values()), dy))

    unfused = run(make_block_fn(cfg, lin, swiglu="kernel"))
    fused = run(make_block_fn(cfg, lin, swiglu="kernel", mlp=mlp))
    for name, a, b in zip(["y", "dx"] + list(w), fused, unfused):
        assert torch.equal(a, b), name
    calls = []
    counting = lambda *a: calls.append(1) or mlp(*a)  # noqa: E731
    run(make_block_fn(cfg, lin, recompute=frozenset({"swiglu"}), mlp=counting))
    assert not calls  # the recompute policy needs the separate steps


# ---------------------------------------------------------------------------------------------- kernels
def _u_and_dout(M, Fd, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    u = (torch.randn(M, 2 * Fd, generator=g) * 3).to(dtype).to(device)
    d = torch.randn(M, Fd, generator=g).to(dtype).to(device)
    return d, u


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_backward_amax_twin(dtype):
    d, u = _u_and_dout(19, 40, dtype)
    du, amax = swiglu_backward_amax(d, u)
    assert torch.equal(du, swiglu_backward_twin(d, u))
    assert amax.dtype == torch.float32 and amax.shape == () and float(amax) == float(du.float().abs().max())


def test_swiglu_fp8_twin_is_swiglu_then_quantize():
    _, u = _u_and_dout(24, 48, torch.bfloat16)
    q, qt, inv = swiglu_fp8(u, E4M3)
    r, rt, rinv = fp8_quantize_torch(swiglu(u), E4M3, transpose=True)
    assert torch.equal(bits(q), bits(r)) and torch.equal(bits(qt), bits(rt)) and torch.equal(inv, rinv)
    assert qt.shape == (48, 24) and torch.equal(bits(qt), bits(q.t().contiguous()))


@pytest.mark.parametrize("M", [40, 1])
def test_quantize_transposed_op_equals_twin(M):
    """One row too: its q^T must be a copy (q.t() is contiguous there, and a custom op may not return aliases)."""
    x = torch.randn(M, 32).bfloat16()
    amax = torch.tensor(2.5)  # values above it saturate, as the twin says
    for dtype in (E4M3, E5M2):
        got = fp8_quantize_transposed(x, amax, dtype)
        want = fp8_quantize_torch(x, dtype, amax, transpose=True)
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, want))
        assert got[0].data_ptr() != got[1].data_ptr()


def _check_triton_amax(device):
    for dtype in (torch.float32, torch.bfloat16):
        for M, Fd in ((1, 16), (19, 300), (33, 8)):
            d, u = _u_and_dout(M, Fd, dtype, device, seed=M)
            with dispatch.backend("triton"):
                du, amax = swiglu_backward_amax(d, u)
            want, _ = swiglu_backward_amax_twin(d, u)
            tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2.0**-7, atol=1e-3)
            torch.testing.assert_close(du, want, **tol)
            # the fused amax is that of the values the kernel stored, exactly
            assert float(amax) == float(du.float().abs().max()), (dtype, M, Fd)


@interp_only
def test_interp_swiglu_backward_amax():
    _check_triton_amax("cpu")


def _check_forward_amax(device):
    """Pass 1 of swiglu_fp8: h as `swiglu` computes it (bf16: within one ulp where Triton's exp/division
    flip a rounding of silu; fp32: within a few fp32 ulps), and the amax of exactly the stored h."""
    from qtrain.kernels.swiglu.fp8 import swiglu_forward_amax_triton
    for dtype in (torch.bfloat16, torch.float32):
        for M, Fd in ((1, 16), (19, 300), (70, 96)):
            _, u = _u_and_dout(M, Fd, dtype, device, seed=M)
            h, amax = swiglu_forward_amax_triton(u)
            tol = dict(rtol=2.0**-7, atol=1e-3) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(h, swiglu(u), **tol)
            assert float(amax) == float(h.float().abs().max()), (dtype, M, Fd)


@interp_only
def test_interp_swiglu_forward_amax():
    _check_forward_amax("cpu")


# ------------------------------------------------------------------------- sm_90 build, on the CPU
@pytest.mark.skipif(not dispatch.HAS_TRITON, reason="no triton")
def test_kernel_builds_for_hopper():
    """Pass 1 (h and its partial abs-maxes) compiles for sm_90 as launched (bf16 through int16 pointers, the default
    tile); pass 2 is the quantize kernel (tests/numerics/test_fp8.py builds it)."""
    from qtrain.kernels.swiglu import fp8 as f8
    sig = {"u_ptr": "*i16", "h_ptr": "*i16", "partial_ptr": "*fp32", "M": "i32", "F": "i32"}
    ptx = compile_for_hopper(f8._swiglu_fwd_amax_kernel, sig, {"KIND": 1, "BLOCK_M": f8.BLOCK_M, "BLOCK_F": f8.BLOCK_F},
                             num_warps=f8.NUM_WARPS)
    assert ptx.count("st.global") > 1


# -------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@needs_cuda
def test_gpu_swiglu_backward_amax():
    _check_triton_amax("cuda")
    _check_forward_amax("cuda")
    d, u = _u_and_dout(16384, 8960, torch.bfloat16, "cuda")  # Qwen2.5-1.5B shape
    du, amax = swiglu_backward_amax(d, u)
    assert float(amax) == float(du.float().abs().max())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("M,Fd", [(5, 48), (333, 400), (16384, 8960)])
def test_gpu_swiglu_fp8_matches_twin(M, Fd):
    """Triton's exp may flip a bf16 rounding of silu(gate) against torch's, and a flipped h element can
    move one e4m3 code: allow one code step on a tiny fraction of elements; the scales agree to an ulp
    of h's amax (exactly, unless the amax element itself flipped)."""
    _, u = _u_and_dout(M, Fd, torch.bfloat16, "cuda")
    q, qt, inv = swiglu_fp8(u, E4M3)
    r, rt, rinv = swiglu_fp8_twin(u, E4M3)
    assert torch.equal(bits(qt), bits(q.t().contiguous()))
    assert abs(float(inv) / float(rinv) - 1) <= 2.0**-7, (float(inv), float(rinv))
    deq, ref = q.float() * inv, r.float() * rinv
    differ = (bits(q) != bits(r)).float().mean().item()
    worst = ((deq - ref).abs() - ref.abs() * 2.0**-3 - float(rinv)).max().item()
    assert differ < 1e-3 and worst <= 0, (differ, worst)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("compiled", [False, True])
def test_gpu_mlp_as_accurate_as_composition(compiled):
    """Fused vs composition on the H200 (eager, and the fused MLP inside torch.compile, where its ops run
    as opaque Triton kernels): each gradient is as close to the bf16 MLP as the composition's, within
    1.1x + 0.2% (a wrong scale or a transposed operand mixed up is off by tens of percent)."""
    x, w_up, w_down, dy = _mlp_inputs(torch.bfloat16, "cuda", B=4, T=512, C=1536, Fd=8960 // 4)
    fused_fn = torch.compile(fp8_swiglu_mlp, dynamic=False) if compiled else fp8_swiglu_mlp
    fused = _run(fused_fn, x, w_up, w_down, dy)
    comp = _run(_composition, x, w_up, w_down, dy, grad_dtype=E4M3)
    ref = _run(lambda a, wu, wd: F.linear(swiglu(F.linear(a, wu)), wd), x, w_up, w_down, dy)
    for name, a, b, r in zip(("y", "dx", "dw_up", "dw_down"), fused, comp, ref):
        ea, eb = rel_err(a, r), rel_err(b, r)
        assert ea <= 1.1 * eb + 2e-3 and ea < 0.15, (name, ea, eb)
