"""Gradient managers under real torch.distributed (gloo, 2 and 4 processes) against sums done by hand.

Every rank feeds deterministic per-rank, per-micro-step random gradients shaped like a tiny model's, in the
model's call order (head non-block groups, blocks L-1..0, embed), for 2 steps of 3 micro-steps. The
reference is the mean over ranks of the micro-step sum, in fp64. All runs of one world size happen in one
spawn (process start-up dominates the cost); the tests below only check the returned shards.

Tolerances. Every rounding on the way (a local or micro-step accumulation, one hop of the cross-rank sum,
the 1/W scale) acts on a partial sum whose magnitude, in units of the final average, is at most
S = mean_r sum_m |g_rm| (elementwise). A rounding errs by at most u*|value|: u = 2^-24 in fp32; in bf16
u = 2^-8 for round-to-nearest and < 2^-7 for stochastic rounding (less than one ulp, and one ulp is at most
2^-7 of the value). The number of roundings is below K = M*(W+2) for every kind (M micro-steps, W ranks),
so |error| <= K*u*S elementwise: a hard bound. For bf16 this bound is loose, so we also check the size and
the bias of the error over all elements. Each rounding error has second moment at most (2^-8 S)^2 (SR:
p(1-p) ulp^2 <= ulp^2/4; RN: |e| <= ulp/2), and they are zero-mean and uncorrelated, so the RMS of err/S
stays below sqrt(K)*2^-8 and its sign-correlated mean within 5 standard errors of zero (a rounding that
truncates instead of dithering is biased by ~ulp/2 per rounding, far outside). The runs are
deterministic, so these statistical checks cannot flake.
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.dist_utils import run_distributed
from qtrain.model.config import ModelConfig
from qtrain.model.llama import LlamaConfig
from qtrain.model.weights import block_tensor_names, param_shapes
from qtrain.parallel.comm import Communicator
from qtrain.parallel.gradients import OFFLOAD_NEEDS_SHARDING, make_gradient_manager
from qtrain.parallel.layout import FlatLayout

STEPS, MICRO = 2, 3
KINDS = ("unsharded", "reduce-scatter", "all-to-all")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Tiny but awkward shapes: C=40, F=56, V=97 (nothing a power of two), so shards cut through tensors.
CONFIGS = {
    "qwen2-tied": dict(model_type="qwen2", vocab_size=97, hidden_size=40, intermediate_size=56, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, attention_bias=True),
    "qwen3-untied": dict(model_type="qwen3", vocab_size=97, hidden_size=40, intermediate_size=56,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=10,
                         tie_word_embeddings=False, attention_bias=False, qk_norm=True),
}


def config(name: str) -> ModelConfig:
    return LlamaConfig(**CONFIGS[name])


def fake_grads(cfg: ModelConfig, rank: int, step: int, micro: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Deterministic gradients of one rank and micro-step; tensor i has magnitude ~10^(i%5 - 3)."""
    gen = torch.Generator().manual_seed(1_000_003 * rank + 10_007 * step + 101 * micro + 7)
    return {name: (torch.randn(shape, generator=gen) * 10.0 ** (i % 5 - 3)).to(dtype)
            for i, (name, shape) in enumerate(param_shapes(cfg).items())}


def feed(mgr, cfg: ModelConfig, g: dict[str, torch.Tensor]) -> None:
    """The model's call order within one micro-step (`Transformer.forward_backward`)."""
    mgr.accumulate_non_block({"norm": g["norm"]} if cfg.tie_word_embeddings else
                             {"norm": g["norm"], "lm_head": g["lm_head"]})
    for layer in reversed(range(cfg.num_hidden_layers)):
        mgr.accumulate_block(layer, {n: g[f"layers.{layer}.{n}"] for n in block_tensor_names(cfg, layer)})
    mgr.accumulate_non_block({"embed": g["embed"]})


def train_grads(mgr, cfg: ModelConfig, rank: int, dtype: torch.dtype, *, device: str = "cpu",
                same_grads: bool = False) -> list[dict]:
    """Run STEPS x MICRO micro-steps; return CPU copies of every group's shard after each step."""
    out = []
    for step in range(STEPS):
        for micro in range(MICRO):
            mgr.start_micro_step(step=step, micro_step=micro, num_micro_steps=MICRO)
            grads = fake_grads(cfg, 0 if same_grads else rank, step, micro, dtype)
            feed(mgr, cfg, {n: t.to(device) for n, t in grads.items()})
            mgr.end_micro_step()
        if torch.device(device).type == "cuda":  # offloaded shards are read by the host: wait for their copies
            torch.cuda.current_stream().synchronize()
        out.append({k: v.to("cpu", copy=True) for k, v in mgr.grad_shards().items()})
    return out


