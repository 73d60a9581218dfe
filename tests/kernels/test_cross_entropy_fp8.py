"""The cross-entropy that writes d(logits) as e5m2 codes (kernels/cross_entropy/fp8.py) and the LM head's FP8 backward
that uses them (kernels/cross_entropy/head.py, --fp8-head-backward).

The specification is the twin: the loss and lse of ``inplace.chunk_loss_and_dlogits`` and the fp32 d(logits) of
``inplace.dlogits_f32``, rounded to e5m2 at the fixed scale 2^15. ``test_interpreter_subprocess`` re-runs the
``test_interp_*`` tests under TRITON_INTERPRET=1; ``gpu``-marked tests need CUDA.
"""
from __future__ import annotations

import pytest
import torch

from qtrain.kernels import dispatch
from qtrain.kernels.cross_entropy import (IGNORE_INDEX, fp8_backward_shapes_ok, head_workspace_bytes,
                                          lm_head_loss_and_grads)
from qtrain.kernels.cross_entropy import fp8 as cf
from qtrain.kernels.cross_entropy import head as loss_mod
from qtrain.kernels.cross_entropy.inplace import chunk_loss_and_dlogits, dlogits_f32
from tests.kernels.test_cross_entropy import make_case as _ce_case
from tests.triton_interp import compile_for_hopper, interp_only, interpreter_subprocess_test, needs_cuda

test_interpreter_subprocess = interpreter_subprocess_test(__file__)

INV = 2.0 ** -cf.G_SCALE_EXP


def make_case(n, v, dtype=torch.bfloat16, seed=0, device="cpu", scale=4.0):
    """test_cross_entropy's case (a trained head's spread, targets at both ends, ignored rows), bf16 by default."""
    return _ce_case(n, v, dtype, seed=seed, device=device, scale=scale)


def _deq(q: torch.Tensor) -> torch.Tensor:
    return q.float() * INV


# --------------------------------------------------------------------------------- twin
@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
def test_twin_codes_are_the_nearest_e5m2_of_the_specification(z_loss):
    """Loss and lse are the specification's bits. Each code is d rounded to nearest e5m2 at scale 2^15: for a normal
    code the error is at most half an ulp, 2^-3 of |d| (two mantissa bits); below e5m2's normals (2^-14, i.e. |d| <
    2^-29) at most half the subnormal step, 2^-17 * 2^-15 = 2^-32. The codes live in the logits' buffer."""
    x, t = make_case(9, 1000, seed=1)
    r_loss, r_lse, _ = chunk_loss_and_dlogits(x, t, z_loss=z_loss, need_grad=False)
    d = dlogits_f32(x.float(), r_lse, t, z_loss)
    buf = x.clone()
    loss, lse, q, qt = cf.cross_entropy_fp8_grads_twin(buf, t, z_loss=z_loss)
    assert torch.equal(loss, r_loss) and torch.equal(lse, r_lse)
    assert q.dtype == qt.dtype == torch.float8_e5m2 and q.shape == (9, 1000) and qt.shape == (1000, 9)
    assert q.data_ptr() == buf.data_ptr() and q.stride() == (2000, 1), "codes over the logits' own rows"
    assert torch.equal(qt.view(torch.uint8), q.view(torch.uint8).t())
    err = (_deq(q) - d).abs()
    assert bool((err <= torch.maximum(d.abs() * 2.0 ** -3, torch.full_like(d, 2.0 ** -32))).all())
    ignored = t == IGNORE_INDEX
    assert not bool(q[ignored].view(torch.uint8).any()), "ignored rows have zero gradient"
    # each valid row's gradient sums to ~0 (softmax - onehot) and the target's entry is p - 1 < 0
    assert bool((_deq(q)[~ignored].gather(1, t[~ignored, None]) < 0).all())


def test_twin_saturates_instead_of_overflowing():
    """A z-loss coefficient beyond e5m2's range at 2^15 (1 + 2 z lse > 1.75) clamps to the largest code, never inf."""
    x, t = make_case(4, 64, seed=2, scale=0.01)
    x[:, 7] = 20.0  # p ~ 1 there, lse ~ 20
    t[:] = 5
    _, _, q, _ = cf.cross_entropy_fp8_grads_twin(x, t, z_loss=10.0)  # d ~ p (1 + 2 * 10 * 20) ~ 401
    assert torch.isfinite(q.float()).all() and q.float().abs().max().item() == 57344.0


