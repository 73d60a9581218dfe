"""Expert parallelism (`--expert-parallel`, parallel/experts.py) on gloo: an MoE model (Qwen3-MoE layout, a routed
and a dense layer, 8 experts) trained with its experts spread over 2 or 4 ranks equals one process on the same global
batch (fp32: losses, norms, router fields, every updated weight), with the three gradient managers and world = dp x ep
(4 ranks as 2 x 2); each rank holds only its experts; a checkpoint resumes bit for bit, and under another
--expert-parallel (on the same ranks, or in one process) it is resharded: the loaded weights and Adam m and v are the
saved ones bit for bit (compared as whole tensors), and the next step equals the run that never stopped within the fp32
tolerance below (the expert gradients are reduced in another order: one rank's GEMM over both token groups' rows
versus each rank's own rows summed by the all-reduce); `qtrain export` of it reassembles every expert; `qtrain train
--gpus 2 --expert-parallel 2` runs from the command line.

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
from qtrain.train.router_metrics import STEP_FIELDS
from qtrain.train.trainer import Trainer
from tests.dist_utils import run_distributed, write_model_dir
from tests.parallel.test_expert_reshard import whole_of
from tests.run_utils import make_run_root, train_argv
from tests.train.test_moe_trainer import CFG, _LoaderState, micro_batch

GA, STEPS, LR = 2, 2, 3e-3
CPU = torch.device("cpu")
# world -> the runs: (expert parallel, gradient manager, host offload of gradients and optimizer state)
RUNS = {2: ((2, "unsharded", False), (2, "reduce-scatter", True)),
        4: ((4, "all-to-all", False), (2, "unsharded", False), (2, "all-to-all", True))}
CHECKPOINTED = {2: 0, 4: 1}  # which run saves a checkpoint after its first step and is resumed from it
RESHARDED = {2: (1,), 4: (4, 1)}  # the other --expert-parallel that resumes it on the same ranks


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
    out: dict = {"runs": [], "held": [], "model_dir": model_dir}
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
    out["other_ep"] = {}
    for ep in RESHARDED[world]:  # another --expert-parallel: resharded
        tr = Trainer(options(model_dir, ep=ep), ctx)
        assert checkpointing.load(out["checkpoint"], tr, train_loader=None, logger=None) == 1
        out["other_ep"][ep] = {"state": state_of(tr), "steps": run_steps(tr, range(1, STEPS), [rank], world)}
    return out


def state_of(tr: Trainer) -> dict[str, dict[str, torch.Tensor]]:
    return {kind: {k: t.clone() for k, t in tensors.items()} for kind, tensors in tr.state_tensors().items()}


def saved_whole(path: str) -> dict[str, dict[str, torch.Tensor]]:
    """Every state kind of a checkpoint as whole tensors (all experts), from its files."""
    from safetensors.torch import load_file
    from qtrain.train.checkpoint_checks import STATE_KINDS, checkpoint_layout, shard_stem
    from qtrain.train.checkpoint_io import read_checkpoint
    meta, _ = read_checkpoint(path)
    layout = checkpoint_layout(CFG, meta)
    return {kind: whole_of(layout, [load_file(os.path.join(path, shard_stem(kind, q, layout.world) + ".safetensors"))
                                    for q in range(layout.world)]) for kind in STATE_KINDS}


def assert_same_state(path: str, layout_world: int, ep: int, states: list[dict]) -> None:
    """The states loaded by `layout_world` ranks with `ep` are the checkpoint's, bit for bit, tensor by tensor."""
    from qtrain.parallel.layout import FlatLayout
    layout = FlatLayout(CFG, layout_world, expert_parallel=ep)
    saved = saved_whole(path)
    for kind, want in saved.items():
        got = whole_of(layout, [s[kind] for s in states])
        assert got.keys() == want.keys()
        for name in want:
            assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), (kind, name, ep)


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


def test_resume_is_bitwise_and_another_expert_parallel_is_resharded(world_runs):
    world, res = world_runs
    ckpt = res[0]["checkpoint"]
    for r in range(world):
        full = res[r]["runs"][CHECKPOINTED[world]][1:]
        for a, b in zip(res[r]["resumed"], full):
            assert all(a[k] == b[k] for k in ("loss", "norm", *STEP_FIELDS))
            assert all(torch.equal(a["weights"][n], b["weights"][n]) for n in a["weights"])
    w1 = res[0]["runs"][CHECKPOINTED[world]][0]["weights"]  # the checkpoint's weights: the update is from there
    for ep in RESHARDED[world]:
        assert_same_state(ckpt, world, ep, [res[r]["other_ep"][ep]["state"] for r in range(world)])
        for r in range(world):
            _like(res[r]["other_ep"][ep]["steps"], res[r]["runs"][CHECKPOINTED[world]][1:], w1)


