"""The memory plan against what qtrain really allocates and keeps.

- persistent state (weights, Adam m / v, optimizer staging, every gradient manager) equals, byte for byte,
  what a real `Trainer` allocates (world 1) and what the managers allocate at world 4;
- activations equal what autograd saves for backward (saved-tensor hooks on one block, eager and through
  AOTAutograd's partitioner) and what a real `Transformer.forward_backward` holds when the LM head starts
  (an allocation tracker), for plain runs, --recompute-block and the fine-grained switches;
- the planned transient workspace bounds the measured peak of a micro-step;
- `propose` returns a configuration that fits whose next-larger batch does not;
- presets give plausible numbers; `qtrain plan` runs through the real CLI parser.
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import json
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import qtrain.model.transformer as tm
from qtrain.model.config import ModelConfig, preset
from qtrain.model.init import init_params
from qtrain.model.layers import rope_tables
from qtrain.model.recompute import block_steps, count_saved_bytes
from qtrain.model.transformer import RunOptions, Transformer, allocate_params, make_block_fn
from qtrain.parallel.weights.replicated import ParamWeights
from qtrain.model.weights import block_shapes
from qtrain.parallel.gradients import make_gradient_manager
from qtrain.parallel.layout import FlatLayout
from qtrain.parallel.optimizer import ShardedAdamW
from qtrain.parallel.weights.sharded import ShardedWeights
from qtrain.cli.plan import add_arguments as add_plan_args
from qtrain.cli.plan import run as run_plan
from qtrain.model.recompute import resolve_flags
from qtrain.model.activations import activation_terms, layer_activation_bytes
from qtrain.plan.memory import GiB, parse_bytes, plan_for_trainer, plan_memory
from qtrain.plan.propose import propose
from qtrain.options import Options
from qtrain.model.matmul import block_linear
from qtrain.train.trainer import Trainer

DT = {"bf16": torch.bfloat16, "fp32": torch.float32}


def small_cfg(model_type: str = "qwen2", *, vocab: int = 512, tied: bool = True, layers: int = 3) -> ModelConfig:
    return ModelConfig(model_type=model_type, vocab_size=vocab, hidden_size=64, intermediate_size=160,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       attention_bias=model_type == "qwen2", qk_norm=model_type == "qwen3",
                       head_dim=32 if model_type == "qwen3" else 0, tie_word_embeddings=tied)


def opts_for(**kw) -> Options:
    """Options for a plan (recompute switches are passed to the plan directly)."""
    return Options(**kw)


# ---------------------------------------------------------------------------------------------------------
# measuring tools
class LiveBytes(TorchDispatchMode):
    """Bytes of the storages that ops allocate while active and that are still alive; and the peak."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.cur = self.peak = 0

    def _free(self, key: int) -> None:
        self.cur -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):  # views and in-place ops
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if st._cdata not in self.live:
                    self.live[st._cdata] = st.nbytes()
                    self.cur += st.nbytes()
                    self.peak = max(self.peak, self.cur)
                    weakref.finalize(st, self._free, st._cdata)
        return out


class NullSink:
    def accumulate_block(self, layer, grads):
        pass

    def accumulate_non_block(self, grads):
        pass


def measure_micro_step(cfg: ModelConfig, dtype: str, *, flags=(), B=2, T=64, chunks=1, fp8=False):
    """(bytes alive when the final norm starts = activations kept for backward, peak of the micro-step),
    counting only what forward_backward allocates."""
    params = allocate_params(cfg, dtype=DT[dtype], device="cpu", requires_grad=False)
    with torch.no_grad():
        init_params(cfg, params, seed=0)
    for p in params.values():
        p.requires_grad_(True)
    run = RunOptions(lmhead_chunks=chunks, matmul_dtype="e4m3" if fp8 else "", recompute=frozenset(flags))
    model = Transformer(cfg, run)
    model.rope(T, torch.device("cpu"), DT[dtype])  # cached tables are not activations
    g = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    tracker, at_head, orig = LiveBytes(), [], tm.rms_norm

    def rms_norm(x, weight, eps):  # the final norm is the first thing the LM head does
        if weight is params["norm"] and not at_head:
            at_head.append(tracker.cur)
        return orig(x, weight, eps)

    tm.rms_norm = rms_norm
    try:
        with tracker:
            model.forward_backward(ParamWeights(cfg, params), inputs, targets, grads=NullSink(), loss_scale=1.0)
    finally:
        tm.rms_norm = orig
    return at_head[0], tracker.peak


