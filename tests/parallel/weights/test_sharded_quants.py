"""--persistent-quants / --offload-quants (`ShardedWeights(quantized=...)`, qtrain/parallel/weights/sharded.py).

Claim: keeping e4m3 shards of the four block matrices, made once per optimizer step with the full tensor's
scale, changes which bytes travel, not one bit of the result. Each rank quantizes its pieces with the
full-tensor abs-max (one all-reduce MAX) through the same `quantize_fp8` the linears apply to the gathered
tensor, and that quantization is element-wise once the scale is fixed, so the gathered codes equal the
codes of the gathered tensor; the linears then get the same operands as without the option. So runs are
compared *bitwise* with the plain sharded runs: losses, gradient norms, weights after every step (which
carry the gradients), evaluation losses.

In 2 processes (gloo), one spawn: sharded vs sharded + persistent quants, vs + offloaded quants, and zero-level 3
+ recompute-block vs the same + persistent/offloaded quants, with grad accumulation 2 over 3 steps; the
codes handed to the model equal `quantize_fp8` of the gathered weights; one quantization per matrix per
step (and none in the linears, which quantize every forward without the option); the block gathers move
half the bytes for the matrices; ranks agree; memory per rank.
In process (a world of one, or the maps of W ranks emulated): the small-tensor exchange for W = 1..8 (shards
that cut small tensors included), the quantized shards of W = 4 ranks assembled against the full tensors,
the saved-tensor guard on the e4m3 buffers, the value-less matrix leaves, --debug-log-abs-max and
fine-grained recompute, a checkpoint load re-quantizing, option validation, and the memory plan against
what is allocated.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import qtrain.kernels.swiglu.mlp as swiglu_mlp
import qtrain.numerics.fp8 as fp8
from tests.dist_utils import full_params_cpu, random_batch, run_distributed, train_steps
from qtrain.model.config import ModelConfig
from qtrain.model.llama import LlamaConfig
from qtrain.model.transformer import FP8_INV_SCALE, FP8_WEIGHT
from qtrain.parallel.comm import Communicator, Handle
from qtrain.parallel.dist import DistContext
from qtrain.parallel.layout import FlatLayout
from qtrain.parallel.weights.persistent_quants import PersistentQuants
from qtrain.parallel.weights.sharded import ShardedWeights
from qtrain.model.llama import FP8_MATRICES
from qtrain.plan.resolution import plan_for_trainer, plan_memory
from qtrain.options import Options, OptionsError
from qtrain.train.trainer import Trainer

# every small tensor kind (ln1, qkv_bias, q_norm, k_norm, ln2); K and N of the linears multiples of 16; odd vocab
CFG = LlamaConfig(model_type="qwen3", vocab_size=101, hidden_size=64, intermediate_size=48, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                  rope_theta=10000.0, tie_word_embeddings=False, attention_bias=True, qk_norm=True,
                  bos_token_id=None, eos_token_id=None)
B, T, GA, STEPS = 2, 16, 2, 3
CPU = torch.device("cpu")
WORLD = 2
L, M = CFG.num_hidden_layers, len(FP8_MATRICES)
RUNS = {
    "sharded": {"shard_weights": True},
    "persistent": {"shard_weights": True, "persistent_quants": True},
    "persistent+offload": {"shard_weights": True, "persistent_quants": True, "offload_quants": True},
    "zero3+recompute": {"zero_level": 3, "recompute_block": True},
    "zero3+recompute+persistent": {"zero_level": 3, "recompute_block": True, "persistent_quants": True,
                                   "offload_quants": True},
}
PAIRS = (("sharded", "persistent"), ("sharded", "persistent+offload"),
         ("zero3+recompute", "zero3+recompute+persistent"))


def options(model_dir: str, **kw) -> Options:
    return Options(model=model_dir, from_scratch=True, device="cpu", compile="off", seed=5, model_dtype="bf16",
                   matmul_dtype="e4m3", fp8_policy="all", opt_m_dtype="bf16", opt_v_dtype="bf16", batch_size=B,
                   seq_len=T, grad_accumulation=GA, learning_rate=3e-3, **kw)


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return random_batch(CFG.vocab_size, B, T, step, micro, rank)


gathered = full_params_cpu


def run_steps(tr: Trainer, steps: range) -> list[dict]:
    return train_steps(tr, steps, batch, GA, 3e-3)


class _CountingQuantize:
    """Counts what the linears quantize: `fp8_linear` / `fp8_swiglu_mlp` call `quantize_fp8` (through their modules'
    names for it, both patched) for a weight that comes without an FP8 copy (the persistent shards use their own)."""

    def __init__(self):
        self.calls, self._orig = 0, fp8.quantize_fp8

    def __call__(self, *a, **kw):
        self.calls += 1
        return self._orig(*a, **kw)


def _codes_match_gathered_weights(tr: Trainer) -> bool:
    """The e4m3 copies the model gets are `quantize_fp8` of the full (gathered) weights, codes and scales."""
    full = tr.full_params()
    ok = True
    with torch.no_grad():
        for layer in range(L):
            w = tr.weights.block(layer)
            for n in FP8_MATRICES:
                q, inv = fp8.quantize_fp8(full[f"layers.{layer}.{n}"])
                ok &= torch.equal(w[FP8_WEIGHT.format(n)].view(torch.uint8), q.view(torch.uint8))
                ok &= torch.equal(w[FP8_INV_SCALE.format(n)], inv)
    return bool(ok)


def _worker(rank: int, world: int, model_dir: str) -> dict:
    ctx = DistContext(rank=rank, world=world, local_rank=rank, device=CPU)
    count = _CountingQuantize()
    fp8.quantize_fp8 = swiglu_mlp.quantize_fp8 = count
    out: dict = {}
    for name, kw in RUNS.items():
        tr = Trainer(options(model_dir, **kw), ctx)
        count.calls = 0
        rec: dict = {"w0": gathered(tr), "steps": run_steps(tr, range(STEPS))}
        rec["eval"] = tr.evaluate([batch(100, 0, rank), batch(101, 0, rank)])
        rec["linear_quantizations"] = count.calls
        w = tr.weights
        rec["gathers"], rec["bytes"] = w.gathers, dict(w.gathered_bytes)
        rec["memory"], rec["host_keys"] = w.memory(), w.host_memory_keys()
        if w.quants is not None:
            rec["quantizations"] = w.quants.quantizations
            rec["codes_ok"] = _codes_match_gathered_weights(tr)
        out[name] = rec
    return out


@pytest.fixture(scope="module")
def results(model_dir):
    return run_distributed(_worker, WORLD, model_dir)


def _same_steps(a: list[dict], b: list[dict], what: str) -> None:
    assert len(a) == len(b) == STEPS
    for s, (x, y) in enumerate(zip(a, b)):
        assert (x["loss"], x["norm"]) == (y["loss"], y["norm"]), f"{what}: step {s} loss/norm"
        for k in y["weights"]:
            assert torch.equal(x["weights"][k], y["weights"][k]), f"{what}: step {s} weight {k}"


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[1]}-vs-{p[0]}")
def test_persistent_quants_train_bitwise_like_quantizing_every_gather(results, pair):
    for r in range(WORLD):
        a, b = results[r][pair[0]], results[r][pair[1]]
        assert all(torch.equal(a["w0"][k], b["w0"][k]) for k in a["w0"]), "initial weights differ"
        _same_steps(b["steps"], a["steps"], f"rank {r} {pair[1]}")
        assert b["eval"] == a["eval"]
        assert b["codes_ok"], f"rank {r} {pair[1]}: codes differ from quantize_fp8 of the gathered weights"
    run = results[0][pair[0]]  # not vacuous: training moved the matrices
    assert not torch.equal(run["steps"][-1]["weights"]["layers.0.up"], run["w0"]["layers.0.up"])


def test_all_ranks_agree(results):
    for name, run in results[0].items():
        for r in range(1, WORLD):
            _same_steps(results[r][name]["steps"], run["steps"], f"{name} rank {r} vs rank 0")


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[1]}-vs-{p[0]}")
def test_one_quantization_per_matrix_per_step_and_half_the_gather_bytes(results, pair):
    layout = FlatLayout(CFG, WORLD)
    padded = layout.block(0).padded_numel
    for r in range(WORLD):
        plain, pq = results[r][pair[0]], results[r][pair[1]]
        # once per weights version: the initial weights and after each of the STEPS updates (the last one by the
        # prefetch at the update, then reused by the evaluation); the linears never quantize a weight
        assert pq["quantizations"] == M * L * (STEPS + 1)
        assert pq["linear_quantizations"] == 0
        # without: every linear quantizes its weight in every forward (the backward reuses the forward's copy; with
        # --recompute-block the backward reruns the forward, quantizing again)
        forwards = STEPS * GA * (2 if "recompute" in pair[0] else 1) + 2  # micro-steps + evaluation batches
        assert plain["linear_quantizations"] == M * L * forwards
        # the same gathers, the matrices in 1 byte instead of 2; the small tensors travel apart, a few bytes
        assert pq["gathers"] == plain["gathers"]
        block_gathers = plain["bytes"]["block"] // (2 * padded)
        assert block_gathers > STEPS * GA
        assert pq["bytes"]["block"] == 0 and pq["bytes"]["block_fp8"] * 2 == plain["bytes"]["block"]
        # the small tensors: one slot per rank, as large as the most any shard holds of them (a few % here, where
        # the matrices are tiny; C-sized against C^2-sized in a real model)
        small = {s.short for s in layout.block(0).segments if s.short not in FP8_MATRICES}
        slot = layout.block(0).max_shard_numel(WORLD, small)
        assert pq["bytes"]["block_small"] == block_gathers * WORLD * slot * 2
        assert pq["bytes"]["block_small"] < plain["bytes"]["block"] / 20
        assert pq["bytes"]["non_block"] == plain["bytes"]["non_block"]


def test_memory_per_rank(results):
    layout = FlatLayout(CFG, WORLD)
    g = layout.block(0)
    for r in range(WORLD):
        plain, pq = results[r]["sharded"]["memory"], results[r]["persistent"]["memory"]
        assert pq["shards"] == plain["shards"] and pq["non_block_buffers"] == plain["non_block_buffers"]
        assert pq["quant_shards"] * WORLD == L * g.padded_numel  # 1 byte per element of the rank's block shards
        assert pq["quant_buffers"] * 2 == plain["block_buffers"]  # two e4m3 block buffers instead of bf16 ones
        assert pq["block_buffers"] < plain["block_buffers"] / 20  # only the small tensors stay in bf16
        assert results[r]["persistent"]["host_keys"] == set()
        assert results[r]["persistent+offload"]["host_keys"] == {"quant_shards"}


# ---- in process: the maps, the quantized shards of W ranks, the guards -----------------------------------------
def _layout_cfgs() -> list[ModelConfig]:
    llama = dataclasses.replace(CFG, model_type="llama", attention_bias=False, qk_norm=False, num_hidden_layers=2)
    wide = dataclasses.replace(CFG, hidden_size=96, intermediate_size=32, num_attention_heads=6, num_key_value_heads=3)
    return [CFG, llama, wide]


def test_small_tensor_exchange_reassembles_the_small_tensors():
    """Every rank packs the small-tensor elements of its shard into its slot; the gathered slots, index-selected,
    are the small tensors back to back. Emulated for W ranks, including shards that cut a small tensor."""
    cut_somewhere = False
    for cfg in _layout_cfgs():
        for world in (1, 2, 3, 4, 8):
            layout = FlatLayout(cfg, world)
            g = layout.block(0)
            full = torch.randn(g.padded_numel)
            qs = [PersistentQuants(layout, FP8_MATRICES, rank=r, world=world, dtype=torch.float32, device=CPU,
                                    offload=False) for r in range(world)]
            slot = qs[0].slot
            exchange = torch.zeros(world * slot)
            for r, q in enumerate(qs):
                lo, hi = g.shard_range(r, world)
                for a, pos, n in q.pack:
                    exchange[r * slot + pos:r * slot + pos + n] = full[lo:hi][a:a + n]
            got = exchange[qs[0].recv_idx]
            want = torch.cat([full[s.start:s.start + s.numel] for s in g.segments if s.short not in FP8_MATRICES])
            assert torch.equal(got, want), (cfg.model_type, world)
            assert all(q.recv_idx.equal(qs[0].recv_idx) and q.slot == slot for q in qs)
            small = [s for s in g.segments if s.short not in FP8_MATRICES]
            cut_somewhere |= any(s.start < hi < s.start + s.numel for s in small
                                 for hi in (g.shard_range(r, world)[1] for r in range(world)))
    assert cut_somewhere, "no case where a shard boundary cuts a small tensor"


class _MaxOverRanks:
    """An all-reduce MAX over W ranks whose `refresh` calls run one after another: a first pass records each
    rank's partial abs-maxes, a second one hands each rank the maximum over all of them."""
    world = 1

    def __init__(self):
        self.partial: list[torch.Tensor] = []
        self.total: torch.Tensor | None = None

    def all_reduce(self, t: torch.Tensor, *, op: str) -> Handle:
        assert op == "max"
        if self.total is None:
            self.partial.append(t.clone())
        else:
            t.copy_(self.total)
        return Handle.done()


