"""An MoE model (Qwen3-MoE layout: a routed and a dense layer) through the Trainer's machinery, as
tests/train/test_trainer_distributed.py runs the dense families:

* the three gradient managers on 2 gloo ranks (unsharded, reduce-scatter, all-to-all; one of them with the optimizer
  state and the gradient shards offloaded to the host) train like one process on the same micro-batches (fp32),
  router fields included;
* a 2-rank checkpoint resumes bit for bit on 2 ranks and reshards onto one process;
* bf16 weights with stochastic rounding train, close to fp32;
* `qtrain train` logs the router fields every step, a run continued from its checkpoint repeats the steps, router
  fields included, bit for bit, and `qtrain plot` draws them.

The router losses are per micro-batch (transformers' loss of one forward), weighted 1 / grad_accumulation: so the
single-process reference takes the W ranks' micro-batches as W x GA micro-steps of its own (not concatenated, which
would be another load-balancing loss) -- then both optimise the same objective.
Tolerances as in test_trainer_distributed.py (fp32 sums in another order): losses and norms to 2e-5 relative,
weights within 1e-3 of each tensor's update; the routing is the same on both sides at these margins (a flipped top-k
choice would move the norms by far more). Expert loads are counts: equal exactly.
"""
from __future__ import annotations

import io
import json
import math
import os

import pytest
import torch

from qtrain.cli.main import main
from qtrain.model.qwen3_moe import Qwen3MoeConfig
from qtrain.observe.log import RunLogger, read_log
from qtrain.options import Options
from qtrain.parallel.dist import DistContext
from qtrain.train import checkpointing
from qtrain.train.router_metrics import STEP_FIELDS
from qtrain.train.trainer import Trainer
from tests.dist_utils import run_distributed, write_model_dir
from tests.run_utils import make_run_root, train_argv

CFG = Qwen3MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                     rope_theta=10000.0, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                     mlp_only_layers=(1,), router_aux_loss_coef=0.05, bos_token_id=0, eos_token_id=0)
B, T, GA, STEPS, CKPT_AT, LR, W = 2, 16, 2, 2, 1, 3e-3, 2
MANAGERS = (("unsharded", False), ("reduce-scatter", True), ("all-to-all", False))  # True: host offload (m, v, grads)
CPU = torch.device("cpu")


def options(model_dir: str, dtype: str = "fp32", kind: str = "unsharded", offload: bool = False, *,
            ga: int = GA) -> Options:
    return Options(model=model_dir, from_scratch=True, device="cpu", compile="off", seed=5, model_dtype=dtype,
                   opt_m_dtype=dtype, opt_v_dtype=dtype, batch_size=B, seq_len=T, grad_accumulation=ga,
                   learning_rate=LR, shard_gradients=kind != "unsharded", all_to_all_reduce=kind == "all-to-all",
                   offload_opt_m=offload, offload_opt_v=offload, offload_gradients=offload and kind != "unsharded",
                   router_z_loss=0.01)


def micro_batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100_003 * step + 1009 * micro + 17 * rank + 1)
    seq = torch.randint(0, CFG.vocab_size, (B, T + 1), generator=gen)
    inputs, targets = seq[:, :-1].clone(), seq[:, 1:].clone()
    targets[torch.rand(B, T, generator=gen) < 1 / 6] = -100
    return inputs, targets


def valid(step: int) -> int:
    return sum(int((micro_batch(step, m, r)[1] != -100).sum()) for m in range(GA) for r in range(W))


def run_steps(tr: Trainer, steps: range, ranks: list[int]) -> list[dict]:
    """`steps` of micro-batches (step, m, r) for m < GA and r in `ranks` (this process's share), the loss scale of
    the whole step over W ranks."""
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
    if rank == 0:  # the single-process reference: the ranks' micro-batches as micro-steps of its own
        solo = DistContext(rank=0, world=1, local_rank=0, device=CPU)
        ref = Trainer(options(model_dir, ga=GA * W), solo)
        out["w0"] = {n: p.float().clone() for n, p in ref.full_params().items()}
        out["ref"] = run_steps(ref, range(STEPS), list(range(W)))
    for kind, offload in MANAGERS:
        tr = Trainer(options(model_dir, kind=kind, offload=offload), ctx)
        steps = run_steps(tr, range(CKPT_AT), [rank])
        if kind == "reduce-scatter":
            log = RunLogger(None, rank=rank, stream=io.StringIO())
            out["checkpoint"] = checkpointing.save(os.path.join(work_dir, "ckpt"), tr, _LoaderState(), log)
        out["runs"][kind] = steps + run_steps(tr, range(CKPT_AT, STEPS), [rank])
    tr = Trainer(options(model_dir, kind="reduce-scatter", offload=True), ctx)
    assert checkpointing.load(out["checkpoint"], tr, train_loader=None, logger=None) == CKPT_AT
    out["resumed"] = run_steps(tr, range(CKPT_AT, STEPS), [rank])
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("moe_model"), CFG)


@pytest.fixture(scope="module")
def dist_runs(model_dir, tmp_path_factory):
    return run_distributed(_worker, W, model_dir, str(tmp_path_factory.mktemp("moe_dist")))


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