def test_dispatch_runs_the_twin_on_cpu():
    x, t = make_case(5, 96, seed=3)
    a = cf.cross_entropy_fp8_grads(x.clone(), t, z_loss=0.0)
    b = cf.cross_entropy_fp8_grads_twin(x.clone(), t, z_loss=0.0)
    assert all(torch.equal(u.view(torch.uint8) if u.dtype == torch.float8_e5m2 else u,
                           v.view(torch.uint8) if v.dtype == torch.float8_e5m2 else v) for u, v in zip(a, b))


def test_bad_input_is_refused_with_its_name():
    with pytest.raises(ValueError, match="logits must be .n, V."):
        cf.cross_entropy_fp8_grads(torch.zeros(3, 4, 5), torch.zeros(3, dtype=torch.long), z_loss=0.0)
    with pytest.raises(ValueError, match="contiguous"):
        cf.cross_entropy_fp8_grads(torch.zeros(8, 6)[:, :4], torch.zeros(8, dtype=torch.long), z_loss=0.0)


# --------------------------------------------------------------------------------- the head
def _head_case(n, c=128, v=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, c, generator=g).to(torch.bfloat16)
    w = (torch.randn(v, c, generator=g) * 0.05).to(torch.bfloat16)
    t = torch.randint(0, v, (n,), generator=g)
    t[3] = IGNORE_INDEX
    return h, w, t


def _exact_grads(h, w, t, z_loss, scale):
    """fp64 d(h), d(w) of scale * summed loss: the reference both the bf16 and the FP8 head approximate."""
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    lg = h64 @ w64.t()
    lse = torch.logsumexp(lg, -1)
    valid = t != IGNORE_INDEX
    tl_ = lg.gather(1, torch.where(valid, t, 0)[:, None]).squeeze(1)
    (torch.where(valid, lse - tl_ + z_loss * lse * lse, 0.0).sum() * scale).backward()
    return h64.grad, w64.grad


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("chunks", [1, 3])
def test_fp8_head_keeps_the_loss_and_approximates_the_gradients(chunks):
    """The logits GEMM is unchanged, so the loss is the bf16 head's bits. The gradients: e4m3 operands (W, h) carry a
    relative RMS error of ~2^-4 / sqrt(3) ~ 3.6% per element at worst and e5m2's G ~7%, averaged over the GEMMs' long
    reductions to a few percent of the result's norm (measured 2.7% here); the bar is 6%. The bf16 head is within
    1% of the exact gradients at these shapes, so a bar the FP8 head meets at 6% and the bf16 head at 1% shows FP8 ran."""
    h, w, t = _head_case(64)
    scale = 1 / 63
    l0, dh0, dw0 = lm_head_loss_and_grads(h, w, t, chunks=chunks, z_loss=1e-4, scale=scale)
    l1, dh1, dw1 = lm_head_loss_and_grads(h, w, t, chunks=chunks, z_loss=1e-4, scale=scale, fp8_backward=True)
    ref_dh, ref_dw = _exact_grads(h, w, t, 1e-4, scale)
    assert torch.equal(l0, l1)
    assert dh1.dtype == dw1.dtype == torch.bfloat16
    assert _rel(dh0, ref_dh) < 0.01 and _rel(dw0, ref_dw) < 0.01
    assert 0.005 < _rel(dh1, ref_dh) < 0.06 and 0.005 < _rel(dw1, ref_dw) < 0.06
    # a frozen head (LoRA): the same d(h) from the same codes, no d(W)
    l2, dh2, dw2 = lm_head_loss_and_grads(h, w, t, chunks=chunks, z_loss=1e-4, scale=scale, fp8_backward=True,
                                          need_weight_grad=False)
    assert torch.equal(l2, l1) and torch.equal(dh2, dh1) and dw2 is None


def test_fp8_head_chunks_share_one_quantization():
    """W, h and G are quantized with scales that do not depend on the chunking (h's abs-max over all rows, G's fixed
    2^15), so d(h) is the same whichever chunks the rows fall in (same codes, same per-row GEMMs: fp32 sums of the
    same products, to fp32 rounding); d(W) sums the chunks' products in another order, each rounded to bf16: its
    norm to a few bf16 roundings (2^-7)."""
    h, w, t = _head_case(96, seed=1)
    _, dh1, dw1 = lm_head_loss_and_grads(h, w, t, chunks=1, z_loss=0.0, scale=0.01, fp8_backward=True)
    _, dh4, dw4 = lm_head_loss_and_grads(h, w, t, chunks=4, z_loss=0.0, scale=0.01, fp8_backward=True)
    torch.testing.assert_close(dh4, dh1, rtol=2 ** -7, atol=1e-6)
    assert _rel(dw4, dw1) < 2 ** -7  # elementwise would trip on sums that cancel to near zero