def test_quantized_shards_of_four_ranks_are_the_full_tensors_codes():
    """Rank by rank (W = 4: shards cut through the matrices), the e4m3 shards with the all-reduced abs-max,
    put side by side, are `quantize_fp8` of each full matrix, and every rank has every matrix's inverse scale."""
    world = 4
    layout = FlatLayout(CFG, world)
    gen = torch.Generator().manual_seed(1)
    full = {g.key: (torch.randn(g.padded_numel, generator=gen) * torch.rand(1, generator=gen)).to(torch.bfloat16)
            for g in layout.groups}
    qs = [PersistentQuants(layout, FP8_MATRICES, rank=r, world=world, dtype=torch.bfloat16, device=CPU,
                            offload=False) for r in range(world)]
    shards = [{k: v[slice(*layout.by_key[k].shard_range(r, world))] for k, v in full.items()} for r in range(world)]
    comm = _MaxOverRanks()
    for r in range(world):
        qs[r].refresh(shards[r], 0, comm)
    comm.total = torch.stack(comm.partial).amax(0)
    for r in range(world):
        qs[r].refresh(shards[r], 0, comm)
    for layer in range(L):
        g = layout.block(layer)
        codes = torch.cat([q.codes[g.key] for q in qs])
        for i, s in enumerate(s for s in g.segments if s.short in FP8_MATRICES):
            want, inv = fp8.quantize_fp8(full[g.key][s.start:s.start + s.numel].view(s.shape))
            assert torch.equal(codes[s.start:s.start + s.numel], want.view(torch.uint8).view(-1)), (layer, s.name)
            assert all(torch.equal(q.inv_scales[layer][i], inv) for q in qs), (layer, s.name)
    assert all(q.quantizations == 2 * M * L for q in qs)


