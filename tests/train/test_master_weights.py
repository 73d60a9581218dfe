"""fp32 master weights under a bf16 model (`--model-dtype bf16 --master-dtype fp32`, parallel/weights/cast.py).

What must hold, each against an independent path:
- with the same bf16 weights, a micro-step's loss and every weight gradient equal the bf16-weights path bit for
  bit (the model runs on the bf16 copy exactly as on bf16 weights), and over several micro-steps the gradient
  buffers hold the fp32 sums of those bf16 gradients;
- the copy is cast once per optimizer step, not per micro-step, and follows the master after each update;
- one optimizer step updates the fp32 master as a hand-written fp32 AdamW fed those fp32 gradients (to the last
  bit or two: the kernel orders some fp32 ops differently);
- sharded weights (ZeRO-3: fp32 master shards, gathers cast to bf16) train bit for bit as replicated ones;
- export writes the fp32 master (resume from checkpoints: tests/train/test_loop.py `test_resume_is_bitwise_equal`,
  plan rows: tests/plan/test_components.py, options: tests/test_options.py).
The same equalities on CUDA with compiled blocks and cuDNN attention: `test_gpu_*` (marked gpu).
"""
from __future__ import annotations

import math

import pytest
import torch

from qtrain.model.llama import LlamaConfig
from qtrain.model.weights import is_decayed
from qtrain.options import Options
from qtrain.parallel.weights.cast import CastWeights
from qtrain.train.trainer import Trainer
from tests.dist_utils import random_batch

CFG = LlamaConfig(model_type="qwen2", vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, rope_theta=10000.0,
                  tie_word_embeddings=False, attention_bias=True, bos_token_id=None, eos_token_id=None)
B, T, LR = 2, 8, 3e-3


def options(model_dir: str, device: str = "cpu", **kw) -> Options:
    base = dict(model=model_dir, from_scratch=True, device=device, compile="off", seed=5, model_dtype="bf16",
                batch_size=B, seq_len=T, grad_clip=0.0, fp8_policy="all")  # e4m3: every linear, tiny as they are
    return Options(**{**base, **kw})


def pair(model_dir: str, ga: int, device: str = "cpu", **kw) -> tuple[Trainer, Trainer]:
    """(bf16 weights, fp32 master) trainers whose master holds exactly the bf16 trainer's weights."""
    ref = Trainer(options(model_dir, device, grad_accumulation=ga, **kw))
    mixed = Trainer(options(model_dir, device, grad_accumulation=ga, master_dtype="fp32", **kw))
    for key, buf in mixed.param_buffers.items():
        buf.copy_(ref.param_buffers[key])  # bf16 -> fp32 exactly
    mixed.weights.invalidate()
    return ref, mixed


class Collect:
    """A GradientSink that keeps each micro-step's gradients as the model hands them over."""

    def __init__(self):
        self.grads: dict[str, torch.Tensor] = {}

    def accumulate_block(self, layer: int, grads: dict[str, torch.Tensor]) -> None:
        self.grads.update({f"layers.{layer}.{n}": g.detach().clone() for n, g in grads.items()})

    def accumulate_non_block(self, grads: dict[str, torch.Tensor]) -> None:
        self.grads.update({n: g.detach().clone() for n, g in grads.items()})


def grad_views(tr: Trainer) -> dict[str, torch.Tensor]:
    """The finished step's gradient (world 1: the shard is the whole buffer) by internal parameter name."""
    return tr.layout.views(tr.grads.grad_shards())


def run_and_compare(ref: Trainer, mixed: Trainer, ga: int, device: str = "cpu") -> None:
    scale = 1.0 / (ga * B * T)
    sums: dict[str, torch.Tensor] = {}
    total = torch.zeros((), dtype=torch.float32, device=device)
    for m in range(ga):
        x, y = (t.to(device) for t in random_batch(CFG.vocab_size, B, T, 0, m, 0))
        sink = Collect()
        loss = ref.model.forward_backward(ref.weights, x, y, grads=sink, loss_scale=scale)
        mixed.micro_step(x, y, loss_scale=scale)
        total += loss
        assert torch.equal(mixed._loss, total), m  # fp32 sums of the bf16 path's losses, bit for bit
        for n, g in sink.grads.items():
            assert g.dtype == torch.bfloat16, n
            sums[n] = g.float() if m == 0 else sums[n] + g.float()
    got = grad_views(mixed)
    assert set(got) == set(sums)
    for n, g in got.items():
        assert g.dtype == torch.float32 and torch.equal(g, sums[n]), n
    assert mixed.weights.casts == 1  # one cast for all the step's micro-steps


