"""Data-parallel training through the Trainer API under real torch.distributed (gloo, 2 and 4 processes).

Every gradient manager ('unsharded' = ZeRO-1, the default; 'reduce-scatter' = --shard-gradients;
'all-to-all' = --shard-gradients --all-to-all-reduce; both sharded ones also with --offload-gradients)
trains a tiny from-scratch Qwen2-style model (untied head, QKV bias, 3 layers, awkward sizes so shards cut
through tensors) for STEPS optimizer steps of GA micro-steps, and is checked against a single process
that sees the same GLOBAL batch:

  rank r takes micro-batch (step, micro, r) of B sequences; the single process takes, per micro-step, the
  concatenation over ranks (B*W sequences). Targets are partly masked (-100) with counts that differ
  between ranks, so the per-rank default loss scale would be wrong; both sides pass the loop's scale:
  W / (valid targets of the whole step over all ranks) on W ranks (the managers average over ranks),
  1 / (the same count) on one process. Both then optimise the mean token loss of the same global batch.

Checks: the same losses, gradient norms and final weights as the single process (tolerances below);
identical weights on every rank after every step; the sharded state per rank is 1/W of the unsharded
(gradient manager `memory()`/`shard_nbytes()`, optimizer `state_nbytes()`); a 2- or 4-rank run resumed from
a checkpoint it wrote gives bit-identical losses, norms and weights to the uninterrupted run; one process
resumes it with the global batch (resharding) like the single process; --offload-gradients without sharding is
refused with a message that says why.

Everything of one world size runs in one spawn (process start-up dominates the cost); the single-process
references run on rank 0 of that spawn (one intra-op thread, like the ranks), before the others start.

Tolerances.
* fp32. The two sides compute the same sums in a different order (per-rank GEMMs over B*T tokens plus a
  cross-rank reduction vs one GEMM over W*B*T tokens; micro-step accumulation before or after the
  reduction). A loss is a sum of n <= W*B*T*GA = 256 positive per-token terms, so its reduction-order
  error is below (n-1)*2^-24 < 1.6e-5 relative; the gradient norm is a sum of positive squares too, of
  gradients whose own error is ~1e-7 of the norm: losses and norms match to 2e-5 relative (measured:
  <= 1e-7). Weights cannot be compared elementwise at that level: Adam divides each element by its own
  gradient RMS, so an element whose gradient nearly cancels over tokens (relative error ~u * sum|terms| /
  |sum|, unbounded in principle) moves differently by up to a fraction of lr. So the weights are compared
  per tensor in norm, against the size of the update itself: ||w - w_ref|| <= 1e-3 * ||w_ref - w0||
  (measured: <= 5e-5 for the worst tensor, ~5e-6 over all weights). A run whose gradients are not
  averaged over ranks (one rank's data only) is off by ~1 of the update (checked in bf16 below).
* bf16 (bf16 weights, gradients and Adam moments, all with stochastic rounding). Every bf16 rounding
  errs by < 1 ulp (<= 2^-7 relative; its RMS is <= 2^-8). The gradient of a micro-step is rounded once
  per rank in the backward (W partial sums instead of one), once more per hop of the cross-rank
  reduction, and at every SR accumulation over micro-steps; K <= GA*(W+2) roundings of zero-mean,
  uncorrelated error, so the gradient's relative RMS error is ~sqrt(K)*2^-8 <= ~1.4e-2 (W = 4), and
  gradient norms match to 3e-2 relative. SR of the weights and moments uses the same bits on both sides
  (keyed by step, tensor and element index, whatever the world size), so two runs whose pre-rounding
  values differ by d round apart by one ulp with probability |d|/ulp: rounding adds no error of its own
  in expectation, the difference stays of the order of the Adam update's sensitivity to that ~1e-2
  gradient error (larger where gradients cancel, as in fp32). An elementwise bound would have to allow
  each side's whole step (Adam moves an element by up to ~lr per step whatever its gradient), which a
  wrong run satisfies too, so the check is in norm, against the update:
  ||w - w_ref|| <= 0.2 * ||w_ref - w0|| over all weights (measured ~0.03 for W = 2 and 4), while a run
  that trains on one rank's share of the data (what every rank does when the reduction is missing) is off
  by >= 0.5 of the update (measured 0.9 for W = 2, 1.1 for W = 4): the bound sits well between the two.
  Norms match to 3e-2 (measured <= 1e-3; the wrong run: 0.39 for W = 2), losses to 2^-7 (measured 6e-5).
  (A sum over ranks where an average is due hardly moves Adam's weights, which are scale-invariant, but
  multiplies the norm by W: the norm checks catch it in both dtypes.)
The runs are deterministic (fixed data, seeds and thread counts) and the margins wide, so they do not flake.
"""
from __future__ import annotations

