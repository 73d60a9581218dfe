"""Sharded weights (--shard-weights / --zero-level 3, `qtrain.parallel.weights.sharded.ShardedWeights`).

Claim: sharding the weights changes where bytes live, not one bit of the result. The forward and backward
see all-gathered copies of the same values (a gather is an exact copy), and the optimizer runs the same
update on the same shard with the same random bits (the SR counter is the element's index in its tensor),
so a sharded run is compared with the replicated run *bitwise*, in fp32, bf16 and FP8 (e4m3 block linears),
with and without --recompute-block: losses, gradient norms, weights after every step, evaluation losses.
If the saved-tensor handling were wrong (layer l's saved weights overwritten by layer l+2's gather), the
non-recompute backward would use another layer's weights and the first step's norm would already differ.

In 2 processes (gloo), one spawn for everything (process start-up dominates):
  * zero-level 1 weights replicated vs --shard-weights; zero-level 2 vs zero-level 3 (sharded gradients too);
  * all ranks hold the same weights (gathered) and report the same losses / norms;
  * weight state per rank: the shards are exactly 1/W of the padded full weights; the rest is two block
    buffers and the non-block buffers, which do not grow with depth;
  * export gathers on every rank and rank 0 writes the same safetensors as the replicated run;
  * a zero-level 3 run resumed from its checkpoint continues bit-exactly.
In-process (a world of one): the exact number of gathers per micro-step (double buffering, one-block
prefetch, version skip); the guards (a backward without re-gathering is caught, so is a forward outside
`saving()`, and other saved tensors keep autograd's in-place check); fine-grained step recompute (whose
own saved-tensor hooks shadow ours inside a block) gives bitwise the replicated gradients; a one-process
trainer with sharded (and offloaded) weights equals the replicated one; option validation.
"""
from __future__ import annotations

import io
import os

import pytest
import torch

from tests.dist_utils import full_params_cpu, random_batch, run_distributed, train_steps
from qtrain.model.config import ModelConfig
from qtrain.model.llama import LlamaConfig
from qtrain.model.registry import config_from_hf_dict
from qtrain.model.transformer import Transformer
from qtrain.parallel.comm import Communicator
from qtrain.parallel.dist import DistContext
from qtrain.parallel.layout import FlatLayout
from qtrain.parallel.weights.sharded import ShardedWeights
from qtrain.train import checkpointing
from qtrain.observe.log import RunLogger
from qtrain.options import Options, OptionsError
from qtrain.train.trainer import Trainer

# K and N of every block linear are multiples of 16 (FP8 runs); odd vocab so shards cut through tensors
CFG = LlamaConfig(model_type="qwen2", vocab_size=101, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0,
                  tie_word_embeddings=False, attention_bias=True, bos_token_id=None, eos_token_id=None)
B, T, GA, STEPS, CKPT_AT = 2, 16, 2, 2, 1
CPU = torch.device("cpu")
WORLD = 2
# (name, dtype, matmul dtype): FP8 only with bf16 weights
DTYPES = (("fp32", "fp32", ""), ("bf16", "bf16", ""), ("fp8", "bf16", "e4m3"))
# (name, options): pairs that must agree bitwise are listed in PAIRS
RUNS = {
    "replicated": {},
    "sharded": {"shard_weights": True},
    "replicated+recompute": {"recompute_block": True},
    "sharded+recompute": {"shard_weights": True, "recompute_block": True},
    "zero2": {"zero_level": 2},
    "zero3": {"zero_level": 3},
}
PAIRS = (("replicated", "sharded"), ("replicated+recompute", "sharded+recompute"), ("zero2", "zero3"))
# every pair in fp32; bf16 and FP8 (CPU bf16 GEMMs are slow) the pairs that add something: bf16 with the
# zero-level 3 resume and the export, FP8 (which saves FP8 weight copies, not the gathered weights) both ways
RUNS_BY_DTYPE = {"fp32": tuple(RUNS), "bf16": ("replicated", "sharded", "zero2", "zero3"),
                 "fp8": ("replicated", "sharded", "replicated+recompute", "sharded+recompute")}


def options(model_dir: str, dtype: str, **kw) -> Options:
    name, model_dtype, matmul = next(d for d in DTYPES if d[0] == dtype)
    low = "bf16" if model_dtype == "bf16" else "fp32"
    return Options(model=model_dir, from_scratch=True, device="cpu", compile="off", seed=5, model_dtype=model_dtype,
                   matmul_dtype=matmul, fp8_policy="all", opt_m_dtype=low, opt_v_dtype=low, batch_size=B, seq_len=T,
                   grad_accumulation=GA, learning_rate=3e-3, **kw)


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return random_batch(CFG.vocab_size, B, T, step, micro, rank)


