"""The LM head's gradient GEMMs in FP8 (--fp8-head-backward, on by default with e4m3 on a GPU where the plan fits
it) with the weights sharded over two processes (gloo): the head multiplies the all-gathered copy of the head weight,
an exact copy, so --shard-weights (and --zero-level 3 against 2) train bit for bit like replicated weights with it, as
they do without it (tests/parallel/weights/test_sharded.py, whose vocabulary of 101 keeps the head in bf16). Here the
vocabulary and hidden size are multiples of 16 and the head is untied, so the FP8 head path runs (CPU: its twin
codes and emulated FP8 GEMMs) and its d(W_head) goes through the sharded gradient path."""
from __future__ import annotations

import pytest
import torch

from qtrain.model.llama import LlamaConfig
from qtrain.options import Options
from qtrain.parallel.dist import DistContext
from qtrain.train.trainer import Trainer
from tests.dist_utils import full_params_cpu, random_batch, run_distributed, train_steps

CFG = LlamaConfig(model_type="qwen2", vocab_size=128, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0,
                  tie_word_embeddings=False, attention_bias=True, bos_token_id=None, eos_token_id=None)
B, T, GA, STEPS, WORLD = 2, 16, 2, 2, 2
RUNS = {"replicated": {}, "sharded": {"shard_weights": True}, "zero2": {"zero_level": 2}, "zero3": {"zero_level": 3},
        "replicated-bf16-head": {"fp8_head_backward": False}}


def _worker(rank: int, world: int, model_dir: str) -> dict:
    ctx = DistContext(rank=rank, world=world, local_rank=rank, device=torch.device("cpu"))
    out = {}
    for name, kw in RUNS.items():
        opts = Options(model=model_dir, from_scratch=True, device="cpu", compile="off", seed=5, model_dtype="bf16",
                       matmul_dtype="e4m3", fp8_policy="all", opt_m_dtype="bf16", opt_v_dtype="bf16", batch_size=B,
                       seq_len=T, grad_accumulation=GA, learning_rate=3e-3,
                       **{"fp8_head_backward": True, **kw})
        tr = Trainer(opts, ctx)
        assert tr.model.run.fp8_head_backward is opts.fp8_head_backward
        w0 = full_params_cpu(tr)
        steps = train_steps(tr, range(STEPS), lambda s, m, r: random_batch(CFG.vocab_size, B, T, s, m, r), GA, 3e-3)
        out[name] = {"w0": w0, "steps": steps}
    return out


@pytest.fixture(scope="module")
def results(model_dir):
    return run_distributed(_worker, WORLD, model_dir)


@pytest.mark.parametrize("base, name", [("replicated", "sharded"), ("zero2", "zero3")])
def test_sharded_weights_with_the_fp8_head_train_bitwise_like_replicated(results, base, name):
    """Each sharded run against the run of the same gradient reduction (all-reduce; reduce-scatter for zero-level 2
    and 3), as in test_sharded.py's pairs."""
    for r in range(WORLD):
        a, b = results[r][base], results[r][name]
        for s, (x, y) in enumerate(zip(a["steps"], b["steps"], strict=True)):
            assert (x["loss"], x["norm"]) == (y["loss"], y["norm"]), (name, r, s)
            for k in x["weights"]:
                assert torch.equal(x["weights"][k], y["weights"][k]), (name, r, s, k)


def test_the_fp8_head_ran_its_own_gradients(results):
    """Not vacuous: the FP8 head's weights after training differ from the bf16 head's (its d(W_head) is an FP8
    product), while the first step's loss, computed before any gradient, is the same."""
    a, b = results[0]["replicated"], results[0]["replicated-bf16-head"]
    assert a["steps"][0]["loss"] == b["steps"][0]["loss"]
    assert not torch.equal(a["steps"][-1]["weights"]["lm_head"], b["steps"][-1]["weights"]["lm_head"])