# ---- the distributed worker: every run of one world size --------------------------------------------
def runs(world: int) -> dict[str, tuple]:
    """name -> (config, kind, dtype, offload, seed, same_grads, use_avg)."""
    specs = {}
    for cfg in CONFIGS:
        for kind in KINDS:
            for dt in DTYPES:
                specs[f"{cfg}/{kind}/{dt}"] = (cfg, kind, dt, False, 1234, False, True)
                if kind != "unsharded":
                    specs[f"{cfg}/{kind}/{dt}/offload"] = (cfg, kind, dt, True, 1234, False, True)
            specs[f"{cfg}/{kind}/bf16/rerun"] = (cfg, kind, "bf16", False, 1234, False, True)
            specs[f"{cfg}/{kind}/bf16/seed2"] = (cfg, kind, "bf16", False, 99, False, True)
            if world == 2:  # identical inputs on every rank: the cross-rank average is exact in bf16 for W=2
                specs[f"{cfg}/{kind}/bf16/same"] = (cfg, kind, "bf16", False, 1234, True, True)
    for kind in ("unsharded", "reduce-scatter"):  # the SUM + 1/W fallback for backends without ReduceOp.AVG
        for dt in DTYPES:
            specs[f"qwen2-tied/{kind}/{dt}/sum"] = ("qwen2-tied", kind, dt, False, 1234, False, False)
    return specs


def _worker(rank: int, world: int, device_type: str = "cpu") -> dict:
    device = f"cuda:{rank}" if device_type == "cuda" else "cpu"
    comms = {True: Communicator(device=device), False: Communicator(device=device, use_avg=False)}
    assert (comms[True].rank, comms[True].world) == (rank, world)
    results = {}
    for name, (cfg_name, kind, dt, offload, seed, same, avg) in runs(world).items():
        cfg = config(cfg_name)
        mgr = make_gradient_manager(kind, FlatLayout(cfg, world), comm=comms[avg], dtype=DTYPES[dt], device=device,
                                    seed=seed, offload=offload)
        shards = train_grads(mgr, cfg, rank, DTYPES[dt], device=device, same_grads=same)
        results[name] = {"shards": shards, "memory": mgr.memory()}
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def dist_results(request):
    world = request.param
    return world, run_distributed(_worker, world)


# ---- reference ----------------------------------------------------------------------------------------
def expected(cfg_name: str, world: int, step: int, dtype: torch.dtype) -> tuple[dict, dict]:
    """Per group: (mean over ranks of the micro-step sum, S = mean over ranks of the sum of |g|), fp64,
    as full padded group buffers."""
    cfg = config(cfg_name)
    layout = FlatLayout(cfg, world)
    mean = {g.key: torch.zeros(g.padded_numel, dtype=torch.float64) for g in layout.groups}
    mag = {g.key: torch.zeros(g.padded_numel, dtype=torch.float64) for g in layout.groups}
    for r in range(world):
        for m in range(MICRO):
            grads = fake_grads(cfg, r, step, m, dtype)
            for g in layout.groups:
                for seg in g.segments:
                    x = grads[seg.name].double().reshape(-1)
                    mean[g.key][seg.start:seg.start + seg.numel] += x / world
                    mag[g.key][seg.start:seg.start + seg.numel] += x.abs() / world
    return mean, mag


def full_buffers(results: list[dict], name: str, step: int) -> dict[str, torch.Tensor]:
    """Concatenate every rank's shard of every group."""
    keys = results[0][name]["shards"][step].keys()
    return {k: torch.cat([res[name]["shards"][step][k] for res in results]) for k in keys}