import io
import math
import os

import pytest
import torch

from tests.dist_utils import run_distributed
from qtrain.model.llama import LlamaConfig
from qtrain.parallel.dist import DistContext
from qtrain.parallel.gradients import OFFLOAD_NEEDS_SHARDING, make_gradient_manager
from qtrain.parallel.comm import Communicator
from qtrain.parallel.layout import FlatLayout
from qtrain.train import checkpointing
from qtrain.observe.log import RunLogger
from qtrain.options import Options, OptionsError
from qtrain.train.trainer import Trainer

CFG = LlamaConfig(model_type="qwen2", vocab_size=101, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0,
                  tie_word_embeddings=False, attention_bias=True, bos_token_id=None, eos_token_id=None)
B, T, GA, STEPS = 2, 16, 2, 3
CKPT_AT = 1  # the sharded runs write a checkpoint after this many steps and are resumed from it
LR = 3e-3
BETAS = (0.9, 0.95)
DTYPES = ("fp32", "bf16")
MANAGERS = (("unsharded", False), ("reduce-scatter", False), ("all-to-all", False),
            ("reduce-scatter", True), ("all-to-all", True))
CPU = torch.device("cpu")


def manager_id(m: tuple[str, bool]) -> str:
    return m[0] + ("+offload" if m[1] else "")


def options(model_dir: str, dtype: str, kind: str = "unsharded", offload: bool = False, *, batch: int = B) -> Options:
    low = "bf16" if dtype == "bf16" else "fp32"
    return Options(model=model_dir, from_scratch=True, device="cpu", compile="off", seed=5, model_dtype=dtype,
                   opt_m_dtype=low, opt_v_dtype=low, batch_size=batch, seq_len=T, grad_accumulation=GA,
                   learning_rate=LR, beta_1=BETAS[0], beta_2=BETAS[1], shard_gradients=kind != "unsharded",
                   all_to_all_reduce=kind == "all-to-all", offload_gradients=offload)


def micro_batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s micro-batch: random tokens, about 1/6 of the targets masked (a different count per rank)."""
    gen = torch.Generator().manual_seed(100_003 * step + 1009 * micro + 17 * rank + 1)
    seq = torch.randint(0, CFG.vocab_size, (B, T + 1), generator=gen)
    inputs, targets = seq[:, :-1].clone(), seq[:, 1:].clone()
    targets[torch.rand(B, T, generator=gen) < 1 / 6] = -100
    return inputs, targets


def step_batches(step: int, data_ranks: list[int]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
    """The GA micro-batches of one process holding the data of `data_ranks` (concatenated), and the
    number of valid targets of the whole step over `data_ranks`."""
    batches = []
    for m in range(GA):
        parts = [micro_batch(step, m, r) for r in data_ranks]
        batches.append((torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])))
    return batches, sum(int((y != -100).sum()) for _, y in batches)


def flat_weights(tr: Trainer) -> torch.Tensor:
    return torch.cat([tr.param_buffers[g.key].float() for g in tr.layout.groups])


def named_weights(tr: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.float().clone() for n, p in tr.full_params().items()}


def run_steps(tr: Trainer, steps: range, data_ranks: list[int], global_ranks: list[int]) -> list[dict]:
    """Train `steps`; this process holds `data_ranks`' data, the step's global batch is `global_ranks`'.
    The loss scale is the loop's: world / (valid targets of the global batch)."""
    out = []
    for s in steps:
        batches = step_batches(s, data_ranks)[0]
        valid = step_batches(s, global_ranks)[1]
        for x, y in batches:
            tr.micro_step(x, y, loss_scale=tr.ctx.world / valid)
        stats = tr.update(lr=LR)
        out.append({"loss": stats["loss"], "norm": stats["norm"], "weights": flat_weights(tr)})
    return out


