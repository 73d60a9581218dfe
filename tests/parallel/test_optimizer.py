"""Offloaded optimizer state (--offload-opt-m, --offload-opt-v, --offload-master, --use-zero-copy).

Claim: offloading moves the state, not the math. The Adam moments (and, with sharded weights, the weight
shards, which are the master) live in host memory -- pinned when CUDA is available -- and the update
streams them through three staging slots on the compute device, chunking shards larger than a block shard
(the embedding and LM head here: vocab 997). The update is elementwise and every element keeps its
stochastic-rounding counter (its index in its tensor) whatever chunk it lands in, so every offload
variant must give *bitwise* the same losses, gradient norms, weights after every step and final Adam
moments as no offload: in fp32, in bf16 (bf16 weights and moments, stochastic rounding) and with an e4m3
first moment (bf16 weights and v; m as e4m3 codes + block scales, which stream with m and whose blocks the
chunks never cut), in 1 process and in 2 (gloo), with replicated weights (m / v), sharded weights (master, everything), sharded gradients
offloaded too, and --use-zero-copy (which on a CPU device updates the host tensors in place).

On a CPU device "host" and "device" are the same memory, so these tests check the streaming logic (slots,
chunks, counters, copy-back), state placement and the bookkeeping; that the copies overlap the update on
the GPU's side stream, and the pinned transfers themselves, only the GPU can show.
"""
from __future__ import annotations


import pytest
import torch

from tests.dist_utils import run_distributed
from qtrain.model.llama import LlamaConfig
from qtrain.parallel.dist import DistContext
from qtrain.parallel.layout import FlatLayout
from qtrain.parallel.optimizer import OFFLOAD_MASTER_NEEDS_SHARDED, ZERO_COPY_CUDA, ShardedAdamW
from qtrain.options import Options, OptionsError
from qtrain.train.trainer import Trainer

CFG = LlamaConfig(model_type="qwen2", vocab_size=997, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0,
                  tie_word_embeddings=False, attention_bias=True, bos_token_id=None, eos_token_id=None)
B, T, GA, STEPS = 2, 16, 1, 2
CPU = torch.device("cpu")
# run -> (baseline run it must equal bitwise, options)
RUNS = {
    "none": (None, {}),
    "m": ("none", {"offload_opt_m": True}),
    "v": ("none", {"offload_opt_v": True}),
    "master": ("none", {"shard_weights": True, "offload_master": True}),
    "all+zero-copy": ("none", {"shard_weights": True, "offload_master": True, "offload_opt_m": True,
                               "offload_opt_v": True, "use_zero_copy": True}),
    "zero2": (None, {"zero_level": 2}),
    "zero3+offload": ("zero2", {"zero_level": 3, "offload_gradients": True, "offload_master": True,
                                "offload_opt_m": True, "offload_opt_v": True}),
}
DTYPES = ("fp32", "bf16", "e4m3")  # e4m3: --opt-m-dtype e4m3 with bf16 weights and v
PINNED = torch.cuda.is_available()  # offloaded state is pinned exactly when CUDA is available


def options(model_dir: str, dtype: str, **kw) -> Options:
    low = "bf16" if dtype == "e4m3" else dtype
    return Options(model=model_dir, from_scratch=True, device="cpu", compile="off", seed=11, model_dtype=low,
                   opt_m_dtype=dtype, opt_v_dtype=low, batch_size=B, seq_len=T, grad_accumulation=GA,
                   learning_rate=3e-3, **kw)


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    seq = torch.randint(0, CFG.vocab_size, (B, T + 1), generator=gen)
    return seq[:, :-1].clone(), seq[:, 1:].clone()


def _placement(tr: Trainer) -> dict:
    """Where every piece of offloadable state lives."""
    def where(ts) -> set:
        return {(t.device.type, t.is_pinned()) for t in ts}
    opt = tr.optimizer
    out = {"m": where([*opt.m.values(), *getattr(opt, "m_scales", {}).values()]),  # e4m3 scales live with m
           "v": where(opt.v.values()), "opt_host_keys": opt.host_memory_keys(),
           "staging": opt.memory()["staging"], "streamed_items": opt.streamed_items,
           "groups": len(tr.layout.groups)}
    if tr.sharded_weights:
        out["master"] = where(tr.weights.shards.values())
        out["weights_host_keys"] = tr.weights.host_memory_keys()
    return out