def measure_block(cfg: ModelConfig, dtype: str, *, flags=(), fp8=False, attn_chunks=1, compiled=False, B=2, T=32):
    """Bytes one block call saves for backward (its input, the weights and RoPE tables excluded)."""
    fn = make_block_fn(cfg, block_linear("e4m3" if fp8 else ""), recompute=block_steps(flags),
                       attn_chunks=attn_chunks, compiled=compiled)
    if compiled:
        torch._dynamo.reset()
        # AOTAutograd with the min-cut partitioner (inductor's), without generating kernels
        fn = torch.compile(fn, dynamic=False, backend="aot_eager_decomp_partition")
    g = torch.Generator().manual_seed(0)
    w = {n: (0.02 * torch.randn(s, generator=g)).to(DT[dtype]).requires_grad_() for n, s in block_shapes(cfg).items()}
    cos, sin = rope_tables(cfg, T, "cpu", DT[dtype])
    x = torch.randn(B, T, cfg.hidden_size, generator=g).to(DT[dtype]).requires_grad_()
    if compiled:
        fn(x, w, cos, sin).sum().backward()  # compile outside the measurement
    skip = {t.untyped_storage().data_ptr() for t in (x, cos, sin, *w.values())}
    seen: dict[int, int] = {}

    def pack(t):
        p = t.untyped_storage().data_ptr()
        # uint8: checkpoint's CPU RNG state (host memory, per layer, not an activation)
        if p not in skip and t.dtype != torch.uint8:
            seen[p] = t.untyped_storage().nbytes()
        return t

    if compiled:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = fn(x, w, cos, sin)
        n = sum(seen.values())
    else:  # the eager Recomputer installs its own hooks; count_saved_bytes sees through them
        with count_saved_bytes(exclude=[x, cos, sin, *w.values()]) as c:
            y = fn(x, w, cos, sin)
            n = c.bytes
    del y
    return n, B * T


# ---------------------------------------------------------------------------------------------------------
# activations
EAGER_FLAGS = [(), ("norm",), ("swiglu",), ("ffn",), ("qkv",), ("att",), ("norm", "swiglu"), ("att", "ffn")]


@pytest.mark.parametrize("model_type,dtype", [("qwen2", "bf16"), ("qwen2", "fp32"), ("llama", "bf16"),
                                              ("qwen3", "bf16"), ("qwen3", "fp32")])
def test_block_terms_match_saved_tensors_eager(model_type, dtype):
    cfg = small_cfg(model_type)
    for flags in EAGER_FLAGS:
        measured, tokens = measure_block(cfg, dtype, flags=flags)
        planned = layer_activation_bytes(cfg, tokens, model_dtype=dtype, recompute=resolve_flags(flags))
        assert planned == pytest.approx(measured, rel=0.10), (flags, planned, measured)


@pytest.mark.parametrize("flags", [(), ("ffn",), ("att",), ("qkv", "swiglu")])
def test_block_terms_fp8_and_attention_chunks_eager(flags):
    cfg = small_cfg()
    measured, tokens = measure_block(cfg, "bf16", flags=flags, fp8=True)
    planned = layer_activation_bytes(cfg, tokens, model_dtype="bf16", matmul_dtype="e4m3",
                                     recompute=resolve_flags(flags))
    assert planned == pytest.approx(measured, rel=0.10)
    measured, tokens = measure_block(cfg, "bf16", flags=flags, attn_chunks=2)
    planned = layer_activation_bytes(cfg, tokens, model_dtype="bf16", recompute=resolve_flags(flags), attn_chunks=2)
    assert planned == pytest.approx(measured, rel=0.10)


@pytest.mark.parametrize("model_type,flags", [("qwen2", ()), ("qwen3", ()), ("qwen2", ("norm", "swiglu")),
                                              ("qwen2", ("ffn",)), ("qwen3", ("att",)), ("qwen2", ("qkv", "norm"))])
def test_block_terms_match_saved_tensors_compiled(model_type, flags):
    """torch.compile'd blocks keep less (the partitioner recomputes element-wise work); measured with the
    partitioner inductor uses (backend aot_eager_decomp_partition: no kernels are generated)."""
    cfg = small_cfg(model_type)
    measured, tokens = measure_block(cfg, "bf16", flags=flags, compiled=True)
    planned = layer_activation_bytes(cfg, tokens, model_dtype="bf16", compiled=True, recompute=resolve_flags(flags))
    assert planned == pytest.approx(measured, rel=0.10)
    eager = layer_activation_bytes(cfg, tokens, model_dtype="bf16", recompute=resolve_flags(flags))
    assert planned < eager if not flags else planned <= eager


