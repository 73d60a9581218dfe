"""Hybrid sharding (`--shard-group-size G`, qtrain/parallel/groups.py) on 4 gloo ranks with G = 2.

Every gradient manager ('unsharded' = ZeRO-1, 'reduce-scatter', 'all-to-all') and sharded weights (ZeRO-3),
fp32, trained on the same data as flat sharding (G = 4): the same losses and gradient norms to 1e-6 relative
and final weights per tensor within 1e-3 of the update (the reduction is hierarchical: the same sum in another
order, so not bit for bit; tolerances as in tests/train/test_trainer_distributed.py); the Adam state per rank
is 1/G of the full state (twice the flat run's); every rank holds the same weights. G = 4 = world is flat
sharding bit for bit (the same code path). A hybrid checkpoint holds one copy of the G shards (written once
though two ranks hold each), resumes bit for bit as hybrid and, resharded, as flat.
"""
from __future__ import annotations

import io
import json
import os

import pytest
import torch

from qtrain.observe.log import RunLogger
from qtrain.options import Options, OptionsError
from qtrain.parallel.dist import DistContext
from qtrain.parallel.groups import ShardGroupError, check_group_size
from qtrain.train import checkpoint_io as cio
from qtrain.train import checkpointing
from qtrain.train.trainer import Trainer
from tests.dist_utils import run_distributed
from tests.train.test_trainer_distributed import B, BETAS, CFG, GA, LR, STEPS, T, step_batches

WORLD, G = 4, 2
__all__ = ["CFG"]  # the model of `model_dir` (tests/conftest.py)
# in CI (issue 20): one 4-rank spawn, ten trainers, about a minute on 2 cores
CPU = torch.device("cpu")
CONFIGS = {
    "zero1": dict(),
    "reduce-scatter": dict(shard_gradients=True),
    "all-to-all": dict(shard_gradients=True, all_to_all_reduce=True),
    "zero3": dict(zero_level=3),
}


def options(model_dir: str, name: str, group: int) -> Options:
    return Options(model=model_dir, from_scratch=True, device="cpu", compile="off", seed=5, model_dtype="fp32",
                   opt_m_dtype="fp32", opt_v_dtype="fp32", batch_size=B, seq_len=T, grad_accumulation=GA,
                   learning_rate=LR, beta_1=BETAS[0], beta_2=BETAS[1], shard_group_size=group, **CONFIGS[name])


def named(tr: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.float().clone() for n, p in tr.full_params().items()}


def run_steps(tr: Trainer, steps: range, data_ranks: list[int], global_ranks: list[int]) -> list[dict]:
    """As test_trainer_distributed.run_steps, with the full weights (gathered when sharded) after each step."""
    out = []
    for s in steps:
        valid = step_batches(s, global_ranks)[1]
        for x, y in step_batches(s, data_ranks)[0]:
            tr.micro_step(x, y, loss_scale=tr.ctx.world / valid)
        stats = tr.update(lr=LR)
        w = named(tr)
        out.append({"loss": stats["loss"], "norm": stats["norm"], "weights": torch.cat([w[k].flatten() for k in w])})
    return out


class _NoLoader:
    def state_dict(self) -> dict:
        return {}


def _worker(rank: int, world: int, model_dir: str, work: str) -> dict:
    ctx = DistContext(rank=rank, world=world, local_rank=rank, device=CPU)
    ranks = list(range(world))
    out: dict = {}
    for name in CONFIGS:
        for group in (0, G):
            tr = Trainer(options(model_dir, name, group), ctx)
            steps = run_steps(tr, range(STEPS), [rank], ranks)
            out[name, group] = {"steps": [(s["loss"], s["norm"]) for s in steps], "final": named(tr),
                                "adam": tr.optimizer.state_nbytes(), "w": [s["weights"] for s in steps]}
    tr = Trainer(options(model_dir, "zero1", WORLD), ctx)  # G = world: flat
    out["zero1", WORLD] = {"steps": [(s["loss"], s["norm"]) for s in run_steps(tr, range(STEPS), [rank], ranks)],
                           "final": named(tr)}
    # a hybrid checkpoint after step 1, resumed as hybrid and as flat
    tr = Trainer(options(model_dir, "reduce-scatter", G), ctx)
    run_steps(tr, range(1), [rank], ranks)
    log = RunLogger(None, rank=rank, total_steps=STEPS, stream=io.StringIO())
    out["ckpt"] = path = checkpointing.save(os.path.join(work, "ckpt"), tr, _NoLoader(), log)
    for group in (G, 0):
        tr = Trainer(options(model_dir, "reduce-scatter", group), ctx)
        assert checkpointing.load(path, tr, train_loader=None, logger=None) == 1
        out["resumed", group] = {"steps": [(s["loss"], s["norm"]) for s in run_steps(tr, range(1, STEPS), [rank],
                                                                                     ranks)],
                                 "final": named(tr)}
    return out


