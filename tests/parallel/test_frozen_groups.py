"""Frozen layout groups and blocks that differ, through the gradient managers and the optimizer (gloo, 2 ranks).

A frozen group (`FlatLayout(..., frozen=...)`, what a frozen base under adapters will be) gets no gradient
buffer, no gradient shard, no Adam state and no update, in every gradient manager kind, and the plan's
statements (`footprint_of`) shrink by exactly its bytes; every trainable group ends bit for bit where it ends
when nothing is frozen (its SR keys and updates do not depend on the other groups). The model hands over no
gradient for a frozen tensor: weights built on a frozen layout do not require grad, and a micro-step's
gradients of the trainable groups are the bits of the unfrozen run.

Blocks that hold different tensors (a hybrid model's layers, an expert group beside a block) go through the
sharded kinds' staging slots, sized for the largest block: with integer-valued fp32 gradients every sum is
exact, so each shard must equal the hand-computed average exactly, padding zero included.
"""
from __future__ import annotations

import torch

from tests.dist_utils import run_distributed
from qtrain.model.family import TensorSpec
from qtrain.model.llama import LlamaConfig
from qtrain.model.transformer import RunOptions, Transformer
from qtrain.parallel.comm import Communicator
from qtrain.parallel.gradients import gradient_footprint, make_gradient_manager
from qtrain.parallel.layout import FlatLayout
from qtrain.parallel.optimizer import ShardedAdamW
from qtrain.parallel.weights import build_weights

KINDS = ("unsharded", "reduce-scatter", "all-to-all")
CFG = LlamaConfig(model_type="qwen2", vocab_size=97, hidden_size=40, intermediate_size=56, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, attention_bias=True)
FROZEN = {"embed", "block.1", "lm_head"}
STEPS, MICRO = 2, 2


def _grads(layout: FlatLayout, rank: int, step: int, micro: int, *, integers: bool = False) -> dict[str, torch.Tensor]:
    """Deterministic gradients of every tensor (of every group, frozen or not: the caller picks)."""
    gen = torch.Generator().manual_seed(1009 * rank + 101 * step + micro)
    out = {}
    for g in layout.groups:
        for s in g.segments:
            x = torch.randint(-8, 9, s.shape, generator=gen).float() if integers else torch.randn(s.shape,
                                                                                                   generator=gen)
            out[s.name] = x
    return out


