"""--document-masking for the MoE families (qwen3_moe, olmoe, mixtral), fp32 on the CPU: a micro-batch of packed
documents gives the loss and every gradient, the router losses' included, that its documents give when each runs
alone through transformers' own model.

What equality holds for the router losses: routing is per token, so once attention stays inside each document every
token's routing is the one it has alone, and the router statistics (top-k picks per expert, probability sums,
logsumexp^2 sums) of a packed micro-batch are the sums of its documents' -- every document of a row, its padding
document included (padding tokens are routed and counted, as with --pad-to). The load-balancing loss
E * sum_e f_e P_e is a product of two fractions over those tokens, so it is not additive: the packed micro-batch's
equals transformers' `load_balancing_loss_func` over the router logits of all its documents run alone, concatenated
(the documents' tokens pooled, as one unpadded batch of them), NOT the sum or mean of each document's own
load-balancing loss. The router z-loss (a mean over tokens) likewise equals the pooled mean. The reference here is
that: sum over documents of the token loss of each alone + coef * LB(pooled logits) + z * z-loss(pooled logits).

Tolerance: tests/model/test_moe_families.py's for qtrain against transformers (fp32, same routing; a flipped top-k
choice would move a gradient by O(1)): losses to 1e-5 relative, gradients to cosine >= 0.99999 and norms within 1e-4
per tensor; the statistics' counts exactly, their sums to 1e-5 relative (sums of the same fp32 values in another
grouping).
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qtrain.kernels.cross_entropy import IGNORE_INDEX  # noqa: E402
from qtrain.model.moe_router import load_balancing_loss, router_z_loss  # noqa: E402
from qtrain.model.transformer import RunOptions, Transformer  # noqa: E402
from qtrain.parallel.weights.replicated import ParamWeights  # noqa: E402
from tests.model.family_fixtures import Collect, cosine  # noqa: E402
from tests.model.test_moe_families import loaded, to_internal  # noqa: E402

T = 24
# two rows of T tokens: documents of these lengths, each row's last one padding (its own document, no targets)
ROWS = [(9, 5, 7, 3), (14, 8, 2)]


def packed_batch(vocab: int, seed: int = 5):
    """(inputs, targets, positions) of ROWS and every document of them as (tokens, targets), padding included (its
    tokens are routed, so they count for the router losses; it has no targets)."""
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, vocab, (len(ROWS), T), generator=g)
    targets = torch.full((len(ROWS), T), IGNORE_INDEX)
    positions = torch.zeros((len(ROWS), T), dtype=torch.int64)
    docs = []
    for r, lengths in enumerate(ROWS):
        s = 0
        for i, n in enumerate(lengths):
            positions[r, s:s + n] = torch.arange(n)
            if i < len(lengths) - 1:  # a document's last token predicts nothing; the padding predicts nothing
                targets[r, s:s + n - 1] = torch.randint(0, vocab, (n - 1,), generator=g)
            docs.append((inputs[r, s:s + n], targets[r, s:s + n]))
            s += n
    return inputs, targets, positions, docs


def transformers_alone(hf, docs, z: float):
    """transformers' gradients of: the summed token loss of each document alone + coef * the load-balancing loss and
    z * the z-loss over all the documents' router logits pooled (module docstring)."""
    hf.zero_grad()
    ce, logits = torch.zeros(()), []
    for tokens, targets in docs:
        out = hf(input_ids=tokens[None], output_router_logits=True)
        ce = ce + torch.nn.functional.cross_entropy(out.logits[0], targets, reduction="sum")
        logits += list(out.router_logits)
    cfg = hf.config
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    lb = load_balancing_loss(logits, experts, cfg.num_experts_per_tok)
    (ce + cfg.router_aux_loss_coef * lb + z * router_z_loss(logits)).backward()
    return ce.detach(), lb.detach(), {n: p.grad for n, p in hf.named_parameters()}


def qtrain_run(cfg, params, run: RunOptions, inputs, targets, positions=None, z: float = 0.0):
    sink, model = Collect(), Transformer(cfg, run)
    loss = model.forward_backward(ParamWeights(cfg, params), inputs, targets, grads=sink, loss_scale=1.0,
                                  router_z_loss=z, positions=positions)
    return loss, model.router_losses, sink.grads


@pytest.mark.parametrize("case,kind,recompute,z", [
    ("qwen3_moe", "masked", (), 0.0),          # a dense layer (mlp_only_layers) and a routed one
    ("qwen3_moe-step", "varlen", ("block",), 0.01),
    ("olmoe", "varlen", (), 0.0),              # whole-projection qk-norm: the RoPE tables per token
    ("mixtral", "masked", ("ffn", "att"), 0.003)])
def test_packed_moe_batch_equals_its_documents_alone(case, kind, recompute, z, tmp_path):
    hf, cfg, params = loaded(case, tmp_path)
    inputs, targets, positions, docs = packed_batch(cfg.vocab_size)
    ce, lb, hf_grads = transformers_alone(hf, docs, z)

    run = RunOptions(document_attention=kind, recompute=frozenset(recompute))
    loss, router, grads = qtrain_run(cfg, params, run, inputs, targets, positions, z)
    assert abs(loss.item() - ce.item()) <= 1e-5 * ce.item()
    assert abs(router.aux_loss().item() - lb.item()) <= 1e-5 * lb.item()
    want = to_internal(cfg, hf_grads)
    assert set(grads) == set(want) == set(params)
    for name, theirs in want.items():
        ours = grads[name]
        c, nerr = cosine(ours, theirs), abs(ours.norm().item() - theirs.norm().item()) / theirs.norm().item()
        assert c >= 0.99999 and nerr <= 1e-4, f"{name}: cosine {c:.7f}, norm error {nerr:.2e}"


@pytest.mark.parametrize("case", ["olmoe", "mixtral"])
def test_router_statistics_of_a_packed_batch_are_the_sums_of_its_documents(case, tmp_path):
    """Per layer: top-k picks per expert exactly, probability and logsumexp^2 sums to fp32 rounding; and without the
    mask the documents' tokens route differently (the check can fail)."""
    _, cfg, params = loaded(case, tmp_path)
    inputs, targets, positions, docs = packed_batch(cfg.vocab_size, seed=8)
    _, packed, _ = qtrain_run(cfg, params, RunOptions(), inputs, targets, positions, z=0.01)
    stats = sum(qtrain_run(cfg, params, RunOptions(), x[None], y[None], z=0.01)[1].stats for x, y in docs)
    E = cfg.router.experts
    assert torch.equal(packed.stats[:, :E], stats[:, :E])
    torch.testing.assert_close(packed.stats[:, E:], stats[:, E:], rtol=1e-5, atol=0)
    _, plain, _ = qtrain_run(cfg, params, RunOptions(), inputs, targets, z=0.01)
    assert not torch.allclose(plain.stats[:, E:], stats[:, E:], rtol=1e-3, atol=0)