@pytest.fixture(scope="module")
def hybrid_runs(model_dir, tmp_path_factory):
    return run_distributed(_worker, WORLD, model_dir, str(tmp_path_factory.mktemp("hybrid")))


def _close(a: dict, b: dict, w0: dict[str, torch.Tensor] | None = None, first: int = 0) -> None:
    for s, ((la, na), (lb, nb)) in enumerate(zip(a["steps"], b["steps"][first:]), start=first):
        assert la == pytest.approx(lb, rel=1e-6) and na == pytest.approx(nb, rel=1e-6), f"step {s}"
    for k, want in b["final"].items():
        err = float((a["final"][k] - want).norm())
        upd = float((want - (w0[k] if w0 is not None else torch.zeros_like(want))).norm())
        assert err <= 1e-3 * upd, f"{k}: {err:.3g} vs update {upd:.3g}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hybrid_trains_like_flat_sharding(hybrid_runs, name):
    flat, hybrid = hybrid_runs[0][name, 0], hybrid_runs[0][name, G]
    _close(hybrid, flat)
    assert hybrid["adam"] > flat["adam"] and abs(hybrid["adam"] - 2 * flat["adam"]) <= 0.01 * hybrid["adam"]
    for r in range(1, WORLD):  # every rank (both groups) holds the same weights after every step
        other = hybrid_runs[r][name, G]
        assert all(torch.equal(a, b) for a, b in zip(hybrid["w"], other["w"])), f"rank {r}"
        assert other["steps"] == hybrid["steps"]


def test_group_of_the_world_is_flat_sharding_bit_for_bit(hybrid_runs):
    a, b = hybrid_runs[0]["zero1", WORLD], hybrid_runs[0]["zero1", 0]
    assert a["steps"] == b["steps"] and all(torch.equal(a["final"][k], b["final"][k]) for k in a["final"])


def test_hybrid_checkpoint_holds_one_copy_and_resumes(hybrid_runs):
    res = hybrid_runs[0]
    meta, files = cio.read_checkpoint(res["ckpt"])
    assert meta["distributed"] == {"world": G, "replicas": WORLD // G}
    assert files.names == sorted(f"{k}.shard_{r:03d}_of_{G:03d}" for k in ("weights", "adam.m", "adam.v")
                                 for r in range(G))
    full = res["reduce-scatter", G]
    again = res["resumed", G]
    assert again["steps"] == full["steps"][1:]
    assert all(torch.equal(again["final"][k], full["final"][k]) for k in full["final"])
    _close(res["resumed", 0], full, first=1)


def test_group_size_must_divide_the_world(model_dir):
    assert check_group_size(0, 8) == 8 and check_group_size(2, 8) == 2 and check_group_size(8, 8) == 8
    for bad in (3, 16):
        with pytest.raises(ShardGroupError, match=f"--shard-group-size {bad} must divide the number of ranks "
                                                  f"\\(8\\)"):
            check_group_size(bad, 8)
    with pytest.raises(OptionsError, match="--shard-group-size must be >= 0"):
        options(model_dir, "zero1", -1).validate()
    with pytest.raises(ShardGroupError, match="--shard-group-size 2 must divide the number of ranks \\(1\\)"):
        Trainer(options(model_dir, "zero1", 2), DistContext(rank=0, world=1, local_rank=0, device=CPU))
    assert json.dumps(options(model_dir, "zero1", 2).to_dict())  # the option travels with the run's options
