"""`Trainer.step` (qtrain/train/trainer.py): one whole optimizer step, loss scale included.

`step(batches, lr=)` must be exactly the sequence `qtrain train`'s loop ran before it existed: count the
valid targets of the step over all ranks, `micro_step(x, y, loss_scale=world / count)` per micro-batch,
`update(lr=)`. Here that sequence is written out by hand, with the count taken straight from the data of
every rank (the batches are a function of (step, micro-step, rank)), and compared bit for bit (losses,
norms, every weight after every step) on 1 process and on 2 gloo processes, replicated and sharded
(ZeRO-3) weights. Targets are masked with valid counts that differ between micro-batches and ranks, so a
per-micro-batch or per-rank scale would give other numbers; `test_masks_make_the_scale_matter` checks
that these batches really tell the scales apart. Without masks, `micro_step`'s default scale is the same
rule, so a loop of bare `micro_step`s trains bit-identically to `step`.
"""
from __future__ import annotations

import pytest
import torch

from qtrain.model.llama import LlamaConfig
from qtrain.options import Options
from qtrain.parallel.dist import DistContext
from qtrain.train.trainer import Trainer
from tests.dist_utils import full_params_cpu, run_distributed

CFG = LlamaConfig(model_type="qwen2", vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, rope_theta=10000.0,
                  tie_word_embeddings=False, attention_bias=True, bos_token_id=None, eos_token_id=None)
B, T, GA, STEPS, LR = 2, 8, 3, 2, 3e-3
CPU = torch.device("cpu")
LAYOUTS = {"replicated": {}, "zero3": {"zero_level": 3}}


def options(model_dir: str, **kw) -> Options:
    return Options(model=model_dir, from_scratch=True, device="cpu", compile="off", seed=11, model_dtype="fp32",
                   batch_size=B, seq_len=T, grad_accumulation=GA, learning_rate=LR, **kw)


