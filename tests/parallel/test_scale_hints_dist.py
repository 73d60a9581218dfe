"""The one-pass SwiGLU FP8 scale hints are per-rank run state (each rank's follow its own micro-batches): with two
gloo ranks (compiled CPU blocks, e4m3, the twins) a checkpoint's meta holds both ranks' hints, and each rank resumes
from its own, even where they differ. Real `torch.distributed`, real checkpoint files."""
from __future__ import annotations

import io
import json
import os

import torch

from qtrain.model.llama import LlamaConfig
from qtrain.observe.log import RunLogger
from qtrain.options import Options
from qtrain.parallel.dist import DistContext
from qtrain.train import checkpointing
from qtrain.train.trainer import Trainer
from tests.dist_utils import run_distributed, write_model_dir

CFG = LlamaConfig(model_type="qwen2", tie_word_embeddings=True, attention_bias=True, vocab_size=128, hidden_size=64,
                  intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, rms_norm_eps=1e-6)


class _NoLoader:
    def state_dict(self) -> dict:
        return {}


def _worker(rank: int, world: int, model_dir: str, ckpt_dir: str) -> dict:
    ctx = DistContext(rank=rank, world=world, local_rank=rank, device=torch.device("cpu"))
    opts = Options(model=model_dir, from_scratch=True, device="cpu", compile="on", batch_size=2, seq_len=32,
                   grad_accumulation=1, matmul_dtype="e4m3", fp8_policy="all", model_dtype="bf16", seed=3)
    tr = Trainer(opts, ctx)
    for step in range(2):
        x = torch.randint(0, CFG.vocab_size, (2, 33), generator=torch.Generator().manual_seed(100 * step + rank))
        tr.micro_step(x[:, :-1], x[:, 1:])
        tr.update(lr=3e-3)
    hints = tr.model.scale_hints()
    if rank == 1:  # make the ranks' hints differ for sure: one binade below, which the rule keeps
        hints[0, 1] -= 1
        tr.model.load_scale_hints(hints)
    path = checkpointing.save(ckpt_dir, tr, _NoLoader(), RunLogger(None, rank=rank, total_steps=2,
                                                                     stream=io.StringIO()))
    resumed = Trainer(opts, ctx)
    assert checkpointing.load(path, resumed, train_loader=None, logger=None) == 2
    meta = json.loads(open(os.path.join(path, "checkpoint.json")).read())
    return {"hints": hints.tolist(), "resumed": resumed.model.scale_hints().tolist(),
            "meta": meta[checkpointing.HINTS_META]}


def test_each_rank_resumes_from_its_own_hints(tmp_path):
    model_dir = write_model_dir(tmp_path, CFG)
    out = run_distributed(_worker, 2, model_dir, str(tmp_path / "ckpt"))
    assert out[0]["hints"] != out[1]["hints"]
    for r in range(2):
        assert out[r]["resumed"] == out[r]["hints"], r
        assert out[r]["meta"] == [out[0]["hints"], out[1]["hints"]], r