@pytest.mark.parametrize("ga", [1, 3])
def test_gradients_are_the_bf16_paths_summed_in_fp32(model_dir, ga):
    ref, mixed = pair(model_dir, ga)
    assert isinstance(mixed.weights, CastWeights) and mixed.master_dtype == torch.float32
    assert all(p.dtype == torch.bfloat16 for p in mixed.weights.params.values())
    run_and_compare(ref, mixed, ga)


def adamw_reference(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, t: int, decay: bool,
                    o: Options) -> torch.Tensor:
    """Hand-written fp32 AdamW (decoupled, lr-scaled weight decay; bias corrections from float64 powers)."""
    f = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    m.mul_(f(o.beta_1)).add_(f(1 - o.beta_1) * g)
    v.mul_(f(o.beta_2)).add_(f(1 - o.beta_2) * (g * g))
    mhat, vhat = m / f(1 - o.beta_1 ** t), v / f(1 - o.beta_2 ** t)
    upd = mhat / (torch.sqrt(vhat) + f(o.adam_epsilon)) + f(o.weight_decay if decay else 0.0) * p
    return p - f(LR) * upd


def test_update_is_fp32_adamw_on_the_master(model_dir):
    _, mixed = pair(model_dir, 2)
    o = mixed.opts
    state: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for step in range(2):
        batches = [random_batch(CFG.vocab_size, B, T, step, m, 0) for m in range(2)]
        scale = 1.0 / (2 * B * T)
        for x, y in batches:
            mixed.micro_step(x, y, loss_scale=scale)
        before = {n: p.detach().clone() for n, p in mixed.params.items()}
        grads = {n: g.clone() for n, g in grad_views(mixed).items()}
        mixed.update(lr=LR)
        for n, p in mixed.params.items():
            m, v = state.setdefault(n, (torch.zeros_like(p), torch.zeros_like(p)))
            want = adamw_reference(before[n], grads[n], m, v, t=step + 1, decay=is_decayed(CFG, n), o=o)
            assert p.dtype == torch.float32
            # the fused update's op order differs from this one in a few last bits (measured: <= 4e-9 absolute, in ~3% of
            # elements); a bf16 master or bf16-rounded gradients would be ~2^16 ulp off
            torch.testing.assert_close(p, want, rtol=3e-7, atol=4e-9, msg=f"{n} step {step}")
        # the next forward's weights: the new master rounded to bf16, cast once
        copy = mixed.weights.non_block()["embed"]
        assert torch.equal(copy, mixed.params["embed"].to(torch.bfloat16)) and mixed.weights.casts == step + 2
    assert not math.isnan(float(mixed.params["norm"].sum()))


def sharded_equals_replicated(model_dir: str, device: str = "cpu", **extra) -> None:
    runs = []
    for layout in ({}, {"zero_level": 3}):
        tr = Trainer(options(model_dir, device, grad_accumulation=2, master_dtype="fp32", **extra, **layout))
        stats = [tr.step([random_batch(CFG.vocab_size, B, T, s, m, 0) for m in range(2)], lr=LR) for s in range(2)]
        runs.append((stats, {n: p.detach().cpu().clone() for n, p in tr.full_params().items()}))
    (a, wa), (b, wb) = runs
    assert a == b
    assert all(wa[n].dtype == torch.float32 and torch.equal(wa[n], wb[n]) for n in wa)


@pytest.mark.parametrize("extra", [{}, {"matmul_dtype": "e4m3", "persistent_quants": True}],
                         ids=["bf16", "e4m3"])
def test_sharded_master_equals_replicated(model_dir, extra):
    """ZeRO-3: fp32 master shards, each gather casts them into the bf16 buffers (and persistent e4m3 shards are
    made from the bf16-rounded values): the same training, bit for bit, as replicated fp32 master weights."""
    sharded_equals_replicated(model_dir, **extra)