def train_all(model_dir: str, ctx: DistContext) -> dict:
    out = {}
    for dtype in DTYPES:
        for name, (_, kw) in RUNS.items():
            tr = Trainer(options(model_dir, dtype, **kw), ctx)
            steps = []
            for s in range(STEPS):
                for m in range(GA):
                    tr.micro_step(*batch(s, m, ctx.rank))
                stats = tr.update(lr=3e-3)
                steps.append((stats["loss"], stats["norm"],
                              {n: p.detach().clone() for n, p in tr.full_params().items()}))
            state = tr.state_tensors()
            out[(dtype, name)] = {"steps": steps, "placement": _placement(tr),
                                  "adam": {k: {g: t.clone() for g, t in v.items()} for k, v in state.items()
                                           if k.startswith("adam")}}
    return out


def _worker(rank: int, world: int, model_dir: str) -> dict:
    return train_all(model_dir, DistContext(rank=rank, world=world, local_rank=rank, device=CPU))


@pytest.fixture(scope="module", params=[1, 2], ids=lambda w: f"world{w}")
def results(request, model_dir):
    world = request.param
    if world == 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # like each spawned rank
        try:
            return world, [train_all(model_dir, DistContext(rank=0, world=1, local_rank=0, device=CPU))]
        finally:
            torch.set_num_threads(threads)
    return world, run_distributed(_worker, world, model_dir)


@pytest.mark.parametrize("name", [n for n, (base, _) in RUNS.items() if base is not None])
@pytest.mark.parametrize("dtype", DTYPES)
def test_offload_is_bitwise_equal_to_no_offload(results, dtype, name):
    world, per_rank = results
    base = RUNS[name][0]
    for r, res in enumerate(per_rank):
        a, b = res[(dtype, name)], res[(dtype, base)]
        for s, ((la, na, wa), (lb, nb, wb)) in enumerate(zip(a["steps"], b["steps"])):
            assert (la, na) == (lb, nb), f"rank {r} step {s}: loss/norm"
            for k in wb:
                assert torch.equal(wa[k], wb[k]), f"rank {r} step {s}: {k}"
        for kind in b["adam"]:
            for g in b["adam"][kind]:
                assert torch.equal(a["adam"][kind][g], b["adam"][kind][g]), f"rank {r}: {kind}[{g}]"
    # not vacuous: the weights moved
    first, last = per_rank[0][(dtype, base)]["steps"][0][2], per_rank[0][(dtype, base)]["steps"][-1][2]
    assert not torch.equal(first["layers.0.up"], last["layers.0.up"])


def test_offloaded_state_lives_in_host_memory_and_is_streamed(results):
    world, per_rank = results
    host = {("cpu", PINNED)}
    for res in per_rank:
        for (dtype, name), rec in res.items():
            kw, p = RUNS[name][1], rec["placement"]
            assert (p["m"] == host) if kw.get("offload_opt_m") else (p["m"] == {("cpu", False)}), (name, p)
            assert (p["v"] == host) if kw.get("offload_opt_v") else (p["v"] == {("cpu", False)}), (name, p)
            assert p["opt_host_keys"] == ({"adam.m"} if kw.get("offload_opt_m") else set()) | \
                ({"adam.v"} if kw.get("offload_opt_v") else set())
            if kw.get("offload_master"):
                assert p["master"] == host and p["weights_host_keys"] == {"shards"}
            offloaded = any(kw.get(k) for k in ("offload_opt_m", "offload_opt_v", "offload_master"))
            if offloaded and not kw.get("use_zero_copy"):
                # streamed: staging slots; the vocab-sized shards are cut into several chunks
                assert p["staging"] > 0 and p["streamed_items"] > p["groups"], (name, p)
            else:
                assert p["staging"] == 0 and p["streamed_items"] == 0, (name, p)


