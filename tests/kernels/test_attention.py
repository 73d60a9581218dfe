"""qtrain's causal attention op pair (kernels/attention.py): the twin is softmax attention, the op's layouts
are what it promises, torch.compile sees it as opaque and gets the same numbers, and on the GPU the cuDNN
kernels agree with torch's flash attention.

Tolerances: the twin computes in fp32, so against F.scaled_dot_product_attention on float64 inputs the
difference is fp32 rounding of O(1) values over sums of T terms (< 1e-5). On the GPU both sides are bf16
kernels with fp32 accumulation: each rounds outputs to bf16 (relative 2^-8), so they may differ by a few
bf16 ulps; gradients are compared relative to their largest element (2e-2, ~5 ulps of the largest).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qtrain.kernels.attention import (causal_attention, causal_attention_backward_twin, causal_attention_twin)

SHAPES = [(2, 24, 4, 2, 16), (1, 17, 6, 6, 8), (2, 9, 8, 1, 32)]  # (B, T, nh, nkv, hs): GQA, MHA, MQA


def block_qkv(B, T, nh, nkv, hs, dtype=torch.float64, device="cpu", seed=0):
    """A (B, T, nh + 2 nkv, hs) projection output and q, k, v as the block makes them (transposed views)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(B, T, nh + 2 * nkv, hs, dtype=torch.float32, device=device, generator=g).to(dtype)
    x.requires_grad_()
    q, k, v = x.split([nh, nkv, nkv], dim=2)
    return x, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def reference(shape, dtype=torch.float64, device="cpu", backend=None):
    """(out, d qkv) from F.scaled_dot_product_attention and the upstream gradient used."""
    x, q, k, v = block_qkv(*shape, dtype=dtype, device=device)
    if backend:
        from torch.nn.attention import sdpa_kernel
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    dout = torch.randn(out.shape, dtype=torch.float32, device=device,
                       generator=torch.Generator(device=device).manual_seed(1)).to(dtype)
    out.backward(dout)
    return out.detach(), x.grad, dout


def is_bthd(t: torch.Tensor) -> bool:
    return t.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_twin_is_causal_softmax_attention(shape):
    ref_out, ref_dx, dout = reference(shape)
    x, q, k, v = block_qkv(*shape)
    out, lse = causal_attention_twin(q, k, v)
    assert is_bthd(out) and out.dtype == q.dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-5)
    dq, dk, dv = causal_attention_backward_twin(q, k, v, out, lse, dout)
    assert all(is_bthd(t) for t in (dq, dk, dv))
    nh, nkv = shape[2], shape[3]
    torch.testing.assert_close(torch.cat([dq, dk, dv], 1).transpose(1, 2), ref_dx, rtol=0, atol=1e-5)
    assert ref_dx[:, :, nh:nh + nkv].abs().max() > 0.1 and ref_dx[:, :, nh + nkv:].abs().max() > 0.1  # dk, dv not ~0


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_op_autograd_and_compile(compiled):
    """The op differentiates through its registered backward, and a compiled caller (which only sees the
    fake implementations' layouts) gets the same values as the eager one (the op runs the same twin; only
    inductor's own row sum after it may associate differently: a few fp32 ulps)."""
    shape = SHAPES[0]
    B, T, nh = shape[:3]

    w = torch.randn(nh * shape[4], generator=torch.Generator().manual_seed(5))  # a gradient that is not uniform

    def f(q, k, v):
        return (causal_attention(q, k, v).transpose(1, 2).reshape(B, T, -1) * w).sum(-1)

    x0, q, k, v = block_qkv(*shape, dtype=torch.float32)
    y0 = f(q, k, v)
    y0.backward(torch.ones_like(y0))
    if compiled:
        x1, q, k, v = block_qkv(*shape, dtype=torch.float32)
        y1 = torch.compile(f, dynamic=False)(q, k, v)
        y1.backward(torch.ones_like(y1))
        torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(x1.grad, x0.grad, rtol=1e-5, atol=1e-6)
    x, q, k, v = block_qkv(*shape, dtype=torch.float32)  # the same loss through torch's attention
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    (out.transpose(1, 2).reshape(B, T, -1) * w).sum().backward()
    torch.testing.assert_close(x0.grad, x.grad, rtol=0, atol=2e-5)