def test_block_terms_fp8_compiled_is_an_upper_bound():
    cfg = small_cfg()
    for flags in [(), ("ffn",)]:
        measured, tokens = measure_block(cfg, "bf16", flags=flags, fp8=True, compiled=True)
        planned = layer_activation_bytes(cfg, tokens, model_dtype="bf16", matmul_dtype="e4m3", compiled=True,
                                         recompute=resolve_flags(flags))
        assert measured <= planned <= 1.25 * measured


@pytest.mark.parametrize("model_type,dtype,flags", [
    ("qwen2", "bf16", ()), ("qwen2", "bf16", ("block",)), ("qwen2", "fp32", ()), ("qwen2", "fp32", ("block",)),
    ("qwen3", "bf16", ()), ("qwen3", "bf16", ("block",)), ("llama", "bf16", ("att", "ffn")),
])
def test_activations_match_a_real_micro_step(model_type, dtype, flags):
    """What forward_backward holds when the LM head starts (every layer's saved tensors and inputs, the last
    output) is the plan's activation row; the micro-step's peak is bounded by activations + workspace."""
    cfg = small_cfg(model_type, tied=model_type != "llama")
    B, T = 2, 64
    at_head, peak = measure_micro_step(cfg, dtype, flags=flags, B=B, T=T)
    plan = plan_memory(cfg, opts_for(model_dtype=dtype, batch_size=B, seq_len=T, recompute_block="block" in flags),
                       device="cpu", compiled=False, recompute=resolve_flags(flags))
    act = plan.item("activations")
    assert act.device == pytest.approx(at_head, rel=0.10)
    assert at_head <= peak <= act.device + plan.item("workspace").device <= 1.6 * peak


@pytest.mark.parametrize("vocab,chunks", [(64, 1), (4096, 1), (4096, 4)])
def test_workspace_bounds_the_peak(vocab, chunks):
    """Block-backward-dominated (small vocab) and LM-head-dominated (large vocab, chunked or not) micro-steps."""
    cfg = small_cfg(vocab=vocab)
    for dtype, flags in [("bf16", ()), ("fp32", ("block",)), ("bf16", ("ffn",))]:
        B, T = 4, 32
        at_head, peak = measure_micro_step(cfg, dtype, flags=flags, B=B, T=T, chunks=chunks)
        plan = plan_memory(cfg, opts_for(model_dtype=dtype, batch_size=B, seq_len=T, lmhead_chunks=chunks),
                           device="cpu", compiled=False, recompute=resolve_flags(flags))
        transient = plan.item("activations").device + plan.item("workspace").device
        assert peak <= transient <= 1.6 * peak, (dtype, flags, peak, transient)


def test_recompute_terms_and_implications():
    cfg = preset("Qwen2.5-7B")
    kw = dict(model_dtype="bf16", compiled=True)
    sizes = {f: layer_activation_bytes(cfg, 4096, recompute=resolve_flags(f), **kw)
             for f in [(), ("swiglu",), ("norm",), ("ffn",), ("att",), ("block",)]}
    assert sizes[()] > sizes[("swiglu",)] > sizes[("ffn",)] > sizes[("block",)] == 0
    assert sizes[()] > sizes[("norm",)] > sizes[("block",)]
    assert resolve_flags(["block"]) == {"swiglu", "norm", "ffn", "qkv", "att", "block"}
    assert "swiglu" in resolve_flags(["ffn"]) and "qkv" in resolve_flags(["att"])
    # compiled blocks keep llm.q's set: per token 6C + 2qkv + 4q + 2kv + 6F bytes (+ rstd, LSE) in bf16
    C, F = cfg.hidden_size, cfg.intermediate_size
    want = 2 * (3 * C + cfg.qkv_dim + 2 * cfg.q_dim + cfg.kv_dim + 3 * F) + 8 + 4 * cfg.num_attention_heads
    assert sizes[()] == 4096 * want
    names = [a.name for a in activation_terms(cfg, matmul_dtype="e4m3")]
    assert "fp8_w_qkv" in names and "down_in_fp8" in names


