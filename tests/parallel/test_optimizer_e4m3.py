"""Adam's first moment in e4m3 with block scales (--opt-m-dtype e4m3 --opt-v-dtype bf16) in training.

What the optimizer promises (`qtrain/parallel/optimizer.py`): m is float8 codes plus one fp32 scale per
block, a block being a 128-element run of a tensor cut by the rank's shard; the update calls the fused
kernel so that every call starts on a block. Claims checked here, bit for bit:

* one `ShardedAdamW` step equals direct `adamw_update_` calls per shard piece (one per piece; two where a
  piece starts mid-block), with the documented scale layout, on 1 rank and on simulated ranks of 2 and 3;
* how the update is cut does not matter: offloaded m (codes and scales staged through the device slots,
  chunks cut on block boundaries), offloaded v and master, zero-copy and forced small staging slots all
  equal the plain device update, also across a skipped (NaN) step and `unstep()`;
* 2 processes (gloo, replicated weights, all-gather) equal 1 process in every block no shard boundary cuts;
  in the cut blocks they may differ (each part has its own scale) -- the one place the world size shows;
* a run resumed from a checkpoint (codes and scales in the `adam.m` file) gives bit-identical losses and
  weights to an uninterrupted one, in 1 process (`qtrain train --continue`) and in 2 (Trainer API, sharded
  weights and offloaded state); a checkpoint claiming more ranks than it has files for is refused naming
  the missing files (resharding to another world size: tests/parallel/test_reshard.py).
The convergence check (final eval loss within 2% of fp32 states) lives in tests/test_numerics_convergence.py;
Trainer-level offload equality in 1 and 2 processes in tests/test_offload_optimizer.py.
"""
from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest
import torch

from tests.dist_utils import run_distributed
from qtrain.kernels.adamw import M_BLOCK
from qtrain.kernels.rng import rng_key
from qtrain.model.llama import LlamaConfig
from qtrain.model.weights import is_decayed
from qtrain.numerics.adamw import AdamWHyper, adamw_update_
from qtrain.parallel.comm import Communicator
from qtrain.parallel.dist import DistContext
from qtrain.parallel.layout import FlatLayout
from qtrain.parallel.optimizer import E4M3_M_NEEDS_SR, SCALES_SUFFIX, ShardedAdamW, group_m_scales
from qtrain.train import checkpointing
from qtrain.observe.log import RunLogger
from qtrain.options import Options
from qtrain.train.trainer import Trainer

# untied head, QKV bias; on 2 ranks every block group is cut inside `up` at element 2240 (mid-block) while
# the embedding / LM-head cuts fall on a block boundary; the vocab-sized shards are chunked when staged
CFG = LlamaConfig(model_type="qwen2", vocab_size=997, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0,
                  tie_word_embeddings=False, attention_bias=True, bos_token_id=None, eos_token_id=None)
SEED, STEPS = 7, 3
HP = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
CPU = torch.device("cpu")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def full_buffers(layout: FlatLayout, seed: int, scale: float) -> dict[str, torch.Tensor]:
    """bf16 group buffers with random tensors (padding zero): per tensor name, so the values do not depend
    on the layout's world size."""
    out = layout.allocate(dtype=torch.bfloat16, device=CPU)
    for g in layout.groups:
        for s in g.segments:
            gen = torch.Generator().manual_seed(seed * 1000 + sum(map(ord, s.name)) * 7 + s.numel)
            out[g.key][s.start:s.start + s.numel] = (torch.randn(s.numel, generator=gen) * scale).bfloat16()
    return out


def grads_of(layout: FlatLayout, step: int) -> dict[str, torch.Tensor]:
    g = full_buffers(layout, 100 + step, 1e-2)
    if step == 1:  # a few larger gradients, so block maxima vary a lot within tensors
        for k in g:
            g[k][::97] *= 50
    return g