# ---- checks (shared by the gloo tests and the NCCL/CUDA tests) -------------------------------------------
def check_hand_average(world: int, results: list[dict], cfg_name: str, kind: str, dt: str, suffix: str = "") -> None:
    """Every rank holds exactly its slice; the slices together are the hand average (bounds: module doc)."""
    dtype = DTYPES[dt]
    name = f"{cfg_name}/{kind}/{dt}{suffix}"
    layout = FlatLayout(config(cfg_name), world)
    K = MICRO * (world + 2)
    u = 2.0**-24 if dtype == torch.float32 else 2.0**-7
    errs, scales, signs = [], [], []
    for step in range(STEPS):
        mean, mag = expected(cfg_name, world, step, dtype)
        full = full_buffers(results, name, step)
        for g in layout.groups:
            for res in results:
                assert res[name]["shards"][step][g.key].numel() == g.shard_size(world)
            got = full[g.key].double()
            assert got.numel() == g.padded_numel
            real = sum(s.numel for s in g.segments)
            assert torch.equal(got[real:], torch.zeros_like(got[real:])), f"{name} {g.key}: padding not zero"
            err = got - mean[g.key]
            bad = (err.abs() > K * u * mag[g.key]).nonzero().flatten()
            assert bad.numel() == 0, (f"{name} step {step} {g.key}: {bad.numel()} elements off, first at "
                                      f"{bad[:5].tolist()}: got {got[bad[:5]].tolist()}, "
                                      f"expected {mean[g.key][bad[:5]].tolist()}")
            errs.append(err[:real]), scales.append(mag[g.key][:real]), signs.append(mean[g.key][:real].sign())
    if dtype == torch.bfloat16:
        rel = torch.cat(errs) / torch.cat(scales)
        rms = rel.pow(2).mean().sqrt().item()
        assert rms <= math.sqrt(K) * 2.0**-8, f"{name}: RMS relative error {rms:.3g}"
        bias = (rel * torch.cat(signs)).mean().item()
        limit = 5 * math.sqrt(K) * 2.0**-8 / math.sqrt(rel.numel())
        assert abs(bias) <= limit, f"{name}: biased rounding, mean {bias:.3g}"


def check_same_bits(a: list[dict], b: list[dict], name_a: str, name_b: str, what: str) -> None:
    for ra, rb in zip(a, b):
        for step in range(STEPS):
            for k, v in ra[name_a]["shards"][step].items():
                assert torch.equal(v, rb[name_b]["shards"][step][k]), f"{name_a} vs {name_b}: {what} (step {step}, {k})"


def check_seed_used(results: list[dict], base: str) -> None:
    differs = any(not torch.equal(v, res[base + "/seed2"]["shards"][step][k])
                  for res in results for step in range(STEPS) for k, v in res[base]["shards"][step].items())
    assert differs, f"{base}: another seed gave the same bits: SR ignores the seed?"


def check_world_size_independent(results: list[dict], cfg_name: str, kind: str, device: str = "cpu") -> None:
    """World 2 with identical gradients on both ranks (the cross-rank average is then exact) must give the
    single-process bits: an element's SR bits depend on its place in its tensor, not on where a shard cuts."""
    cfg = config(cfg_name)
    solo = make_gradient_manager(kind, FlatLayout(cfg, 1), comm=Communicator.solo(device), dtype=torch.bfloat16,
                                 device=device, seed=1234)
    want = train_grads(solo, cfg, 0, torch.bfloat16, device=device)
    lay1, lay2 = FlatLayout(cfg, 1), FlatLayout(cfg, 2)
    for step in range(STEPS):
        got = lay2.views(full_buffers(results, f"{cfg_name}/{kind}/bf16/same", step))
        ref = lay1.views(want[step])
        for n in ref:
            assert torch.equal(got[n], ref[n]), f"{kind} step {step} {n}: differs from the single-process run"


# ---- tests (gloo, CPU) ----------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg_name", list(CONFIGS))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dt", list(DTYPES))
def test_shards_match_hand_average(dist_results, cfg_name, kind, dt):
    world, results = dist_results
    check_hand_average(world, results, cfg_name, kind, dt)


@pytest.mark.parametrize("kind", ["unsharded", "reduce-scatter"])
@pytest.mark.parametrize("dt", list(DTYPES))
def test_sum_then_scale_fallback(dist_results, kind, dt):
    world, results = dist_results
    check_hand_average(world, results, "qwen2-tied", kind, dt, suffix="/sum")


@pytest.mark.parametrize("cfg_name", list(CONFIGS))
@pytest.mark.parametrize("kind", ["reduce-scatter", "all-to-all"])
@pytest.mark.parametrize("dt", list(DTYPES))
def test_offload_is_bitwise_equal(dist_results, cfg_name, kind, dt):
    _, results = dist_results
    name = f"{cfg_name}/{kind}/{dt}"
    check_same_bits(results, results, name, name + "/offload", "offload differs")


@pytest.mark.parametrize("cfg_name", list(CONFIGS))
@pytest.mark.parametrize("kind", KINDS)
def test_deterministic_and_seeded(dist_results, cfg_name, kind):
    _, results = dist_results
    base = f"{cfg_name}/{kind}/bf16"
    check_same_bits(results, results, base, base + "/rerun", "a rerun differs")
    check_seed_used(results, base)


