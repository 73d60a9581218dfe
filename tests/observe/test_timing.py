"""`--debug-time-breakdown` (`qtrain.observe.timing`): one `time-breakdown` object per step with one time per
micro-step and the update, whoever calls the trainer's methods (here a custom loop, as in
docs/python-api.md), plus a console line."""
from __future__ import annotations

import io

import pytest

from qtrain.model.llama import LlamaConfig
from qtrain.observe.log import RunLogger, read_log
from qtrain.observe.timing import TimeBreakdown
from qtrain.options import Options
from qtrain.train.trainer import Trainer
from tests.dist_utils import random_batch

CFG = LlamaConfig(model_type="llama", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)


def test_breakdown_per_step_on_cpu(tmp_path, model_dir):
    opts = Options(model=model_dir, from_scratch=True, model_dtype="fp32", batch_size=2, seq_len=16,
                   grad_accumulation=3, device="cpu", compile="off")
    trainer = Trainer(opts)
    out = io.StringIO()
    log = RunLogger(tmp_path / "log.jsonl", stream=out)
    TimeBreakdown(trainer, log, cuda=False)
    for step in range(2):
        for micro in range(3):
            trainer.micro_step(*random_batch(CFG.vocab_size, 2, 16, step, micro, 0))
        stats = trainer.update(lr=1e-3)
        log.log_step(step, step_tokens=96, duration_ms=1.0, norm=stats["norm"], loss=stats["loss"], lr=1e-3)
    log.close()
    events = [e for e in read_log(tmp_path / "log.jsonl") if e["log"] == "time-breakdown"]
    assert [e["step"] for e in events] == [0, 1]
    for e in events:
        assert len(e["micro_steps"]) == 3 and all(m > 0 for m in e["micro_steps"]) and e["update"] > 0
        assert e["total"] == pytest.approx(sum(e["micro_steps"]) + e["update"])
    assert out.getvalue().count("[Time] step") == 2