# ---------------------------------------------------------------------------------------------------------
# persistent state: the plan equals the allocations
TRAINER_VARIANTS = [
    dict(),
    dict(shard_gradients=True),
    dict(shard_gradients=True, all_to_all_reduce=True),
    dict(shard_gradients=True, offload_gradients=True),
    dict(opt_m_dtype="bf16", opt_v_dtype="bf16"),
    dict(model_dtype="fp32"),
    dict(offload_opt_m=True, offload_opt_v=True),
    dict(shard_weights=True),
    dict(shard_weights=True, offload_master=True, offload_opt_m=True),
    dict(shard_weights=True, offload_master=True, offload_opt_v=True, use_zero_copy=True),
    dict(opt_m_dtype="e4m3", opt_v_dtype="bf16"),
    dict(opt_m_dtype="e4m3", opt_v_dtype="bf16", offload_opt_m=True),
    dict(opt_m_dtype="e4m3", opt_v_dtype="bf16", shard_weights=True, offload_master=True, offload_opt_m=True,
         offload_opt_v=True),
    dict(shard_weights=True, matmul_dtype="e4m3", persistent_quants=True),
    dict(zero_level=3, matmul_dtype="e4m3", persistent_quants=True, offload_quants=True, offload_master=True),
]


@pytest.mark.parametrize("variant", TRAINER_VARIANTS, ids=lambda v: ",".join(f"{k}={v[k]}" for k in v) or "default")
def test_persistent_state_equals_trainer_allocations(variant):
    opts = Options(device="cpu", seq_len=32, batch_size=2, grad_accumulation=1, **variant)
    trainer = Trainer(opts)
    plan = plan_for_trainer(trainer)
    nb = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731

    w = plan.item("weights")
    if trainer.param_buffers is not None:
        assert w.parts == {"params": nb(trainer.param_buffers.values())}
    else:
        # --persistent-quants: the e4m3 block shards and buffers are a row of their own
        q = plan.item("fp8 weights") if variant.get("persistent_quants") else None
        assert {**w.parts, **(q.parts if q else {})} == trainer.weights.memory()
        host = sum(v for k, v in trainer.weights.memory().items() if k in trainer.weights.host_memory_keys())
        assert w.host + (q.host if q else 0) == host
    opt_mem = trainer.optimizer.memory() if hasattr(trainer.optimizer, "memory") else {
        "adam.m": nb(trainer.optimizer.m.values()), "adam.v": nb(trainer.optimizer.v.values()), "staging": 0}
    m_scales = getattr(trainer.optimizer, "m_scales", {})  # e4m3 m: fp32 block scales belong to m
    assert plan.item("adam m").parts["adam.m"] == opt_mem["adam.m"] == nb(trainer.optimizer.m.values()) + \
        nb(m_scales.values())
    if variant.get("opt_m_dtype") == "e4m3":  # 1 byte per element + 4 per 128-element block of each tensor
        assert nb(trainer.optimizer.m.values()) == sum(t.numel() for t in trainer.optimizer.m.values())
        assert nb(m_scales.values()) == 4 * sum(-(-s.numel // 128) for g in trainer.layout.groups for s in g.segments)
    assert plan.item("adam v").parts["adam.v"] == opt_mem["adam.v"] == nb(trainer.optimizer.v.values())
    staging = sum(i.device for i in plan.items if i.name == "optimizer staging")
    assert staging == opt_mem.get("staging", 0)
    g = plan.item("gradients")
    assert g.parts == trainer.grads.memory()
    assert g.device == trainer.grads.device_nbytes()
    assert g.device + g.host == trainer.grads.shard_nbytes()
    for name in ("adam m", "adam v"):
        off = bool(variant.get(f"offload_opt_{name[-1]}"))
        assert (plan.item(name).host > 0) == off and (plan.item(name).device > 0) == (not off)


class FakeComm:
    """Rank 1 of 4: enough for constructors, which only allocate."""
    rank, world = 1, 4


@pytest.mark.parametrize("kind", ["unsharded", "reduce-scatter", "all-to-all"])
@pytest.mark.parametrize("sharded_weights", [False, True])
def test_persistent_state_world4_equals_manager_allocations(kind, sharded_weights):
    cfg = small_cfg(tied=False)
    W, E = 4, 2
    layout = FlatLayout(cfg, W)
    offload = kind != "unsharded"
    variant = dict(shard_gradients=kind != "unsharded", all_to_all_reduce=kind == "all-to-all",
                   offload_gradients=offload, opt_m_dtype="bf16")
    if sharded_weights:
        variant.update(shard_weights=True, offload_master=True, offload_opt_v=True)
    opts = Options(**variant)
    plan = plan_memory(cfg, opts, world=W, device="cpu")
    grads = make_gradient_manager(kind, layout, comm=FakeComm(), dtype=torch.bfloat16, device="cpu", seed=0,
                                  offload=offload)
    assert plan.item("gradients").parts == grads.memory()
    if sharded_weights:
        weights = ShardedWeights(layout, comm=FakeComm(), dtype=torch.bfloat16, device="cpu", offload=True)
        assert plan.item("weights").parts == weights.memory()
        assert plan.item("weights").host == weights.memory()["shards"]
        opt = ShardedAdamW(layout, shards=weights.shards, rank=1, device="cpu", m_dtype="bf16", v_dtype="fp32",
                           offload_params=True, offload_v=True)
    else:
        params = layout.allocate(dtype=torch.bfloat16, device="cpu")
        assert plan.item("weights").device == sum(t.numel() * E for t in params.values())
        opt = ShardedAdamW(layout, params, rank=1, m_dtype="bf16", v_dtype="fp32")
    mem = opt.memory()
    assert plan.item("adam m").parts["adam.m"] == mem["adam.m"]
    assert plan.item("adam v").parts["adam.v"] == mem["adam.v"]
    assert sum(i.device for i in plan.items if i.name == "optimizer staging") == mem["staging"]
    # the layout math: shards are 1/W of the padded groups
    total = layout.total_numel()
    assert mem["adam.m"] == total // W * 2 and mem["adam.v"] == total // W * 4


@pytest.mark.parametrize("offload_m", [False, True])
def test_e4m3_m_world4_equals_optimizer_allocations(offload_m):
    """e4m3 m on 4 ranks: codes (1 byte/element) + the scales of the most demanding rank (shards cut tensor
    blocks), and, offloaded, the staging slots with their scale slots: the plan equals what rank 1 allocates."""
    cfg = small_cfg(tied=False)
    W = 4
    layout = FlatLayout(cfg, W)
    opts = Options(opt_m_dtype="e4m3", opt_v_dtype="bf16", offload_opt_m=offload_m)
    plan = plan_memory(cfg, opts, world=W, device="cpu")
    opt = ShardedAdamW(layout, layout.allocate(dtype=torch.bfloat16, device="cpu"), rank=1, m_dtype="e4m3",
                       v_dtype="bf16", offload_m=offload_m)
    mem = opt.memory()
    assert plan.item("adam m").parts["adam.m"] == mem["adam.m"]
    assert plan.item("adam v").parts["adam.v"] == mem["adam.v"]
    assert sum(i.device for i in plan.items if i.name == "optimizer staging") == mem["staging"]
    assert (mem["staging"] > 0) == offload_m
    total = layout.total_numel()
    assert total // W + 4 * (total // W // 128) <= mem["adam.m"] <= total // W + 4 * (total // W // 128 + 16 * len(
        layout.groups))