@pytest.mark.parametrize("cfg_name", list(CONFIGS))
def test_sharded_memory_is_one_over_world(dist_results, cfg_name):
    world, results = dist_results
    for res in results:
        full = res[f"{cfg_name}/unsharded/bf16"]["memory"]
        block_bytes = full["blocks"] // config(cfg_name).num_hidden_layers
        for kind in ("reduce-scatter", "all-to-all"):
            mem = res[f"{cfg_name}/{kind}/bf16"]["memory"]
            assert mem["block_shards"] * world == full["blocks"]
            assert mem["non_block"] == full["non_block"]
            assert mem["staging"] == 2 * block_bytes  # two full block buffers, whatever the depth


@pytest.mark.parametrize("cfg_name", list(CONFIGS))
@pytest.mark.parametrize("kind", KINDS)
def test_world_size_independent_bits(dist_results, cfg_name, kind):
    world, results = dist_results
    if world != 2:
        pytest.skip("the cross-rank bf16 average of identical inputs is exact only for world 2")
    check_world_size_independent(results, cfg_name, kind)


# ---- tests (NCCL, CUDA): on the device machine --------------------------------------------------------
@pytest.mark.gpu
def test_nccl_cuda_matches_hand_average_and_gloo():
    """The CUDA path: side stream + events, NCCL, Triton SR kernels, pinned-host offload with device staging.
    Same checks as on gloo; and all-to-all (no arithmetic in the collective, fp32 sum in a fixed order,
    Triton SR = twin bits) must equal the gloo/CPU run bit for bit."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    gpu = run_distributed(_worker, 2, "cuda", backend="nccl")
    cpu = run_distributed(_worker, 2, "cpu")
    for cfg_name in CONFIGS:
        for kind in KINDS:
            for dt in DTYPES:
                check_hand_average(2, gpu, cfg_name, kind, dt)
                if kind != "unsharded":
                    name = f"{cfg_name}/{kind}/{dt}"
                    check_same_bits(gpu, gpu, name, name + "/offload", "offload differs")
            base = f"{cfg_name}/{kind}/bf16"
            check_same_bits(gpu, gpu, base, base + "/rerun", "a rerun differs")
            check_seed_used(gpu, base)
            check_world_size_independent(gpu, cfg_name, kind, device="cuda:0")
            for dt in DTYPES:
                if kind == "all-to-all":
                    check_same_bits(gpu, cpu, f"{cfg_name}/{kind}/{dt}", f"{cfg_name}/{kind}/{dt}", "CUDA != CPU")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_single_gpu_matches_cpu_bits(kind):
    """World 1 on CUDA (no process group; local copies, side stream still used) gives the CPU bits."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = config("qwen3-untied")
    for offload in ([False, True] if kind != "unsharded" else [False]):
        got = {}
        for dev in ("cpu", "cuda"):
            mgr = make_gradient_manager(kind, FlatLayout(cfg, 1), comm=Communicator.solo(dev), dtype=torch.bfloat16,
                                        device=dev, seed=5, offload=offload)
            got[dev] = train_grads(mgr, cfg, 0, torch.bfloat16, device=dev)
        for step in range(STEPS):
            for k, v in got["cpu"][step].items():
                assert torch.equal(v, got["cuda"][step][k]), f"{kind} offload={offload} step {step} {k}"


# ---- single-process checks (no spawn) ------------------------------------------------------------------
def test_offload_with_unsharded_is_refused():
    cfg = config("qwen2-tied")
    with pytest.raises(ValueError, match=r"^--offload-gradients requires sharded gradients \(--shard-gradients or "
                                         r"--zero-level 2\)$"):
        make_gradient_manager("unsharded", FlatLayout(cfg, 1), comm=Communicator.solo("cpu"), dtype=torch.bfloat16,
                              device="cpu", seed=0, offload=True)
    with pytest.raises(ValueError, match="unknown gradient manager kind"):
        make_gradient_manager("zero-9", FlatLayout(cfg, 1), comm=Communicator.solo("cpu"), dtype=torch.bfloat16,
                              device="cpu", seed=0)
    assert OFFLOAD_NEEDS_SHARDING.startswith("--offload-gradients")