def test_an_expert_parallel_checkpoint_resumes_in_one_process(world_runs):
    """The checkpoint of 2 (EP 2) or 4 (2 x 2) ranks, resumed by one process without expert parallelism: the state
    is the saved one bit for bit; the next step (all ranks' micro-batches) equals the run that never stopped."""
    world, res = world_runs
    ckpt = res[0]["checkpoint"]
    tr = Trainer(options(res[0]["model_dir"], ga=GA * world), DistContext(rank=0, world=1, local_rank=0, device=CPU))
    assert checkpointing.load(ckpt, tr, train_loader=None, logger=None) == 1
    assert_same_state(ckpt, 1, 1, [state_of(tr)])
    _like(run_steps(tr, range(1, STEPS), list(range(world)), world), res[0]["runs"][CHECKPOINTED[world]][1:],
          res[0]["runs"][CHECKPOINTED[world]][0]["weights"])


def test_export_of_an_expert_parallel_checkpoint_holds_every_expert(world_runs):
    """`qtrain export` reassembles the experts from every rank's shards: the weights of the checkpointed step."""
    from qtrain.train.export import checkpoint_params
    world, res = world_runs
    _, params, _ = checkpoint_params(res[0]["checkpoint"])
    want = res[0]["runs"][CHECKPOINTED[world]][0]["weights"]
    assert params.keys() == want.keys() and all(torch.equal(params[k].float(), want[k]) for k in want)


def test_qtrain_train_gpus_2_expert_parallel_2_on_the_cpu(tmp_path):
    """The command line: two gloo workers, each with 4 of the 8 experts; the run trains, logs its routers, and its
    export holds every expert; `--continue` in one process without --expert-parallel resumes it, and its checkpoint
    resumes on 2 ranks with --expert-parallel 2."""
    import json
    root = make_run_root(tmp_path)
    (root / "model" / "config.json").write_text(json.dumps(CFG.to_hf_dict()))
    assert main(train_argv(root, name="ep", steps=3, extra=("--gpus", "2", "--expert-parallel", "2"))) == 0
    steps = [e for e in read_log(root / "logs" / "ep.jsonl") if e["log"] == "step"]
    assert [e["step"] for e in steps] == [0, 1, 2] and all("aux_loss" in e for e in steps)
    from safetensors.torch import load_file
    tensors = load_file(root / "out" / "ep" / "model.safetensors")
    assert all(f"model.layers.0.mlp.experts.{e}.up_proj.weight" in tensors for e in range(CFG.num_experts))
    # --continue in one process without expert parallelism (the same global batch): resharded, and it trains on
    assert main(train_argv(root, name="ep", steps=5, grad_accumulation=2, extra=("--continue", ""))) == 0
    log = read_log(root / "logs" / "ep.jsonl")
    assert any("resharded" in e.get("message", "") and "--expert-parallel 2 -> 1" in e["message"] for e in log)
    assert [e["step"] for e in log if e["log"] == "step"][-2:] == [3, 4]
    # and back: the one-process checkpoint resumed on 2 ranks with --expert-parallel 2
    assert main(train_argv(root, name="ep", steps=6, extra=("--gpus", "2", "--expert-parallel", "2", "--continue",
                                                            ""))) == 0
    log = read_log(root / "logs" / "ep.jsonl")
    assert any("--expert-parallel 1 -> 2" in e.get("message", "") for e in log)
    assert [e["step"] for e in log if e["log"] == "step"][-1] == 5


def _resume_on_four(rank: int, world: int, model_dir: str, ckpt: str) -> dict:
    """The 2-rank (EP 2) checkpoint resumed on 4 ranks with --expert-parallel 4 and 2 (2 x 2): the global batch of its
    next step (2 ranks x GA micro-batches) is one micro-batch per rank."""
    ctx = DistContext(rank=rank, world=world, local_rank=rank, device=CPU)
    out = {}
    for ep in (4, 2):
        tr = Trainer(options(model_dir, ep=ep, ga=1), ctx)
        assert checkpointing.load(ckpt, tr, train_loader=None, logger=None) == 1
        state = state_of(tr)
        valid = sum(int((micro_batch(1, m, r)[1] != -100).sum()) for m in range(GA) for r in range(2))
        tr.micro_step(*micro_batch(1, rank // 2, rank % 2), loss_scale=world / valid)
        stats = tr.update(lr=LR)
        out[ep] = {"state": state, "steps": [{**stats, "weights": {n: p.float().clone()
                                                                   for n, p in tr.full_params().items()}}]}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world_runs", [2], indirect=True)
def test_a_two_rank_expert_parallel_checkpoint_resumes_on_four_ranks(world_runs):
    _, res = world_runs
    ckpt = res[0]["checkpoint"]
    four = run_distributed(_resume_on_four, 4, res[0]["model_dir"], ckpt)
    full = res[0]["runs"][CHECKPOINTED[2]]
    for ep in (4, 2):
        assert_same_state(ckpt, 4, ep, [four[r][ep]["state"] for r in range(4)])
        for r in range(4):
            _like(four[r][ep]["steps"], full[1:], full[0]["weights"])