# ---------------------------------------------------------------------------------------------------------
# presets, formatting, proposal, CLI
@pytest.mark.parametrize("name", ["Qwen2.5-0.5B", "Qwen2.5-1.5B", "Qwen2.5-7B", "Qwen2.5-14B"])
def test_preset_plans_are_plausible(name):
    cfg = preset(name)
    plan = plan_memory(cfg, Options(model=name, seq_len=1024, batch_size=4), world=1, gpu_memory=80 * GiB)
    w = plan.item("weights").device
    assert w == pytest.approx(2 * cfg.num_params(), rel=1e-3)  # bf16; padding is < 0.1%
    assert plan.item("adam m").device == pytest.approx(2 * w, rel=1e-6) == plan.item("adam v").device
    assert plan.item("gradients").device == w
    assert 0 < plan.item("activations").device < 40 * GiB
    assert plan.device_total > 6 * w  # bf16 weights + grads, fp32 m + v: 12 bytes per parameter
    if name == "Qwen2.5-7B":
        assert 15.1e9 < w < 15.3e9  # 7.62B parameters in bf16
        assert not plan.fits  # 7B with full fp32 Adam state on one 80 GB GPU: ~111 GiB
    text = plan.format()
    for row in ("weights", "adam m", "adam v", "gradients", "activations", "workspace", "total", "device memory"):
        assert row in text
    d = json.loads(json.dumps(plan.to_dict()))
    assert d["device_total"] == plan.device_total and d["fits"] == plan.fits
    # sharded over 8 GPUs: state shrinks 8x, weights stay replicated
    p8 = plan_memory(cfg, Options(model=name, seq_len=1024, batch_size=4, zero_level=2), world=8)
    assert p8.item("adam m").device == pytest.approx(plan.item("adam m").device / 8, rel=1e-3)
    assert p8.item("gradients").device < plan.item("gradients").device / 2
    assert p8.item("weights").device == pytest.approx(w, rel=1e-3)