gathered = full_params_cpu


def run_steps(tr: Trainer, steps: range) -> list[dict]:
    return train_steps(tr, steps, batch, GA, 3e-3)


class _Loader:
    def state_dict(self) -> dict:
        return {}


def _worker(rank: int, world: int, model_dir: str, work: str) -> dict:
    ctx = DistContext(rank=rank, world=world, local_rank=rank, device=CPU)
    out: dict = {"runs": {}}
    for dtype, *_ in DTYPES:
        for name in RUNS_BY_DTYPE[dtype]:
            tr = Trainer(options(model_dir, dtype, **RUNS[name]), ctx)
            rec: dict = {"w0": gathered(tr)}
            if name == "zero3":  # checkpoint after CKPT_AT steps, then resume it in a fresh trainer below
                rec["steps"] = run_steps(tr, range(CKPT_AT))
                log = RunLogger(None, rank=rank, total_steps=STEPS, stream=io.StringIO())
                rec["ckpt"] = checkpointing.save(os.path.join(work, f"ckpt-{dtype}"), tr, _Loader(), log)
                rec["steps"] += run_steps(tr, range(CKPT_AT, STEPS))
            else:
                rec["steps"] = run_steps(tr, range(STEPS))
            rec["eval"] = tr.evaluate([batch(100, 0, rank), batch(101, 0, rank)])
            if dtype == "bf16" and name in ("replicated", "sharded"):
                tr.export(os.path.join(work, f"export-{name}"))
            if tr.sharded_weights:
                rec["kept"] = len(tr.full_params(keep=rank == 0))  # the export's gather: rank 0 keeps the copy
                rec["memory"] = tr.weights.memory()
                rec["host_keys"] = tr.weights.host_memory_keys()
            out["runs"][(dtype, name)] = rec
        if "zero3" not in RUNS_BY_DTYPE[dtype]:
            continue
        # resume the zero-level 3 run
        tr = Trainer(options(model_dir, dtype, zero_level=3), ctx)
        assert checkpointing.load(out["runs"][(dtype, "zero3")]["ckpt"], tr, train_loader=None,
                                  logger=None) == CKPT_AT
        out["runs"][(dtype, "zero3-resumed")] = {"steps": run_steps(tr, range(CKPT_AT, STEPS))}
    if rank == 0:
        from safetensors.torch import load_file
        out["exports"] = {n: load_file(os.path.join(work, f"export-{n}", "model.safetensors"))
                          for n in ("replicated", "sharded")}
    return out


@pytest.fixture(scope="module")
def results(model_dir, tmp_path_factory):
    return run_distributed(_worker, WORLD, model_dir, str(tmp_path_factory.mktemp("sharded")))


def _same_steps(a: list[dict], b: list[dict], what: str) -> None:
    assert len(a) == len(b)
    for s, (x, y) in enumerate(zip(a, b)):
        assert (x["loss"], x["norm"]) == (y["loss"], y["norm"]), f"{what}: step {s} loss/norm"
        for k in y["weights"]:
            assert torch.equal(x["weights"][k], y["weights"][k]), f"{what}: step {s} weight {k}"


@pytest.mark.parametrize("dtype,pair", [(d, p) for d, *_ in DTYPES for p in PAIRS if p[1] in RUNS_BY_DTYPE[d]],
                         ids=lambda x: x if isinstance(x, str) else f"{x[0]}-vs-{x[1]}")
def test_sharded_weights_train_bitwise_like_replicated(results, dtype, pair):
    for r in range(WORLD):
        a, b = results[r]["runs"][(dtype, pair[0])], results[r]["runs"][(dtype, pair[1])]
        assert all(torch.equal(a["w0"][k], b["w0"][k]) for k in a["w0"]), "initial weights differ"
        _same_steps(b["steps"], a["steps"], f"rank {r} {dtype} {pair[1]}")
        assert b["eval"] == a["eval"]
    # not vacuous: training moved the weights
    run = results[0]["runs"][(dtype, pair[0])]
    assert not torch.equal(run["steps"][-1]["weights"]["layers.0.qkv"], run["w0"]["layers.0.qkv"])


def test_all_ranks_agree(results):
    for key, run in results[0]["runs"].items():
        for r in range(1, WORLD):
            _same_steps(results[r]["runs"][key]["steps"], run["steps"], f"{key} rank {r} vs rank 0")


