"""Sharded weights (--zero-level 3) for layers that are more than one group, or not alike: an MoE layer (its block's
group and its experts'), a hybrid Qwen3.5 model (Gated DeltaNet and full-attention layers, routed), a LoRA layer (the
frozen base and the adapters).

Claim, as tests/parallel/weights/test_sharded.py states it for dense blocks: sharding the weights changes where bytes
live, not one bit of the result. Each layer's groups are gathered back to back into a slot as large as the largest
layer, and every layer hands out its own leaf views into it; if a layer's view pointed at the wrong offset, or a
saved weight were overwritten by layer l+2's gather, the first step's loss or norm would already differ. So on two
gloo ranks (fp32), for each model, --zero-level 3 equals --zero-level 2 bitwise (losses, gradient norms, every
weight after every step); the MoE model also with its master weights offloaded, with --expert-parallel 2 (the expert
group gathered over the ranks holding the same experts, the export's experts reassembled), and resumed from a
zero-level 3 checkpoint bit for bit (with and without expert parallelism; LoRA's holds the adapters only); LoRA
dropout draws each layer's masks under sharded weights as without (its key names the layer the slot holds). The gather
slots are what the memory plan states: two slots of the largest layer's groups.

In one process: every layer's tensors are the replicated weights' values, distinct leaves per layer, frozen ones not
requiring grad; a LoRA base under an fp32 master keeps its shards in the compute dtype (it has no master).
"""
from __future__ import annotations

import io
import os

import pytest
import torch

from qtrain.model.llama import LlamaConfig
from qtrain.model.lora.spec import LoraSpec
from qtrain.observe.log import RunLogger
from qtrain.options import Options
from qtrain.parallel.comm import Communicator
from qtrain.parallel.dist import DistContext
from qtrain.parallel.layout import FlatLayout
from qtrain.parallel.weights.factory import build_weights
from qtrain.parallel.weights.sharded import ShardedWeights
from qtrain.train import checkpointing
from qtrain.train.trainer import Trainer
from tests.dist_utils import random_batch, run_distributed, train_steps, write_model_dir, write_model_dirs
from tests.train.test_moe_trainer import CFG as MOE
from tests.train.test_qwen3_5_distributed import CFG as QWEN35

DENSE = LlamaConfig(model_type="qwen2", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0,
                    tie_word_embeddings=False, attention_bias=True, bos_token_id=0, eos_token_id=0)
MODELS = {"moe": MOE, "qwen35": QWEN35, "lora": DENSE}
LORA = dict(lora_rank=4, lora_alpha=8.0, lora_targets="q,v,o,gate,down")
B, T, GA, STEPS, LR, WORLD = 2, 16, 2, 2, 3e-3, 2
CPU = torch.device("cpu")
# (model, name) -> options; each zero-level 3 run is compared with the zero-level 2 run of its model and `ep`
RUNS = {
    ("moe", "zero2"): dict(zero_level=2),
    ("moe", "zero3"): dict(zero_level=3),
    ("moe", "zero3-offload"): dict(zero_level=3, offload_master=True),
    ("moe", "zero2-ep2"): dict(zero_level=2, expert_parallel=2),
    ("moe", "zero3-ep2"): dict(zero_level=3, expert_parallel=2),
    ("qwen35", "zero2"): dict(zero_level=2),
    ("qwen35", "zero3"): dict(zero_level=3),
    ("lora", "zero2"): dict(zero_level=2, **LORA),
    ("lora", "zero3"): dict(zero_level=3, **LORA),
    ("lora", "zero3-offload"): dict(zero_level=3, offload_master=True, **LORA),  # the base in host memory
    ("lora", "zero2-dropout"): dict(zero_level=2, lora_dropout=0.25, **LORA),
    ("lora", "zero3-dropout"): dict(zero_level=3, lora_dropout=0.25, **LORA),  # masks keyed by the slot's layer
}
# checkpointed after step 1, resumed
RESUMED = (("moe", "zero3"), ("moe", "zero3-ep2"), ("lora", "zero3"), ("lora", "zero3-dropout"))


def options(model_dir: str, **kw) -> Options:
    base = dict(model=model_dir, from_scratch=True, device="cpu", compile="off", seed=5, model_dtype="fp32",
                opt_m_dtype="fp32", opt_v_dtype="fp32", batch_size=B, seq_len=T, grad_accumulation=GA, learning_rate=LR)
    return Options(**{**base, **kw})