class _LoaderState:
    """Stands in for the TokenLoader whose position a checkpoint records (these tests feed batches by hand)."""

    def state_dict(self) -> dict:
        return {}


def train(model_dir: str, ctx: DistContext, dtype: str, kind: str = "unsharded", offload: bool = False, *,
          data_ranks: list[int], global_ranks: list[int], ckpt_dir: str | None = None) -> dict:
    tr = Trainer(options(model_dir, dtype, kind, offload, batch=B * len(data_ranks)), ctx)
    rec = {"w0": named_weights(tr), "steps": []}
    if ckpt_dir is not None:
        rec["steps"] += run_steps(tr, range(CKPT_AT), data_ranks, global_ranks)
        log = RunLogger(None, rank=ctx.rank, total_steps=STEPS, stream=io.StringIO())
        rec["checkpoint"] = checkpointing.save(ckpt_dir, tr, _LoaderState(), log)
        rec["steps"] += run_steps(tr, range(CKPT_AT, STEPS), data_ranks, global_ranks)
    else:
        rec["steps"] += run_steps(tr, range(STEPS), data_ranks, global_ranks)
    rec["final"] = named_weights(tr)
    rec["memory"] = {"grads": tr.grads.memory(), "grads_total": tr.grads.shard_nbytes(),
                     "grads_device": tr.grads.footprint().device, "host_keys": tr.grads.host_memory_keys(),
                     "optimizer": tr.optimizer.state_nbytes()}
    return rec


def resume(model_dir: str, ctx: DistContext, dtype: str, kind: str, offload: bool, path: str,
           ranks: list[int]) -> dict:
    tr = Trainer(options(model_dir, dtype, kind, offload), ctx)
    start = checkpointing.load(path, tr, train_loader=None, logger=None)
    assert start == CKPT_AT
    return {"steps": run_steps(tr, range(start, STEPS), [ctx.rank], ranks), "final": named_weights(tr)}


def _worker(rank: int, world: int, model_dir: str, work_dir: str) -> dict:
    ranks = list(range(world))
    ctx = DistContext(rank=rank, world=world, local_rank=rank, device=CPU)
    out: dict = {"runs": {}, "resumed": {}}
    if rank == 0:  # the single-process references (the other ranks wait in their first collective)
        solo = DistContext(rank=0, world=1, local_rank=0, device=CPU)
        out["ref"] = {d: train(model_dir, solo, d, data_ranks=ranks, global_ranks=ranks) for d in DTYPES}
        out["wrong"] = {d: train(model_dir, solo, d, data_ranks=[0], global_ranks=[0]) for d in DTYPES}
    for dtype in DTYPES:
        for kind, offload in MANAGERS:
            key = (dtype, kind, offload)
            ckpt = os.path.join(work_dir, f"ckpt-{dtype}-{kind}-{int(offload)}") if kind != "unsharded" else None
            out["runs"][key] = train(model_dir, ctx, dtype, kind, offload, data_ranks=[rank], global_ranks=ranks,
                                     ckpt_dir=ckpt)
            if ckpt is not None:
                out["resumed"][key] = resume(model_dir, ctx, dtype, kind, offload, out["runs"][key]["checkpoint"],
                                             ranks)
    return out


# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def dist_runs(request, model_dir, tmp_path_factory):
    world = request.param
    work = tmp_path_factory.mktemp(f"world{world}")
    return world, run_distributed(_worker, world, model_dir, str(work))


def _rel_norm(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], w0: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b - w0|| over all tensors together: a difference in units of b's total update."""
    num = sum(float((a[k] - b[k]).double().pow(2).sum()) for k in b)
    den = sum(float((b[k] - w0[k]).double().pow(2).sum()) for k in b)
    return math.sqrt(num / den)