def test_bf16_gradient_sums(model_dir):
    """--grad-accum-dtype bf16: one micro-step's bf16 gradients land exactly, so with one micro-step per update
    training equals fp32 sums bit for bit; with several the sums are stochastically rounded to bf16 (close, not
    equal)."""
    def train(ga: int, **kw) -> tuple[list[dict], dict[str, torch.Tensor]]:
        tr = Trainer(options(model_dir, grad_accumulation=ga, master_dtype="fp32", **kw))
        stats = [tr.step([random_batch(CFG.vocab_size, B, T, s, m, 0) for m in range(ga)], lr=LR) for s in range(2)]
        dtypes = {g.dtype for g in tr.grads.grad_shards().values()}
        assert dtypes == {torch.bfloat16 if kw else torch.float32}
        return stats, {n: p.clone() for n, p in tr.params.items()}

    (a, wa), (b, wb) = train(1, grad_accum_dtype="bf16"), train(1)
    assert a == b and all(torch.equal(wa[n], wb[n]) for n in wa)
    sums = {}
    for kw in ({"grad_accum_dtype": "bf16"}, {}):  # three micro-steps: the sums, rounded to bf16 or not
        tr = Trainer(options(model_dir, grad_accumulation=3, master_dtype="fp32", **kw))
        for m in range(3):
            tr.micro_step(*random_batch(CFG.vocab_size, B, T, 0, m, 0), loss_scale=1.0 / (3 * B * T))
        sums[bool(kw)] = {k: g.float() for k, g in tr.grads.grad_shards().items()}
    for k, g in sums[True].items():
        exact = sums[False][k]
        assert not torch.equal(g, exact), k
        # two stochastically rounded adds, each off by under one bf16 unit in the last place of its partial sum
        # (partial sums may exceed the result: bound by the group's largest value)
        assert ((g - exact).abs() <= 2 * 2.0 ** -7 * exact.abs().max()).all(), k


def test_export_writes_the_fp32_master(model_dir, tmp_path):
    from safetensors.torch import load_file
    _, mixed = pair(model_dir, 1)
    mixed.step([random_batch(CFG.vocab_size, B, T, 0, 0, 0)], lr=LR)
    mixed.export(str(tmp_path / "out"))
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in saved.values())
    emb = mixed.params["embed"]
    assert torch.equal(saved["model.embed_tokens.weight"], emb)
    assert not torch.equal(emb, emb.to(torch.bfloat16).float())  # the update left fp32 values no bf16 copy holds


# ---- GPU: the same with compiled blocks and cuDNN attention (bf16 on Hopper) ---------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("ga", [1, 2])
@pytest.mark.parametrize("matmul", ["", "e4m3"])
def test_gpu_gradients_are_the_bf16_paths_summed_in_fp32(model_dir, ga, matmul):
    ref, mixed = pair(model_dir, ga, "cuda", compile="on", matmul_dtype=matmul)
    assert mixed.model.run.compile
    run_and_compare(ref, mixed, ga, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_update_is_fp32_adamw_on_the_master(model_dir):
    _, mixed = pair(model_dir, 1, "cuda", compile="on")
    x, y = (t.cuda() for t in random_batch(CFG.vocab_size, B, T, 0, 0, 0))
    mixed.micro_step(x, y, loss_scale=1.0 / (B * T))
    before = {n: p.detach().clone() for n, p in mixed.params.items()}
    grads = {n: g.clone() for n, g in grad_views(mixed).items()}
    mixed.update(lr=LR)
    for n, p in mixed.params.items():
        z = torch.zeros_like(p)
        want = adamw_reference(before[n], grads[n], z, z.clone(), t=1, decay=is_decayed(CFG, n), o=mixed.opts)
        torch.testing.assert_close(p, want, rtol=2e-6, atol=1e-8, msg=n)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("extra", [{}, {"matmul_dtype": "e4m3", "persistent_quants": True}],
                         ids=["bf16", "e4m3"])
def test_gpu_sharded_master_equals_replicated(model_dir, extra):
    sharded_equals_replicated(model_dir, "cuda", compile="on", **extra)
