"""The fused in-place cross-entropy kernel (qtrain.kernels.cross_entropy.inplace) against its twin and the
specification, and the chunked LM head around it (qtrain.kernels.cross_entropy.head).

The specification is ``qtrain.kernels.cross_entropy.inplace.chunk_loss_and_dlogits``. ``test_interpreter_subprocess``
re-runs this file's ``test_interp_*`` tests with TRITON_INTERPRET=1 (CPU, fp32/bf16/fp16 through bit-level loads);
``gpu``-marked tests need CUDA.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from tests.triton_interp import compile_for_hopper, interp_only, interpreter_subprocess_test, needs_cuda
from qtrain.kernels import dispatch
from qtrain.kernels.cross_entropy import IGNORE_INDEX, chunked_lm_head_loss
from qtrain.kernels.cross_entropy import head as loss_mod
from qtrain.kernels.cross_entropy import inplace as ce
from qtrain.kernels.cross_entropy.inplace import chunk_loss_and_dlogits as _chunk_loss_and_dlogits



test_interpreter_subprocess = interpreter_subprocess_test(__file__)


def make_case(n, v, dtype=torch.float32, seed=0, device="cpu", scale=4.0, shift=0.0):
    """Logits with a spread like a trained head's (std `scale`), targets hitting the first and last column,
    and ignored rows (row 1; every third row from 5)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, v, generator=g) * scale + shift).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    t[0] = v - 1
    if n > 2:
        t[2] = 0
    t[1::3] = IGNORE_INDEX
    return x.to(device), t.to(device)


# --------------------------------------------------------------------------------- twin vs specification
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
def test_twin_is_the_specification_and_overwrites_its_input(dtype, z_loss):
    """Tolerance: none. The twin calls the specification and copies its d(logits) into the input, so every
    output is bit-identical; what this pins is the aliasing contract (d(logits) IS the logits buffer)."""
    x, t = make_case(9, 301, dtype, seed=1)
    ref_loss, ref_lse, ref_dl = _chunk_loss_and_dlogits(x.clone(), t, z_loss=z_loss, need_grad=True)
    buf = x.clone()
    loss, lse, dl = ce.cross_entropy_fwd_bwd_inplace_twin(buf, t, z_loss=z_loss, need_grad=True)
    assert dl is buf and dl.dtype == dtype
    assert torch.equal(loss, ref_loss) and torch.equal(lse, ref_lse) and torch.equal(dl, ref_dl)
    assert loss.dtype == lse.dtype == torch.float32

    buf = x.clone()
    loss, lse, dl = ce.cross_entropy_fwd_bwd_inplace_twin(buf, t, z_loss=z_loss, need_grad=False)
    assert dl is None and torch.equal(buf, x), "need_grad=False must leave the logits alone"
    assert torch.equal(loss, ref_loss) and torch.equal(lse, ref_lse)


def test_signatures_are_the_specification_contract():
    spec = inspect.signature(_chunk_loss_and_dlogits)
    for fn in (ce.cross_entropy_fwd_bwd_inplace_, ce.cross_entropy_fwd_bwd_inplace_twin,
               ce.cross_entropy_fwd_bwd_inplace_triton):
        assert inspect.signature(fn) == spec, fn.__name__


def test_loss_fn_selection(monkeypatch):
    assert loss_mod._loss_fn(False) is _chunk_loss_and_dlogits
    assert loss_mod._loss_fn(True) is ce.cross_entropy_fwd_bwd_inplace_
    assert loss_mod._loss_fn(False) is _chunk_loss_and_dlogits  # the CPU keeps running the specification