def test_plan_reacts_to_options():
    cfg = preset("Qwen2.5-1.5B")
    base = Options(seq_len=2048, batch_size=8)
    p = plan_memory(cfg, base)
    chunked = plan_memory(cfg, dataclasses.replace(base, lmhead_chunks=8))
    assert chunked.phases["lm_head"] < p.phases["lm_head"] / 4
    rb = plan_memory(cfg, dataclasses.replace(base, recompute_block=True))
    assert rb.item("activations").device < p.item("activations").device / 10
    fp8 = plan_memory(cfg, dataclasses.replace(base, matmul_dtype="e4m3"))
    assert fp8.item("activations").device != p.item("activations").device
    off = plan_memory(cfg, dataclasses.replace(base, offload_opt_m=True, offload_opt_v=True))
    assert off.item("adam m").device == 0 and off.item("adam m").host == p.item("adam m").device
    assert off.device_total < p.device_total and off.host_total > p.host_total
    eager = plan_memory(cfg, base, compiled=False)
    assert eager.item("activations").device > p.item("activations").device


@pytest.mark.parametrize("name,gib,world", [("Qwen2.5-0.5B", 24, 1), ("Qwen2.5-7B", 80, 1), ("Qwen2.5-7B", 80, 4),
                                            ("Qwen2.5-14B", 80, 8)])
def test_propose_returns_largest_fitting_batch(name, gib, world):
    cfg, budget = preset(name), gib * GiB
    base = Options(model=name, seq_len=1024, batch_size=4)
    props = propose(cfg, base, budget, world, max_batch=64)
    assert props, "something must fit"
    batches = [p.batch_size for _, p in props]
    assert batches == sorted(batches, reverse=True) and len(set(batches)) == len(batches)
    for changes, plan in props:
        assert plan.fits and plan.device_total <= budget
        o = dataclasses.replace(base, **changes).validate()  # the changes are applicable options
        assert plan_memory(cfg, o, world=world, gpu_memory=budget).device_total == plan.device_total
    changes, best = props[0]
    if best.batch_size < 64:  # the next larger batch does not fit, with these changes or with every switch on
        bigger = {**changes, "batch_size": 2 * best.batch_size}
        assert not plan_memory(cfg, dataclasses.replace(base, **bigger), world=world, gpu_memory=budget).fits
        from qtrain.plan.propose import _ladder
        everything = {**_ladder(base, world)[-1][1], "batch_size": 2 * best.batch_size, "lmhead_chunks": 256}
        try:
            o = dataclasses.replace(base, **everything).validate()
        except ValueError:
            o = None
        assert o is None or not plan_memory(cfg, o, world=world, gpu_memory=budget).fits


def test_propose_prefers_least_intrusive_changes():
    cfg = preset("Qwen2.5-0.5B")
    props = propose(cfg, Options(seq_len=1024, batch_size=1), 80 * GiB, 1, max_batch=4)
    assert props[0][1].batch_size == 4
    # plenty of room: nothing else changes but the accumulation that keeps 1 x 4 sequences per step
    assert props[0][0] == {"batch_size": 4, "grad_accumulation": 1}
    assert propose(cfg, Options(seq_len=1024), 1 * GiB, 1) == []  # nothing fits 1 GiB


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * GiB
    assert parse_bytes("80 GB") == 80 * 10**9
    assert parse_bytes("141e9") == 141 * 10**9
    assert parse_bytes("1.5MiB") == 3 << 19
    with pytest.raises(ValueError):
        parse_bytes("lots")


