"""The adapter term of one block linear (`LoraAdapter.__call__`) against peft's expression per target, fp32, CPU.

qtrain adds every target of a fused matrix (qkv = [q; k; v], up = [up; gate]) with one GEMM into the base output, y + s
h Bbd^T (h: every target's A output, Bbd: the targets' B block-diagonal, zero rows for an untargeted module); peft adds
result + lora_B(lora_A(dropout(x))) * scaling per module. They differ only in the GEMMs' summation (exact zeros added,
blocking), so the output and the gradients of x, y, A and B agree to fp32 rounding: asserted within 2e-6 of each
tensor's scale (measured: <= 5.4e-7; fp32 epsilon 1.2e-7), the untargeted rows bitwise (y's own values, y's gradient).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qtrain.model.lora import LoraAdapter, LoraSpec
from qtrain.model.lora.adapter import block_diagonal
from qtrain.model.lora.tensors import a_name, adapted, adapter_tensors, b_name
from tests.model.test_activations import small_cfg

RANK, ALPHA = 4, 6.0
TARGET_SETS = [("q", "k", "v", "o", "gate", "up", "down"), ("q", "v"), ("k",), ("up",), ("gate", "down"), ("o",)]


def peft_term(cfg, adapter: LoraAdapter, matrix: str, x, w, y):
    """peft's `lora.Linear.forward` for each target module of `matrix`: its rows of y plus s B_i A_i dropout_i(x)
    (the masks drawn by the adapter's own key, as its dropout does)."""
    r, a, b = adapter.r, w[a_name(matrix)], w[b_name(matrix)]
    out, brow = y.clone(), 0
    targets = adapted(cfg, adapter.spec, 0)[matrix]
    for i, (t, xi) in enumerate(zip(targets, adapter._drop(x, a, matrix, len(targets)))):
        term = F.linear(F.linear(xi, a[i * r:(i + 1) * r]), b[brow:brow + t.rows]) * adapter.scaling
        out = torch.cat([out[..., :t.row], out[..., t.row:t.row + t.rows] + term, out[..., t.row + t.rows:]], -1)
        brow += t.rows
    return out


def _grads(fn, leaves):
    out = fn()
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    return (out, *torch.autograd.grad(out, leaves, g))


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dropout", [0.0, 0.25])
@pytest.mark.parametrize("targets", TARGET_SETS)
def test_one_gemm_term_equals_peft_per_target(targets, dropout):
    cfg = small_cfg("qwen2", layers=1)
    spec = LoraSpec(RANK, ALPHA, dropout, targets)
    adapter = LoraAdapter(cfg, spec, seed=3)
    gen = torch.Generator().manual_seed(0)
    w = {t.name: torch.randn(t.shape, generator=gen).requires_grad_() for t in adapter_tensors(cfg, spec, 0)}
    adapter.bind_layers([w])
    adapter.at(2, 1)
    for matrix, (parts, total) in adapter.parts.items():
        x = torch.randn(2, 8, adapter.cols[matrix], generator=gen).requires_grad_()
        y = torch.randn(2, 8, total, generator=gen).requires_grad_()
        leaves = (x, y, w[a_name(matrix)], w[b_name(matrix)])
        got = _grads(lambda: adapter(matrix, x, w, y), leaves)
        want = _grads(lambda: peft_term(cfg, adapter, matrix, x, w, y), leaves)
        for name, g_, w_ in zip(("out", "x", "y", "a", "b"), got, want):
            assert _rel(g_, w_) <= 2e-6, (matrix, name, _rel(g_, w_))
        untargeted = torch.ones(total, dtype=torch.bool)
        for row, rows in parts:
            untargeted[row:row + rows] = False
        assert torch.equal(got[0][..., untargeted], y[..., untargeted])  # an untargeted module gets nothing added
        assert torch.equal(got[2], want[2])  # y's gradient is the output's, bitwise


def test_block_diagonal_layout():
    """Bbd of q and v in qkv (rows 0-63 q, 64-95 k, 96-127 v): B_q in columns 0-3 of q's rows, B_v in 4-7 of v's
    rows, zeros elsewhere (k's rows all zero)."""
    b = torch.arange(1, (64 + 32) * RANK + 1, dtype=torch.float32).view(96, RANK)
    bd = block_diagonal(b, [(0, 64), (96, 32)], 128, RANK)
    assert bd.shape == (128, 2 * RANK)
    assert torch.equal(bd[:64, :RANK], b[:64]) and torch.equal(bd[96:, RANK:], b[64:])
    assert not bd[:64, RANK:].any() and not bd[64:96].any() and not bd[96:, :RANK].any()


def test_adapters_leave_a_compiled_block_one_graph():
    """Without dropout no adapter leaves the compiled block's graph: the whole block of all seven targets is one
    dynamo frame. Before, each adapter of an unfused matrix (o, down) called the dropout function, which dynamo may
    not trace (torch._disable_dynamo), dropout or not: 8 graphs a block. With dropout each adapted matrix breaks
    the graph once (its masks' generators)."""
    from torch._dynamo.testing import CompileCounter

    from qtrain.kernels.rope import rope_tables
    from qtrain.model.matmul import block_linear
    from qtrain.model.transformer import make_block_fn
    from qtrain.model.weights import block_shapes
    cfg = small_cfg("qwen2", layers=1)
    spec = LoraSpec(RANK, ALPHA, 0.0, TARGET_SETS[0])
    gen = torch.Generator().manual_seed(0)
    w = {n: 0.02 * torch.randn(s, generator=gen) for n, s in block_shapes(cfg, 0).items()}
    w.update({t.name: torch.randn(t.shape, generator=gen).requires_grad_() for t in adapter_tensors(cfg, spec, 0)})
    fn = make_block_fn(cfg, block_linear(""), adapter=LoraAdapter(cfg, spec))
    cos, sin = rope_tables(cfg, 16, "cpu", torch.float32)
    x = torch.randn(2, 16, cfg.hidden_size, generator=gen)
    counter = CompileCounter()
    torch._dynamo.reset()
    got = torch.compile(fn, backend=counter, dynamic=False)(x, w, cos, sin)
    assert counter.frame_count == 1
    assert torch.equal(got, fn(x, w, cos, sin))
