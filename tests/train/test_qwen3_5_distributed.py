"""The hybrid Qwen3.5 model (a Gated DeltaNet and a gated full-attention layer, whose blocks hold different tensors; MoE
with its router losses) through the Trainer's machinery on 2 gloo ranks, as tests/train/test_moe_trainer.py runs the
MoE families:

* the gradient managers (unsharded, reduce-scatter with the optimizer state and gradient shards offloaded to the
  host, all-to-all), sharded weights (--zero-level 3, the master offloaded) and expert parallelism (--expert-parallel
  2: each rank holds half the experts, the tokens exchanged; with and without sharded weights) train like one process
  on the same micro-batches (fp32), router fields included;
* a 2-rank checkpoint resumes bit for bit on 2 ranks and reshards onto one process.

The single-process reference takes the ranks' micro-batches as micro-steps of its own (the router losses are per
micro-batch, test_moe_trainer.py says why). Tolerances as there (fp32 sums in another order): losses and norms to
2e-5 relative, weights within 1e-3 of each tensor's update; expert loads are counts: equal exactly.
"""
from __future__ import annotations

import io
import os

import pytest
import torch

from qtrain.observe.log import RunLogger
from qtrain.options import Options
from qtrain.parallel.dist import DistContext
from qtrain.train import checkpointing
from qtrain.train.router_metrics import STEP_FIELDS
from qtrain.train.trainer import Trainer
from tests.dist_utils import run_distributed, write_model_dir
from tests.model.family_fixtures import qwen35_cfg as tiny_cfg

CFG = tiny_cfg(moe=True, vocab_size=96, hidden_size=32, num_hidden_layers=2, head_dim=16,
               layer_types=("linear_attention", "full_attention"), bos_token_id=0, eos_token_id=0,
               max_position_embeddings=64, router_aux_loss_coef=0.05)
B, T, GA, STEPS, CKPT_AT, LR, W = 2, 16, 2, 2, 1, 3e-3, 2
RUNS = {"unsharded": dict(), "reduce-scatter": dict(shard_gradients=True, offload_opt_m=True, offload_opt_v=True,
                                                      offload_gradients=True),
        "all-to-all": dict(shard_gradients=True, all_to_all_reduce=True),
        "expert-parallel": dict(expert_parallel=2), "zero3": dict(zero_level=3, offload_master=True),
        "expert-parallel-zero3": dict(expert_parallel=2, zero_level=3)}
CPU = torch.device("cpu")


def options(model_dir: str, *, ga: int = GA, **kw) -> Options:
    return Options(model=model_dir, from_scratch=True, device="cpu", compile="off", seed=5, model_dtype="fp32",
                   opt_m_dtype="fp32", opt_v_dtype="fp32", batch_size=B, seq_len=T, grad_accumulation=ga,
                   learning_rate=LR, router_z_loss=0.01, **kw)


def micro_batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100_003 * step + 1009 * micro + 17 * rank + 1)
    seq = torch.randint(0, CFG.vocab_size, (B, T + 1), generator=gen)
    inputs, targets = seq[:, :-1].clone(), seq[:, 1:].clone()
    targets[torch.rand(B, T, generator=gen) < 1 / 6] = -100
    return inputs, targets


def valid(step: int) -> int:
    return sum(int((micro_batch(step, m, r)[1] != -100).sum()) for m in range(GA) for r in range(W))


def run_steps(tr: Trainer, steps: range, ranks: list[int]) -> list[dict]:
    out = []
    for s in steps:
        for m in range(GA):
            for r in ranks:
                tr.micro_step(*micro_batch(s, m, r), loss_scale=tr.ctx.world / valid(s))
        stats = tr.update(lr=LR)
        out.append({**stats, "weights": {n: p.float().clone() for n, p in tr.full_params().items()}})
    return out


class _LoaderState:
    def state_dict(self) -> dict:
        return {}