def test_cli_plan_through_the_real_parser():
    p = argparse.ArgumentParser()
    add_plan_args(p)
    out = io.StringIO()
    ns = p.parse_args(["--model", "Qwen2.5-7B", "--gpu-memory", "80GiB", "--seq-len", "1024", "--gpus", "4",
                       "--max-batch", "16"])
    assert run_plan(ns, (), out=out) == 0
    text = out.getvalue()
    assert "[Memory plan] Qwen2.5-7B" in text and "world 4" in text and "[Proposal]" in text
    out = io.StringIO()
    ns = p.parse_args(["--model", "Qwen2.5-0.5B", "--gpu-memory", "24GB", "--batch-size", "2", "--json",
                       "--no-propose"])
    run_plan(ns, (), out=out)
    d = json.loads(out.getvalue())
    assert d["plan"]["batch_size"] == 2 and d["proposals"] == []


# ---- the step model that picks among proposals (plan/step_cost.py) --------------------------------------
def test_step_cost_recompute_flops_follow_the_switches():
    """Recomputation adds exactly the forward FLOPs of the GEMMs (and attention) it reruns: none for the
    elementwise switches, the MLP-up GEMM for ffn, a whole block forward for block (1/3 of a block's step)."""
    from qtrain.plan.step_cost import forward_flops_per_token, recompute_flops_per_token
    cfg, T = preset("Qwen2.5-14B"), 1024
    parts, head = forward_flops_per_token(cfg, T)
    L, C, F = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size
    assert parts["mlp_up"] == 2 * C * 2 * F and parts["mlp_down"] == 2 * F * C and head == 2 * C * cfg.vocab_size
    assert recompute_flops_per_token(cfg, T, {"swiglu", "norm"}) == 0
    assert recompute_flops_per_token(cfg, T, {"ffn"}) == L * parts["mlp_up"]
    assert recompute_flops_per_token(cfg, T, {"att"}) == L * (parts["qkv"] + parts["attention"])  # att => qkv
    assert recompute_flops_per_token(cfg, T, {"block"}) == L * sum(parts.values())
    # 14B: recompute-ffn adds ~17% of the step's matmul FLOPs, recompute-block ~32% (the head is not rerun)
    step = 3 * (L * sum(parts.values()) + head)
    assert 0.15 < recompute_flops_per_token(cfg, T, {"ffn"}) / step < 0.19
    assert 0.30 < recompute_flops_per_token(cfg, T, {"block"}) / step < 0.34


def test_step_cost_offload_amortizes_with_accumulation():
    """Offloaded moments cost a fixed PCIe time per optimizer step (both directions of the state at
    PCIE_RATE), so their share falls with the sequences per step; recomputation's share does not."""
    from qtrain.plan.step_cost import PCIE_RATE, step_cost
    cfg = preset("Qwen2.5-14B")
    base = Options(model="Qwen2.5-14B", seq_len=1024, batch_size=8, opt_m_dtype="bf16", opt_v_dtype="bf16")
    off = dataclasses.replace(base, offload_opt_m=True, offload_opt_v=True)
    ffn = dataclasses.replace(base, recompute_ffn=True)
    plan_off, plan_ffn = plan_memory(cfg, off), plan_memory(cfg, ffn)
    moments = plan_off.item("adam m").host + plan_off.item("adam v").host
    assert moments > 0 and plan_ffn.host_total == 0
    shares = {}
    for seqs in (32, 256):
        c_off = step_cost(cfg, off, plan_off, sequences_per_step=seqs)
        c_ffn = step_cost(cfg, ffn, plan_ffn, sequences_per_step=seqs)
        assert c_off.tokens == c_ffn.tokens == seqs * 1024
        assert c_off.transfer_s == pytest.approx(moments / PCIE_RATE) and c_off.recompute_s == 0
        assert c_ffn.transfer_s == 0 and c_ffn.recompute_s > 0
        shares[seqs] = (c_off.transfer_s / c_off.total_s, c_ffn.recompute_s / c_ffn.total_s)
    # the same transfer over 8x the tokens: its share s becomes s/(8 - 7s) (0.19 -> 0.029 at 14B here); 2%:
    # the first micro-step's accumulation is a copy (one pass less), which 8x the micro-steps do not scale
    s32 = shares[32][0]
    assert shares[256][0] == pytest.approx(s32 / (8 - 7 * s32), rel=0.02)
    assert shares[256][1] == pytest.approx(shares[32][1], rel=0.02)
    # and so at 32 sequences per step recomputing the MLP-up GEMM is the cheaper way, at 256 the offload
    assert step_cost(cfg, off, plan_off, sequences_per_step=32).total_s > \
        step_cost(cfg, ffn, plan_ffn, sequences_per_step=32).total_s
    assert step_cost(cfg, off, plan_off, sequences_per_step=256).total_s < \
        step_cost(cfg, ffn, plan_ffn, sequences_per_step=256).total_s


