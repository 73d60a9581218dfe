"""The frozen base linear and its adapters as one op (`model/lora/fused_linear.py`), on the CPU: equal to its twin
(the unfused path's autograd) in fp64, every gradient it makes; its input gradient is one addmm over the base's
(the point of the op: no separate add pass), as AOTAutograd traces it for a compiled block; and a block takes it
exactly where it applies (no dropout, a plain linear), with the same output and gradients as the unfused path.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import qtrain.model.lora.adapter as adapter_mod
from qtrain.model.lora import LoraAdapter, LoraSpec
from qtrain.model.lora.fused_linear import adapted_linear, adapted_linear_twin
from qtrain.model.lora.tensors import adapter_tensors
from tests.model.test_activations import small_cfg


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("base_grads", [False, True])
def test_equals_the_twin_in_fp64_with_every_gradient(bias, base_grads):
    """fp64: the two differ only in summation order, so 1e-12 of each tensor's scale bounds them (measured ~1e-16);
    a frozen W and b get no gradient, a trainable one its own."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 12, generator=gen, dtype=torch.float64).requires_grad_()
    w = torch.randn(20, 12, generator=gen, dtype=torch.float64).requires_grad_(base_grads)
    b = torch.randn(20, generator=gen, dtype=torch.float64).requires_grad_(base_grads) if bias else None
    a = torch.randn(6, 12, generator=gen, dtype=torch.float64).requires_grad_()
    bd = torch.randn(20, 6, generator=gen, dtype=torch.float64).requires_grad_()
    leaves = [t for t in (x, w, b, a, bd) if t is not None and t.requires_grad]
    dout = torch.randn(2, 5, 20, generator=gen, dtype=torch.float64)
    got = adapted_linear(x, w, b, a, bd, 1.5)
    want = adapted_linear_twin(x, w, b, a, bd, 1.5)
    assert _rel(got, want) <= 1e-12
    for g, h in zip(torch.autograd.grad(got, leaves, dout), torch.autograd.grad(want, leaves, dout)):
        assert g.shape == h.shape and _rel(g, h) <= 1e-12
    if not base_grads:
        assert not w.requires_grad and len(leaves) == 3  # x, A, Bbd only


def test_the_input_gradient_is_one_addmm_over_the_base_gradient():
    """As AOTAutograd traces it (what inductor compiles): d(x) leaves the backward graph as aten.addmm whose C is the
    base's d(x) (an aten.mm of d(out) and W), and no aten.add makes it."""
    from functorch.compile import aot_function, make_boxed_func

    graphs = []

    def record(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 12, generator=gen).requires_grad_()
    w, a = torch.randn(20, 12, generator=gen), torch.randn(4, 12, generator=gen).requires_grad_()
    bd = torch.randn(20, 4, generator=gen).requires_grad_()
    fn = aot_function(lambda x, w, a, bd: adapted_linear(x, w, None, a, bd, 2.0), fw_compiler=lambda gm, _: make_boxed_func(gm.forward),
                      bw_compiler=record)
    fn(x, w, a, bd).sum().backward()
    (bw,) = graphs
    out = next(n for n in bw.graph.nodes if n.op == "output")
    dx = out.args[0][0]
    while dx.target in (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
                        torch.ops.aten.reshape.default):
        dx = dx.args[0]
    assert dx.target == torch.ops.aten.addmm.default, dx.format_node()
    assert dx.args[0].target == torch.ops.aten.mm.default  # C: d(out) W, the base's input gradient
    assert not [n for n in bw.graph.nodes if n.target in (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor)]


@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_a_block_fuses_exactly_where_it_applies_and_computes_the_same(dropout, monkeypatch):
    """Every adapted matrix of a Qwen2 block (q, k, v, o, gate, up, down) runs through the fused op without dropout,
    none with it; forcing the unfused path gives the same output and gradients (fp32: summation order only, 2e-6 of
    each tensor's scale; fp32 epsilon 1.2e-7)."""
    from qtrain.kernels.rope import rope_tables
    from qtrain.model.matmul import block_linear
    from qtrain.model.transformer import make_block_fn
    from qtrain.model.weights import block_shapes
    cfg = small_cfg("qwen2", layers=1)
    spec = LoraSpec(4, 8.0, dropout, ("q", "k", "v", "o", "gate", "up", "down"))
    gen = torch.Generator().manual_seed(2)
    w = {n: 0.05 * torch.randn(s, generator=gen) for n, s in block_shapes(cfg, 0).items()}
    w.update({t.name: 0.1 * torch.randn(t.shape, generator=gen).requires_grad_()
              for t in adapter_tensors(cfg, spec, 0)})
    adapter = LoraAdapter(cfg, spec, seed=1)
    adapter.bind_layers([w])
    fn = make_block_fn(cfg, block_linear(""), adapter=adapter)
    cos, sin = rope_tables(cfg, 16, "cpu", torch.float32)
    x = torch.randn(2, 16, cfg.hidden_size, generator=gen).requires_grad_()
    leaves = [x] + [t for t in w.values() if t.requires_grad]
    dout = torch.randn(2, 16, cfg.hidden_size, generator=gen)
    calls = []
    fused = adapter_mod.adapted_linear
    monkeypatch.setattr(adapter_mod, "adapted_linear", lambda *args: calls.append(1) or fused(*args))
    got = fn(x, w, cos, sin)
    g_got = torch.autograd.grad(got, leaves, dout)
    assert len(calls) == (0 if dropout else len(adapter.parts))  # qkv, o, up (gate + up), down
    if dropout:
        return
    monkeypatch.setattr(LoraAdapter, "fuses", lambda self, name, w: False)
    want = fn(x, w, cos, sin)
    g_want = torch.autograd.grad(want, leaves, dout)
    assert len(calls) == len(adapter.parts) == 4
    assert _rel(got, want) <= 2e-6
    for g, h in zip(g_got, g_want):
        assert _rel(g, h) <= 2e-6