@pytest.mark.parametrize("kind", [m for m, _ in MANAGERS])
def test_gradient_managers_train_like_one_process(dist_runs, kind):
    ref, w0 = dist_runs[0]["ref"], dist_runs[0]["w0"]
    assert ref[0]["expert_load_mean"] == B * T * W * GA * CFG.num_experts_per_tok / CFG.num_experts
    for r in range(W):
        _like(dist_runs[r]["runs"][kind], ref, w0)
        assert all(torch.equal(a, b) for a, b in zip(dist_runs[r]["runs"][kind][-1]["weights"].values(),
                                                     dist_runs[0]["runs"][kind][-1]["weights"].values()))


def test_resume_is_bitwise_and_reshards_onto_one_process(dist_runs, model_dir):
    for r in range(W):
        full = dist_runs[r]["runs"]["reduce-scatter"][CKPT_AT:]
        for a, b in zip(dist_runs[r]["resumed"], full):
            assert all(a[k] == b[k] for k in ("loss", "norm", *STEP_FIELDS))
            assert all(torch.equal(a["weights"][n], b["weights"][n]) for n in a["weights"])
    # W -> 1: the 2-rank checkpoint (sharded gradients, offloaded optimizer state) in one process
    tr = Trainer(options(model_dir, ga=GA * W), DistContext(rank=0, world=1, local_rank=0, device=CPU))
    assert checkpointing.load(dist_runs[0]["checkpoint"], tr, train_loader=None, logger=None) == CKPT_AT
    _like(run_steps(tr, range(CKPT_AT, STEPS), list(range(W))), dist_runs[0]["ref"], dist_runs[0]["w0"],
          first=CKPT_AT)


def test_bf16_with_stochastic_rounding_trains(model_dir):
    """bf16 weights, gradients and Adam moments (stochastically rounded): the loss falls on a repeated batch as in
    fp32, step by step within bf16's precision of the chain (2^-6 relative; measured ~1e-3)."""
    losses = {}
    for dtype in ("fp32", "bf16"):
        tr = Trainer(options(model_dir, dtype, ga=1), DistContext(rank=0, world=1, local_rank=0, device=CPU))
        losses[dtype] = []
        for _ in range(6):
            x, y = micro_batch(0, 0, 0)
            tr.micro_step(x, y, loss_scale=1 / int((y != -100).sum()))
            stats = tr.update(lr=1e-2)
            assert all(math.isfinite(stats[k]) for k in ("loss", "norm", *STEP_FIELDS))
            losses[dtype].append(stats["loss"])
    assert losses["bf16"][-1] < losses["bf16"][0] - 0.2
    for a, b in zip(losses["bf16"], losses["fp32"]):
        assert a == pytest.approx(b, rel=2 ** -6)


def test_qtrain_train_logs_the_routers_and_continues_bitwise(tmp_path):
    """The JSON log has the router fields every step, the console its router line every --log-router-every steps;
    `--continue 2` repeats steps 2 and 3 of the uninterrupted run bit for bit (losses, norms, router fields, the
    exported weights), with --recompute-block and bf16 weights; `qtrain plot` draws the routers."""
    root = make_run_root(tmp_path)
    (root / "model" / "config.json").write_text(json.dumps(CFG.to_hf_dict()))
    common = dict(steps=4, model_dtype="bf16", opt_m_dtype="bf16", opt_v_dtype="bf16", log_router_every=2,
                  router_z_loss=0.001, grad_accumulation=2, extra=("--recompute-block",))
    assert main(train_argv(root, name="full", **common)) == 0
    argv = train_argv(root, name="full", **common) + ["--continue", "2"]
    argv[argv.index("--log-file") + 1] = str(root / "logs" / "resumed.jsonl")
    argv[argv.index("--out-dir") + 1] = str(root / "out" / "resumed")
    assert main(argv) == 0
    full = {e["step"]: e for e in read_log(root / "logs" / "full.jsonl") if e["log"] == "step"}
    resumed = {e["step"]: e for e in read_log(root / "logs" / "resumed.jsonl") if e["log"] == "step"}
    assert sorted(full) == [0, 1, 2, 3] and sorted(resumed) == [2, 3]
    for s in resumed:
        assert all(resumed[s][k] == full[s][k] for k in ("loss", "norm", *STEP_FIELDS)), s
    assert full[0]["expert_load_mean"] == B * T * 2 * CFG.num_experts_per_tok / CFG.num_experts  # one MoE layer
    from safetensors.torch import load_file
    a = load_file(root / "out" / "full" / "model.safetensors")
    b = load_file(root / "out" / "resumed" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in a
    assert main(["plot", str(root / "logs" / "full.jsonl"), "--out", str(tmp_path / "plot.png")]) == 0
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_router_line_on_the_console_every_n_steps(capsys):
    log = RunLogger(None, stream=io.StringIO(), router_every=3)
    import sys
    log.stream = sys.stdout
    fields = dict(aux_loss=1.25, router_z_loss=3.5, expert_load_min=2.0, expert_load_mean=8.0, expert_load_max=15.0)
    for step in range(4):
        obj = log.log_step(step, step_tokens=64, duration_ms=10.0, norm=1.0, loss=2.0, lr=1e-3, **fields)
        assert obj["aux_loss"] == 1.25 and obj["expert_load_max"] == 15.0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[R]")]
    assert lines == ["[R] step     0 | aux loss   1.2500 | z-loss    3.500 | tokens/expert min 2 mean 8 max 15",
                     "[R] step     3 | aux loss   1.2500 | z-loss    3.500 | tokens/expert min 2 mean 8 max 15"]