def test_propose_picks_the_cheaper_ladder_and_recommends_by_the_step_model():
    """14B on a 139.7 GiB GPU (the H200): at 256 sequences per step the proposal for B=16 offloads the
    moments rather than recomputing the whole block, and the recommendation is the entry with the least
    estimated time per token; the list itself stays largest batch first."""
    from qtrain.plan.propose import recommend
    cfg = preset("Qwen2.5-14B")
    base = Options(model="Qwen2.5-14B", seq_len=1024, batch_size=8, grad_accumulation=32, opt_m_dtype="bf16",
                   opt_v_dtype="bf16")
    props = propose(cfg, base, int(139.7 * GiB), 1, max_batch=16)
    batches = [p.batch_size for _, p in props]
    assert batches == sorted(batches, reverse=True)
    by_b = {p.batch_size: c for c, p in props}
    assert by_b[16].get("offload_opt_m") and not by_b[16].get("recompute_block"), by_b[16]
    for c, p in props:  # the sequences per step stay 256
        assert c.get("batch_size", base.batch_size) * c.get("grad_accumulation", base.grad_accumulation) == 256
    for c, p in props:  # each plan was made with the accumulation its changes name
        assert p.settings.get("grad_accumulation", c.get("grad_accumulation")) == c.get("grad_accumulation", 32)
    # what the step model recommends is what measured fastest on the H200 (BENCHMARKS.md, session 6):
    # at 256 sequences per step B=8 with SwiGLU + norm recomputed and Adam m offloaded (6.90k tokens/s, against
    # 6.80k with m and v offloaded and 5.45k for B=32 with the block recomputed) ...
    best, costs = recommend(cfg, base, props)
    assert len(costs) == len(props)
    assert props[best][0] == {"recompute_swiglu": True, "recompute_norm": True, "offload_opt_m": True}
    # ... and at 32 sequences per step B=4 with SwiGLU + norm recomputed and nothing offloaded (6.62k, against
    # 6.20k for B=2 x 16): one 1.2 s offload per 32 sequences costs more than the bigger micro-batch gains
    small = dataclasses.replace(base, grad_accumulation=4)
    props = propose(cfg, small, int(139.7 * GiB), 1, max_batch=16)
    best, _ = recommend(cfg, small, props)
    assert props[best][0] == {"batch_size": 4, "grad_accumulation": 8, "recompute_swiglu": True,
                              "recompute_norm": True}


def test_recommend_keeps_the_sequences_per_step():
    """A batch larger than the sequences per step (so more sequences per step) is listed but not recommended
    when a batch that keeps them fits: a per-step cost spread over more tokens must not win by that alone."""
    from qtrain.plan.propose import recommend
    cfg = preset("Qwen2.5-0.5B")
    base = Options(model="Qwen2.5-0.5B", seq_len=1024, batch_size=1, grad_accumulation=2, offload_opt_m=True)
    props = propose(cfg, base, 80 * GiB, 1, max_batch=8)
    assert [p.batch_size for _, p in props] == [8, 4, 2, 1]
    best, costs = recommend(cfg, base, props)
    assert props[best][1].batch_size == 2 and costs[0].tokens == 8 * 1024 and costs[best].tokens == 2 * 1024
    assert recommend(cfg, base, []) == (None, [])


def test_step_cost_counts_offloaded_master_gathers_per_micro_step():
    """--offload-master: every block gather copies the host shard in on the compute stream, forward and
    backward, so the master's bytes cross PCIe twice per micro-step besides the update's round trip."""
    from qtrain.plan.step_cost import PCIE_ONE_WAY, PCIE_RATE, step_cost
    cfg = preset("Qwen2.5-1.5B")
    o = Options(model="Qwen2.5-1.5B", seq_len=1024, batch_size=4, grad_accumulation=8, shard_weights=True,
                offload_master=True)
    plan = plan_memory(cfg, o)
    master = plan.item("weights").host
    assert master > 0
    c = step_cost(cfg, o, plan)
    assert c.transfer_s == pytest.approx(master / PCIE_RATE + 8 * 2 * master / PCIE_ONE_WAY)
