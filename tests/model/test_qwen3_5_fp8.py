"""--matmul-dtype e4m3 in the Qwen3.5 block (model/qwen3_5/block.py; FP8_MATRICES: in_proj, out, qkv, o, up, down run
through matmul.block_linear's FP8 function, the delta rule, convolution, norms and gates in the model dtype): each layer
kind's block, built as the Transformer builds it, stays within e4m3's rounding of the bf16 block, its output and the
gradient of its input and of every weight. tests/train/test_qwen3_5_train.py trains it through `qtrain train`.

Tolerance (relative error in norm, per tensor): one GEMM with both operands rounded to e4m3 (3 mantissa bits: each
element within 2^-4 of itself) is within 2^-4 sqrt(2) of the exact one (tests/kernels/test_grouped_gemm_fp8.py says
why), and the independent errors of a chain of GEMMs add in quadrature. The longest chains are the input's gradient and
the first linear's weight gradient: four forwards (in_proj or qkv, out or o, up, down; the MLP reads the attention's
output) and four backwards, so 2^-4 sqrt(16) = 0.25 bounds every tensor (measured 0.06-0.10, and 0.13 for the gated
norm's gain, a sum of cancelling terms; other seeds and weight scales move the decay rates' gradients, the same kind
of sum, to ~0.2). The output and the input's gradient are compared without the residual (out - x, dx - dy), which
would otherwise hide the block's own error. The input has the scale of a fresh model's first block (its embedding's
init std 0.02), so the branch outweighs the residual and bf16's rounding of out = x + branch stays a small part of the
difference (the bf16 block against the fp32 one: <= 0.03).
"""
from __future__ import annotations

import pytest
import torch

from qtrain.kernels.rope import rope_tables
from qtrain.model.init import init_params
from qtrain.model.transformer import RunOptions, Transformer, allocate_params
from tests.model.family_fixtures import qwen35_cfg

# 8 value heads: in_proj's rows (q, k, v, z, b, a: 336) a multiple of 16, as the FP8 GEMMs need
CFG = qwen35_cfg(linear_num_value_heads=8, num_hidden_layers=2, layer_types=("linear_attention", "full_attention"))
CHAIN = 2.0**-4 * 16**0.5  # module docstring
B, T = 2, 32


def _run(matmul_dtype: str, w0: dict[str, torch.Tensor], x0: torch.Tensor, dy: torch.Tensor, cos, sin
         ) -> dict[str, torch.Tensor]:
    fn = Transformer(CFG, RunOptions(matmul_dtype=matmul_dtype)).block_fn
    w = {k: v.detach().clone().requires_grad_() for k, v in w0.items()}
    x = x0.detach().clone().requires_grad_()
    out = fn(x, w, cos, sin)
    out.backward(dy)
    return {"out - x": (out - x).detach().float(), "dx - dy": (x.grad - dy).float(),
            **{f"d({k})": v.grad.float() for k, v in w.items()}}


@pytest.mark.parametrize("layer", [0, 1], ids=["linear_attention", "full_attention"])
def test_fp8_block_within_e4m3_rounding_of_the_bf16_block(layer):
    params = allocate_params(CFG, dtype=torch.bfloat16, device="cpu")
    init_params(CFG, params)  # the model's own initialisation (its norms' gains at their identity)
    w0 = {k.split(".", 2)[2]: v for k, v in params.items() if k.startswith(f"layers.{layer}.")}
    g = torch.Generator().manual_seed(layer)
    x0 = (0.02 * torch.randn(B, T, CFG.hidden_size, generator=g)).bfloat16()
    dy = torch.randn(B, T, CFG.hidden_size, generator=g).bfloat16()
    cos, sin = rope_tables(CFG, T, "cpu", torch.bfloat16)
    ref, got = _run("", w0, x0, dy, cos, sin), _run("e4m3", w0, x0, dy, cos, sin)
    assert got.keys() == ref.keys() and len(ref) == 2 + len(w0)
    errors = {k: ((got[k] - ref[k]).norm() / ref[k].norm()).item() for k in ref}
    assert all(e < CHAIN for e in errors.values()), errors
    # the FP8 path ran: e4m3's rounding (~2^-4 / sqrt(3) rms an operand) shows in every tensor
    assert all(e > 2.0**-5 for e in errors.values()), errors
    assert all(torch.isfinite(t).all() for t in got.values())