def test_compiled_block_with_the_op_matches_eager():
    """A whole decoder block (qkv projection, RoPE, the op, output projection, MLP) compiled by inductor on
    the CPU, against the same block run eagerly: what the compiled graph hands the op (and reads back from
    it) must agree with the op's declared layouts. fp32; inductor may fuse and reassociate the elementwise
    work around the op, so a few fp32 ulps of O(1) values."""
    from qtrain.model.llama import LlamaConfig
    from qtrain.model.init import init_params
    from qtrain.kernels.rope import rope_tables
    from qtrain.model.transformer import allocate_params, make_block_fn
    cfg = LlamaConfig(model_type="qwen2", vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
                      tie_word_embeddings=True, attention_bias=True)
    params = allocate_params(cfg, dtype=torch.float32, device="cpu")
    init_params(cfg, params, seed=0)
    w = {n.split(".", 2)[2]: p for n, p in params.items() if n.startswith("layers.0.")}
    B, T = 2, 16
    cos, sin = rope_tables(cfg, T, device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(B, T, cfg.hidden_size, generator=g)
    dy = torch.randn(B, T, cfg.hidden_size, generator=g)
    results = []
    for compiled in (False, True):
        fn = make_block_fn(cfg, sdpa_backend="cudnn")
        fn = torch.compile(fn, dynamic=False) if compiled else fn
        xi = x.clone().requires_grad_()
        wi = {k: v.detach().clone().requires_grad_() for k, v in w.items()}
        y = fn(xi, wi, cos, sin)
        y.backward(dy)
        results.append((y.detach(), xi.grad, {k: v.grad for k, v in wi.items()}))
    (y0, dx0, dw0), (y1, dx1, dw1) = results
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx1, dx0, rtol=1e-5, atol=1e-5)
    for k in dw0:
        torch.testing.assert_close(dw1[k], dw0[k], rtol=1e-4, atol=1e-5, msg=k)


def test_rejects_bad_shapes():
    q = torch.zeros(1, 3, 4, 8)
    with pytest.raises(ValueError, match="nkv | nh"):
        causal_attention(q, torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(4, 1024, 12, 2, 128), (2, 1024, 28, 4, 128), (3, 256, 14, 2, 64)], ids=str)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gpu_cudnn_op_matches_flash(shape, compiled):
    """cuDNN through the op, eager and inside torch.compile, against torch's flash attention run eagerly
    (bf16; tolerance in the module docstring). This is the test that caught F.sdpa's cuDNN path inside
    compiled graphs (relative gradient error ~1.6 on the H200)."""
    from torch.nn.attention import SDPBackend
    ref_out, ref_dx, dout = reference(shape, dtype=torch.bfloat16, device="cuda", backend=SDPBackend.FLASH_ATTENTION)
    x, q, k, v = block_qkv(*shape, dtype=torch.bfloat16, device="cuda")
    fn = torch.compile(causal_attention, dynamic=False) if compiled else causal_attention
    out = fn(q, k, v)
    assert is_bthd(out)
    out.backward(dout)
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=2e-2, atol=2e-2)
    err = (x.grad.float() - ref_dx.float()).abs().max() / ref_dx.float().abs().max()
    assert err < 2e-2, f"relative gradient error {err:.3g}"


def test_auto_backend_resolution():
    """'auto' becomes cudnn only on Hopper CUDA devices (where the op was validated); names given stay."""
    from qtrain.model.layers import resolve_sdpa_backend
    bf16 = torch.bfloat16
    assert resolve_sdpa_backend("auto", torch.device("cpu"), bf16) == "auto"
    assert resolve_sdpa_backend("flash", torch.device("cpu"), bf16) == "flash"
    if torch.cuda.is_available():
        hopper = torch.cuda.get_device_capability()[0] == 9
        assert resolve_sdpa_backend("auto", torch.device("cuda"), bf16) == ("cudnn" if hopper else "auto")
        assert resolve_sdpa_backend("auto", torch.device("cuda"), torch.float32) == "auto"  # cuDNN takes no fp32
        assert resolve_sdpa_backend("flash", torch.device("cuda"), bf16) == "flash"
