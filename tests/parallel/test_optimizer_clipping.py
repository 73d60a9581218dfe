"""Gradient clipping by global norm and the skipped step, decided on the device.

The trainer queues the AdamW update before the host reads the gradient norm (so the GPU does not idle
while the host waits), which means the clipping factor and the skip on a non-finite norm are computed on
the device (`clip_scale`) and read by the kernel. Claims checked here:
- `clip_scale` is the standard rule: clip / norm above the threshold, 1 below it or without clipping,
  NaN (= skip) for a non-finite norm;
- a trainer step with clipping equals a step whose gradients were scaled by clip / norm by hand (the
  update sees the clipped gradient, not the raw one);
- a step with a NaN gradient changes nothing (weights, Adam moments, bias-correction count) and is
  reported as skipped; training continues normally afterwards.
"""
from __future__ import annotations

import json
import math

import torch

from qtrain.model.llama import LlamaConfig
from qtrain.parallel.optimizer import clip_scale
from qtrain.options import Options
from qtrain.train.trainer import Trainer

CFG = LlamaConfig(model_type="qwen2", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0,
                  tie_word_embeddings=True, attention_bias=True, bos_token_id=None, eos_token_id=None)
B, T = 2, 16


def test_clip_scale_values():
    t = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    assert clip_scale(t(4.0), 1.0).item() == 0.25
    assert clip_scale(t(0.5), 1.0).item() == 1.0
    assert clip_scale(t(1.0), 1.0).item() == 1.0  # at the threshold: unchanged
    assert clip_scale(t(7.0), 0.0).item() == 1.0  # clip <= 0: no clipping
    for bad in (float("inf"), float("nan")):
        assert math.isnan(clip_scale(t(bad), 1.0).item())
        assert math.isnan(clip_scale(t(bad), 0.0).item())  # still skipped without clipping


def _trainer(tmp_path, **kw) -> Trainer:
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(CFG.to_hf_dict()))
    return Trainer(Options(model=str(d), from_scratch=True, device="cpu", compile="off", seed=3, model_dtype="fp32",
                           batch_size=B, seq_len=T, grad_accumulation=1, learning_rate=1e-2, **kw))


def _batch(seed: int):
    seq = torch.randint(0, CFG.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(seed))
    return seq[:, :-1].clone(), seq[:, 1:].clone()


def _state(tr: Trainer) -> dict[str, torch.Tensor]:
    out = {f"w.{k}": v.clone() for k, v in tr.param_buffers.items()}
    out.update({f"m.{k}": v.clone() for k, v in tr.optimizer.m.items()})
    out.update({f"v.{k}": v.clone() for k, v in tr.optimizer.v.items()})
    return out


def test_clipped_step_equals_hand_scaled_gradients(tmp_path):
    """Two steps (Adam's second step is not scale-invariant, so clipping is visible) with clip 0.05, against
    the same steps without clipping on gradients multiplied by min(1, 0.05 / norm) through the loss scale."""
    clip = 0.05
    a = _trainer(tmp_path, grad_clip=clip)
    b = _trainer(tmp_path, grad_clip=0.0)
    for step in range(2):
        inp, tgt = _batch(step)
        # the unclipped norm first, from a probe run of b's micro-step (b's manager is reset by the next one)
        b.micro_step(inp, tgt, loss_scale=1.0 / (B * T))
        norm = b.optimizer.grad_norm(b.grads).item()
        b.micro = 0
        factor = min(1.0, clip / norm)
        assert factor < 0.5  # clipping is active in both steps
        a.micro_step(inp, tgt, loss_scale=1.0 / (B * T))
        sa = a.update(lr=1e-2)
        b.micro_step(inp, tgt, loss_scale=factor / (B * T))
        b.update(lr=1e-2)
        assert math.isclose(sa["norm"], norm, rel_tol=1e-6)  # reported: the pre-clip norm
    # fp32: the two runs scale the gradient at different places (kernel vs. head GEMM alpha), so they agree
    # to rounding, which Adam's 1/sqrt(v) amplifies on the smallest elements: max |a - b| / max |b| < 1e-4
    # (measured <= 1.2e-5). Unclipped, the weights differ by > 1% and m / v by > 10x (Adam's second step
    # is not scale-invariant), so the bound cannot be met by ignoring the clip.
    sb = _state(b)
    for k, va in _state(a).items():
        assert ((va - sb[k]).abs().max() / sb[k].abs().max()).item() < 1e-4, k


def test_nan_gradient_skips_the_step(tmp_path):
    tr = _trainer(tmp_path, grad_clip=1.0)
    ref = _trainer(tmp_path, grad_clip=1.0)
    inp, tgt = _batch(0)
    for t in (tr, ref):
        t.micro_step(inp, tgt)
        t.update(lr=1e-2)
    before = _state(tr)
    tr.micro_step(inp, tgt)
    key = tr.layout.groups[0].key
    tr.grads.grad_shard(key)[0] = float("nan")  # one non-finite gradient element
    stats = tr.update(lr=1e-2)
    assert stats["skipped"] == 1.0 and math.isnan(stats["norm"])
    for k, v in _state(tr).items():
        assert torch.equal(v, before[k]), k
    assert tr.optimizer.step_count == 1 and tr.steps_done == 2
    # the next step is the second real update: bias corrections of t=2, like ref's second step
    inp2, tgt2 = _batch(1)
    for t in (tr, ref):
        t.micro_step(inp2, tgt2)
        s = t.update(lr=1e-2)
        assert s["skipped"] == 0.0
    for k, v in _state(tr).items():
        assert torch.equal(v, _state(ref)[k]), k
