"""The memory plan against what qtrain really keeps (persistent state: tests/plan/test_components.py; the
per-layer activation tables: tests/model/test_activations.py).

- the activation row equals what a real `Transformer.forward_backward` holds when the LM head starts (an
  allocation tracker), for plain runs, --recompute-block and the fine-grained switches;
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
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import qtrain.model.transformer as tm
from tests.model.test_activations import DT, small_cfg
from qtrain.cli.plan import add_arguments as add_plan_args
from qtrain.cli.plan import run as run_plan
from qtrain.model.config import ModelConfig
from qtrain.model.registry import preset
from qtrain.model.init import init_params
from qtrain.model.recompute import resolve_flags
from qtrain.model.weights import num_params
from qtrain.model.transformer import RunOptions, Transformer, allocate_params
from qtrain.options import Options, OptionsError
from qtrain.parallel.layout import FlatLayout
from qtrain.parallel.optimizer import ShardedAdamW
from qtrain.parallel.weights.replicated import ParamWeights
from qtrain.plan.memory import GiB, MiB, parse_bytes
from qtrain.plan.resolution import AUTO_MARGIN, plan_memory
from qtrain.plan.propose import propose


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


def measure_micro_step(cfg: ModelConfig, dtype: str, *, flags=(), B=2, T=64, chunks=1, fp8=False, mlp_chunks=1):
    """(bytes alive when the final norm starts = activations kept for backward, peak of the micro-step),
    counting only what forward_backward allocates; the head's logits buffer, claimed at the micro-step's start
    (`head_logits_buffer`), is the head's workspace, not an activation."""
    params = allocate_params(cfg, dtype=DT[dtype], device="cpu", requires_grad=False)
    with torch.no_grad():
        init_params(cfg, params, seed=0)
    for p in params.values():
        p.requires_grad_(True)
    run = RunOptions(lmhead_chunks=chunks, matmul_dtype="e4m3" if fp8 else "", recompute=frozenset(flags),
                     mlp_chunks=mlp_chunks)
    model = Transformer(cfg, run)
    model.rope(T, torch.device("cpu"), DT[dtype])  # cached tables are not activations
    g = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    tracker, at_head, orig, buffers = LiveBytes(), [], model._final_norm, []

    def final_norm(x, weight, eps):  # the final norm is the first thing the LM head does
        if not at_head:
            at_head.append(tracker.cur)
        return orig(x, weight, eps)

    real_buffer = tm.head_logits_buffer

    def logits_buffer(*args, **kw):
        buffers.append(real_buffer(*args, **kw))
        return buffers[-1]

    model._final_norm = final_norm
    with tracker, mock.patch.object(tm, "head_logits_buffer", logits_buffer):
        model.forward_backward(ParamWeights(cfg, params), inputs, targets, grads=NullSink(), loss_scale=1.0)
    return at_head[0] - sum(b.untyped_storage().nbytes() for b in buffers), tracker.peak