def micro_batch(step: int, micro: int, rank: int, *, masked: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens; with `masked`, the first (1 + micro + 3 * rank + step) % (B * T - 1) targets are
    -100, so the valid counts differ between micro-batches, ranks and steps (none is fully masked)."""
    gen = torch.Generator().manual_seed(7919 * step + 131 * micro + 17 * rank + 5)
    seq = torch.randint(0, CFG.vocab_size, (B, T + 1), generator=gen)
    inputs, targets = seq[:, :-1].clone(), seq[:, 1:].clone()
    if masked:
        targets.view(-1)[:(1 + micro + 3 * rank + step) % (B * T - 1)] = -100
    return inputs, targets


def valid_targets(step: int, world: int, masked: bool = True) -> int:
    """The step's valid targets over every rank, counted from the data itself."""
    return sum(int((micro_batch(step, m, r, masked=masked)[1] != -100).sum()) for r in range(world) for m in range(GA))


def record(tr: Trainer, stats: dict) -> dict:
    return {"loss": stats["loss"], "norm": stats["norm"], "weights": full_params_cpu(tr)}


def run(tr: Trainer, how: str, *, masked: bool = True) -> list[dict]:
    """STEPS optimizer steps on this rank's batches: through `step` ("step"), the loop's old sequence by
    hand ("by_hand"), or bare micro_steps with their default scale ("default")."""
    rank, world, out = tr.ctx.rank, tr.ctx.world, []
    for s in range(STEPS):
        batches = [micro_batch(s, m, rank, masked=masked) for m in range(GA)]
        if how == "step":
            stats = tr.step(batches, lr=LR)
        else:
            scale = world / valid_targets(s, world, masked) if how == "by_hand" else None
            for x, y in batches:
                tr.micro_step(x, y, loss_scale=scale)
            stats = tr.update(lr=LR)
        out.append(record(tr, stats))
    return out


def runs(model_dir: str, ctx: DistContext) -> dict:
    out = {}
    for name, kw in LAYOUTS.items():
        for how in ("step", "by_hand", "default"):
            out[(name, how)] = run(Trainer(options(model_dir, **kw), ctx), how)
        out[(name, "step", "unmasked")] = run(Trainer(options(model_dir, **kw), ctx), "step", masked=False)
        out[(name, "default", "unmasked")] = run(Trainer(options(model_dir, **kw), ctx), "default", masked=False)
    return out


def _worker(rank: int, world: int, model_dir: str) -> dict:
    return runs(model_dir, DistContext(rank=rank, world=world, local_rank=rank, device=CPU))


@pytest.fixture(scope="module", params=[1, 2], ids=lambda w: f"world{w}")
def results(request, model_dir) -> tuple[int, list[dict]]:
    world = request.param
    if world == 1:
        return world, [runs(model_dir, DistContext(rank=0, world=1, local_rank=0, device=CPU))]
    return world, run_distributed(_worker, world, model_dir)


def assert_same(a: list[dict], b: list[dict], what: str) -> None:
    for s, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x["loss"] == y["loss"] and x["norm"] == y["norm"], (what, s, x["loss"], y["loss"], x["norm"], y["norm"])
        for k in x["weights"]:
            assert torch.equal(x["weights"][k], y["weights"][k]), f"{what}: {k} after step {s}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_step_is_the_loops_sequence_bitwise(results, layout):
    world, per_rank = results
    for r, res in enumerate(per_rank):
        assert_same(res[(layout, "step")], res[(layout, "by_hand")], f"rank {r} of {world}, {layout}")
        assert_same(res[(layout, "step")], per_rank[0][(layout, "step")], f"rank {r} vs rank 0, {layout}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_unmasked_default_micro_step_scale_is_steps(results, layout):
    """micro_step's default scale is `loss_scale` of (its own count x grad_accumulation x world): with
    equal counts everywhere, bit-identical to `step`."""
    _, per_rank = results
    for res in per_rank:
        assert_same(res[(layout, "default", "unmasked")], res[(layout, "step", "unmasked")], layout)


def test_masks_make_the_scale_matter(results):
    """On these masked batches the per-micro-batch default scale gives other losses than `step`: the
    equalities above would catch a step that scaled per micro-batch (or per rank)."""
    _, per_rank = results
    for layout in LAYOUTS:
        a, b = per_rank[0][(layout, "step")], per_rank[0][(layout, "default")]
        assert all(x["loss"] != y["loss"] for x, y in zip(a, b)), layout


def test_step_loss_is_the_mean_token_loss_of_the_global_batch(results, model_dir):
    """The first step's loss is the mean token loss over the valid targets of all ranks' micro-batches,
    computed here on one process by the model's evaluation path on the same initial weights. fp32 sums of
    <= W*GA*B*T = 96 positive terms in another order: within 96 * 2^-24 < 1e-5 relative."""
    world, per_rank = results
    tr = Trainer(options(model_dir), DistContext(rank=0, world=1, local_rank=0, device=CPU))
    total, n = 0.0, 0
    with torch.no_grad():
        for r in range(world):
            for m in range(GA):
                loss, count = tr.model.loss_sum(tr.weights, *micro_batch(0, m, r))
                total, n = total + float(loss), n + int(count)
    assert n == valid_targets(0, world)
    assert per_rank[0][("replicated", "step")][0]["loss"] == pytest.approx(total / n, rel=1e-5)


def test_step_refuses_a_wrong_number_of_micro_batches(model_dir):
    tr = Trainer(options(model_dir), DistContext(rank=0, world=1, local_rank=0, device=CPU))
    with pytest.raises(ValueError, match=f"step\\(\\) got {GA - 1} micro-batches; --grad-accumulation is {GA}"):
        tr.step([micro_batch(0, m, 0) for m in range(GA - 1)], lr=LR)
    assert tr.micro == 0 and tr.steps_done == 0
    tr.micro_step(*micro_batch(0, 0, 0))
    with pytest.raises(RuntimeError, match="step\\(\\) after 1 micro_step\\(\\) calls of an unfinished step"):
        tr.step([micro_batch(0, m, 0) for m in range(GA)], lr=LR)
    assert tr.micro == 1 and tr.steps_done == 0
