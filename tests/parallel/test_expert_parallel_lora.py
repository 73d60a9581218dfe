"""LoRA under expert parallelism (`--lora-rank R --expert-parallel N`, attention targets): the experts are frozen and
spread over the ranks as without LoRA, the adapters replicated. On 2 gloo ranks (fp32) the adapters trained with EP 2,
and with EP 2 over sharded weights (--zero-level 3), equal one process on the same global batch, a checkpoint resumes
bit for bit, and an expert target (gate, up, down adapt an MoE model's experts) is refused in one line.

The reference takes the ranks' micro-batches as micro-steps of its own (tests/parallel/test_expert_parallel.py says
why). Tolerances as there: fp32 sums in another order, losses and norms to 2e-5 relative, each adapter within 1e-3 of
its update (the base never moves: compared exactly).
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
from qtrain.train.trainer import Trainer
from tests.dist_utils import run_distributed, write_model_dir
from tests.parallel.test_expert_parallel import _LoaderState, run_steps
from tests.train.test_moe_trainer import CFG

GA, STEPS, LR, W = 2, 2, 3e-3, 2
CPU = torch.device("cpu")
RUNS = {"ep2": dict(expert_parallel=2), "ep2-zero3": dict(expert_parallel=2, zero_level=3)}


def options(model_dir: str, *, ga: int = GA, **kw) -> Options:
    return Options(model=model_dir, from_scratch=True, device="cpu", compile="off", seed=5, model_dtype="fp32",
                   opt_m_dtype="fp32", opt_v_dtype="fp32", batch_size=2, seq_len=16, grad_accumulation=ga,
                   learning_rate=LR, router_z_loss=0.01, lora_rank=4, lora_alpha=8.0, lora_targets="q,k,v,o", **kw)


def _full(tr: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.float().clone() for n, p in tr.full_params().items()}


def _worker(rank: int, world: int, model_dir: str, work_dir: str) -> dict:
    ctx = DistContext(rank=rank, world=world, local_rank=rank, device=CPU)
    out: dict = {"runs": {}}
    if rank == 0:
        ref = Trainer(options(model_dir, ga=GA * world), DistContext(rank=0, world=1, local_rank=0, device=CPU))
        out["w0"] = _full(ref)
        out["ref"] = run_steps(ref, range(STEPS), list(range(world)), world)
        out["ref_w"] = _full(ref)
    for name, kw in RUNS.items():
        tr = Trainer(options(model_dir, **kw), ctx)
        steps = run_steps(tr, range(1), [rank], world)
        if name == "ep2":
            log = RunLogger(None, rank=rank, stream=io.StringIO())
            out["checkpoint"] = checkpointing.save(os.path.join(work_dir, "ckpt"), tr, _LoaderState(), log)
        steps += run_steps(tr, range(1, STEPS), [rank], world)
        out["runs"][name] = {"steps": steps, "w": _full(tr),
                             "adapters": {n: p.float().clone() for n, p in tr.full_params(trainable_only=True).items()},
                             "held": {n: tuple(p.shape) for n, p in tr.params.items() if "experts" in n}
                             if tr.params else {}}
    tr = Trainer(options(model_dir, **RUNS["ep2"]), ctx)
    assert checkpointing.load(out["checkpoint"], tr, train_loader=None, logger=None) == 1
    out["resumed"] = {"steps": run_steps(tr, range(1, STEPS), [rank], world), "w": _full(tr)}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = write_model_dir(tmp_path_factory.mktemp("ep-lora-model"), CFG)
    return run_distributed(_worker, W, d, str(tmp_path_factory.mktemp("ep-lora")))


@pytest.mark.parametrize("name", list(RUNS))
def test_adapters_train_like_one_process(runs, name):
    ref, w0, want = runs[0]["ref"], runs[0]["w0"], runs[0]["ref_w"]
    for r in range(W):
        got = runs[r]["runs"][name]
        for s, (a, b) in enumerate(zip(got["steps"], ref)):
            for k in ("loss", "norm", "aux_loss", "router_z_loss"):
                assert a[k] == pytest.approx(b[k], rel=2e-5), f"rank {r} step {s} {k}"
        adapters = [n for n in want if "_lora_" in n]
        assert adapters and all(n.split(".")[-1].startswith(("q", "k", "v", "o")) for n in adapters)
        for n, v in got["w"].items():
            if n in adapters:
                err, upd = float((v - want[n]).norm()), float((want[n] - w0[n]).norm())
                assert upd > 0 and err <= 1e-3 * upd, f"{n}: {err:.3g} against an update of {upd:.3g}"
            else:  # the base, the experts included (reassembled from both ranks), never moves
                assert torch.equal(v, w0[n]), n
        # what an adapter export gathers (trainable groups only): exactly the adapters, equal to the full set's
        assert sorted(got["adapters"]) == sorted(adapters)
        assert all(torch.equal(got["adapters"][n], got["w"][n]) for n in adapters)
    if name == "ep2":  # each rank holds half of the experts
        held = runs[0]["runs"][name]["held"]
        assert held and all(shape[0] == CFG.num_experts // 2 for n, shape in held.items() if n.endswith("up_gate"))


def test_resume_is_bitwise(runs):
    for r in range(W):
        got, want = runs[r]["resumed"], runs[r]["runs"]["ep2"]
        assert [(s["loss"], s["norm"]) for s in got["steps"]] == [(s["loss"], s["norm"]) for s in want["steps"][1:]]
        assert all(torch.equal(got["w"][n], want["w"][n]) for n in want["w"])


def test_expert_targets_are_refused_in_one_line():
    from qtrain.model.lora.checks import spec_from_options
    from qtrain.model.lora.spec import LoraError
    with pytest.raises(LoraError, match=r"--lora-rank with --expert-parallel 2: targets gate,up,down adapt the experts"):
        spec_from_options({"lora_rank": 4, "expert_parallel": 2}, CFG)
    assert spec_from_options({"lora_rank": 4, "expert_parallel": 2, "lora_targets": "q,o"}, CFG) is not None