def _batch(model: str):
    return lambda step, micro, rank: random_batch(MODELS[model].vocab_size, B, T, step, micro, rank)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Loader:
    def state_dict(self) -> dict:
        return {}


def _worker(rank: int, world: int, dirs: dict[str, str], work: str) -> dict:
    ctx = DistContext(rank=rank, world=world, local_rank=rank, device=CPU)
    out: dict = {}
    for (model, name), kw in RUNS.items():
        tr = Trainer(options(dirs[model], **kw), ctx)
        rec: dict = {}
        if (model, name) in RESUMED:
            rec["steps"] = train_steps(tr, range(1), _batch(model), GA, LR)
            log = RunLogger(None, rank=rank, total_steps=STEPS, stream=io.StringIO())
            ckpt = checkpointing.save(os.path.join(work, f"{model}-{name}"), tr, _Loader(), log)
            rec["steps"] += train_steps(tr, range(1, STEPS), _batch(model), GA, LR)
            again = Trainer(options(dirs[model], **kw), ctx)
            assert checkpointing.load(ckpt, again, train_loader=None, logger=None) == 1
            rec["resumed"] = train_steps(again, range(1, STEPS), _batch(model), GA, LR)
        else:
            rec["steps"] = train_steps(tr, range(STEPS), _batch(model), GA, LR)
        if tr.sharded_weights:
            w = tr.weights
            rec["memory"] = w.memory()
            rec["allocated"] = {"shards": sum(_nbytes(t) for t in w.shards.values()),
                                "block_buffers": sum(_nbytes(b.buf) for b in w._blocks),
                                "non_block_buffers": sum(_nbytes(b.buf) for b in w._non_block.values())}
            rec["planned"] = ShardedWeights.footprint_of(tr.layout, dtype=torch.float32,
                                                         offload=bool(kw.get("offload_master"))).parts
            rec["slot"] = ShardedWeights.slot_numel(tr.layout)
            rec["layers"] = [sum(g.padded_numel for g in tr.layout.layer_groups(i))
                             for i in range(tr.cfg.num_hidden_layers)]
        out[model, name] = rec
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded-layers")
    return run_distributed(_worker, WORLD, write_model_dirs(root, MODELS), str(root))


def _same_steps(a: list[dict], b: list[dict], what: str) -> None:
    assert len(a) == len(b) == STEPS - (STEPS - len(a))
    for s, (x, y) in enumerate(zip(a, b)):
        assert (x["loss"], x["norm"]) == (y["loss"], y["norm"]), f"{what}: step {s} loss/norm"
        assert x["weights"].keys() == y["weights"].keys()
        for k in y["weights"]:
            assert torch.equal(x["weights"][k], y["weights"][k]), f"{what}: step {s} weight {k}"


SHARDED = [k for k in RUNS if RUNS[k]["zero_level"] == 3]


@pytest.mark.parametrize("model,name", SHARDED, ids=[f"{m}-{n}" for m, n in SHARDED])
def test_zero3_trains_bitwise_like_zero2(results, model, name):
    ref = name.replace("zero3", "zero2") if name.endswith(("ep2", "dropout")) else "zero2"
    for r in range(WORLD):
        _same_steps(results[r][model, name]["steps"], results[r][model, ref]["steps"], f"rank {r} {model} {name}")
    # not vacuous: training moved the weights (the adapters only, under LoRA), and the ranks agree
    first, last = (results[0][model, name]["steps"][i]["weights"] for i in (0, -1))
    moved = {k for k in first if not torch.equal(first[k], last[k])}
    assert moved and (model != "lora" or all("_lora_" in k for k in moved)), sorted(moved)[:4]
    _same_steps(results[1][model, name]["steps"], results[0][model, name]["steps"], f"{model} {name} rank 1 vs 0")


def test_export_of_expert_parallel_zero3_holds_every_expert(results):
    w = results[0]["moe", "zero3-ep2"]["steps"][-1]["weights"]
    assert w["layers.0.experts_up_gate"].shape[0] == MOE.num_experts  # both ranks' experts, reassembled


@pytest.mark.parametrize("model,name", RESUMED, ids=[f"{m}-{n}" for m, n in RESUMED])
def test_zero3_resume_is_bitwise(results, model, name):
    for r in range(WORLD):
        rec = results[r][model, name]
        _same_steps(rec["resumed"], rec["steps"][1:], f"rank {r} {model} {name} resumed")