@pytest.mark.parametrize("kind", KINDS)
def test_single_process_fp32_is_exact_sum(kind):
    """World 1, fp32, gradients that are small integers: every sum is exact, so the shard must be too."""
    cfg = config("qwen3-untied")
    layout = FlatLayout(cfg, 1)
    mgr = make_gradient_manager(kind, layout, comm=Communicator.solo("cpu"), dtype=torch.float32, device="cpu", seed=0)
    total = {n: torch.zeros(s) for n, s in param_shapes(cfg).items()}
    for step in range(2):
        for n in total:
            total[n].zero_()
        for micro in range(MICRO):
            g = {n: (t * 1000).round() for n, t in fake_grads(cfg, 0, step, micro, torch.float32).items()}
            for n in total:
                total[n] += g[n]
            mgr.start_micro_step(step=step, micro_step=micro, num_micro_steps=MICRO)
            feed(mgr, cfg, g)
            mgr.end_micro_step()
        got = layout.views(mgr.grad_shards())
        for n in total:
            assert torch.equal(got[n], total[n]), f"{kind} step {step} {n}"


def test_protocol_errors_are_reported():
    cfg = config("qwen2-tied")
    mgr = make_gradient_manager("reduce-scatter", FlatLayout(cfg, 1), comm=Communicator.solo("cpu"),
                                dtype=torch.float32, device="cpu", seed=0)
    g = fake_grads(cfg, 0, 0, 0, torch.float32)
    block0 = {n: g[f"layers.0.{n}"] for n in block_tensor_names(cfg)}
    with pytest.raises(RuntimeError, match="outside a micro-step"):
        mgr.accumulate_block(0, block0)
    mgr.start_micro_step(step=0, micro_step=0, num_micro_steps=2)
    mgr.accumulate_block(0, block0)
    with pytest.raises(RuntimeError, match="arrived twice"):
        mgr.accumulate_block(0, block0)
    with pytest.raises(KeyError, match="expected"):
        mgr.accumulate_block(1, {"qkv": g["layers.1.qkv"]})
    with pytest.raises(RuntimeError, match="no gradients were received"):
        mgr.end_micro_step()
    with pytest.raises(RuntimeError, match="final only after"):
        mgr.grad_shard("embed")
    with pytest.raises(RuntimeError, match="was not ended"):
        mgr.start_micro_step(step=0, micro_step=1, num_micro_steps=2)


# ---- the SR key table (CUDA graphs) ---------------------------------------------------------------
@pytest.mark.parametrize("cfg_name", list(CONFIGS))
def test_key_table_gives_the_scalar_paths_bits(cfg_name):
    """`use_key_table`: every SR launch reads its key from the device table that start_micro_step refills;
    fp32 gradients into bf16 buffers round on every micro-step (SR copy, then SR adds), and the shards
    are bitwise those of the scalar-key path. A table refilled for the wrong micro-step gives other bits,
    so the kernels really read it."""
    cfg = config(cfg_name)

    def manager(table: bool):
        mgr = make_gradient_manager("unsharded", FlatLayout(cfg, 1), comm=Communicator.solo("cpu"),
                                    dtype=torch.bfloat16, device="cpu", seed=99)
        if table:
            mgr.use_key_table()
        return mgr

    want = train_grads(manager(False), cfg, 0, torch.float32)
    check_same_bits([{"x": {"shards": want}}], [{"x": {"shards": train_grads(manager(True), cfg, 0, torch.float32)}}],
                    "x", "x", "key table vs scalar keys")
    wrong = manager(True)
    fill = wrong._keys.fill
    wrong._keys.fill = lambda seed, step, micro: fill(seed, step, 0)  # every micro-step gets micro-step 0's keys
    got = train_grads(wrong, cfg, 0, torch.float32)
    assert any(not torch.equal(v, want[s][k]) for s in range(STEPS) for k, v in got[s].items())


def test_key_table_scope_and_replayed_protocol():
    cfg = config("qwen2-tied")
    for kind in ("reduce-scatter", "all-to-all"):
        mgr = make_gradient_manager(kind, FlatLayout(cfg, 1), comm=Communicator.solo("cpu"), dtype=torch.bfloat16,
                                    device="cpu", seed=0)
        with pytest.raises(ValueError, match="needs unsharded gradients on one rank"):
            mgr.use_key_table()
    mgr = make_gradient_manager("unsharded", FlatLayout(cfg, 1), comm=Communicator.solo("cpu"), dtype=torch.bfloat16,
                                device="cpu", seed=0)
    mgr.start_micro_step(step=0, micro_step=0, num_micro_steps=1)
    with pytest.raises(RuntimeError, match="only a manager using the SR key table"):
        mgr.replayed()
    mgr.use_key_table()
    mgr.replayed()  # a graph queued the accumulation: every group counts as received
    with pytest.raises(RuntimeError, match="call it once"):
        mgr.replayed()
    mgr.end_micro_step()
    assert set(mgr.grad_shards()) == {g.key for g in mgr.layout.groups}
