"""Expert parallelism (`--expert-parallel`, parallel/experts.py) on gloo: an MoE model (Qwen3-MoE layout, a routed
and a dense layer, 8 experts) trained with its experts spread over 2 or 4 ranks equals one process on the same global
batch (fp32: losses, norms, router fields, every updated weight), with the three gradient managers and world = dp x ep
(4 ranks as 2 x 2); each rank holds only its experts; a checkpoint resumes bit for bit and is refused by a run of
another --expert-parallel; `qtrain export` of it reassembles every expert; `qtrain train --gpus 2 --expert-parallel 2`
runs from the command line.

The reference (one process) takes the W ranks' micro-batches as W x GA micro-steps of its own (the router losses are
per micro-batch, tests/train/test_moe_trainer.py). Tolerances as there: fp32 sums in another order (an expert's
rows arrive grouped by source rank), losses and norms to 2e-5 relative, weights within 1e-3 of each tensor's update;
expert loads are counts: equal exactly.
"""
from __future__ import annotations

import io
import os

import pytest
import torch

from qtrain.cli.main import main
from qtrain.observe.log import RunLogger, read_log
from qtrain.options import Options
from qtrain.parallel.dist import DistContext
from qtrain.train import checkpointing
from qtrain.train.checkpoint_io import CheckpointError
from qtrain.train.router_metrics import STEP_FIELDS
from qtrain.train.trainer import Trainer
from tests.dist_utils import run_distributed, write_model_dir
from tests.run_utils import make_run_root, train_argv
from tests.train.test_moe_trainer import CFG, _LoaderState, micro_batch

GA, STEPS, LR = 2, 2, 3e-3
CPU = torch.device("cpu")
# world -> the runs: (expert parallel, gradient manager, host offload of gradients and optimizer state)
RUNS = {2: ((2, "unsharded", False), (2, "reduce-scatter", True)),
        4: ((4, "all-to-all", False), (2, "unsharded", False), (2, "all-to-all", True))}
CHECKPOINTED = {2: 0, 4: 1}  # which run saves a checkpoint after its first step and is resumed from it


def options(model_dir: str, *, ep: int = 1, kind: str = "unsharded", offload: bool = False, ga: int = GA) -> Options:
    return Options(model=model_dir, from_scratch=True, device="cpu", compile="off", seed=5, model_dtype="fp32",
                   opt_m_dtype="fp32", opt_v_dtype="fp32", batch_size=2, seq_len=16, grad_accumulation=ga,
                   learning_rate=LR, shard_gradients=kind != "unsharded", all_to_all_reduce=kind == "all-to-all",
                   offload_opt_m=offload, offload_opt_v=offload, offload_gradients=offload and kind != "unsharded",
                   router_z_loss=0.01, expert_parallel=ep)


def run_steps(tr: Trainer, steps: range, ranks: list[int], world: int) -> list[dict]:
    """`steps` of micro-batches (step, m, r) for m < GA and r in `ranks`, the loss scale of the whole step."""
    out = []
    for s in steps:
        valid = sum(int((micro_batch(s, m, r)[1] != -100).sum()) for m in range(GA) for r in range(world))
        for m in range(GA):
            for r in ranks:
                tr.micro_step(*micro_batch(s, m, r), loss_scale=tr.ctx.world / valid)
        stats = tr.update(lr=LR)
        out.append({**stats, "weights": {n: p.float().clone() for n, p in tr.full_params().items()}})
    return out


def _worker(rank: int, world: int, model_dir: str, work_dir: str) -> dict:
    ctx = DistContext(rank=rank, world=world, local_rank=rank, device=CPU)
    out: dict = {"runs": [], "held": []}
    if rank == 0:
        ref = Trainer(options(model_dir, ga=GA * world), DistContext(rank=0, world=1, local_rank=0, device=CPU))
        out["w0"] = {n: p.float().clone() for n, p in ref.full_params().items()}
        out["ref"] = run_steps(ref, range(STEPS), list(range(world)), world)
    for i, (ep, kind, offload) in enumerate(RUNS[world]):
        tr = Trainer(options(model_dir, ep=ep, kind=kind, offload=offload), ctx)
        out["held"].append({n: tuple(p.shape) for n, p in tr.params.items() if "experts" in n})
        steps = run_steps(tr, range(1), [rank], world)
        if i == CHECKPOINTED[world]:
            log = RunLogger(None, rank=rank, stream=io.StringIO())
            out["checkpoint"] = checkpointing.save(os.path.join(work_dir, "ckpt"), tr, _LoaderState(), log)
        out["runs"].append(steps + run_steps(tr, range(1, STEPS), [rank], world))
    ep, kind, offload = RUNS[world][CHECKPOINTED[world]]
    tr = Trainer(options(model_dir, ep=ep, kind=kind, offload=offload), ctx)
    assert checkpointing.load(out["checkpoint"], tr, train_loader=None, logger=None) == 1
    out["resumed"] = run_steps(tr, range(1, STEPS), [rank], world)
    try:  # another --expert-parallel (here: none) cannot take the experts' shards
        checkpointing.load(out["checkpoint"], Trainer(options(model_dir), ctx), train_loader=None, logger=None)
        out["other_ep"] = None
    except CheckpointError as e:
        out["other_ep"] = str(e)
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("ep_model"), CFG)