@pytest.mark.parametrize("manager", MANAGERS, ids=manager_id)
@pytest.mark.parametrize("dtype", DTYPES)
def test_trains_like_one_process_on_the_global_batch(dist_runs, dtype, manager):
    world, results = dist_runs
    ref = results[0]["ref"][dtype]
    run = results[0]["runs"][(dtype, *manager)]
    assert all(torch.equal(ref["w0"][k], run["w0"][k]) for k in ref["w0"]), "initial weights differ"
    _check_like_reference(run["steps"], run["final"], ref, results[0]["wrong"][dtype], dtype)


def _check_like_reference(steps: list[dict], final: dict[str, torch.Tensor], ref: dict, wrong: dict, dtype: str,
                          first: int = 0) -> None:
    """Losses and norms of `steps` (steps first, first+1, ...) and the `final` weights against the single
    process on the global batch `ref`, to the tolerances of the module docstring."""
    loss_rtol, norm_rtol = (2e-5, 2e-5) if dtype == "fp32" else (2 ** -7, 3e-2)
    for s, (a, r) in enumerate(zip(steps, ref["steps"][first:]), start=first):
        assert a["loss"] == pytest.approx(r["loss"], rel=loss_rtol), f"step {s} loss"
        assert a["norm"] == pytest.approx(r["norm"], rel=norm_rtol), f"step {s} gradient norm"
    want, w0 = ref["final"], ref["w0"]
    if dtype == "fp32":
        for k in want:
            err = float((final[k] - want[k]).norm())
            upd = float((want[k] - w0[k]).norm())
            assert err <= 1e-3 * upd, f"{k}: ||w - w_ref|| = {err:.3g}, update {upd:.3g}"
        return
    # bf16: in norm, against the size of the update; a run on one rank's data must fail the same bound
    rel = _rel_norm(final, want, w0)
    rel_wrong = _rel_norm(wrong["final"], want, w0)
    assert rel <= 0.2, f"||w - w_ref|| is {rel:.3f} of the update"
    assert rel_wrong >= 0.5, f"a run on one rank's data is only {rel_wrong:.3f} of the update away"


def test_offload_is_bitwise_equal_to_device_shards(dist_runs):
    """On CPU the offloaded shards live in the same memory as the device ones: identical results."""
    _, results = dist_runs
    for dtype in DTYPES:
        for kind in ("reduce-scatter", "all-to-all"):
            a, b = results[0]["runs"][(dtype, kind, False)], results[0]["runs"][(dtype, kind, True)]
            for s, (x, y) in enumerate(zip(a["steps"], b["steps"])):
                assert (x["loss"], x["norm"]) == (y["loss"], y["norm"]) and torch.equal(x["weights"], y["weights"]), \
                    f"{dtype} {kind} step {s}"


def test_all_ranks_hold_identical_weights_after_every_step(dist_runs):
    world, results = dist_runs
    for key in results[0]["runs"]:
        for r in range(1, world):
            for s, (a, b) in enumerate(zip(results[0]["runs"][key]["steps"], results[r]["runs"][key]["steps"])):
                assert torch.equal(a["weights"], b["weights"]), f"{key}: rank {r} differs from rank 0 after step {s}"
                assert (a["loss"], a["norm"]) == (b["loss"], b["norm"]), f"{key}: rank {r} loss/norm, step {s}"