def _solo(**kw) -> ShardedWeights:
    w = ShardedWeights(FlatLayout(CFG, 1), comm=Communicator.solo(CPU), dtype=torch.bfloat16, device=CPU, **kw)
    gen = torch.Generator().manual_seed(0)
    for t in w.shards.values():
        t.copy_(torch.randn(t.shape, generator=gen) * 0.05)
    return w


def test_matrix_leaves_hold_no_values_and_the_block_dict_has_the_copies():
    w = _solo(quantized=FP8_MATRICES)
    with torch.no_grad():
        blk = w.block(0)
    full = w.gather_full()
    for s in w.layout.block(0).segments:
        t = blk[s.short]
        assert t.is_leaf and t.requires_grad and t.shape == s.shape and t.dtype == torch.bfloat16
        if s.short in FP8_MATRICES:  # zero strides over one zero element: nothing to read but zeros
            assert t.stride() == (0, 0) and t.untyped_storage().nbytes() == 2 and not t.detach().any()
            q = blk[FP8_WEIGHT.format(s.short)]
            assert q.dtype == fp8.E4M3 and q.shape == s.shape and q.is_contiguous() and not q.requires_grad
            assert blk[FP8_INV_SCALE.format(s.short)].shape == ()
        else:
            assert torch.equal(t.detach(), full[s.name])
    with torch.no_grad():
        again = w.block(0)
    # the same leaves every time (the backward differentiates against the forward's objects), the same code views
    assert all(again[s.short] is blk[s.short] for s in w.layout.block(0).segments)
    assert all(again[FP8_WEIGHT.format(n)] is blk[FP8_WEIGHT.format(n)] for n in FP8_MATRICES)