def _worker(rank: int, world: int, model_dir: str, work_dir: str) -> dict:
    ctx = DistContext(rank=rank, world=world, local_rank=rank, device=CPU)
    out: dict = {"runs": {}}
    if rank == 0:
        ref = Trainer(options(model_dir, ga=GA * W), DistContext(rank=0, world=1, local_rank=0, device=CPU))
        out["w0"] = {n: p.float().clone() for n, p in ref.full_params().items()}
        out["ref"] = run_steps(ref, range(STEPS), list(range(W)))
    for name, kw in RUNS.items():
        tr = Trainer(options(model_dir, **kw), ctx)
        steps = run_steps(tr, range(CKPT_AT), [rank])
        if name == "reduce-scatter":
            log = RunLogger(None, rank=rank, stream=io.StringIO())
            out["checkpoint"] = checkpointing.save(os.path.join(work_dir, "ckpt"), tr, _LoaderState(), log)
        out["runs"][name] = steps + run_steps(tr, range(CKPT_AT, STEPS), [rank])
    tr = Trainer(options(model_dir, **RUNS["reduce-scatter"]), ctx)
    assert checkpointing.load(out["checkpoint"], tr, train_loader=None, logger=None) == CKPT_AT
    out["resumed"] = run_steps(tr, range(CKPT_AT, STEPS), [rank])
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("qwen35_model"), CFG)


@pytest.fixture(scope="module")
def dist_runs(model_dir, tmp_path_factory):
    return run_distributed(_worker, W, model_dir, str(tmp_path_factory.mktemp("qwen35_dist")))


def _like(steps: list[dict], ref: list[dict], w0: dict, first: int = 0) -> None:
    for s, (a, r) in enumerate(zip(steps, ref[first:]), start=first):
        for k in ("loss", "norm", "aux_loss", "router_z_loss"):
            assert a[k] == pytest.approx(r[k], rel=2e-5), f"step {s} {k}"
        for k in ("expert_load_min", "expert_load_mean", "expert_load_max"):
            assert a[k] == r[k], f"step {s} {k}"
    final, want = steps[-1]["weights"], ref[-1]["weights"]
    for k in want:
        err, upd = float((final[k] - want[k]).norm()), float((want[k] - w0[k]).norm())
        assert err <= 1e-3 * upd, f"{k}: ||w - w_ref|| = {err:.3g}, update {upd:.3g}"


@pytest.mark.parametrize("name", list(RUNS))
def test_gradient_managers_train_like_one_process(dist_runs, name):
    ref, w0 = dist_runs[0]["ref"], dist_runs[0]["w0"]
    assert any(k.endswith("A_log") for k in w0) and any(k.endswith("q_norm") for k in w0)  # both kinds of layer
    for r in range(W):
        _like(dist_runs[r]["runs"][name], ref, w0)
        assert all(torch.equal(a, b) for a, b in zip(dist_runs[r]["runs"][name][-1]["weights"].values(),
                                                     dist_runs[0]["runs"][name][-1]["weights"].values()))


def test_resume_is_bitwise_and_reshards_onto_one_process(dist_runs, model_dir):
    for r in range(W):
        full = dist_runs[r]["runs"]["reduce-scatter"][CKPT_AT:]
        for a, b in zip(dist_runs[r]["resumed"], full):
            assert all(a[k] == b[k] for k in ("loss", "norm", *STEP_FIELDS))
            assert all(torch.equal(a["weights"][n], b["weights"][n]) for n in a["weights"])
    tr = Trainer(options(model_dir, ga=GA * W), DistContext(rank=0, world=1, local_rank=0, device=CPU))
    assert checkpointing.load(dist_runs[0]["checkpoint"], tr, train_loader=None, logger=None) == CKPT_AT
    _like(run_steps(tr, range(CKPT_AT, STEPS), list(range(W))), dist_runs[0]["ref"], dist_runs[0]["w0"],
          first=CKPT_AT)
