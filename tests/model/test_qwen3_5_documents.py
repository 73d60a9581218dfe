"""--document-masking for the hybrid Qwen3.5 model: a micro-batch of packed documents computes, in fp32 on the CPU, the
loss and every gradient its documents give when each runs alone (positions from 0), dense and MoE, with both forms of
document attention, chunked attention and recompute. On linear-attention layers the causal convolution and the
delta-rule state restart at each document's first token; full attention stays inside each document.

The rows are longer than one delta-rule chunk (64) and their documents cross chunk boundaries. The MoE model runs
with router_aux_loss_coef = 0: the load-balancing loss is a statistic of the whole micro-batch (its f . P over all
rows), which no sum over documents reproduces; every token's routing itself is per token.

Tolerance: the same sums in other groupings (fp32), as tests/model/test_document_masking.py: 1e-5 relative on the
summed loss; per tensor, the gradient's error norm relative to its norm below 1e-4 (measured up to 3e-5: the delta
rule's gradients sum cancelling terms through exp(cumulative decay) over 50-token documents, and fp32 rounding of
those sums reaches every earlier tensor; tests/model/test_qwen3_5.py measures the same effect against transformers).
That this is rounding and not a missed boundary: the same comparison in fp64 agrees to 2e-7 (the fp32 parts of the
loss; a boundary the state crossed would move gradients by O(1)), asserted below at 1e-6.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from qtrain.kernels.cross_entropy import IGNORE_INDEX  # noqa: E402
from qtrain.model.transformer import RunOptions, Transformer  # noqa: E402
from qtrain.model.weights import hf_to_internal  # noqa: E402
from qtrain.parallel.weights.replicated import ParamWeights  # noqa: E402
from tests.model.family_fixtures import Collect, hf_state  # noqa: E402
from tests.model.family_fixtures import qwen35_cfg as tiny_cfg, qwen35_hf_model as hf_model  # noqa: E402

T = 80
# two rows: documents of these lengths, each row's last one padding (no targets); documents cross the chunk at 64
ROWS = [(11, 6, 50, 13), (70, 1, 9)]


def packed_batch(vocab: int, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, vocab, (len(ROWS), T), generator=g)
    targets = torch.full((len(ROWS), T), IGNORE_INDEX)
    positions = torch.zeros((len(ROWS), T), dtype=torch.int64)
    docs = []
    for r, lengths in enumerate(ROWS):
        s = 0
        for i, n in enumerate(lengths):
            positions[r, s:s + n] = torch.arange(n)
            if i < len(lengths) - 1:
                targets[r, s:s + n - 1] = torch.randint(0, vocab, (n - 1,), generator=g)
                docs.append((inputs[r, s:s + n], targets[r, s:s + n]))
            s += n
        assert s == T
    return inputs, targets, positions, docs


def config(moe: bool):
    return tiny_cfg(moe=moe, num_hidden_layers=3, tied=moe,
                    layer_types=("linear_attention", "full_attention", "linear_attention"),
                    **({"router_aux_loss_coef": 0.0} if moe else {}))


def params_of(cfg):
    sd = hf_state(hf_model(cfg, seed=2))
    return {n: t.detach().clone().requires_grad_(True) for n, t in hf_to_internal(cfg, lambda k: sd[k])}


def run_packed(cfg, params, run, inputs, targets, positions):
    sink = Collect()
    loss = Transformer(cfg, run).forward_backward(ParamWeights(cfg, params), inputs, targets, grads=sink,
                                                  loss_scale=1.0, positions=positions)
    return loss, sink.grads


def run_alone(cfg, params, docs):
    model, total, grads = Transformer(cfg, RunOptions()), torch.zeros(()), {}
    for tokens, targets in docs:
        sink = Collect()
        total += model.forward_backward(ParamWeights(cfg, params), tokens[None], targets[None], grads=sink,
                                        loss_scale=1.0)
        for k, g in sink.grads.items():
            grads[k] = grads[k] + g if k in grads else g.clone()
    return total, grads


def assert_same(packed, alone, tol: float = 1e-4):
    (loss, grads), (ref_loss, ref_grads) = packed, alone
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    assert set(grads) == set(ref_grads)
    for k, ref in ref_grads.items():
        err = (grads[k] - ref).norm().item() / ref.norm().item()
        assert err <= tol, f"{k}: relative error {err:.2e}"


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("kind", ["masked", "varlen"])
def test_packed_documents_equal_documents_alone(moe, kind):
    cfg = config(moe)
    params = params_of(cfg)
    inputs, targets, positions, docs = packed_batch(cfg.vocab_size)
    alone = run_alone(cfg, params, docs)
    assert_same(run_packed(cfg, params, RunOptions(document_attention=kind), inputs, targets, positions), alone)
    # without the documents the rows' documents see each other (attention, convolution, delta-rule state)
    sink = Collect()
    plain = Transformer(cfg, RunOptions()).forward_backward(ParamWeights(cfg, params), inputs, targets, grads=sink,
                                                            loss_scale=1.0)
    assert abs(plain.item() - alone[0].item()) > 1e-3 * abs(alone[0].item())


@pytest.mark.parametrize("run", [RunOptions(attn_bwd_chunks=2, document_attention="varlen"),
                                 RunOptions(recompute=frozenset({"att", "qkv"}), document_attention="masked"),
                                 RunOptions(recompute=frozenset({"block"}), document_attention="varlen")],
                         ids=["chunks-varlen", "recompute-att-qkv", "recompute-block"])
def test_chunked_attention_and_recompute_keep_documents_apart(run):
    cfg = config(False)
    params = params_of(cfg)
    inputs, targets, positions, docs = packed_batch(cfg.vocab_size, seed=6)
    assert_same(run_packed(cfg, params, run, inputs, targets, positions), run_alone(cfg, params, docs))


def test_linear_attention_alone_keeps_documents_apart_fp64():
    """A model of linear-attention layers only (nothing but the convolution's and the delta rule's restarts keeps
    the documents apart), in fp64: agreement to 1e-6 (module docstring)."""
    cfg = tiny_cfg(num_hidden_layers=2, layer_types=("linear_attention", "linear_attention"))
    params = {k: v.detach().double().requires_grad_(True) for k, v in params_of(cfg).items()}
    inputs, targets, positions, docs = packed_batch(cfg.vocab_size, seed=7)
    assert_same(run_packed(cfg, params, RunOptions(recompute=frozenset({"block"})), inputs, targets, positions),
                run_alone(cfg, params, docs), tol=1e-6)


def test_eval_logits_follow_the_documents():
    cfg = config(False)
    params = params_of(cfg)
    inputs, _, positions, _ = packed_batch(cfg.vocab_size, seed=8)
    model, w = Transformer(cfg, RunOptions()), ParamWeights(cfg, params)
    logits = model.logits(w, inputs, positions)
    s, n = ROWS[0][0] + ROWS[0][1], ROWS[0][2]  # the third document of row 0 crosses the chunk boundary
    ref = model.logits(w, inputs[:1, s:s + n])[0]
    rel = ((logits[0, s:s + n] - ref).norm() / ref.norm()).item()
    assert rel <= 1e-5, f"logits relative error {rel:.2e}"