def test_backward_without_regather_is_caught_for_the_e4m3_buffers():
    """The linears save the e4m3 copy (a view into the rotating code buffer): layer 2's gather overwrites layer
    0's codes, so differentiating block 0 then must fail, and succeed after `block(0)` gathered them again."""
    w = _solo(quantized=FP8_MATRICES)
    x = torch.randn(32, CFG.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    with w.saving():
        w0 = w.block(0)
        y0 = fp8.fp8_linear(x, w0["qkv"], None, weight_fp8=(w0[FP8_WEIGHT.format("qkv")],
                                                               w0[FP8_INV_SCALE.format("qkv")]))
        w.block(1)
        w.block(2)
        with pytest.raises(RuntimeError, match=r"backward of block\.0 .* now holds block\.2"):
            torch.autograd.grad(y0.sum(), [x], retain_graph=True)
        w.block(0)
        dx, dw = torch.autograd.grad(y0.sum(), [x, w0["qkv"]])
    # the same as a linear that quantizes the full weight itself
    xr, wr = x.detach().requires_grad_(), w.gather_full()["layers.0.qkv"].requires_grad_()
    dxr, dwr = torch.autograd.grad(fp8.fp8_linear(xr, wr).sum(), [xr, wr])
    assert torch.equal(dx, dxr) and torch.equal(dw, dwr) and dw.any()


def _trainer(model_dir: str, **kw) -> Trainer:
    return Trainer(options(model_dir, **kw), DistContext(rank=0, world=1, local_rank=0, device=CPU))


def _one_step(tr: Trainer) -> dict:
    for m in range(GA):
        tr.micro_step(*batch(0, m, 0))
    return tr.update(lr=3e-3)


@pytest.mark.parametrize("extra", [{"debug_log_abs_max": 1}, {"recompute_att": True, "recompute_ffn": True}],
                         ids=["debug-log-abs-max", "recompute-att+ffn"])
def test_single_process_consumers(model_dir, extra):
    """--debug-log-abs-max (the recorder wraps linears that now get the FP8 copy; the weights' abs-maxes come
    from the shards) and the eager step recompute (whose hooks keep the e4m3 views as they are, relying on the
    backward's re-gather): bitwise the plain sharded run."""
    plain = _trainer(model_dir, shard_weights=True, **extra)
    pq = _trainer(model_dir, shard_weights=True, persistent_quants=True, **extra)
    assert _one_step(pq) == _one_step(plain)
    assert pq.abs_maxes == plain.abs_maxes
    if "debug_log_abs_max" in extra:
        assert len(pq.abs_maxes) == 12 * L  # 4 inputs, 4 output gradients, 4 weights per layer
    for n, p in plain.full_params().items():
        assert torch.equal(pq.full_params()[n], p), n


def test_checkpoint_load_requantizes(model_dir):
    tr = _trainer(model_dir, shard_weights=True, persistent_quants=True)
    _one_step(tr)
    state = {k: {g: t.clone() for g, t in v.items()} for k, v in tr.state_tensors().items()}
    _one_step(tr)
    n = tr.weights.quants.quantizations
    tr.load_state_tensors(state, step=1)
    assert tr.weights.quants.quantizations == n + M * L  # the load invalidates; the prefetch re-quantizes
    assert _codes_match_gathered_weights(tr)


# ---- options ---------------------------------------------------------------------------------------------------
def _refused(match: str, **kw) -> None:
    with pytest.raises(OptionsError, match=match):
        Options(**kw).validate()


def test_options():
    for kw in ({"shard_weights": True}, {"zero_level": 3}):  # either way of sharding (llm.q: only the flag)
        Options(persistent_quants=True, matmul_dtype="e4m3", **kw).validate()
        Options(persistent_quants=True, offload_quants=True, matmul_dtype="e4m3", **kw).validate()
    Options(persistent_quants=True, matmul_dtype="e4m3").validate()  # replicated: train.fp8_weights
    _refused(r"--offload-quants needs sharded weights \(--shard-weights or --zero-level 3\)",
             persistent_quants=True, offload_quants=True, matmul_dtype="e4m3", zero_level=2)
    _refused("--offload-quants needs --persistent-quants", offload_quants=True, shard_weights=True, matmul_dtype="e4m3")
    _refused(r"--persistent-quants .* only apply with --matmul-dtype e4m3", persistent_quants=True, shard_weights=True)
    _refused(r"only apply with --matmul-dtype e4m3", persistent_quants=True, zero_level=3, matmul_dtype="bf16")


def test_misaligned_matrix_is_refused_with_its_name():
    cfg = dataclasses.replace(CFG, head_dim=12, hidden_size=48)  # q_norm + k_norm: 24 elements before 'o'
    with pytest.raises(ValueError, match=r"block matrix 'o' .* multiple of 16"):
        ShardedWeights(FlatLayout(cfg, 1), comm=Communicator.solo(CPU), dtype=torch.bfloat16, device=CPU,
                       quantized=FP8_MATRICES)


# ---- the memory plan -------------------------------------------------------------------------------------------
def _plan_parts(plan) -> dict[str, int]:
    parts = dict(plan.item("weights").parts)
    parts.update(plan.item("fp8 weights").parts)
    return parts


@pytest.mark.parametrize("offload", [False, True])
def test_plan_equals_allocation_single_process(model_dir, offload):
    tr = _trainer(model_dir, shard_weights=True, persistent_quants=True, offload_quants=offload)
    _one_step(tr)  # the inverse scales exist from the first gather on
    plan = plan_for_trainer(tr)
    mem = tr.weights.memory()
    assert _plan_parts(plan) == mem
    q = plan.item("fp8 weights")
    assert q.host == (mem["quant_shards"] if offload else 0)
    assert q.device + q.host == mem["quant_shards"] + mem["quant_buffers"] + mem["quant_scales"]


def test_plan_activations_keep_no_per_layer_fp8_weights():
    """What one block saves for backward, less what `saving()` keeps as handles (anything in a block slot: the
    e4m3 weights are views of the gathered codes), is the plan's per-layer activation row without e4m3 weight
    copies -- and measurably less than with them."""
    from qtrain.kernels.rope import rope_tables
    from qtrain.model.transformer import make_block_fn
    from qtrain.model.activations import layer_activation_bytes
    from qtrain.model.matmul import block_linear
    w = _solo(quantized=FP8_MATRICES)
    with torch.no_grad():
        blk = w.block(0)
    Bm, Tm = 2, 16  # few tokens: the per-layer e4m3 weights would be a fifth of what a layer keeps
    x = torch.randn(Bm, Tm, CFG.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = rope_tables(CFG, Tm, "cpu", torch.bfloat16)
    skip = set().union(*(b.storages for b in w._blocks), (t.untyped_storage().data_ptr() for t in (x, cos, sin)))
    seen: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    fn = make_block_fn(CFG, block_linear("e4m3"))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x, blk, cos, sin)
    measured = sum(seen.values())
    kw = dict(model_dtype="bf16", matmul_dtype="e4m3")
    assert layer_activation_bytes(CFG, Bm * Tm, fp8_weight_copies=False, **kw) == pytest.approx(measured, rel=0.10)
    assert layer_activation_bytes(CFG, Bm * Tm, **kw) > 1.15 * measured


class _FakeComm:
    """Rank 1 of 4: enough for constructors, which only allocate."""
    rank, world = 1, 4


@pytest.mark.parametrize("offload", [False, True])
def test_plan_equals_allocation_world4(offload):
    world = 4
    layout = FlatLayout(CFG, world)
    opts = Options(zero_level=3, matmul_dtype="e4m3", fp8_policy="all", persistent_quants=True, offload_quants=offload)
    plan = plan_memory(CFG, opts, world=world, device="cpu")
    w = ShardedWeights(layout, comm=_FakeComm(), dtype=torch.bfloat16, device=CPU, quantized=FP8_MATRICES,
                       offload_quants=offload)
    assert _plan_parts(plan) == w.memory()
    assert plan.item("fp8 weights").host == (w.memory()["quant_shards"] if offload else 0)
    # without the option, the plan has no such row and the bf16 block buffers are full size
    plain = plan_memory(CFG, Options(zero_level=3, matmul_dtype="e4m3", fp8_policy="all"), world=world, device="cpu")
    assert all(not i.name.startswith("fp8 weights") for i in plain.items)
    assert plain.item("weights").parts["block_buffers"] == 2 * 2 * layout.block(0).padded_numel