class Grads:
    """GradShards over full gradient buffers: rank r's slice."""

    def __init__(self, layout: FlatLayout, full: dict[str, torch.Tensor], rank: int):
        self.layout, self.full, self.rank = layout, full, rank

    def grad_shard(self, key: str) -> torch.Tensor:
        lo, hi = self.layout.by_key[key].shard_range(self.rank, self.layout.world)
        return self.full[key][lo:hi]


def shards_of(layout: FlatLayout, full: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    out = {}
    for g in layout.groups:
        lo, hi = g.shard_range(rank, layout.world)
        out[g.key] = full[g.key][lo:hi].clone()
    return out


def grad_scale(step: int) -> float | torch.Tensor:
    return 0.7 if step != 1 else torch.tensor(0.9)  # also the device-scalar path


# ---- (a) one step == direct kernel calls per piece ------------------------------------------------------
@pytest.mark.parametrize("world,rank", [(1, 0), (2, 1), (3, 2)], ids=lambda x: str(x))
def test_step_equals_direct_adamw_update_per_piece(world, rank):
    layout = FlatLayout(CFG, world)
    params = full_buffers(layout, SEED, 0.05)
    shards = shards_of(layout, params, rank)
    opt = ShardedAdamW(layout, shards=shards, rank=rank, device=CPU, m_dtype="e4m3", v_dtype="bf16", seed=SEED)
    assert all(t.dtype == torch.float8_e4m3fn and not t.float().any() for t in opt.m.values())
    ref = {}  # (group, piece index) -> [param, m codes, v, scales] of that piece alone
    for g in layout.groups:
        for i, p in enumerate(g.shard_pieces(rank, world)):
            nblk = -(-(p.tensor_offset + p.numel) // M_BLOCK) - p.tensor_offset // M_BLOCK
            ref[g.key, i] = [shards[g.key][p.shard_offset:p.shard_offset + p.numel].clone(),
                             torch.zeros(p.numel, dtype=torch.float8_e4m3fn), torch.zeros(p.numel, dtype=torch.bfloat16),
                             torch.zeros(nblk, dtype=torch.float32)]
    head_calls = 0
    for step in range(STEPS):
        full_g = grads_of(layout, step)
        amax = opt.step(Grads(layout, full_g, rank), grad_scale=grad_scale(step), **HP)
        hp = AdamWHyper(step=step + 1, grad_scale=grad_scale(step), **HP)
        ref_amax = []
        for g in layout.groups:
            lo = g.shard_range(rank, world)[0]
            for i, p in enumerate(g.shard_pieces(rank, world)):
                P, M, V, S = ref[g.key, i]
                G = full_g[g.key][lo + p.shard_offset:lo + p.shard_offset + p.numel]
                head = min(p.numel, (-p.tensor_offset) % M_BLOCK)  # a piece starting mid-block: its rest first
                calls = ([(0, head, 0, 1)] if head else []) + ([(head, p.numel, 1 if head else 0, len(S))]
                                                               if head < p.numel else [])
                head_calls += bool(head)
                for a, b, s0, s1 in calls:
                    ref_amax.append(adamw_update_(
                        P[a:b], G[a:b], M[a:b], V[a:b], m_scales=S[s0:s1], hp=hp, decay=is_decayed(CFG, p.segment.name),
                        key=rng_key(SEED, step + 1, g.index, g.segments.index(p.segment)), offset=p.tensor_offset + a))
        assert same(amax, torch.stack(ref_amax).max()), step
    assert (head_calls > 0) == (world > 1)  # the mid-block case is exercised where it exists
    for g in layout.groups:
        s_off = 0
        for i, p in enumerate(g.shard_pieces(rank, world)):
            P, M, V, S = ref[g.key, i]
            sl = slice(p.shard_offset, p.shard_offset + p.numel)
            assert same(opt.shards[g.key][sl], P) and same(opt.m[g.key][sl], M) and same(opt.v[g.key][sl], V), g.key
            assert same(opt.m_scales[g.key][s_off:s_off + len(S)], S), g.key
            s_off += len(S)
        assert not opt.m_scales[g.key][s_off:].any()  # the tail other ranks need stays zero here
        assert opt.m_scales[g.key].numel() == group_m_scales(g, world)
    assert (opt.m["block.0"].float() != 0).float().mean() > 0.9  # not vacuous: m holds values


# ---- (b) how the update is cut does not matter ----------------------------------------------------------
class _Slots(ShardedAdamW):
    capacity = 0

    def _chunk_capacity(self) -> int:
        return self.capacity


def _small_slots(cap: int) -> type:
    return type(f"Slots{cap}", (_Slots,), {"capacity": cap})


VARIANTS = {
    "offload m": (ShardedAdamW, dict(offload_m=True)),
    "offload m, v, master": (ShardedAdamW, dict(offload_m=True, offload_v=True, offload_params=True)),
    "zero-copy": (ShardedAdamW, dict(offload_m=True, offload_params=True, zero_copy=True)),
    "slots 320": (_small_slots(320), dict(offload_m=True, offload_v=True)),
    "slots 1000": (_small_slots(1000), dict(offload_v=True)),  # m on the device, chunked calls anyway
}


def _run(world: int, rank: int, cls=ShardedAdamW, **kw) -> ShardedAdamW:
    layout = FlatLayout(CFG, world)
    opt = cls(layout, shards=shards_of(layout, full_buffers(layout, SEED, 0.05), rank), rank=rank, device=CPU,
              m_dtype="e4m3", v_dtype="bf16", seed=SEED, **kw)
    for step in range(STEPS):
        opt.step(Grads(layout, grads_of(layout, step), rank), grad_scale=grad_scale(step), **HP)
        if step == 1:  # a skipped step (NaN clip factor) writes nothing and is not counted
            before = {k: [t.clone() for t in d.values()] for k, d in opt.state_tensors().items()}
            opt.step(Grads(layout, grads_of(layout, 9), rank), grad_scale=torch.tensor(float("nan")), **HP)
            opt.unstep()
            after = {k: list(d.values()) for k, d in opt.state_tensors().items()}
            assert all(same(a, b) for k in before for a, b in zip(before[k], after[k]))
            assert opt.step_count == 2
    return opt


@pytest.fixture(scope="module", params=[(1, 0), (2, 1)], ids=lambda x: f"world{x[0]}-rank{x[1]}")
def device_run(request):
    return request.param, _run(*request.param)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_offloaded_and_chunked_m_equal_device_m(device_run, variant):
    (world, rank), base = device_run
    cls, kw = VARIANTS[variant]
    opt = _run(world, rank, cls, **kw)
    if kw.get("offload_m"):
        assert {t.device.type for t in opt.m_scales.values()} == {"cpu"} and "adam.m" in opt.host_memory_keys()
    if cls is not ShardedAdamW or not kw.get("zero_copy"):
        assert opt.streamed_items > len(opt.layout.groups)  # chunks: the vocab-sized shards at least
    if cls is not ShardedAdamW and kw.get("offload_m"):
        assert opt.memory()["staging"] > 0 and "m_scales" in opt._staging
    for kind in ("adam.m", "adam.v"):
        a, b = opt.state_tensors()[kind], base.state_tensors()[kind]
        assert a.keys() == b.keys()
        for k in b:
            assert same(a[k], b[k]), f"{variant}: {kind}[{k}]"
    for k in base.shards:
        assert same(opt.shards[k], base.shards[k]), f"{variant}: weights[{k}]"


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("capacity", [128, 200, 4096])
def test_chunks_cover_shards_and_cut_on_blocks(world, capacity):
    """The work items of any slot size (down to one block) tile every shard, stay within the slot, and
    every kernel call starts on a block: a multiple of 128 in its tensor, or a piece start."""
    layout = FlatLayout(CFG, world)
    for rank in range(world):
        opt = ShardedAdamW(layout, shards=layout.allocate(dtype=torch.bfloat16, device=CPU, shard=True), rank=rank,
                           device=CPU, m_dtype="e4m3", v_dtype="bf16")
        items = opt._items(capacity)
        for g in layout.groups:
            mine = [it for it in items if it.group is g]
            assert [it.lo for it in mine][0] == 0 and mine[-1].hi == g.shard_size(world)
            assert all(a.hi == b.lo for a, b in zip(mine, mine[1:])) and mine[-1].last_of_group
            assert all(0 < it.hi - it.lo <= capacity for it in mine)
            pieces = {p.shard_offset: p for p in g.shard_pieces(rank, world)}
            covered = 0
            for it in mine:
                for c in it.calls:
                    assert c.offset % M_BLOCK == 0 or it.lo + c.a in pieces, (g.key, it, c)
                    assert c.s_hi - c.s_lo == -(-(c.b - c.a) // M_BLOCK) and c.b - c.a <= M_BLOCK * (c.s_hi - c.s_lo)
                    covered += c.b - c.a
            assert covered == sum(p.numel for p in pieces.values())
            assert all(it.s_hi <= group_m_scales(g, world) for it in mine)


def test_refusals_and_state_checks():
    layout = FlatLayout(CFG, 1)
    shards = layout.allocate(dtype=torch.bfloat16, device=CPU, shard=True)
    with pytest.raises(ValueError) as e:
        ShardedAdamW(layout, shards=shards, m_dtype="e4m3", v_dtype="bf16", stochastic_rounding=False)
    assert str(e.value) == E4M3_M_NEEDS_SR
    opt = ShardedAdamW(layout, shards=shards, m_dtype="e4m3", v_dtype="bf16")
    state = opt.state_tensors()
    assert set(state["adam.m"]) == {g.key for g in layout.groups} | {g.key + SCALES_SUFFIX for g in layout.groups}
    no_scales = {"adam.m": dict(opt.m), "adam.v": state["adam.v"]}
    with pytest.raises(ValueError, match="--opt-m-dtype"):
        opt.load_state_tensors(no_scales, 1)
    bf16 = ShardedAdamW(layout, shards=shards, m_dtype="bf16", v_dtype="bf16")
    with pytest.raises(ValueError, match="unexpected tensors"):
        bf16.load_state_tensors(state, 1)
    with pytest.raises(ValueError, match="dtype"):
        opt.load_state_tensors({"adam.m": {**bf16.state_tensors()["adam.m"], **{
            k: v for k, v in state["adam.m"].items() if k.endswith(SCALES_SUFFIX)}}, "adam.v": state["adam.v"]}, 1)


# ---- (c) + (d, 2 ranks): gloo ---------------------------------------------------------------------------
def _dequant_by_tensor(opt: ShardedAdamW) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """This rank's m (dequantized fp32), m codes and scale-per-element, by tensor name -> (tensor offsets,
    values, codes), using the documented scale layout (pieces in order, one scale per tensor block)."""
    out = {}
    for g in opt.layout.groups:
        s_off = 0
        for p in g.shard_pieces(opt.rank, opt.world):
            t = torch.arange(p.tensor_offset, p.tensor_offset + p.numel)
            sidx = s_off + t // M_BLOCK - p.tensor_offset // M_BLOCK
            codes = opt.m[g.key][p.shard_offset:p.shard_offset + p.numel]
            out[p.segment.name] = (t, codes.float() * opt.m_scales[g.key][sidx], bits(codes).clone())
            s_off += -(-(p.tensor_offset + p.numel) // M_BLOCK) - p.tensor_offset // M_BLOCK
    return out


def _optimizer_run(world: int, rank: int, comm) -> dict:
    layout = FlatLayout(CFG, world)
    params = full_buffers(layout, SEED, 0.05)
    opt = ShardedAdamW(layout, params, rank=rank, comm=comm, device=CPU, m_dtype="e4m3", v_dtype="bf16",
                       seed=SEED, offload_m=True)
    for step in range(STEPS):
        opt.step(Grads(layout, grads_of(layout, step), rank), grad_scale=grad_scale(step), **HP)
    cut = {}  # tensor name -> tensor blocks a shard boundary cuts (a piece of rank > 0 starting mid-block)
    for g in layout.groups:
        for r in range(1, world):
            for p in g.shard_pieces(r, world)[:1]:
                if p.tensor_offset % M_BLOCK:
                    cut.setdefault(p.segment.name, set()).add(p.tensor_offset // M_BLOCK)
    return {"params": {n: v.clone() for n, v in layout.views(params).items()}, "m": _dequant_by_tensor(opt),
            "cut": cut}


class _LoaderState:
    def state_dict(self) -> dict:
        return {}


def _trainer_opts(model_dir: str) -> Options:
    return Options(model=model_dir, from_scratch=True, device="cpu", compile="off", seed=SEED, model_dtype="bf16",
                   opt_m_dtype="e4m3", opt_v_dtype="bf16", batch_size=2, seq_len=16, grad_accumulation=1,
                   learning_rate=3e-3, zero_level=3, offload_master=True, offload_opt_m=True)


def _trainer_steps(tr: Trainer, steps: range, rank: int) -> list:
    out = []
    for s in steps:
        gen = torch.Generator().manual_seed(1000 * s + rank)
        seq = torch.randint(0, CFG.vocab_size, (2, 17), generator=gen)
        tr.micro_step(seq[:, :-1], seq[:, 1:])
        st = tr.update(lr=3e-3)
        out.append((st["loss"], st["norm"]))
    return out


def _worker(rank: int, world: int, model_dir: str, ckpt_dir: str) -> dict:
    ctx = DistContext(rank=rank, world=world, local_rank=rank, device=CPU)
    out = {"opt": _optimizer_run(world, rank, Communicator(device=CPU))}
    if rank == 0:
        out["ref"] = _optimizer_run(1, 0, None)
    # resume through a checkpoint, 2 ranks, sharded weights, offloaded master and m
    tr = Trainer(_trainer_opts(model_dir), ctx)
    steps = _trainer_steps(tr, range(1), rank)
    path = checkpointing.save(ckpt_dir, tr, _LoaderState(), RunLogger(None, rank=rank, total_steps=3,
                                                                         stream=io.StringIO()))
    steps += _trainer_steps(tr, range(1, 3), rank)
    final = {n: p.clone() for n, p in tr.full_params().items()}
    tr2 = Trainer(_trainer_opts(model_dir), ctx)
    assert checkpointing.load(path, tr2, train_loader=None, logger=None) == 1
    resumed = _trainer_steps(tr2, range(1, 3), rank)
    out["resume"] = {"steps": steps, "resumed": resumed, "final": final,
                     "final_resumed": {n: p.clone() for n, p in tr2.full_params().items()}, "path": path}
    return out


@pytest.fixture(scope="module")
def gloo(model_dir, tmp_path_factory):
    return run_distributed(_worker, 2, model_dir, str(tmp_path_factory.mktemp("ckpt2")))


def test_two_processes_equal_one_outside_the_blocks_shards_cut(gloo):
    ref = gloo[0]["ref"]
    cut = gloo[0]["opt"]["cut"]
    assert cut and all(n.endswith(".up") for n in cut), cut  # the case this model is built to have
    differing = 0
    for r, res in enumerate(gloo):
        for name, p in res["opt"]["params"].items():  # replicated weights: all-gathered on every rank
            blk = torch.arange(p.numel()) // M_BLOCK
            keep = ~torch.isin(blk, torch.tensor(sorted(cut.get(name, {-1}))))
            a, b = bits(p.reshape(-1)), bits(ref["params"][name].reshape(-1))
            assert torch.equal(a[keep], b[keep]), f"rank {r}: {name}"
            differing += int((a[~keep] != b[~keep]).sum())
        for name, (t, m, codes) in res["opt"]["m"].items():
            _, m1, codes1 = ref["m"][name]
            keep = ~torch.isin(t // M_BLOCK, torch.tensor(sorted(cut.get(name, {-1}))))
            assert torch.equal(codes[keep], codes1[t][keep]), f"rank {r}: m codes of {name}"
            assert torch.equal(bits(m[keep]), bits(m1[t][keep])), f"rank {r}: m of {name}"
    # the cut blocks have one scale per part, so there the world size shows (the documented exception)
    assert differing > 0


def test_two_process_resume_is_bitwise_equal(gloo):
    for r, res in enumerate(gloo):
        rec = res["resume"]
        assert rec["steps"][1:] == rec["resumed"], f"rank {r}: losses / norms"
        for n, p in rec["final"].items():
            assert same(rec["final_resumed"][n], p), f"rank {r}: {n}"
    # the checkpoint holds codes and scales per rank, in the adam.m files
    from qtrain.train.checkpoint_io import read_checkpoint
    _, files = read_checkpoint(gloo[0]["resume"]["path"])
    m0 = files.load("adam.m.shard_000_of_002")
    assert m0["block.0"].dtype == torch.float8_e4m3fn and m0["block.0" + SCALES_SUFFIX].dtype == torch.float32


# ---- (d) resume, one process, through the CLI; missing shard files are refused -------------------------------
def test_cli_resume_is_bitwise_equal_and_missing_shards_refused(tmp_path, monkeypatch):
    from qtrain.cli.main import main
    from qtrain.data.token_files import write_token_file
    from qtrain.observe.log import read_log
    from safetensors.torch import load_file

    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(CFG.to_hf_dict()))
    rng = np.random.default_rng(0)
    write_token_file("train.bin", rng.integers(0, CFG.vocab_size, 20_000).astype(np.int32), vocab_size=CFG.vocab_size)
    opts = ["--model", "model", "--from-scratch", "--train-file", "train.bin", "--device", "cpu", "--compile", "off",
            "--model-dtype", "bf16", "--opt-m-dtype", "e4m3", "--opt-v-dtype", "bf16", "--batch-size", "2",
            "--seq-len", "32", "--grad-accumulation", "2", "--lr", "3e-3", "--warmup", "2", "--steps", "6",
            "--ckpt-interval", "3", "--no-save-training-state", "--seed", "5"]
    assert main(["train", *opts, "--out-dir", "full", "--checkpoint-dir", "ckpt", "--log-file", "full.jsonl"]) == 0
    assert main(["train", *opts, "--out-dir", "resumed", "--checkpoint-dir", "ckpt", "--log-file", "resumed.jsonl",
                 "--continue", "3"]) == 0
    steps = lambda f: {e["step"]: (e["loss"], e["norm"]) for e in read_log(f) if e["log"] == "step"}  # noqa: E731
    full, resumed = steps("full.jsonl"), steps("resumed.jsonl")
    assert sorted(resumed) == [3, 4, 5]
    assert all(resumed[k] == full[k] for k in resumed), (full, resumed)
    a, b = load_file("full/model.safetensors"), load_file("resumed/model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # the same checkpoint claimed by 2 ranks (resharding would read rank 1's files, which are not there):
    # refused before anything is read, naming the missing files
    meta_path = tmp_path / "ckpt" / "step_00000003" / "checkpoint.json"
    meta = json.loads(meta_path.read_text())
    meta["distributed"]["world"] = 2
    meta_path.write_text(json.dumps(meta))
    opt = Options(model="model", from_scratch=True, device="cpu", compile="off", seed=5, model_dtype="bf16",
                  opt_m_dtype="e4m3", opt_v_dtype="bf16", batch_size=2, seq_len=32, grad_accumulation=2)
    tr = Trainer(opt.validate())
    with pytest.raises(checkpointing.CheckpointError, match="needs weights.shard_000_of_002.safetensors") as e:
        checkpointing.load(str(meta_path.parent), tr, train_loader=None, logger=None)
    assert "rank 0 of 1" in str(e.value) and "adam.m.shard_001_of_002.safetensors" in str(e.value)
    assert os.path.isdir(tmp_path / "ckpt" / "step_00000003")