def test_weight_state_per_rank_is_one_over_world(results):
    layout = FlatLayout(CFG, WORLD)
    for dtype, model_dtype, _ in DTYPES:
        es = 4 if model_dtype == "fp32" else 2
        for r in range(WORLD):
            for name in ("sharded", "sharded+recompute", "zero3"):
                if name not in RUNS_BY_DTYPE[dtype]:
                    continue
                mem = results[r]["runs"][(dtype, name)]["memory"]
                assert mem["shards"] * WORLD == layout.total_numel() * es
                assert mem["block_buffers"] == 2 * layout.block(0).padded_numel * es  # not L blocks
                assert mem["non_block_buffers"] == sum(g.padded_numel for g in layout.non_block_groups()) * es
                assert results[r]["runs"][(dtype, name)]["host_keys"] == set()


def test_export_with_sharded_weights_matches_replicated(results):
    """Rank 0 writes the export; the other ranks take part in the gather and keep nothing (not the whole model in
    every rank's host memory)."""
    kept = [results[r]["runs"][("bf16", "sharded")]["kept"] for r in range(WORLD)]
    assert kept[0] > 0
    assert kept[1:] == [0] * (WORLD - 1)
    ex = results[0]["exports"]
    assert ex["replicated"].keys() == ex["sharded"].keys() and len(ex["sharded"]) > 0
    for k, t in ex["replicated"].items():
        assert torch.equal(ex["sharded"][k], t), k


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_zero3_resume_is_bitwise_equal(results, dtype):
    for r in range(WORLD):
        full = results[r]["runs"][(dtype, "zero3")]["steps"][CKPT_AT:]
        _same_steps(results[r]["runs"][(dtype, "zero3-resumed")]["steps"], full, f"rank {r} {dtype} resumed")


# ---- in process: the gather schedule and the guards --------------------------------------------------------
def _solo_weights(cfg: ModelConfig) -> tuple[ShardedWeights, FlatLayout]:
    layout = FlatLayout(cfg, 1)
    w = ShardedWeights(layout, comm=Communicator.solo(CPU), dtype=torch.float32, device=CPU)
    gen = torch.Generator().manual_seed(0)
    for t in w.shards.values():
        t.copy_(torch.randn(t.shape, generator=gen) * 0.05)
    return w, layout


class _Sink:
    def accumulate_block(self, layer, grads):
        pass

    def accumulate_non_block(self, grads):
        pass


def test_gathers_per_micro_step_double_buffered_with_prefetch_and_version_skip():
    L = 5
    cfg = config_from_hf_dict({**CFG.to_hf_dict(), "num_hidden_layers": L})
    w, _ = _solo_weights(cfg)
    model = Transformer(cfg)
    x, y = batch(0, 0, 0)

    def micro_step():
        before = w.gathers
        with w.saving():
            model.forward_backward(w, x, y, grads=_Sink(), loss_scale=1.0)
        return w.gathers - before

    nb = len(FlatLayout(cfg, 1).non_block_groups())
    # first micro-step: non-block groups + every block in the forward; the backward finds layers L-1 and L-2
    # still resident and gathers L-2 blocks
    assert micro_step() == nb + L + (L - 2)
    # later micro-steps of the same step: layers 0 and 1 are resident from the backward
    assert micro_step() == (L - 2) + (L - 2)
    w.invalidate(prefetch=True)  # after an update: everything stale; non-block groups and block 0 prefetched
    assert w.gathers == nb + L + 3 * (L - 2) + nb + 1
    assert micro_step() == (L - 1) + (L - 2)
    with torch.no_grad():  # a forward-only pass (evaluation) after a training micro-step
        before = w.gathers
        model.hidden_states(w, x)
        assert w.gathers - before == L - 2


def test_backward_without_regather_is_caught_and_regather_restores_the_weights():
    w, layout = _solo_weights(CFG)
    x = torch.randn(2, 4, CFG.hidden_size, requires_grad=True)
    with w.saving():
        w0 = w.block(0)
        y0 = (x @ w0["qkv"].t()).sum()  # dx needs the weight: autograd saves a view of block buffer 0
        w.block(1)
        w.block(2)  # layer 2 goes into buffer 0: layer 0's saved weights are gone
        with pytest.raises(RuntimeError, match=r"backward of block\.0 .* now holds block\.2 .* call weights\.block"):
            torch.autograd.grad(y0, [x], retain_graph=True)
        again = w.block(0)  # re-gather: the same leaf objects, layer 0's values again
        assert all(again[k] is w0[k] for k in w0)
        (g,) = torch.autograd.grad(y0, [x])
    full = w.gather_full()
    assert torch.equal(w0["qkv"].detach(), full["layers.0.qkv"])
    assert torch.equal(g, (torch.ones(2, 4, full["layers.0.qkv"].shape[0]) @ full["layers.0.qkv"]))