def test_sharded_state_per_rank_is_one_over_world(dist_runs):
    world, results = dist_runs
    layout, solo = FlatLayout(CFG, world), FlatLayout(CFG, 1)
    blocks = [layout.block(l) for l in range(CFG.num_hidden_layers)]
    non_block = sum(g.padded_numel for g in layout.non_block_groups())
    for dtype in DTYPES:
        es = 4 if dtype == "fp32" else 2
        unsharded = results[0]["runs"][(dtype, "unsharded", False)]["memory"]
        assert unsharded["grads"] == {"non_block": non_block * es, "blocks": sum(g.padded_numel for g in blocks) * es}
        for kind, offload in MANAGERS[1:]:
            for r in range(world):
                mem = results[r]["runs"][(dtype, kind, offload)]["memory"]
                # block gradients: exactly 1/W of the unsharded blocks on every rank (same padded layout)
                assert mem["grads"]["block_shards"] * world == unsharded["grads"]["blocks"], (kind, offload)
                # the rest does not grow with depth: the replicated non-block groups and two block buffers
                # (2 staging slots, or 1 send + 1 receive buffer)
                assert mem["grads"]["non_block"] == non_block * es
                assert mem["grads"]["staging"] == 2 * blocks[0].padded_numel * es
                assert mem["grads_total"] == sum(mem["grads"].values())
                assert mem["host_keys"] == ({"block_shards"} if offload else set())
                on_device = mem["grads_total"] - (mem["grads"]["block_shards"] if offload else 0)
                assert mem["grads_device"] == on_device
        # Adam moments: 1/W of the full-size moments on every rank, whatever the gradient manager; and
        # 1/W of the single-process size up to the padding of each group to a multiple of W*64 elements
        full = layout.total_numel() * 2 * es
        solo_full = solo.total_numel() * 2 * es
        for r in range(world):
            for key, run in results[r]["runs"].items():
                if key[0] == dtype:
                    assert run["memory"]["optimizer"] * world == full
                    assert 0 <= full - solo_full <= len(layout.groups) * world * 64 * 2 * es
        assert results[0]["ref"][dtype]["memory"]["optimizer"] == solo_full


def test_resume_under_sharding_is_bitwise_equal(dist_runs):
    world, results = dist_runs
    for r in range(world):
        for key, resumed in results[r]["resumed"].items():
            full = results[r]["runs"][key]
            assert len(resumed["steps"]) == STEPS - CKPT_AT
            for s, (a, b) in enumerate(zip(resumed["steps"], full["steps"][CKPT_AT:]), start=CKPT_AT):
                assert a["loss"] == b["loss"] and a["norm"] == b["norm"], f"rank {r} {key} step {s}"
                assert torch.equal(a["weights"], b["weights"]), f"rank {r} {key} weights after step {s}"
            assert all(torch.equal(resumed["final"][k], full["final"][k]) for k in full["final"])


def _named(flat: torch.Tensor, world: int) -> dict[str, torch.Tensor]:
    """Tensors by name from `flat_weights` of a `world`-rank trainer (its groups padded for that world)."""
    layout = FlatLayout(CFG, world)
    return layout.views(dict(zip([g.key for g in layout.groups], flat.split([g.padded_numel for g in layout.groups]))))


@pytest.mark.parametrize("dtype", DTYPES)
def test_resume_on_one_rank_reshards(dist_runs, model_dir, dtype):
    """W -> 1: one process resumes the W-rank checkpoint (sharded gradients) with the global batch: the weights
    it loads are the W-rank run's bit for bit, and it continues like the single process on the global batch
    (to the same tolerances as the W-rank run: fp32 sums in another order, so not bit for bit)."""
    world, results = dist_runs
    ranks = list(range(world))
    run = results[0]["runs"][(dtype, "reduce-scatter", False)]
    tr = Trainer(options(model_dir, dtype, "reduce-scatter", batch=B * world),
                 DistContext(rank=0, world=1, local_rank=0, device=CPU))
    assert checkpointing.load(run["checkpoint"], tr, train_loader=None, logger=None) == CKPT_AT
    saved = _named(run["steps"][CKPT_AT - 1]["weights"], world)
    assert all(torch.equal(p.float(), saved[k]) for k, p in tr.full_params().items())
    steps = run_steps(tr, range(CKPT_AT, STEPS), ranks, ranks)
    _check_like_reference(steps, named_weights(tr), results[0]["ref"][dtype], results[0]["wrong"][dtype], dtype,
                          first=CKPT_AT)


def test_offload_needs_sharded_gradients(model_dir):
    opts = options(model_dir, "bf16", "unsharded", offload=True)
    with pytest.raises(OptionsError, match="--offload-gradients needs sharded gradients"):
        Trainer(opts, DistContext(rank=0, world=1, local_rank=0, device=CPU))
    with pytest.raises(ValueError) as e:
        make_gradient_manager("unsharded", FlatLayout(CFG, 1), comm=Communicator.solo(CPU), dtype=torch.bfloat16,
                              device=CPU, seed=0, offload=True)
    assert str(e.value) == OFFLOAD_NEEDS_SHARDING
