"""--document-masking in the model: a micro-batch of packed documents computes, in fp32 on the CPU, the loss and every
gradient that its documents give when each runs alone as its own sequence (positions from 0), for each dense family
(llama, qwen2, qwen3), both forms of document attention, chunked attention and recompute.

Tolerance: the two computations are the same sums taken over other groupings (each weight gradient sums over all
tokens of the batch in one GEMM where the reference adds per-document GEMMs; attention's matrix products run over
T keys with the other documents' weights exactly 0 instead of over L keys), so they differ by fp32 rounding only:
relative 1e-5 on the summed loss, and per tensor an error norm below 1e-5 of the gradient's norm (observed ~1e-7).
"""
from __future__ import annotations

import pytest
import torch

from qtrain.kernels.cross_entropy import IGNORE_INDEX
from qtrain.model.transformer import RunOptions, Transformer
from qtrain.model.weights import hf_to_internal
from qtrain.parallel.weights.replicated import ParamWeights
from tests.model.test_transformer import Collect, hf_model, tiny_cfg

T = 32
# two rows of T tokens: documents of these lengths, each row's last one padding (its own document, no targets)
ROWS = [(11, 6, 13, 2), (20, 9, 3)]


def packed_batch(vocab: int, seed: int = 5, rows: list[tuple[int, ...]] = ROWS):
    """(inputs, targets, positions) of `rows` (document lengths per row, each row's last one padding) and the
    documents as (tokens, targets) pairs; a document's last token predicts nothing (the next token starts another
    document), and the padding documents have no targets."""
    g = torch.Generator().manual_seed(seed)
    T = sum(rows[0])
    inputs = torch.randint(0, vocab, (len(rows), T), generator=g)
    targets = torch.full((len(rows), T), IGNORE_INDEX)
    positions = torch.zeros((len(rows), T), dtype=torch.int64)
    docs = []
    for r, lengths in enumerate(rows):
        assert sum(lengths) == T
        s = 0
        for i, n in enumerate(lengths):
            positions[r, s:s + n] = torch.arange(n)
            if i < len(lengths) - 1:  # the last one is padding
                targets[r, s:s + n - 1] = torch.randint(0, vocab, (n - 1,), generator=g)
                docs.append((inputs[r, s:s + n], targets[r, s:s + n]))
            s += n
    return inputs, targets, positions, docs


def params_of(cfg):
    hf = hf_model(cfg, seed=2)
    sd = dict(hf.state_dict())
    return {n: t.detach().clone().requires_grad_(True) for n, t in hf_to_internal(cfg, lambda k: sd[k])}


def run_packed(cfg, params, run: RunOptions, inputs, targets, positions):
    sink = Collect()
    loss = Transformer(cfg, run).forward_backward(ParamWeights(cfg, params), inputs, targets, grads=sink,
                                                  loss_scale=1.0, positions=positions)
    return loss, sink.grads


def run_alone(cfg, params, docs, run: RunOptions | None = None):
    """The summed loss and gradients of each document run alone (one sequence of its own length, on the device of
    `params`, with `run`'s execution options), summed in fp32 (so that a bf16 run's reference adds no rounding of its
    own)."""
    device = next(iter(params.values())).device
    model, total, grads = Transformer(cfg, run or RunOptions()), torch.zeros((), device=device), {}
    for tokens, targets in docs:
        sink = Collect()
        total += model.forward_backward(ParamWeights(cfg, params), tokens[None].to(device), targets[None].to(device),
                                        grads=sink, loss_scale=1.0).float()
        for k, g in sink.grads.items():
            grads[k] = grads[k] + g.float() if k in grads else g.to(torch.float32, copy=True)
    return total, grads


def assert_same(packed, alone):
    (loss, grads), (ref_loss, ref_grads) = packed, alone
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    assert set(grads) == set(ref_grads)
    for k, ref in ref_grads.items():
        err = (grads[k] - ref).norm().item() / ref.norm().item()
        assert err <= 1e-5, f"{k}: relative error {err:.2e}"


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("kind", ["masked", "varlen"])
def test_packed_documents_equal_documents_alone(model_type, kind):
    cfg = tiny_cfg(model_type, tied=model_type != "llama")
    params = params_of(cfg)
    inputs, targets, positions, docs = packed_batch(cfg.vocab_size)
    alone = run_alone(cfg, params, docs)
    assert_same(run_packed(cfg, params, RunOptions(document_attention=kind), inputs, targets, positions), alone)
    # without the mask the rows' documents see each other: the check above can fail
    sink = Collect()
    plain = Transformer(cfg, RunOptions()).forward_backward(ParamWeights(cfg, params), inputs, targets, grads=sink,
                                                            loss_scale=1.0)
    assert abs(plain.item() - alone[0].item()) > 1e-3 * abs(alone[0].item())


@pytest.mark.parametrize("run", [RunOptions(attn_bwd_chunks=2, document_attention="varlen"),
                                 RunOptions(attn_bwd_chunks=2, document_attention="masked"),
                                 RunOptions(recompute=frozenset({"att", "qkv"}), document_attention="varlen"),
                                 RunOptions(recompute=frozenset({"block"}), document_attention="masked"),
                                 RunOptions(lmhead_chunks=3, document_attention="varlen")],
                         ids=["chunks-varlen", "chunks-masked", "recompute-att-qkv", "recompute-block", "lmhead"])
def test_chunked_attention_and_recompute_keep_documents_apart(run):
    cfg = tiny_cfg("qwen2", tied=True)
    params = params_of(cfg)
    inputs, targets, positions, docs = packed_batch(cfg.vocab_size, seed=6)
    assert_same(run_packed(cfg, params, run, inputs, targets, positions), run_alone(cfg, params, docs))


def test_eval_loss_and_logits_follow_the_documents():
    """`loss_sum` and `logits` with position ids score each document as if alone."""
    cfg = tiny_cfg("qwen3", tied=False)
    params = params_of(cfg)
    inputs, targets, positions, docs = packed_batch(cfg.vocab_size, seed=7)
    model, w = Transformer(cfg, RunOptions()), ParamWeights(cfg, params)
    loss, n = model.loss_sum(w, inputs, targets, positions)
    ref = sum(model.loss_sum(w, t[None], y[None])[0] for t, y in docs)
    assert n.item() == sum(int((y != IGNORE_INDEX).sum()) for _, y in docs)
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
    logits = model.logits(w, inputs, positions)
    first = ROWS[0][0]
    torch.testing.assert_close(logits[0, first:first + ROWS[0][1]], model.logits(w, inputs[:1, first:first + ROWS[0][1]])[0],
                               rtol=1e-5, atol=1e-5)


def test_malformed_positions_are_refused():
    cfg = tiny_cfg("qwen2", tied=True)
    model, w = Transformer(cfg, RunOptions()), ParamWeights(cfg, params_of(cfg))
    inputs = torch.zeros((1, 8), dtype=torch.int64)
    for bad in ([1, 2, 3, 4, 5, 6, 7, 8], [0, 1, 2, 2, 3, 0, 1, 2]):
        with pytest.raises(ValueError, match="position"):
            model.loss_sum(w, inputs, inputs, torch.tensor([bad]))
