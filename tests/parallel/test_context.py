"""Context parallelism (parallel/context.py, parallel/ring_attention.py) on gloo: each sequence split over 2 (and 4)
ranks in load-balanced causal chunks computes what one process computes on whole sequences (fp32): the same loss
and, summed over the ranks, the same gradient of every parameter, in both modes (all-gather, ring), with and without
documents (--document-masking's position ids), and on 4 ranks also as 2 data-parallel replicas of CP=2. Tolerance:
the split changes only reduction orders (attention's softmax over a masked full row, or the ring's log-sum-exp merge
of blocks, instead of the causal kernel's; the gradient sums across ranks), so fp32 agrees to ~1e-6 relative; 1e-5
on the loss, 1e-4 relative on each gradient's norm of difference. `qtrain train` end to end:
test_context_train.py."""
from __future__ import annotations

import pytest
import torch

from qtrain.model.llama import LlamaConfig
from qtrain.parallel.context import ContextParallelError, check_context_parallel, chunk_positions
from tests.dist_utils import run_distributed

CFG = LlamaConfig(model_type="qwen2", vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0,
                  tie_word_embeddings=False, attention_bias=True, qk_norm=False)
B, T = 2, 32


def test_chunks_balance_the_causal_work():
    assert chunk_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert chunk_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    for n in (2, 4):  # every position once; each rank's queries see the same number of keys
        held = [chunk_positions(64, n, r) for r in range(n)]
        assert sorted(torch.cat(held).tolist()) == list(range(64))
        assert len({int((p + 1).sum()) for p in held}) == 1
    with pytest.raises(ContextParallelError, match="must divide the number of ranks"):
        check_context_parallel(2, world=3, seq_len=32)
    with pytest.raises(ContextParallelError, match="--seq-len 30 must be a multiple of 4"):
        check_context_parallel(2, world=2, seq_len=30)


def _setup():
    from qtrain.model.init import init_params
    from qtrain.model.transformer import allocate_params
    params = allocate_params(CFG, dtype=torch.float32, device="cpu", requires_grad=False)
    init_params(CFG, params, seed=3)
    g = torch.Generator().manual_seed(4)
    inputs = torch.randint(0, CFG.vocab_size, (B, T), generator=g)
    targets = torch.randint(0, CFG.vocab_size, (B, T), generator=g)
    targets[0, 5] = -100
    return params, inputs, targets


def _positions() -> torch.Tensor:
    """Documents of (B, T) rows whose boundaries fall inside and across the chunks of CP=2 (8 tokens) and CP=4 (4)."""
    rows = ([5, 11, 9, 7], [2, 1, 21, 3, 5])
    return torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in rows])


def _loss_and_grads(split, params, inputs, targets, n_valid, positions=None, **run):
    """(loss, gradients) of one micro-step on this rank's part (`run`: more RunOptions, test_context_compile.py's)."""
    from qtrain.model.transformer import RunOptions, Transformer
    from qtrain.parallel.weights.replicated import ParamWeights
    from tests.model.test_transformer import Collect
    p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    sink = Collect()
    model = Transformer(CFG, RunOptions(context=split, lmhead_chunks=2, **run))
    if split is not None:  # positions stay whole: the split's documents need every rank's
        inputs, targets = split.shard(inputs), split.shard(targets)
    loss = model.forward_backward(ParamWeights(CFG, p), inputs, targets, grads=sink, loss_scale=1.0 / n_valid,
                                  positions=positions)
    return loss.detach(), sink.grads


# (context parallel ranks per group, mode, documents): each case's loss and gradients summed over all ranks
CASES = {2: [(2, "allgather", False), (2, "allgather", True), (2, "ring", False), (2, "ring", True)],
         4: [(4, "allgather", True), (4, "ring", False), (4, "ring", True), (2, "ring", True), (2, "allgather", False)]}


def _rank(rank: int, world: int):
    """Every case of CASES[world]: with groups of `parts` < world, each group (a data-parallel replica) takes its
    own rows of the batch, as the trainer's replicas read their own sequences."""
    import torch.distributed as dist

    from qtrain.parallel.context import data_rank, make_context_parallel
    params, inputs, targets = _setup()
    n_valid = int((targets != -100).sum())
    out = {}
    for parts, mode, docs in CASES[world]:
        split = make_context_parallel(parts, rank=rank, world=world, mode=mode)
        replica, replicas = data_rank(rank, world, parts)
        rows = slice(replica * B // replicas, (replica + 1) * B // replicas)
        pos = _positions()[rows] if docs else None
        loss, grads = _loss_and_grads(split, params, inputs[rows], targets[rows], n_valid, pos)
        dist.all_reduce(loss)
        for g in grads.values():
            dist.all_reduce(g)
        out[parts, mode, docs] = loss, grads
    return out


def _assert_same(got, want, what):
    (loss, grads), (ref_loss, ref) = got, want
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item()), what
    assert grads.keys() == ref.keys()
    for k, r in ref.items():
        err = ((grads[k] - r).norm() / r.norm()).item()
        assert err <= 1e-4, f"{what} {k}: {err:.2e}"


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks: 35 s of spawning
def test_split_sequences_equal_one_process(world):
    """CP=2 and CP=4 (and, on 4 ranks, 2 replicas of CP=2), all-gather and ring, with and without documents: the
    loss and every gradient of one process on the whole rows (documents: the same position ids)."""
    params, inputs, targets = _setup()
    n_valid = int((targets != -100).sum())
    refs = {docs: _loss_and_grads(None, params, inputs, targets, n_valid, _positions() if docs else None)
            for docs in (False, True)}
    assert (refs[True][0] - refs[False][0]).abs() > 1e-3  # the documents change the loss
    results = run_distributed(_rank, world)
    for case, got in results[0].items():
        _assert_same(got, refs[case[2]], case)
    for r in results[1:]:  # every rank holds the same sums
        assert all(torch.equal(r[c][0], results[0][c][0]) for c in r)


def test_ring_attention_in_row_slices_is_causal_attention(monkeypatch):
    """The ring's block math on a ring of one rank (no process group), its query rows in slices of 3 (SCORE_BYTES
    made tiny), with grouped-query heads: the output and the gradients of q, k, v equal causal SDPA's (fp32; the
    same sums in other groupings, 1e-5 relative)."""
    import torch.nn.functional as F

    from qtrain.parallel import ring_attention as ring_mod
    B_, nh, nkv, t, hs = 2, 4, 2, 10, 8
    monkeypatch.setattr(ring_mod, "SCORE_BYTES", 3 * 4 * B_ * nh * t)
    assert len(ring_mod.row_slices(t, 4 * B_ * nh * t)) == 4
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B_, h, t, hs, generator=g, requires_grad=True) for h in (nh, nkv, nkv))
    causal = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
    ring = ring_mod.Ring(0, [0], None)
    out, lse = ring_mod.ring_forward(q.detach(), k.detach(), v.detach(), ring, lambda source: causal)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    dout = torch.randn(out.shape, generator=g)
    grads = ring_mod.ring_backward(q.detach(), k.detach(), v.detach(), out, lse, dout, ring, lambda source: causal)
    refs = torch.autograd.grad(ref, (q, k, v), dout)
    for a, b in ((out, ref), *zip(grads, refs)):
        assert ((a - b).norm() / b.norm()).item() <= 1e-5