def test_block_with_grad_outside_saving_is_refused():
    w, _ = _solo_weights(CFG)
    with pytest.raises(RuntimeError, match=r"inside `with weights.saving\(\):`"):
        w.block(0)
    with torch.no_grad():
        w.block(0)  # evaluation: no graph, nothing to protect


def test_saving_keeps_autograd_version_check_for_other_tensors():
    w, _ = _solo_weights(CFG)
    a = torch.randn(3, requires_grad=True)
    with w.saving():
        b = a * 2
        y = (b * b).sum()  # saves b
        with torch.no_grad():
            b.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.autograd.grad(y, [a])


def test_single_process_sharded_equals_replicated(model_dir):
    ctx = DistContext(rank=0, world=1, local_rank=0, device=CPU)
    runs = {}
    for name, kw in (("replicated", {}), ("sharded", {"shard_weights": True}),
                     ("offload-master", {"shard_weights": True, "offload_master": True})):
        tr = Trainer(options(model_dir, "fp32", **kw), ctx)
        runs[name] = run_steps(tr, range(2))
    _same_steps(runs["sharded"], runs["replicated"], "sharded")
    _same_steps(runs["offload-master"], runs["replicated"], "offload-master")


# ---- options ---------------------------------------------------------------------------------------------
def _refused(match: str, **kw) -> None:
    with pytest.raises(OptionsError, match=match):
        Options(**kw).validate()


def test_options():
    assert Options(shard_weights=True).validate().weights_sharded
    assert Options(shard_weights=True).gradient_manager_kind == "unsharded"  # llm.q: the two flags are separate
    z3 = Options(zero_level=3).validate()
    assert z3.weights_sharded and z3.gradient_manager_kind == "reduce-scatter"
    assert not Options(zero_level=2).weights_sharded
    _refused("--zero-level and --shard-weights are mutually exclusive", zero_level=3, shard_weights=True)
    _refused("--zero-level and --shard-weights are mutually exclusive", zero_level=2, shard_weights=True)
    # persistent quants: FP8 matmuls; their host offload needs sharded weights (either way of sharding them)
    _refused(r"--offload-quants needs sharded weights \(--shard-weights or --zero-level 3\)",
             persistent_quants=True, offload_quants=True, matmul_dtype="e4m3")
    _refused("--offload-quants needs --persistent-quants", offload_quants=True, shard_weights=True,
             matmul_dtype="e4m3")
    _refused("only apply with --matmul-dtype e4m3", persistent_quants=True, shard_weights=True)
    _refused("only apply with --matmul-dtype e4m3", persistent_quants=True, offload_quants=True, zero_level=3)
    _refused("--offload-master needs sharded weights.*no separate master copy", offload_master=True)
    Options(offload_master=True, zero_level=3).validate()
    Options(offload_master=True, shard_weights=True).validate()


class _Record:
    """A gradient sink that keeps copies of everything it receives."""

    def __init__(self):
        self.grads: dict[str, torch.Tensor] = {}

    def accumulate_block(self, layer, grads):
        self.grads.update({f"layers.{layer}.{k}": v.clone() for k, v in grads.items()})

    def accumulate_non_block(self, grads):
        self.grads.update({k: v.clone() for k, v in grads.items()})


@pytest.mark.parametrize("recompute", [(), ("att", "ffn"), ("norm", "swiglu", "qkv")],
                         ids=lambda r: "+".join(r) or "none")
def test_fine_grained_recompute_with_sharded_weights(recompute):
    """The eager step recompute (recompute.py) installs its own saved-tensor hooks inside the block, which
    shadow `saving()`'s there: what it keeps of the weights are the buffer views themselves (and steps rerun
    from the weights dict), so correctness rests on the backward's `block(l)` re-gather. Bitwise check."""
    from qtrain.model.transformer import RunOptions
    from qtrain.parallel.weights.replicated import ParamWeights
    L = 4
    cfg = config_from_hf_dict({**CFG.to_hf_dict(), "num_hidden_layers": L})
    w, layout = _solo_weights(cfg)
    params = w.gather_full()
    ref = ParamWeights(cfg, {n: p.clone().requires_grad_(True) for n, p in params.items()})
    model = Transformer(cfg, RunOptions(recompute=frozenset(recompute)))
    x, y = batch(0, 0, 0)
    got, want = _Record(), _Record()
    with w.saving():
        loss = model.forward_backward(w, x, y, grads=got, loss_scale=0.1)
    loss_ref = model.forward_backward(ref, x, y, grads=want, loss_scale=0.1)
    assert torch.equal(loss, loss_ref)
    assert got.grads.keys() == want.grads.keys()
    for k in want.grads:
        assert torch.equal(got.grads[k], want.grads[k]), k