# ---- refusals --------------------------------------------------------------------------------------------
def test_zero_copy_and_offload_master_refusals():
    with pytest.raises(OptionsError, match="--use-zero-copy needs offloaded state"):
        Options(use_zero_copy=True).validate()
    with pytest.raises(OptionsError, match="--use-zero-copy is not supported on CUDA"):
        Options(use_zero_copy=True, offload_opt_m=True, device="cuda").validate()
    Options(use_zero_copy=True, offload_opt_v=True, device="cpu").validate()
    with pytest.raises(OptionsError, match="--offload-master needs sharded weights"):
        Options(offload_master=True, offload_opt_m=True).validate()
    Options(offload_opt_m=True, offload_opt_v=True).validate()  # replicated weights, offloaded moments: fine
    layout = FlatLayout(CFG, 1)
    shards = layout.allocate(dtype=torch.float32, device=CPU, shard=True)
    with pytest.raises(ValueError) as e:  # refused before anything is allocated on the (absent) GPU
        ShardedAdamW(layout, shards=shards, device="cuda", offload_m=True, zero_copy=True)
    assert str(e.value) == ZERO_COPY_CUDA
    with pytest.raises(ValueError) as e:
        ShardedAdamW(layout, layout.allocate(dtype=torch.float32, device=CPU), offload_params=True)
    assert str(e.value) == OFFLOAD_MASTER_NEEDS_SHARDED


# ---- on the GPU: the streamed update with real copy streams -----------------------------------------------
GPU_CFG = LlamaConfig(model_type="qwen2", vocab_size=32000, hidden_size=512, intermediate_size=1536,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                      max_position_embeddings=64, rope_theta=10000.0, tie_word_embeddings=False,
                      attention_bias=True, bos_token_id=None, eos_token_id=None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m_dtype", ["bf16", "e4m3"])
def test_gpu_streamed_update_equals_device_update(m_dtype):
    """On CUDA the staged update runs on three streams (host->device, compute, device->host) with the slots
    reused every third item; a missing wait shows up as stale or half-copied state. The model is sized so
    the copies take real time (46M parameters, ~18 work items: the 16M-element embedding and LM-head shards
    are cut into chunks). Three steps run back to back with no host sync between them (so the order between
    one step's copy-backs and the next step's fetches is on the streams alone); the weights after every step
    (where they stay on the device) and everything after the last must equal the on-device update bitwise.
    Variants: moments offloaded; moments and weight shards; gradient shards in host memory (staged too)."""
    dev = torch.device("cuda")
    layout = FlatLayout(GPU_CFG, 1)

    def filled(seed: int, scale: float) -> dict[str, torch.Tensor]:
        out = layout.allocate(dtype=torch.bfloat16, device=dev)
        g = torch.Generator(device=dev).manual_seed(seed)
        for t in out.values():
            t.copy_(torch.randn(t.shape, device=dev, generator=g) * scale)
        return out

    class Grads:
        def __init__(self, g: dict[str, torch.Tensor]):
            self.g = g

        def grad_shard(self, key: str) -> torch.Tensor:
            return self.g[key]

    def run(host_grads: bool = False, **kw) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
        shards = filled(1, 0.05)
        if kw.get("offload_params"):
            shards = {k: t.cpu().pin_memory() for k, t in shards.items()}
        grads = [filled(100 + step, 1e-2) for step in range(3)]
        if host_grads:
            grads = [{k: t.cpu().pin_memory() for k, t in g.items()} for g in grads]
        torch.cuda.synchronize()
        opt = ShardedAdamW(layout, shards=shards, device=dev, m_dtype=m_dtype, v_dtype="bf16", seed=3, **kw)
        per_step = []
        for g in grads:  # back to back: no host sync until state_tensors()
            opt.step(Grads(g), lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
            if not kw.get("offload_params"):  # device weights: a copy ordered on the compute stream
                per_step.append({k: t.clone() for k, t in opt.shards.items()})
        st = opt.state_tensors()  # waits for the last copy-backs
        final = {f"{n}.{k}": t.to(dev, copy=True) for n, d in
                 (("param", opt.shards), ("m", st["adam.m"]), ("v", st["adam.v"])) for k, t in d.items()}
        staged = bool(kw) or host_grads
        assert opt.streamed_items == (len(opt._items(opt._capacity or opt._chunk_capacity())) if staged else 0)
        return per_step, final

    base_steps, base = run()
    variants = (dict(offload_m=True, offload_v=True), dict(offload_m=True, offload_v=True, offload_params=True),
                dict(host_grads=True), dict(host_grads=True, offload_m=True))
    for kw in variants:
        steps, final = run(**kw)
        assert final.keys() == base.keys()
        for k in base:
            assert torch.equal(base[k].view(torch.uint8), final[k].view(torch.uint8)), (kw, k)
        for step, got in enumerate(steps):
            for k, t in got.items():
                assert torch.equal(base_steps[step][k].view(torch.uint8), t.view(torch.uint8)), (kw, step, k)