@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
def test_chunked_head_loss_accepts_in_place_dlogits(monkeypatch, z_loss):
    """The caller must not read the logits after the loss function: run chunked_lm_head_loss on the CPU
    with the in-place twin and compare with the specification (bit-identical: same math, same order)."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(37, 16, generator=g)
    w = torch.randn(203, 16, generator=g) * 0.3
    t = torch.randint(0, 203, (37,), generator=g)
    t[::4] = IGNORE_INDEX
    results = []
    for fn in (_chunk_loss_and_dlogits, ce.cross_entropy_fwd_bwd_inplace_twin):
        monkeypatch.setattr(loss_mod, "_loss_fn", lambda cuda, fn=fn: fn)
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        out = chunked_lm_head_loss(hh, ww, t, chunks=3, z_loss=z_loss, scale=0.1)
        out.backward()
        results.append((out.detach(), hh.grad, ww.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_grads_without_autograd_are_the_functions(dtype):
    """`lm_head_loss_and_grads` (the training micro-step's head, no autograd) returns the loss and the gradients that
    `chunked_lm_head_loss` gives through backward() (which multiplies them by the upstream 1: exact), bit for bit;
    without need_grad only the loss, the same."""
    from qtrain.kernels.cross_entropy import lm_head_loss_and_grads
    g = torch.Generator().manual_seed(5)
    h = torch.randn(37, 16, generator=g).to(dtype)
    w = (torch.randn(203, 16, generator=g) * 0.3).to(dtype)
    t = torch.randint(0, 203, (37,), generator=g)
    t[::5] = IGNORE_INDEX
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    out = chunked_lm_head_loss(hh, ww, t, chunks=3, z_loss=1e-3, scale=0.1)
    out.backward()
    loss, dh, dw = lm_head_loss_and_grads(h, w, t, chunks=3, z_loss=1e-3, scale=0.1)
    assert torch.equal(loss, out.detach()) and torch.equal(dh, hh.grad) and torch.equal(dw, ww.grad)
    assert hh.grad.abs().sum() > 0 and ww.grad.abs().sum() > 0
    frozen = lm_head_loss_and_grads(h, w, t, chunks=3, z_loss=1e-3, scale=0.1, need_weight_grad=False)  # LoRA's head
    assert torch.equal(frozen[0], loss) and torch.equal(frozen[1], dh) and frozen[2] is None
    only = lm_head_loss_and_grads(h, w, t, chunks=3, z_loss=1e-3, scale=0.1, need_grad=False)
    assert torch.equal(only[0], loss) and only[1] is None and only[2] is None
    none = lm_head_loss_and_grads(h[:0], w, t[:0], chunks=3, z_loss=1e-3, scale=0.1)  # no tokens: d(w) is zero
    assert float(none[0]) == 0 and none[1].shape == (0, 16) and torch.equal(none[2], torch.zeros_like(w))
    with pytest.raises(ValueError, match="lmhead-chunks"):
        lm_head_loss_and_grads(h, w, t, chunks=0, z_loss=0.0, scale=1.0)


@pytest.mark.parametrize("chunks", [1, 3])
def test_head_grads_through_the_micro_steps_logits_buffer_are_the_same(chunks):
    """With the buffer a micro-step claims before its blocks (`head_logits_buffer`: as many rows as the largest chunk,
    the head's dtype) the loss and both gradients are bit for bit those the head gives allocating its own logits, and
    the chunks' logits were written there (its bytes changed); a buffer's rows follow the FP8 backward's 16-row
    chunks too."""
    from qtrain.kernels.cross_entropy import head_logits_buffer, lm_head_loss_and_grads
    g = torch.Generator().manual_seed(7)
    h = torch.randn(37, 16, generator=g).to(torch.bfloat16)
    w = (torch.randn(203, 16, generator=g) * 0.3).to(torch.bfloat16)
    t = torch.randint(0, 203, (37,), generator=g)
    want = lm_head_loss_and_grads(h, w, t, chunks=chunks, z_loss=1e-3, scale=0.1)
    buf = head_logits_buffer(37, w, chunks=chunks)
    assert buf.shape == (-(-37 // chunks), 203) and buf.dtype == w.dtype
    buf.fill_(float("nan"))
    got = lm_head_loss_and_grads(h, w, t, chunks=chunks, z_loss=1e-3, scale=0.1, logits_buffer=buf)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not buf.isnan().any()  # every row of the largest chunk was written
    head = torch.empty(256, 32)  # 112 rows in three chunks: 37-38 rows each, with FP8's 16-row groups 32, 32, 48
    assert head_logits_buffer(112, head, chunks=3).shape[0] == 38
    assert head_logits_buffer(112, head, chunks=3, fp8_backward=True).shape[0] == 48
    with pytest.raises(ValueError, match="lmhead-chunks"):
        head_logits_buffer(37, w, chunks=0)


# --------------------------------------------------------------------------------- Triton vs twin
def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    ia, ib = a.view(torch.int16).to(torch.int32), b.view(torch.int16).to(torch.int32)
    # sign-magnitude -> monotone integers (so -0 and +0 are 0 ulps apart)
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    return int((ia - ib).abs().max())


def _check_triton_vs_twin(x, t, z_loss, *, block=None, need_grad=True):
    """Kernel (in place on a copy) vs twin. Tolerances, fp32: the kernel's lse is an online max/sum-exp over
    blocks, the twin's torch.logsumexp is two-pass, so lse agrees to a few ulps (rtol 2e-6, |lse| ~ 10-1000);
    d(logits) = exp(x - lse) inherits that as an absolute error of ~ulp(lse) in the exponent, i.e. a relative
    error ~1e-6 on each probability (atol 2e-6 relative to values <= 1 + 2 z lse), and the per-row losses
    are then summed in a different order (rtol 1e-5). bf16/fp16: the fp32 results round to the same
    16-bit value except where they straddle a rounding boundary: at most 1 ulp."""
    kw = dict(z_loss=z_loss, need_grad=need_grad)
    buf = x.clone()
    if block is None:
        with dispatch.backend("triton"):
            loss, lse, dl = ce.cross_entropy_fwd_bwd_inplace_(buf, t, **kw)
    else:
        loss, lse, dl = ce._launch(buf, t, **kw, block=block, num_warps=4)
    with dispatch.backend("twin"):
        r_loss, r_lse, r_dl = ce.cross_entropy_fwd_bwd_inplace_(x.clone(), t, **kw)
    assert loss.dtype == lse.dtype == torch.float32 and loss.dim() == 0
    torch.testing.assert_close(lse, r_lse, rtol=2e-6, atol=0)
    torch.testing.assert_close(loss, r_loss, rtol=1e-5, atol=1e-6)
    if not need_grad:
        assert dl is None and torch.equal(buf, x)
        return
    assert dl is buf
    if x.dtype == torch.float32:
        torch.testing.assert_close(dl, r_dl, rtol=1e-5, atol=2e-6)
    elif x.dtype == torch.bfloat16:
        assert _bf16_ulps(dl, r_dl) <= 1
    else:  # fp16: 1 ulp is 2**-10 relative for normals, 2**-24 absolute for subnormals
        assert bool(((dl.float() - r_dl.float()).abs() <= r_dl.float().abs() * 2**-10 + 2**-24).all())
    ignored = t == IGNORE_INDEX
    assert not dl[ignored].any(), "ignored rows get an all-zero gradient"
    # each valid row's gradient sums to 2 z lse (softmax sums to 1, minus the one-hot)
    rs = dl[~ignored].double().sum(1)
    # fp32: sum of V values each within ~1e-6 relative; 16-bit: each stored value within half an ulp
    # (2**-9 relative), so the probabilities' total is off by <= 2**-9 and the target's -1 + p by <= 2**-9
    atol = 1e-4 if x.dtype == torch.float32 else 5e-3
    torch.testing.assert_close(rs, (2 * z_loss * r_lse[~ignored]).double(), rtol=0, atol=atol)


# (n, V, BLOCK): V a multiple of the block, V not a multiple, V below one block, V = 1
INTERP_SHAPES = [(6, 512, 128), (7, 1000, 128), (5, 77, 128), (3, 1, 16)]


@interp_only
@pytest.mark.parametrize("n,v,block", INTERP_SHAPES)
@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
def test_interp_triton_matches_twin_fp32(n, v, block, z_loss):
    x, t = make_case(n, v, seed=n + v)
    _check_triton_vs_twin(x, t, z_loss, block=block)
    _check_triton_vs_twin(x, t, z_loss, block=block, need_grad=False)


@interp_only
def test_interp_large_logits_and_all_ignored():
    """Online max keeps exp() in range for logits around 1e3 (a naive sum of exp would overflow)."""
    x, t = make_case(4, 300, scale=30.0, shift=1000.0, seed=5)
    _check_triton_vs_twin(x, t, 1e-4, block=64)
    t_all = torch.full_like(t, IGNORE_INDEX)
    _check_triton_vs_twin(x, t_all, 1e-4, block=64)


@interp_only
def test_interp_strided_rows_leave_padding_alone():
    """Rows of a wider buffer (stride(0) > V): the kernel writes only the V columns of each row."""
    x, t = make_case(5, 333, seed=9)
    wide = torch.full((5, 400), 7.0)
    wide[:, :333] = x
    view = wide[:, :333]
    loss, lse, dl = ce._launch(view, t, z_loss=0.0, need_grad=True, block=128, num_warps=4)
    r_loss, r_lse, r_dl = _chunk_loss_and_dlogits(x, t, z_loss=0.0, need_grad=True)
    torch.testing.assert_close(dl, r_dl, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(lse, r_lse, rtol=2e-6, atol=0)
    assert torch.equal(wide[:, 333:], torch.full((5, 67), 7.0))


@interp_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_interp_16bit_through_bit_level_loads(dtype):
    """bf16 is loaded and stored as int16 bit patterns (RNE by integer arithmetic), so the interpreter's
    unreliable bf16 arithmetic is never used; fp16 goes through Triton's own conversion."""
    x, t = make_case(6, 700, dtype, seed=11)
    _check_triton_vs_twin(x, t, 1e-3, block=128)


@interp_only
def test_interp_public_dispatch_uses_default_block():
    x, t = make_case(3, ce.BLOCK_V + 5, seed=13)
    _check_triton_vs_twin(x, t, 1e-3)


# ------------------------------------------------------------------------- sm_90 build, on the CPU
CE_SIG = {"logits_ptr": "*i16", "targets_ptr": "*i64", "loss_ptr": "*fp32", "lse_ptr": "*fp32", "V": "i32",
          "stride_row": "i32", "z_loss": "fp32"}


@pytest.mark.skipif(not dispatch.HAS_TRITON, reason="no triton")
@pytest.mark.parametrize("kind", [0, 1])
@pytest.mark.parametrize("write_grad", [True, False])
def test_kernel_builds_for_hopper(kind, write_grad):
    """The kernel compiles for sm_90 at the launch shape used (bf16 through int16 pointers, fp32), with and
    without pass 2: its d(logits) stores are there only with it."""
    sig = {**CE_SIG, "logits_ptr": "*i16" if kind == 1 else "*fp32"}
    ptx = compile_for_hopper(ce._ce_fwd_bwd_kernel, sig, {"KIND": kind, "WRITE_GRAD": write_grad,
                                                           "BLOCK": ce.BLOCK_V}, num_warps=ce.NUM_WARPS)
    stores = ptx.count("st.global")
    assert stores > (2 if write_grad else 0), "loss and lse per row, and with pass 2 the gradient blocks"


# --------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("v", [151936, 32000 + 7])
def test_gpu_triton_matches_twin(dtype, v):
    x, t = make_case(64, v, dtype, seed=v, device="cuda")
    _check_triton_vs_twin(x, t, 1e-4)
    _check_triton_vs_twin(x, t, 0.0, need_grad=False)


@pytest.mark.gpu
@needs_cuda
def test_gpu_bf16_matches_cpu_specification():
    x, t = make_case(16, 151936, torch.bfloat16, seed=2)
    r_loss, r_lse, r_dl = _chunk_loss_and_dlogits(x, t, z_loss=1e-4, need_grad=True)
    with dispatch.backend("triton"):
        loss, lse, dl = ce.cross_entropy_fwd_bwd_inplace_(x.cuda(), t.cuda(), z_loss=1e-4, need_grad=True)
    torch.testing.assert_close(lse.cpu(), r_lse, rtol=2e-6, atol=0)
    torch.testing.assert_close(loss.cpu(), r_loss, rtol=1e-5, atol=1e-6)
    assert _bf16_ulps(dl.cpu(), r_dl) <= 1


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("z_loss", [0.0, 1e-4])
def test_gpu_chunked_lm_head_loss_with_fused_ce(z_loss):
    """The whole LM head + loss with the fused kernel (what CUDA logits run) matches the head running the
    specification on the GPU (the twin backend): same bf16 GEMMs, d(logits) within 1 bf16 ulp, so loss to fp32
    rounding and gradients to ~bf16 noise."""
    g = torch.Generator().manual_seed(4)
    n, c, v = 300, 128, 151936
    h = (torch.randn(n, c, generator=g)).to(torch.bfloat16).cuda()
    w = (torch.randn(v, c, generator=g) * 0.05).to(torch.bfloat16).cuda()
    t = torch.randint(0, v, (n,), generator=g)
    t[::5] = IGNORE_INDEX
    t = t.cuda()
    results = []
    for backend in ("twin", "auto"):
        with dispatch.backend(backend):
            hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
            out = chunked_lm_head_loss(hh, ww, t, chunks=3, z_loss=z_loss,
                                       scale=1.0 / int((t != IGNORE_INDEX).sum()))
            out.backward()
            results.append((out.detach().float(), hh.grad.float(), ww.grad.float()))
            with torch.no_grad():  # evaluation path (need_grad=False)
                results[-1] += (chunked_lm_head_loss(h, w, t, chunks=2, z_loss=z_loss).float(),)
    (la, dha, dwa, ea), (lb, dhb, dwb, eb) = results
    torch.testing.assert_close(lb, la, rtol=1e-5, atol=0)
    torch.testing.assert_close(eb, ea, rtol=1e-5, atol=0)
    for a, b in ((dha, dhb), (dwa, dwb)):
        assert float((b - a).norm() / a.norm()) < 1e-2