def _feed(mgr, layout: FlatLayout, grads: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """The model's order: non-block groups, blocks last to first; only what is trainable."""
    nb = {g.key: grads[g.key].to(dtype) for g in layout.trainable_groups(blocks=False)}
    mgr.accumulate_non_block(nb)
    for layer in reversed(range(layout.num_layers)):
        mgr.accumulate_block(layer, {s.short: grads[s.name].to(dtype) for g in layout.layer_groups(layer)
                                     if g.trainable for s in g.segments})


def _train(layout: FlatLayout, kind: str, comm: Communicator, rank: int) -> dict:
    """Two steps of two micro-steps of bf16 gradients (stochastic rounding) and bf16 AdamW."""
    mgr = make_gradient_manager(kind, layout, comm=comm, dtype=torch.bfloat16, device="cpu", seed=7)
    buffers = layout.allocate(dtype=torch.bfloat16, device="cpu")
    gen = torch.Generator().manual_seed(3)
    for g in layout.groups:  # the same weights whatever is frozen
        buffers[g.key][:g.content_numel] = torch.randn(g.content_numel, generator=gen).bfloat16()
    initial = {k: v.clone() for k, v in buffers.items()}
    opt = ShardedAdamW(layout, params=buffers, comm=comm, m_dtype="bf16", v_dtype="bf16", seed=7)
    for step in range(STEPS):
        for micro in range(MICRO):
            mgr.start_micro_step(step=step, micro_step=micro, num_micro_steps=MICRO)
            _feed(mgr, layout, _grads(layout, rank, step, micro), torch.bfloat16)
            mgr.end_micro_step()
        opt.step(mgr, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    return {"params": buffers, "initial": initial, "m": dict(opt.m), "v": dict(opt.v),
            "grad_keys": sorted(mgr.grad_shards()), "grad_memory": mgr.memory(), "opt_memory": opt.memory()}


HYBRID = ([TensorSpec("embed", (16, 8), (("e", (16, 8)),)), TensorSpec("norm", (8,), (("n", (8,)),), decay=False)],
          [[TensorSpec("ln1", (8,), (("a", (8,)),)), TensorSpec("router", (4, 8), (("r", (4, 8)),)),
            TensorSpec("up", (4, 6, 8), (("u", (4, 6, 8)),), experts=4, group="experts")],
           [TensorSpec("ln1", (8,), (("b", (8,)),)), TensorSpec("in_proj", (24, 8), (("i", (24, 8)),)),
            TensorSpec("out_proj", (8, 8), (("o", (8, 8)),))],
           [TensorSpec("ln1", (8,), (("c", (8,)),))]])


def _hybrid(kind: str, comm: Communicator, rank: int, world: int) -> list[dict[str, torch.Tensor]]:
    layout = FlatLayout(CFG, world, tensors=HYBRID)
    mgr = make_gradient_manager(kind, layout, comm=comm, dtype=torch.float32, device="cpu", seed=1)
    out = []
    for step in range(STEPS):
        for micro in range(MICRO):
            mgr.start_micro_step(step=step, micro_step=micro, num_micro_steps=MICRO)
            _feed(mgr, layout, _grads(layout, rank, step, micro, integers=True), torch.float32)
            mgr.end_micro_step()
        out.append({k: v.clone() for k, v in mgr.grad_shards().items()})
    return out


def _worker(rank: int, world: int) -> dict:
    comm = Communicator(device="cpu")
    out = {}
    for kind in KINDS:
        for name, frozen in (("full", ()), ("frozen", FROZEN)):
            out[kind, name] = _train(FlatLayout(CFG, world, frozen=frozen), kind, comm, rank)
        out[kind, "hybrid"] = _hybrid(kind, comm, rank, world)
    return out


def test_frozen_groups_have_no_state_and_the_trainable_ones_the_same_bits():
    world = 2
    results = run_distributed(_worker, world)
    frozen_layout = FlatLayout(CFG, world, frozen=FROZEN)
    trainable = [g.key for g in frozen_layout.trainable_groups()]
    frozen_bytes = {g.key: g.shard_size(world) * 2 for g in frozen_layout.groups if not g.trainable}  # bf16 shards
    for kind in KINDS:
        for res in results:
            full, frz = res[kind, "full"], res[kind, "frozen"]
            assert frz["grad_keys"] == sorted(trainable) and set(frz["m"]) == set(frz["v"]) == set(trainable)
            for key in trainable:  # the same bits as when nothing is frozen
                for what in ("params", "m", "v"):
                    assert torch.equal(frz[what][key], full[what][key]), (kind, key, what)
            for key in FROZEN:  # never updated
                assert torch.equal(frz["params"][key], frz["initial"][key]), (kind, key)
                assert not torch.equal(full["params"][key], full["initial"][key]), (kind, key)
            # what the managers and the optimizer hold is what the memory plan reads (`footprint_of`), and it
            # loses exactly the frozen groups: Adam m and v their shards, the gradients their full buffers
            # (unsharded and non-block groups) or block shards (the sharded kinds; the staging slots stay)
            assert frz["grad_memory"] == gradient_footprint(kind, frozen_layout, dtype=torch.bfloat16,
                                                            device="cpu").parts
            assert full["opt_memory"]["adam.m"] - frz["opt_memory"]["adam.m"] == sum(frozen_bytes.values())
            assert full["opt_memory"]["adam.v"] - frz["opt_memory"]["adam.v"] == sum(frozen_bytes.values())
            lost = sum(2 * (g.padded_numel if kind == "unsharded" or g.layer is None else g.shard_size(world))
                       for g in frozen_layout.groups if not g.trainable)
            assert sum(full["grad_memory"].values()) - sum(frz["grad_memory"].values()) == lost
    for kind in KINDS:  # blocks that differ: every shard is the exact average, padding zero
        layout = FlatLayout(CFG, world, tensors=HYBRID)
        for step in range(STEPS):
            for g in layout.groups:
                want = torch.zeros(g.padded_numel)
                for r in range(world):
                    for micro in range(MICRO):
                        grads = _grads(layout, r, step, micro, integers=True)
                        for s in g.segments:
                            want[s.start:s.start + s.numel] += grads[s.name].reshape(-1) / world
                got = torch.cat([res[kind, "hybrid"][step][g.key] for res in results])
                assert torch.equal(got, want), (kind, step, g.key)


def test_a_frozen_tensor_gets_no_gradient_from_the_model():
    """Weights built on a frozen layout do not require grad; the micro-step hands over gradients of the trainable
    groups only, with the bits of the unfrozen run."""
    comm = Communicator.solo("cpu")
    inputs = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    shards = {}
    for name, frozen in (("full", ()), ("frozen", FROZEN)):
        layout = FlatLayout(CFG, 1, frozen=frozen)
        w = build_weights(layout, comm=comm, dtype=torch.float32, device=torch.device("cpu"), sharded=False, seed=1)
        assert {n for n, p in w.params.items() if not p.requires_grad} == {
            s.name for g in layout.groups if not g.trainable for s in g.segments}
        mgr = make_gradient_manager("unsharded", layout, comm=comm, dtype=torch.float32, device="cpu", seed=1)
        mgr.start_micro_step(step=0, micro_step=0, num_micro_steps=1)
        Transformer(CFG, RunOptions()).forward_backward(w.source, inputs, inputs.roll(-1, 1), grads=mgr,
                                                        loss_scale=1 / inputs.numel())
        mgr.end_micro_step()  # raises if a trainable group got nothing
        shards[name] = mgr.grad_shards()
    assert set(shards["frozen"]) == set(shards["full"]) - FROZEN
    for key, g in shards["frozen"].items():
        assert torch.equal(g, shards["full"][key]), key
