"""--debug-log-abs-max: the logged abs-maxes are the real ones (checked against an independent
computation for the first linear input), every linear of every layer is covered, recomputation does not
change them, and the loop writes them to the run log."""
from __future__ import annotations

import json

import pytest
import torch

from qtrain.model.llama import LlamaConfig
from qtrain.model.layers import rms_norm
from qtrain.observe.log import read_log
from qtrain.train.loop import run_training
from qtrain.options import Options
from qtrain.train.trainer import Trainer

CFG = LlamaConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rope_theta=10000.0,
                  tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CFG.to_hf_dict(dtype="float32")))
    return str(d)


def run_one_step(model_dir, **kw) -> tuple[Trainer, torch.Tensor]:
    opts = Options(model=model_dir, from_scratch=True, model_dtype="fp32", batch_size=2, seq_len=16,
                   grad_accumulation=1, learning_rate=1e-3, device="cpu", compile="off", debug_log_abs_max=1,
                   matmul_dtype="e4m3", fp8_policy="all", **kw)
    tr = Trainer(opts)
    x = torch.randint(0, CFG.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    tr.micro_step(x[:, :-1], x[:, 1:])
    return tr, x[:, :-1]


def test_abs_maxes_cover_every_linear_and_match_an_independent_computation(model_dir):
    tr, inputs = run_one_step(model_dir)
    am = tr.abs_maxes
    L = CFG.num_hidden_layers
    for layer in range(L):
        for kind in ("act.ln1", "act.att", "act.ln2", "act.swiglu", "grad.qkv", "grad.o", "grad.up", "grad.down"):
            v = am[f"layers.{layer}.{kind}"]
            assert v > 0 and v == v, (layer, kind, v)
        for w in ("qkv", "o", "up", "down"):
            assert am[f"layers.{layer}.{w}.weight"] == float(tr.params[f"layers.{layer}.{w}"].detach().abs().max())
    p = tr.params
    ln1 = rms_norm(torch.nn.functional.embedding(inputs, p["embed"]), p["layers.0.ln1"], CFG.rms_norm_eps)
    assert am["layers.0.act.ln1"] == float(ln1.abs().max())


def test_recompute_does_not_change_the_recorded_values(model_dir):
    plain, _ = run_one_step(model_dir)
    recomputed, _ = run_one_step(model_dir, recompute_att=True, recompute_ffn=True)
    assert plain.abs_maxes == recomputed.abs_maxes


def test_loop_logs_abs_max_events(model_dir, tmp_path):
    import numpy as np
    from qtrain.data.token_files import write_token_file
    write_token_file(tmp_path / "t.bin", np.random.default_rng(0).integers(0, 64, 4000, dtype=np.int32), vocab_size=64)
    run_training(Options(model=model_dir, from_scratch=True, model_dtype="fp32", matmul_dtype="e4m3",
                         fp8_policy="all", batch_size=2,
                         seq_len=16, grad_accumulation=1, steps=4, debug_log_abs_max=2, device="cpu", compile="off",
                         train_file=str(tmp_path / "t.bin"), out_dir=str(tmp_path / "o"),
                         checkpoint_dir=str(tmp_path / "c"), log_file=str(tmp_path / "log.jsonl"),
                         save_training_state=False, learning_rate=1e-3), argv=[])
    events = [e for e in read_log(tmp_path / "log.jsonl") if e["log"] == "abs-maxes"]
    assert [e["step"] for e in events] == [0, 2]
    assert len(events[0]["abs_maxes"]) == 3 * 4 * CFG.num_hidden_layers
