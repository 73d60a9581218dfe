"""Context parallelism in torch.compile'd blocks and with recomputed attention (parallel/context_ops.py), on gloo with
2 ranks: the all-gather's collectives and the ring's send/recv are opaque custom ops, so a compiled block holds them
without a graph break and computes what one process computes on whole sequences (fp32), in both modes, with and
without documents; --recompute-att and --recompute-block rerun the attention's forward, communication included.

Backends: CI compiles with `aot_eager_decomp_partition`: dynamo's capture, AOTAutograd and the min-cut partitioner
inductor uses (what decides whether a collective can be traced, where it runs and whether it is recomputed), without
generating kernels; the same cases through inductor's C++ backend are marked slow (about 100 s on 2 cores).
Tolerance: as test_context.py's (fp32 reduction orders: 1e-5 on the loss, 1e-4 relative on each gradient); eager
recompute reruns the same ops in the same order, so it equals the run without recompute bit for bit."""
from __future__ import annotations

import functools

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.parallel.test_context import CFG, _assert_same, _loss_and_grads, _positions, _setup

L = CFG.num_hidden_layers
# (mode, documents, compiled, recompute switches): the compiled cases, then recompute against the plain eager run
FAST = [(mode, docs, True, ()) for mode in ("allgather", "ring") for docs in (False, True)] + [
    (mode, True, False, rc) for mode in ("allgather", "ring") for rc in ((), ("att",), ("block",))] + [
    ("allgather", True, True, ("att",)), ("ring", False, True, ("block",))]
SLOW = [(mode, docs, True, rc) for mode in ("allgather", "ring") for docs in (False, True)
        for rc in ((), ("att",), ("block",))]
# the ops' callbacks on ContextParallel: each forward one and backward one is one collective step per block call
STEPS = {"allgather": ("gather_kv", "reduce_kv"), "ring": ("ring_forward", "ring_backward")}


def _rank(rank: int, world: int, backend: str, cases: list) -> dict:
    """Every case's loss and gradients summed over the ranks, the calls of each communicating step, and the graph
    breaks dynamo counted."""
    import torch._dynamo
    import torch.distributed as dist

    from qtrain.parallel.context import ContextParallel, make_context_parallel
    if backend != "inductor":  # the Transformer's torch.compile call, with the test's backend
        torch.compile = functools.partial(torch.compile, backend=backend)
    calls: dict[str, int] = {}
    for name in (*STEPS["allgather"], *STEPS["ring"]):  # count the communicating steps the ops run
        def counted(self, *args, _step=getattr(ContextParallel, name), _name=name):
            calls[_name] = calls.get(_name, 0) + 1
            return _step(self, *args)
        setattr(ContextParallel, name, counted)
    params, inputs, targets = _setup()
    n_valid = int((targets != -100).sum())
    out = {}
    for mode, docs, compiled, rc in cases:
        calls.clear()
        split = make_context_parallel(2, rank=rank, world=world, mode=mode)
        loss, grads = _loss_and_grads(split, params, inputs, targets, n_valid, _positions() if docs else None,
                                      compile=compiled, recompute=frozenset(rc))
        dist.all_reduce(loss)
        for g in grads.values():
            dist.all_reduce(g)
        out[mode, docs, compiled, rc] = loss, grads, dict(calls)
    out["graph_breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())
    return out


def _check(backend: str, cases: list) -> None:
    params, inputs, targets = _setup()
    n_valid = int((targets != -100).sum())
    refs = {docs: _loss_and_grads(None, params, inputs, targets, n_valid, _positions() if docs else None)
            for docs in (False, True)}
    got = run_distributed(_rank, 2, backend, cases)[0]
    assert got.pop("graph_breaks") == 0  # each block is one graph, the ops inside it
    for (mode, docs, compiled, rc), (loss, grads, calls) in got.items():
        case = (mode, docs, compiled, rc)
        _assert_same((loss, grads), refs[docs], case)
        # one forward step per block call, a second where recompute reruns it, one backward step: the partitioner
        # neither recomputes nor duplicates a collective on its own
        forward, backward = STEPS[mode]
        assert calls == {forward: 2 * L if rc else L, backward: L}, (case, calls)
        if not compiled and rc:  # eager recompute: the plain run's numbers, bit for bit
            plain = got[mode, docs, False, ()]
            assert torch.equal(loss, plain[0]), case
            assert all(torch.equal(g, plain[1][k]) for k, g in grads.items()), case


def test_compiled_blocks_and_recompute_equal_one_process():
    """CP=2 with compiled blocks (AOTAutograd's partitioner) in both modes, with and without documents, and
    --recompute-att / --recompute-block eager and compiled: one process's loss and gradients, no graph break, each
    collective step once per block call (twice forward with recompute)."""
    _check("aot_eager_decomp_partition", FAST)


@pytest.mark.slow
def test_inductor_compiled_blocks_equal_one_process():
    """The same through inductor's generated (C++) kernels: every mode x documents x recompute case."""
    _check("inductor", SLOW)