# ---------------------------------------------------------------------------------------------------------
# activations
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
    plan = plan_memory(cfg, Options(model_dtype=dtype, batch_size=B, seq_len=T, recompute_block="block" in flags),
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
        plan = plan_memory(cfg, Options(model_dtype=dtype, batch_size=B, seq_len=T, lmhead_chunks=chunks),
                           device="cpu", compiled=False, recompute=resolve_flags(flags))
        transient = plan.item("activations").device + plan.item("workspace").device
        assert peak <= transient <= 1.6 * peak, (dtype, flags, peak, transient)


# ---------------------------------------------------------------------------------------------------------
# persistent state: tests/plan/test_components.py measures every row against real components; here the
# e4m3 m layout math at world 4
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
    assert w == pytest.approx(2 * num_params(cfg), rel=1e-3)  # bf16; padding is < 0.1%
    assert plan.item("adam m").device == pytest.approx(2 * w, rel=1e-6) == plan.item("adam v").device
    grads = plan.item("gradients")  # at 4 x 1024 the 0.5B and 1.5B steps run CUDA graphs: their SR key table
    assert grads.device - grads.parts.get("sr_key_table", 0) == w
    assert ("sr_key_table" in grads.parts) == (name in ("Qwen2.5-0.5B", "Qwen2.5-1.5B"))
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


def test_proposals_keep_the_runs_lora_layout():
    """A LoRA run's proposals are planned over its own layout (the base frozen): every proposal's plan has the
    adapters' gradients and Adam state only, as the plan of the options as given does (they were planned as a full
    fine-tune: 14 GiB of gradients at Qwen2.5-7B where the adapters need 0.23 GiB with their Adam state)."""
    cfg = preset("Qwen2.5-7B")
    base = Options(seq_len=4096, batch_size=1, lora_rank=16, opt_m_dtype="bf16", opt_v_dtype="bf16").validate()
    given = plan_memory(cfg, base, world=1, gpu_memory=80 * GiB)
    props = propose(cfg, base, 80 * GiB, 1, max_batch=4)
    assert props

    def state(plan):
        return sum(i.device + i.host for i in plan.items if i.name.startswith(("gradients", "adam")))
    assert 0 < state(given) < 0.5 * GiB  # r=16 adapters: 40M parameters, fp32 gradients + Adam m, v
    for _, plan in props:
        assert state(plan) == state(given)


def test_proposals_keep_an_e4m3_lora_base_on_the_host_where_the_gpu_cannot_hold_it():
    """A 72B base as e4m3 codes is ~68 GiB: on a 40 GiB GPU no recompute or optimizer offload makes the run fit,
    the base's codes on the host (--offload-quants, which needs --recompute-block) do; sharded weights are not
    proposed (an e4m3 base is replicated: `sharded_weights_refusal`)."""
    cfg = preset("Qwen2.5-72B")
    base = Options(seq_len=4096, batch_size=1, lora_rank=16, lora_base_dtype="e4m3", model_dtype="bf16").validate()
    props = propose(cfg, base, 40 * GiB, 1, max_batch=2)
    assert props
    for changes, plan in props:
        assert changes.get("offload_quants") and changes.get("recompute_block"), changes
        assert not changes.get("shard_weights") and plan.item("weights").host > 60 * GiB
    # with FP8 GEMMs too: no --persistent-quants added (the base's codes are made once; the option is refused with it)
    fp8 = dataclasses.replace(base, matmul_dtype="e4m3", grad_accumulation=8)
    props = propose(cfg, fp8, 40 * GiB, 1, max_batch=2)
    assert props and not any(c.get("persistent_quants") for c, _ in props)


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
    assert parse_bytes("0") == 0 and parse_bytes("1048576") == 1 << 20  # bare numbers are bytes
    with pytest.raises(ValueError, match="'141' has no unit, so it is 141 bytes; write 141GiB or 141GB"):
        parse_bytes("141")  # what `--gpu-memory 141` meant is 141 GiB or GB, never 141 bytes
    with pytest.raises(ValueError, match="so it is 0.5 bytes"):
        parse_bytes("0.5")
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
    assert parts["up"] == 2 * C * 2 * F and parts["down"] == 2 * F * C and head == 2 * C * cfg.vocab_size
    assert recompute_flops_per_token(cfg, T, {"swiglu", "norm"}) == 0
    assert recompute_flops_per_token(cfg, T, {"ffn"}) == L * parts["up"]
    assert recompute_flops_per_token(cfg, T, {"att"}) == L * (parts["qkv"] + parts["attention"])  # att => qkv
    assert recompute_flops_per_token(cfg, T, {"block"}) == L * sum(parts.values())
    # 14B: recompute-ffn adds ~17% of the step's matmul FLOPs, recompute-block ~32% (the head is not rerun)
    step = 3 * (L * sum(parts.values()) + head)
    assert 0.15 < recompute_flops_per_token(cfg, T, {"ffn"}) / step < 0.19
    assert 0.30 < recompute_flops_per_token(cfg, T, {"block"}) / step < 0.34


def test_step_cost_recompute_ffn_reruns_the_qwen3_5_moe_up_gemms():
    """Qwen3.5-MoE: --recompute-ffn reruns the experts' up/gate grouped GEMM (k of the E experts' rows a token) and
    the shared expert's up/gate, the block's 'up' steps (qwen3_5/block.py `moe_mlp`), as a dense MLP's up GEMM.
    Before: none of them (their MatmulSpec named no step)."""
    from qtrain.plan.step_cost import forward_flops_per_token, recompute_flops_per_token
    from tests.model.family_fixtures import qwen35_cfg
    cfg, T = qwen35_cfg(moe=True, num_hidden_layers=2, layer_types=("linear_attention", "full_attention")), 64
    C, F, Fs, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size, \
        cfg.num_experts_per_tok
    for layer in range(2):
        parts, _ = forward_flops_per_token(cfg, T, layer)
        assert parts["experts_up_gate"] == 2 * k * 2 * F * C and parts["shared_up"] == 2 * 2 * Fs * C
    assert recompute_flops_per_token(cfg, T, {"ffn"}) == cfg.num_hidden_layers * (2 * k * 2 * F * C + 2 * 2 * Fs * C)


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


def test_step_cost_of_a_lora_base_on_the_host_is_its_gathers_not_an_update():
    """A LoRA base kept on the host (bf16 shards with --zero-level 3 --offload-master, or e4m3 codes with
    --lora-base-dtype e4m3 --offload-quants) travels to the GPU twice per micro-step (forward and the recomputed
    backward's gathers) and never back: the update does not touch a frozen base."""
    from qtrain.plan.step_cost import PCIE_ONE_WAY, step_cost
    cfg = preset("Qwen2.5-7B")
    base = Options(model="Qwen2.5-7B", seq_len=1024, batch_size=2, grad_accumulation=4, lora_rank=16,
                   recompute_block=True)
    for kw, row in ((dict(zero_level=3, offload_master=True), "weights"),
                    (dict(lora_base_dtype="e4m3", offload_quants=True), "weights")):
        opts = dataclasses.replace(base, **kw)
        plan = plan_memory(cfg, opts)
        on_host = plan.item(row).host
        assert on_host > 4e9  # the base: 7B in bf16 or e4m3
        cost = step_cost(cfg, opts, plan)
        assert cost.transfer_s == pytest.approx(4 * 2 * on_host / PCIE_ONE_WAY, rel=1e-3), kw
    # with FP8 GEMMs an e4m3 base is quantized once, at load: no quantization per step (nor --persistent-quants to add)
    e4m3 = dataclasses.replace(base, lora_base_dtype="e4m3", offload_quants=True, matmul_dtype="e4m3")
    assert step_cost(cfg, e4m3, plan_memory(cfg, e4m3)).quantize_s == 0


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
    # 6.80k with m and v offloaded and 5.45k for B=32 with the block recomputed); since v is copied out of the
    # fused QKV buffer (session 9, 4.5 GiB less at 14B B=8) the norm need not be recomputed any more ...
    best, costs = recommend(cfg, base, props)
    assert len(costs) == len(props)
    assert props[best][0] == {"recompute_swiglu": True, "offload_opt_m": True}
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


def test_step_cost_counts_fp8_weight_quantization_per_micro_step_or_once():
    """With FP8 linears every micro-step quantizes the FP8 block matrices (abs-max, e4m3 copy, transpose);
    --persistent-quants does it once per optimizer step. The rate is the one measured at Qwen2.5-7B 8 x 8 e4m3
    (3346.7 ms per step without, 3278.6 with: 7 of 8 quantizations saved); bf16 quantizes nothing."""
    from qtrain.plan.step_cost import FP8_WEIGHT_QUANT_RATE, fp8_weight_params, step_cost
    cfg = preset("Qwen2.5-7B")
    C, F, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    o = Options(model="Qwen2.5-7B", seq_len=1024, batch_size=8, grad_accumulation=8, opt_m_dtype="bf16",
                opt_v_dtype="bf16", matmul_dtype="e4m3")
    n = fp8_weight_params(cfg, o)
    assert n == L * (C * (cfg.q_dim + 2 * cfg.kv_dim) + cfg.q_dim * C + 2 * F * C + F * C)  # all four linears
    pq = dataclasses.replace(o, persistent_quants=True)
    per_micro = step_cost(cfg, o, plan_memory(cfg, o))
    once = step_cost(cfg, pq, plan_memory(cfg, pq))
    assert per_micro.quantize_s == pytest.approx(8 * n / FP8_WEIGHT_QUANT_RATE)
    assert once.quantize_s == pytest.approx(n / FP8_WEIGHT_QUANT_RATE)
    assert per_micro.quantize_s - once.quantize_s == pytest.approx(3.3467 - 3.2786, rel=0.02)
    assert once.total_s - once.quantize_s == pytest.approx(per_micro.total_s - per_micro.quantize_s)
    bf16 = dataclasses.replace(o, matmul_dtype="bf16")
    assert step_cost(cfg, bf16, plan_memory(cfg, bf16)).quantize_s == 0
    bypassed = dataclasses.replace(pq, debug_log_abs_max=1)  # its recorder makes the linears quantize per call
    assert step_cost(cfg, bypassed, plan_memory(cfg, bypassed)).quantize_s == pytest.approx(per_micro.quantize_s)


def test_propose_adds_persistent_quants_where_it_fits():
    """e4m3 with several micro-steps: each proposal gets --persistent-quants when its plan still fits with the
    copies (the step model finds it faster); not where they would not fit, not with one micro-step, not with
    sharded weights, never in bf16."""
    cfg, budget = preset("Qwen2.5-7B"), int(139 * GiB)
    base = Options(model="Qwen2.5-7B", seq_len=1024, batch_size=8, grad_accumulation=8, opt_m_dtype="bf16",
                   opt_v_dtype="bf16", matmul_dtype="e4m3")
    props = propose(cfg, base, budget, 1, max_batch=16)
    by_b = {p.batch_size: c for c, p in props}
    assert by_b[8] == {"persistent_quants": True} and by_b[16].get("persistent_quants")
    from qtrain.plan.step_cost import fp8_weight_params
    for c, p in props:  # at 139 GiB every proposal with FP8 linears and accumulation fits with the copies
        o = dataclasses.replace(base, **c).validate()
        eligible = fp8_weight_params(cfg, o) > 0 and o.grad_accumulation >= 2
        assert p.fits and eligible == bool(c.get("persistent_quants")), (p.batch_size, c)
        assert not eligible or p.item("fp8 weights").device > 0
    assert by_b[1] == {"batch_size": 1, "grad_accumulation": 64}  # 1 x 1024 tokens: the policy keeps bf16
    # 100 GiB: B=8 fits without the copies (98.5 GiB planned) but not with them (104.3)
    tight = {p.batch_size: c for c, p in propose(cfg, base, 100 * GiB, 1, max_batch=8)}
    assert not tight[8].get("persistent_quants") and tight[4].get("persistent_quants")
    one = {p.batch_size: c for c, p in propose(cfg, dataclasses.replace(base, grad_accumulation=1), budget, 1,
                                                max_batch=8)}
    assert one[8] == {} and one[4].get("persistent_quants")  # 8 sequences per step: 1 micro-step at B=8, 2 at B=4
    for other in (dataclasses.replace(base, matmul_dtype="bf16"), dataclasses.replace(base, shard_weights=True),
                  dataclasses.replace(base, use_cuda_graphs=True), dataclasses.replace(base, debug_log_abs_max=1)):
        assert not any(c.get("persistent_quants") for c, _ in propose(cfg, other, budget, 1, max_batch=8))


def test_fp32_master_and_fp8_policy_in_the_plan():
    """--master-dtype fp32: master, bf16 compute copy and fp32 gradients as rows; --fp8-policy auto: the header
    names the FP8 linears, and a mixed choice plans the larger activations of all-FP8 and no FP8."""
    cfg = preset("Qwen2.5-1.5B")
    mixed = plan_memory(cfg, Options(master_dtype="fp32", batch_size=4), gpu_memory=parse_bytes("141GiB"))
    n = FlatLayout(cfg, 1).total_numel()
    assert mixed.item("weights (fp32, master)").device == 4 * n
    assert mixed.item("weights (bf16, compute copy)").device == 2 * n
    g = mixed.item("gradients")  # 1.5B at 4 x 1024 runs CUDA graphs: + their SR key table
    assert g.name == "gradients (unsharded, fp32)" and g.device == 4 * n + g.parts["sr_key_table"]
    plain = plan_memory(cfg, Options(batch_size=4), gpu_memory=parse_bytes("141GiB"))
    assert mixed.device_total - plain.device_total == 2 * n + 2 * n + 2 * n  # master 4 vs 2 bytes, the copy, fp32 grads
    assert "bf16 on fp32 master" in mixed.format()
    fp8 = {p: plan_memory(cfg, Options(matmul_dtype="e4m3", fp8_policy=p, batch_size=4, fp8_min_size=m,
                                   fp8_min_block_gflop=0))
           for p, m in (("all", 800), ("auto", 800))}
    assert "matmul e4m3 for up/down |" in fp8["auto"].format() and "matmul e4m3 |" in fp8["all"].format()
    acts = fp8["auto"].item("activations").device
    assert acts >= fp8["all"].item("activations").device and acts >= plain.item("activations").device


def test_cuda_graphs_row_is_the_lm_head_transient_beside_the_graph_pool():
    """--use-cuda-graphs: evaluation allocates outside the graphs' private pool, bounded by the LM head's transient
    (the Qwen3.5-4B run at 4096 without evaluation: 44.9 GiB allocated, the plan with the row 48.43, without 45.25);
    nothing changes on the CPU (no graphs there)."""
    cfg = preset("Qwen2.5-0.5B")
    base = Options(model="Qwen2.5-0.5B", seq_len=1024, batch_size=4, use_cuda_graphs=False)
    graphs = dataclasses.replace(base, use_cuda_graphs=True)
    unset = dataclasses.replace(base, use_cuda_graphs=None)  # on at 0.5B micro-batch 4 (a host-bound step)
    assert plan_memory(cfg, unset).device_total == plan_memory(cfg, graphs).device_total
    big = dataclasses.replace(unset, batch_size=64)  # off at 64 x 1024: no row
    with pytest.raises(KeyError):
        plan_memory(cfg, big).item("cuda graphs")
    plain, with_graphs = plan_memory(cfg, base), plan_memory(cfg, graphs)
    row = with_graphs.item("cuda graphs")
    assert row.device == with_graphs.phases["lm_head"] > 0
    keys = with_graphs.item("gradients").parts["sr_key_table"]  # the SR keys the graphs read from the device
    assert 0 < keys < 2**20 and "sr_key_table" not in plain.item("gradients").parts
    assert with_graphs.device_total == plain.device_total + row.device + keys
    assert plan_memory(cfg, graphs, device="cpu").device_total == plan_memory(cfg, base, device="cpu").device_total
    # a run that never evaluates allocates nothing that size beside the pool (the update works in place): no row
    quiet = plan_memory(cfg, dataclasses.replace(graphs, eval_num_steps=0))
    assert "cuda graphs" not in [i.name for i in quiet.items]
    assert quiet.device_total == with_graphs.device_total - row.device


def test_fp8_keep_transposes_auto_where_the_plan_fits():
    """--fp8-keep-transposes unset: the plan keeps the e4m3 input transposes of compiled FP8 blocks where the plan
    with them fits the budget with AUTO_MARGIN of activations + workspace to spare (a run measured on the H200 ran out
    of memory with 0.84 GiB spare, fragmentation beyond the plan's 5%), and is the plan without them otherwise (never a plan that fits only without them
    turned into one that does not); as given when set; never without FP8 linears, a compiled block or a budget.
    The kept bytes are the activation terms' (tests/model/test_activations.py): 2 hidden-size rows per token and
    layer without recompute."""
    cfg = preset("Qwen2.5-3B")
    base = Options(model="Qwen2.5-3B", seq_len=1024, batch_size=32, grad_accumulation=4, opt_m_dtype="bf16",
                   opt_v_dtype="bf16", matmul_dtype="e4m3", lmhead_chunks=4, persistent_quants=True,
                   fp8_head_backward=False)  # its own auto goes first (the next test)

    def plan(o, gib=141, **kw):
        return plan_memory(cfg, o, gpu_memory=None if gib is None else int(gib * GiB), device="cuda", **{
            "compiled": True, **kw})

    on, off = (plan(dataclasses.replace(base, fp8_keep_transposes=v)) for v in (True, False))
    kept = on.item("activations").device - off.item("activations").device
    assert kept == cfg.num_hidden_layers * 2 * cfg.hidden_size * 32 * 1024
    assert on.settings["fp8_keep_transposes"] and not off.settings["fp8_keep_transposes"]
    assert plan(base).settings["fp8_keep_transposes"] and plan(base).device_total == on.device_total
    between = (on.device_total + off.device_total) / 2 / GiB  # fits only without the copies
    auto = plan(base, gib=between)
    assert auto.fits and not auto.settings["fp8_keep_transposes"] and auto.device_total == off.device_total
    assert not plan(dataclasses.replace(base, fp8_keep_transposes=True), gib=between).fits  # as given
    margin = AUTO_MARGIN * (on.item("activations").device + on.item("workspace").device)
    assert margin > GiB  # (~4.5 GiB here)
    assert not plan(base, gib=(on.device_total + margin - MiB) / GiB).settings["fp8_keep_transposes"]  # fits, too tight
    assert plan(base, gib=(on.device_total + margin + MiB) / GiB).settings["fp8_keep_transposes"]
    assert not plan(base, gib=None).settings["fp8_keep_transposes"]  # no budget: off
    assert not plan(base, compiled=False).settings["fp8_keep_transposes"]  # eager keeps them anyway
    bf16 = dataclasses.replace(base, matmul_dtype="", persistent_quants=False)
    assert not plan(bf16).settings["fp8_keep_transposes"]
    with pytest.raises(ValueError, match="--fp8-keep-transposes"):
        dataclasses.replace(bf16, fp8_keep_transposes=True).validate()


def test_fp8_head_backward_auto_where_the_plan_fits_before_the_kept_transposes():
    """--fp8-head-backward unset: on with e4m3 on a CUDA device where the plan with it fits with AUTO_MARGIN to
    spare (its bytes: the chunk's e5m2 gradient and the e4m3 copies), decided before --fp8-keep-transposes (the
    larger gain), which then takes what is left; off where only the plan without it fits with the margin, without
    a budget, under bf16, under LoRA (a frozen head), or when given off; as given when set."""
    cfg = preset("Qwen2.5-0.5B")
    base = Options(model="Qwen2.5-0.5B", seq_len=1024, batch_size=32, grad_accumulation=4, opt_m_dtype="bf16",
                   opt_v_dtype="bf16", matmul_dtype="e4m3")

    def plan(o, gib=79.18, **kw):
        return plan_memory(cfg, o, gpu_memory=None if gib is None else int(gib * GiB), device="cuda",
                           compiled=True, **kw)

    on, off = (plan(dataclasses.replace(base, fp8_head_backward=v, fp8_keep_transposes=False)) for v in (True, False))
    assert on.device_total > off.device_total  # it costs memory
    auto = plan(base)
    assert auto.settings["fp8_head_backward"] and auto.settings["fp8_keep_transposes"]  # 79 GiB: room for both
    margin = AUTO_MARGIN * (on.item("activations").device + on.item("workspace").device)
    tight = plan(base, gib=(on.device_total + margin + MiB) / GiB)  # the head fits with its margin, the copies not
    assert tight.settings["fp8_head_backward"] and not tight.settings["fp8_keep_transposes"]
    assert tight.device_total == on.device_total
    between = plan(base, gib=(on.device_total + margin - MiB) / GiB)  # too tight for the head: as before it
    assert not between.settings["fp8_head_backward"] and between.fits
    others = (dataclasses.replace(base, matmul_dtype=""), dataclasses.replace(base, lora_rank=8),
              dataclasses.replace(base, fp8_head_backward=False))
    assert not plan(base, gib=None).settings["fp8_head_backward"]
    for o in others:
        assert not plan(o).settings["fp8_head_backward"], o
    assert plan(dataclasses.replace(base, fp8_head_backward=True), gib=(on.device_total + MiB) / GiB).settings[
        "fp8_head_backward"]  # given: taken without the margin


def test_a_proposal_rung_the_resolution_refuses_is_skipped_not_the_whole_proposal():
    """Persistent quants of matrices that sharding cannot split on the FP8 alignment: the ladder's "shard weights"
    rung is refused by the run's resolution inside the plan; `propose` skips that rung (the replicated run the user
    asked for still plans) instead of ending `qtrain plan` with an error about options never given."""
    from tests.model.family_fixtures import qwen35_cfg
    from qtrain.plan.resolution import plan_memory
    cfg = qwen35_cfg(vocab_size=96, hidden_size=32, num_hidden_layers=2, head_dim=16, bos_token_id=0, eos_token_id=0,
                     layer_types=("linear_attention", "full_attention"), max_position_embeddings=64)
    opts = Options(persistent_quants=True, matmul_dtype="e4m3", fp8_policy="all", seq_len=64, batch_size=4,
                   grad_accumulation=2).validate()
    assert plan_memory(cfg, opts, world=1, gpu_memory=1 << 40, device="cuda").fits
    with pytest.raises(OptionsError, match="persistent-quants with sharded weights"):
        plan_memory(cfg, dataclasses.replace(opts, shard_weights=True).validate(), world=1, device="cuda")
    props = propose(cfg, opts, 1 << 20, 1, device="cuda")  # 1 MiB: every rung is tried, none fits
    assert props == []
    assert all(not c.get("shard_weights") for c, _ in propose(cfg, opts, 1 << 40, 1, device="cuda", max_batch=8))