@pytest.mark.parametrize("model,name", SHARDED, ids=[f"{m}-{n}" for m, n in SHARDED])
def test_gather_slots_are_two_of_the_largest_layer_as_planned(results, model, name):
    rec = results[0][model, name]
    assert rec["slot"] == max(rec["layers"])
    if model != "lora":  # the routed / hybrid layers really differ, so the slot is not every layer's size
        assert len(set(rec["layers"])) > 1
    assert rec["memory"]["block_buffers"] == 2 * rec["slot"] * 4
    assert rec["memory"] == rec["planned"] == rec["allocated"]  # the statement, the plan's call, the tensors


# ---- one process ----
def _fill_adapters(tensors: dict[str, torch.Tensor]) -> None:
    """Nonzero, distinct, the same every time (LoRA's B starts at zero, which would hide a wrong offset)."""
    for i, t in enumerate(tensors.values()):
        t.copy_(torch.sin(torch.arange(t.numel(), dtype=t.dtype) + 100 * i).view(t.shape))


@pytest.mark.parametrize("model", MODELS)
def test_every_layer_hands_out_its_own_views_of_the_replicated_values(model):
    cfg = MODELS[model]
    lora = LoraSpec(4, 8.0, targets=("q", "v", "o", "gate", "down")) if model == "lora" else None
    layout = FlatLayout(cfg, 1, lora=lora)
    comm = Communicator.solo(CPU)
    kw = dict(comm=comm, dtype=torch.float32, device=CPU, seed=3,
              adapters=_fill_adapters if lora else None)
    ref = build_weights(layout, sharded=False, **kw).params
    sharded = build_weights(layout, sharded=True, **kw).source
    seen: dict[int, torch.Tensor] = {}
    with sharded.saving():
        for layer in [*range(cfg.num_hidden_layers), *reversed(range(cfg.num_hidden_layers))]:
            w = sharded.block(layer)
            names = {s.name for g in layout.layer_groups(layer) for s in g.segments}
            assert {f"layers.{layer}.{n}" for n in w} == names
            for n, t in w.items():
                assert torch.equal(t, ref[f"layers.{layer}.{n}"]), (layer, n)
                assert t.requires_grad == layout.group_of[f"layers.{layer}.{n}"].trainable
                assert seen.setdefault(id(t), t) is t
    assert len(seen) == len(ref) - len(layout.non_block_groups())  # one leaf per block tensor, never shared


def test_a_frozen_base_keeps_its_shards_in_the_compute_dtype():
    layout = FlatLayout(DENSE, 1, lora=LoraSpec(4, 8.0, targets=("q", "v")))
    w = ShardedWeights(layout, comm=Communicator.solo(CPU), dtype=torch.float32, device=CPU,
                       compute_dtype=torch.bfloat16)
    assert {g.key: w.shards[g.key].dtype for g in layout.groups} == {
        g.key: torch.float32 if g.trainable else torch.bfloat16 for g in layout.groups}
    fp = ShardedWeights.footprint_of(layout, dtype=torch.float32, compute_dtype=torch.bfloat16)
    assert fp.parts["shards"] == sum(t.numel() * t.element_size() for t in w.shards.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model", MODELS)
def test_gpu_offloaded_shards_train_bitwise_like_zero2(model, tmp_path):
    """On CUDA the offloaded (pinned host) shards are copied into the rank's own slice of each layer's groups in the
    slot before the gather, on the compute stream: a copy ordered wrongly (or into the wrong group's slice) changes
    the bits of the first step. bf16, one process."""
    d = write_model_dir(tmp_path, MODELS[model])
    ctx = DistContext(rank=0, world=1, local_rank=0, device=torch.device("cuda"))
    extra = LORA if model == "lora" else {}
    runs = {}
    for name, kw in (("zero2", dict(zero_level=2)), ("zero3-offload", dict(zero_level=3, offload_master=True))):
        o = options(d, device="cuda", model_dtype="bf16", opt_m_dtype="bf16", opt_v_dtype="bf16", **kw, **extra)
        runs[name] = train_steps(Trainer(o, ctx), range(STEPS), _batch(model), GA, LR)
    _same_steps(runs["zero3-offload"], runs["zero2"], f"{model} cuda")