def test_fp8_head_chunk_bounds_are_multiples_of_16(monkeypatch):
    """d(W)'s reduction runs over a chunk's rows, which cuBLASLt FP8 wants in multiples of 16: 96 rows in 5 chunks
    are cut at multiples of 16 (the last takes the rest), and every chunk takes the FP8 path."""
    seen = []
    real = loss_mod._Fp8HeadOperands.chunk_grads
    monkeypatch.setattr(loss_mod._Fp8HeadOperands, "chunk_grads",
                        lambda self, g, g_t, lo, hi, dh, dw, first: (seen.append((lo, hi)),
                                                                     real(self, g, g_t, lo, hi, dh, dw, first=first)))
    h, w, t = _head_case(96)
    lm_head_loss_and_grads(h, w, t, chunks=5, z_loss=0.0, scale=1.0, fp8_backward=True)
    assert seen and all(lo % 16 == 0 and (hi - lo) % 16 == 0 for lo, hi in seen)
    assert seen[0][0] == 0 and seen[-1][1] == 96 and len(seen) <= 5


@pytest.mark.parametrize("n,c,v", [(50, 128, 512), (64, 120, 512), (64, 128, 500)])
def test_shapes_fp8_cannot_take_run_the_bf16_head(n, c, v):
    """Rows, hidden or vocabulary not multiples of 16: the bf16 head, bit for bit."""
    assert not fp8_backward_shapes_ok(n, c, v)
    h, w, t = _head_case(n, c, v)
    a = lm_head_loss_and_grads(h, w, t, chunks=2, z_loss=0.0, scale=0.5)
    b = lm_head_loss_and_grads(h, w, t, chunks=2, z_loss=0.0, scale=0.5, fp8_backward=True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_workspace_counts_the_fp8_operands():
    """The plan's head workspace grows by G^T (a byte per logit of a chunk), W's and h's e4m3 copies (both orders) and
    with several chunks one fp32 (V, C) product; unchanged where the shapes keep the head in bf16."""
    N, C, V = 65536, 1536, 151936
    base = head_workspace_bytes(N, C, V, dtype_bytes=2, chunks=4)
    fp8 = head_workspace_bytes(N, C, V, dtype_bytes=2, chunks=4, fp8_backward=True)
    assert fp8 - base == N // 4 * V + 2 * (V + N) * C + 4 * V * C
    assert head_workspace_bytes(N + 8, C, V, dtype_bytes=2, chunks=4, fp8_backward=True) == \
        head_workspace_bytes(N + 8, C, V, dtype_bytes=2, chunks=4)


# --------------------------------------------------------------------------------- interpreter
def _check_kernel_vs_twin(x, t, z_loss, *, codes: bool, **tiles):
    """Loss and lse to fp32 rounding (the kernel sums in blocks); the codes over the logits, q^T their transpose,
    ignored rows zero. `codes`: on the GPU the codes equal the twin's except where exp's approximation moves d across
    an e5m2 rounding boundary (one step, at most 0.1% of them); the interpreter's fp32 -> fp8 cast is not the GPU's
    (it misses by a binade at times), so there only the signs of the larger gradients are compared. `tiles`: the
    Triton launcher's tile parameters (default: the dispatched op's launch)."""
    ref = cf.cross_entropy_fp8_grads_twin(x.clone(), t, z_loss=z_loss)
    buf = x.clone()
    with dispatch.backend("triton"):
        got = cf.cross_entropy_fp8_grads_triton(buf, t, z_loss=z_loss, **tiles) if tiles else \
            cf.cross_entropy_fp8_grads(buf, t, z_loss=z_loss)
    torch.testing.assert_close(got[1], ref[1], rtol=2e-6, atol=0)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    assert got[2].data_ptr() == buf.data_ptr()
    assert torch.equal(got[3].view(torch.uint8), got[2].view(torch.uint8).t())
    a, b = got[2].view(torch.uint8).to(torch.int16), ref[2].view(torch.uint8).to(torch.int16)
    assert not bool(a[t == IGNORE_INDEX].any())
    if codes:
        assert int((a - b).abs().max()) <= 1 and int((a != b).sum()) <= max(1, a.numel() // 1000)
    else:
        big = ref[2].float().abs() >= 1.0  # |d| >= 2^-15
        assert torch.equal(torch.sign(got[2].float()[big]), torch.sign(ref[2].float()[big]))


@interp_only
@pytest.mark.parametrize("n,v", [(7, 1000), (40, 300), (3, 33)])
def test_interp_kernel_matches_twin(n, v):
    """Small tiles so that rows and columns both span several programs and loop iterations, with ragged edges
    (cols 192: a 2-D grid's column range of three tiles, the last one ragged)."""
    tiles = dict(block_m=16, block_v=64, cols=192, t_block=16)
    x, t = make_case(n, v, torch.float32, seed=n + v)
    _check_kernel_vs_twin(x, t, 1e-3, codes=False, **tiles)
    x, t = make_case(n, v, torch.bfloat16, seed=n)
    _check_kernel_vs_twin(x, t, 0.0, codes=False, **tiles)


# ------------------------------------------------------------------------- sm_90 build, on the CPU
@pytest.mark.skipif(not dispatch.HAS_TRITON, reason="no triton")
def test_kernel_builds_for_hopper():
    """Pass 2 and the byte transpose compile for sm_90 as launched on the GPU (bf16 read natively, e5m2 codes by the hardware's saturating
    conversion)."""
    sig = {"x_ptr": "*bf16", "qt_ptr": "*fp8e5", "targets_ptr": "*i64", "lse_ptr": "*fp32", "N": "i32", "V": "i32",
           "stride_x": "i32", "z_loss": "fp32"}
    ptx = compile_for_hopper(cf._dlogits_fp8_t_kernel, sig, {"LOAD_KIND": 0, "SCALE": 32768.0, "FMAX": 57344.0,
                                                             "BLOCK_M": cf.BLOCK_M, "BLOCK_V": cf.BLOCK_V,
                                                             "COLS": cf.COLS}, num_warps=cf.NUM_WARPS)
    assert "e5m2" in ptx
    compile_for_hopper(cf.transpose_u8_kernel, {"src_ptr": "*u8", "dst_ptr": "*u8", "R": "i32", "C": "i32",
                                                 "stride_src": "i32", "stride_dst": "i32"},
                       {"BLOCK_R": cf.T_BLOCK, "BLOCK_C": cf.T_BLOCK}, num_warps=cf.T_WARPS)


# --------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("n,v", [(96, 151936), (96, 32000), (14336, 151936)])
def test_gpu_kernel_matches_twin(n, v):
    """The last shape puts q^T's offsets (V * n) past 2^31: the first version's int32 column offsets overflowed
    there (an illegal address in a 1.5B run). q^T's tile is transposed as bytes (the first version's q^T, the e5m2
    tile transposed under a transposed mask, was wrong on the H200)."""
    x, t = make_case(n, v, seed=v, device="cuda")
    _check_kernel_vs_twin(x, t, 1e-4, codes=True)


@pytest.mark.gpu
@needs_cuda
def test_gpu_fp8_head_matches_the_cpu_twin_path():
    """The GPU head (Triton codes, cuBLASLt FP8 GEMMs) against the CPU's (twin codes, fp32 emulation of the same
    GEMMs): the same quantized operands up to a code where exp rounds differently, so within bf16 noise (1%)."""
    g = torch.Generator().manual_seed(4)
    n, c, v = 256, 128, 151936
    h = torch.randn(n, c, generator=g).to(torch.bfloat16)
    w = (torch.randn(v, c, generator=g) * 0.05).to(torch.bfloat16)
    t = torch.randint(0, v, (n,), generator=g)
    t[::5] = IGNORE_INDEX
    cpu = lm_head_loss_and_grads(h, w, t, chunks=2, z_loss=1e-4, scale=1 / 200, fp8_backward=True)
    gpu = lm_head_loss_and_grads(h.cuda(), w.cuda(), t.cuda(), chunks=2, z_loss=1e-4, scale=1 / 200,
                                 fp8_backward=True)
    torch.testing.assert_close(gpu[0].cpu(), cpu[0], rtol=1e-5, atol=0)
    assert _rel(gpu[1].cpu(), cpu[1]) < 0.01 and _rel(gpu[2].cpu(), cpu[2]) < 0.01
