"""--persistent-quants with sharded weights (--zero-level 3) for layers that are more than one group, or not alike: an
MoE model with a dense layer (mlp_only_layers), a hybrid Qwen3.5 model (linear- and full-attention layers), a LoRA
layer (the frozen base and the adapters) -- `PersistentQuants` / `ShardedWeights(quantized=...)` per layer.

Claim: each rank keeps e4m3 shards of the FP8 matrices each layer holds (a layer's own subset: in_proj / out or
qkv / o, up / down only in a dense layer), quantized with the full tensor's scale, and the rest of a layer travels as
without the option (the expert stacks, the adapters: whole groups in the model dtype; the small tensors beside the
matrices through the exchange). The codes equal `quantize_fp8` of the gathered matrix, so the linears get the
operands the replicated weights' cached FP8 copies (`QuantizedWeights`, --zero-level 2 --persistent-quants) give
them: runs are compared *bitwise* (losses, gradient norms, every weight after every step), with the quantized shards
on the device and in host memory (--offload-quants, with --offload-master). The dense uniform model is compared the same way (the case
tests/parallel/weights/test_sharded_quants.py compares with the unquantized gathers). bf16 weights, e4m3 matmuls,
FP8 policy "all", on two gloo ranks, as test_sharded_quants.py runs FP8 on CPU. Also: the memory statement is what
is allocated, and in one process the e4m3 bytes a layer's gather moves are its quantized groups' codes.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import qtrain.numerics.fp8 as fp8
from qtrain.model.fp8_policy import choose_fp8
from qtrain.model.transformer import FP8_INV_SCALE, FP8_WEIGHT
from qtrain.options import Options
from qtrain.parallel.comm import Communicator
from qtrain.parallel.dist import DistContext
from qtrain.parallel.layout import FlatLayout
from qtrain.parallel.weights.sharded import ShardedWeights
from qtrain.train.trainer import Trainer
from tests.dist_utils import random_batch, run_distributed, train_steps, write_model_dir, write_model_dirs
from tests.model.family_fixtures import qwen35_cfg
from tests.parallel.weights.test_sharded_layers import DENSE, LORA
from tests.train.test_moe_trainer import CFG as MOE

# the hybrid model of test_sharded_layers.py with 8 value heads: the linear-attention block's `out` then starts at a
# multiple of 16 elements (4 heads leave dt_bias + A_log + gnorm at 24 elements), as its e4m3 view needs
QWEN35 = qwen35_cfg(moe=True, vocab_size=96, hidden_size=32, num_hidden_layers=2, head_dim=16,
                    layer_types=("linear_attention", "full_attention"), bos_token_id=0, eos_token_id=0,
                    max_position_embeddings=64, router_aux_loss_coef=0.05, linear_num_value_heads=8)
MODELS = {"dense": DENSE, "moe": dataclasses.replace(MOE, intermediate_size=48),  # the dense layer's K, N: 16 x k
          "qwen35": QWEN35, "lora": DENSE}
B, T, GA, STEPS, LR, WORLD = 2, 16, 2, 2, 3e-3, 2
CPU = torch.device("cpu")
QUANTS = dict(persistent_quants=True)
RUNS = {"zero2": dict(zero_level=2, **QUANTS), "zero3": dict(zero_level=3, **QUANTS),
        "zero3-offload": dict(zero_level=3, offload_quants=True, offload_master=True, **QUANTS)}


def options(model_dir: str, model: str, **kw) -> Options:
    base = dict(model=model_dir, from_scratch=True, device="cpu", compile="off", seed=5, model_dtype="bf16",
                matmul_dtype="e4m3", fp8_policy="all", opt_m_dtype="bf16", opt_v_dtype="bf16", batch_size=B, seq_len=T,
                grad_accumulation=GA, learning_rate=LR)
    return Options(**{**base, **(LORA if model == "lora" else {}), **kw})


def _batch(model: str):
    return lambda step, micro, rank: random_batch(MODELS[model].vocab_size, B, T, step, micro, rank)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _allocated(w: ShardedWeights) -> dict[str, int]:
    """What the persistent-quants weight source holds, by the kinds its memory statement names."""
    q = w.quants
    leaves = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
              for views in w._views for t in views.values() if all(s == 0 for s in t.stride())}
    return {"shards": sum(_nbytes(t) for t in w.shards.values()),
            "block_buffers": sum(_nbytes(b.compute) + _nbytes(b.exchange) for b in w._blocks) + sum(leaves.values()),
            "non_block_buffers": sum(_nbytes(b.buf) for b in w._non_block.values()),
            "quant_buffers": sum(_nbytes(b.buf) for b in w._blocks),
            "quant_shards": sum(_nbytes(c) for c in q.codes.values()),
            "quant_scales": sum(_nbytes(i) for row in q.inv_scales for i in row),
            "small_index": sum(_nbytes(p.recv_idx) for p in q.plans)}


def _codes_match_gathered_weights(tr: Trainer) -> list[tuple[int, str]]:
    """The (layer, matrix) pairs whose e4m3 copy the model gets, each checked to be `quantize_fp8` of the full
    (gathered) weight, codes and scale; a mismatch fails with its name."""
    full, seen = tr.full_params(), []
    with torch.no_grad():
        for layer in range(tr.cfg.num_hidden_layers):
            w = tr.weights.block(layer)
            for n in tr.weights.quants.matrices[layer]:
                q, inv = fp8.quantize_fp8(full[f"layers.{layer}.{n}"])
                assert torch.equal(w[FP8_WEIGHT.format(n)].view(torch.uint8), q.view(torch.uint8)), (layer, n)
                assert torch.equal(w[FP8_INV_SCALE.format(n)], inv), (layer, n)
                seen.append((layer, n))
    return seen


def _worker(rank: int, world: int, dirs: dict[str, str]) -> dict:
    ctx = DistContext(rank=rank, world=world, local_rank=rank, device=CPU)
    out: dict = {}
    for model in MODELS:
        for name, kw in RUNS.items():
            tr = Trainer(options(dirs[model], model, **kw), ctx)
            rec: dict = {"steps": train_steps(tr, range(STEPS), _batch(model), GA, LR)}
            rec["eval"] = tr.evaluate([_batch(model)(100, 0, rank)])
            if tr.sharded_weights:
                w = tr.weights
                rec["quantized"] = _codes_match_gathered_weights(tr)
                q = w.quants
                rec["quantizations"] = (q.quantizations, sum(len(m) for m in q.matrices),
                                        sum(len(p.own) for _, g, p in q._groups() if not g.trainable))
                rec["memory"], rec["allocated"] = w.memory(), _allocated(w)
                rec["host_keys"] = w.host_memory_keys()
                rec["bytes"] = dict(w.gathered_bytes)
            out[model, name] = rec
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    dirs = write_model_dirs(tmp_path_factory.mktemp("sharded-layer-quants"), MODELS)
    return run_distributed(_worker, WORLD, dirs)


def _same_steps(a: list[dict], b: list[dict], what: str) -> None:
    assert len(a) == len(b) == STEPS
    for s, (x, y) in enumerate(zip(a, b)):
        assert (x["loss"], x["norm"]) == (y["loss"], y["norm"]), f"{what}: step {s} loss/norm"
        assert x["weights"].keys() == y["weights"].keys()
        for k in y["weights"]:
            assert torch.equal(x["weights"][k], y["weights"][k]), f"{what}: step {s} weight {k}"


CASES = [(m, n) for m in MODELS for n in RUNS if n != "zero2"]


@pytest.mark.parametrize("model,name", CASES, ids=[f"{m}-{n}" for m, n in CASES])
def test_zero3_persistent_quants_train_bitwise_like_zero2(results, model, name):
    for r in range(WORLD):
        a, b = results[r][model, name], results[r][model, "zero2"]
        _same_steps(a["steps"], b["steps"], f"rank {r} {model} {name}")
        assert a["eval"] == b["eval"]
    _same_steps(results[1][model, name]["steps"], results[0][model, name]["steps"], f"{model} {name} rank 1 vs 0")
    first, last = (results[0][model, name]["steps"][i]["weights"] for i in (0, -1))
    moved = {k for k in first if not torch.equal(first[k], last[k])}  # not vacuous: training moved the weights
    assert moved and (model != "lora" or all("_lora_" in k for k in moved)), sorted(moved)[:4]


@pytest.mark.parametrize("model,name", CASES, ids=[f"{m}-{n}" for m, n in CASES])
def test_each_layer_quantizes_the_fp8_matrices_it_holds(results, model, name):
    cfg = MODELS[model]
    names = choose_fp8(cfg, B * T, "all").fp8
    want = [(layer, n) for layer in range(cfg.num_hidden_layers) for n in names
            if f"layers.{layer}.{n}" in results[0][model, name]["steps"][0]["weights"]]
    for r in range(WORLD):
        assert sorted(results[r][model, name]["quantized"]) == sorted(want)
    if model in ("moe", "qwen35"):  # the layers differ in which matrices they hold
        per_layer = [{n for layer, n in want if layer == i} for i in range(cfg.num_hidden_layers)]
        assert per_layer[0] != per_layer[1]


@pytest.mark.parametrize("model,name", CASES, ids=[f"{m}-{n}" for m, n in CASES])
def test_memory_statement_is_what_is_allocated(results, model, name):
    for r in range(WORLD):
        rec = results[r][model, name]
        assert rec["memory"] == rec["allocated"]
        assert rec["host_keys"] == ({"shards", "quant_shards"} if "offload" in name else set())
        # the groups without quantized matrices (experts, adapters) go as they are; a uniform block has none
        assert (rec["bytes"]["block"] > 0) == (model in ("moe", "qwen35", "lora")), rec["bytes"]
        assert rec["bytes"]["block_fp8"] > 0


# ---- one process: what one layer's gather moves ----
@pytest.mark.parametrize("model", ["moe", "qwen35", "lora"])
def test_a_layer_gathers_its_quantized_groups_as_e4m3_codes(model):
    """Gathering one layer moves its quantized groups' padded buffers as 1-byte codes ('block_fp8'), its other
    groups whole in the model dtype ('block'), the small tensors through the exchange ('block_small'); the layer's
    tensors are the full weights' values, its codes `quantize_fp8` of them."""
    from qtrain.model.lora.spec import LoraSpec
    from qtrain.parallel.weights.persistent_quants import quantized_groups
    cfg = MODELS[model]
    lora = LoraSpec(4, 8.0, targets=("q", "v", "o", "gate", "down")) if model == "lora" else None
    layout = FlatLayout(cfg, 1, lora=lora)
    names = choose_fp8(cfg, B * T, "all").fp8
    w = ShardedWeights(layout, comm=Communicator.solo(CPU), dtype=torch.bfloat16, device=CPU, quantized=names)
    gen = torch.Generator().manual_seed(0)
    for t in w.shards.values():
        t.copy_(torch.randn(t.shape, generator=gen) * 0.05)
    full = w.gather_full()
    quantized = quantized_groups(layout, names)
    for layer in range(cfg.num_hidden_layers):
        w.invalidate(prefetch=False)  # nothing resident: the next gather moves the whole layer
        before = dict(w.gathered_bytes)
        with torch.no_grad():
            w._gather_block(layer)
            moved = {k: v - before[k] for k, v in w.gathered_bytes.items()}
            blk = w.block(layer)  # the slot holds it now (this also prefetches the next layer)
        qgroups = {g.key for g, _ in quantized[layer]}
        assert qgroups  # every layer here holds quantized matrices
        assert moved["block_fp8"] == sum(layout.by_key[k].padded_numel for k in qgroups)  # 1 byte per element
        assert moved["block"] == 2 * sum(g.padded_numel for g in layout.layer_groups(layer) if g.key not in qgroups)
        mats = w.quants.matrices[layer]
        for g in layout.layer_groups(layer):
            for s in g.segments:
                if s.short in mats:
                    q, inv = fp8.quantize_fp8(full[s.name])
                    assert torch.equal(blk[FP8_WEIGHT.format(s.short)].view(torch.uint8), q.view(torch.uint8))
                    assert torch.equal(blk[FP8_INV_SCALE.format(s.short)], inv)
                    assert blk[s.short].stride() == (0, 0)
                else:
                    assert torch.equal(blk[s.short].detach(), full[s.name]), (layer, s.name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model", MODELS)
def test_gpu_offloaded_shards_and_quants_train_bitwise_like_zero2(model, tmp_path):
    """On CUDA the host shards (the master with --offload-master, the codes with --offload-quants) are copied into the
    rank's own slice of their gather targets on the compute stream, the plain groups' into the compute buffer: a copy
    ordered wrongly, or into the wrong place, changes the bits of the first step. One process, the real FP8 GEMMs."""
    d = write_model_dir(tmp_path, MODELS[model])
    ctx = DistContext(rank=0, world=1, local_rank=0, device=torch.device("cuda"))
    runs = {}
    for name, kw in (("zero2", RUNS["zero2"]), ("zero3", RUNS["zero3-offload"])):
        runs[name] = train_steps(Trainer(options(d, model, device="cuda", **kw), ctx), range(STEPS), _batch(model), GA,
                                 LR)
    _same_steps(runs["zero3"], runs["zero2"], f"{model} cuda")


@pytest.mark.parametrize("model", ["moe", "lora"])
def test_a_frozen_base_is_quantized_once(results, model):
    """Each weights version re-quantizes the trainable groups' matrices; a frozen group's (a LoRA base's) never change
    after the first, so they are quantized once (their codes and scales kept): the LoRA run quantizes its whole base
    once in STEPS steps, the MoE run (nothing frozen) every matrix once per version."""
    done, per_version, frozen = results[0][model, "zero3"]["quantizations"]
    versions = STEPS + 1  # the initial weights, then one per update
    assert done == per_version + (versions - 1) * (per_version - frozen)
    assert (frozen == per_version > 0) if model == "lora" else frozen == 0