@pytest.fixture(scope="module", params=sorted(RUNS))
def world_runs(request, model_dir, tmp_path_factory):
    world = request.param
    return world, run_distributed(_worker, world, model_dir, str(tmp_path_factory.mktemp(f"ep{world}")))


def _like(steps: list[dict], ref: list[dict], w0: dict) -> None:
    for s, (a, r) in enumerate(zip(steps, ref)):
        for k in ("loss", "norm", "aux_loss", "router_z_loss"):
            assert a[k] == pytest.approx(r[k], rel=2e-5), f"step {s} {k}"
        for k in ("expert_load_min", "expert_load_mean", "expert_load_max"):
            assert a[k] == r[k], f"step {s} {k}"
    final, want = steps[-1]["weights"], ref[-1]["weights"]
    assert final.keys() == want.keys()
    for k in want:
        err, upd = float((final[k] - want[k]).norm()), float((want[k] - w0[k]).norm())
        assert err <= 1e-3 * upd, f"{k}: ||w - w_ref|| = {err:.3g}, update {upd:.3g}"


def test_expert_parallel_trains_like_one_process(world_runs):
    world, res = world_runs
    ref, w0 = res[0]["ref"], res[0]["w0"]
    for i, (ep, kind, _) in enumerate(RUNS[world]):
        for r in range(world):
            # each rank holds E/ep experts of every stack; full_params gathers all of them
            assert all(shape[0] == CFG.num_experts // ep for shape in res[r]["held"][i].values())
            _like(res[r]["runs"][i], ref, w0)
            assert all(torch.equal(a, b) for a, b in zip(res[r]["runs"][i][-1]["weights"].values(),
                                                         res[0]["runs"][i][-1]["weights"].values())), (ep, kind)


def test_resume_is_bitwise_and_another_expert_parallel_is_refused(world_runs):
    world, res = world_runs
    for r in range(world):
        full = res[r]["runs"][CHECKPOINTED[world]][1:]
        for a, b in zip(res[r]["resumed"], full):
            assert all(a[k] == b[k] for k in ("loss", "norm", *STEP_FIELDS))
            assert all(torch.equal(a["weights"][n], b["weights"][n]) for n in a["weights"])
        ep = RUNS[world][CHECKPOINTED[world]][0]
        assert f"written with --expert-parallel {ep} on {world} rank(s), this run has --expert-parallel 1" in \
            res[r]["other_ep"]


def test_export_of_an_expert_parallel_checkpoint_holds_every_expert(world_runs):
    """`qtrain export` reassembles the experts from every rank's shards: the weights of the checkpointed step."""
    from qtrain.train.export import checkpoint_params
    world, res = world_runs
    _, params, _ = checkpoint_params(res[0]["checkpoint"])
    want = res[0]["runs"][CHECKPOINTED[world]][0]["weights"]
    assert params.keys() == want.keys() and all(torch.equal(params[k].float(), want[k]) for k in want)


def test_qtrain_train_gpus_2_expert_parallel_2_on_the_cpu(tmp_path):
    """The command line: two gloo workers, each with 4 of the 8 experts; the run trains, logs its routers, and its
    export holds every expert."""
    import json
    root = make_run_root(tmp_path)
    (root / "model" / "config.json").write_text(json.dumps(CFG.to_hf_dict()))
    assert main(train_argv(root, name="ep", steps=3, extra=("--gpus", "2", "--expert-parallel", "2"))) == 0
    steps = [e for e in read_log(root / "logs" / "ep.jsonl") if e["log"] == "step"]
    assert [e["step"] for e in steps] == [0, 1, 2] and all("aux_loss" in e for e in steps)
    from safetensors.torch import load_file
    tensors = load_file(root / "out" / "ep" / "model.safetensors")
    assert all(f"model.layers.0.mlp.experts.{e}.up_proj.weight" in tensors for e in range(CFG.num_experts))
