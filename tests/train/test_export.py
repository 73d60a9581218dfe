"""`qtrain export` of a checkpoint written by 2 ranks with sharded weights and optimizer state (gloo) gives
exactly the HF export the run itself wrote at the end (same bits: both are the same weights)."""
from __future__ import annotations

import json
import os

import numpy as np
import torch

from tests.dist_utils import run_distributed
from qtrain.model.llama import LlamaConfig

CFG = LlamaConfig(model_type="llama", vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rope_theta=10000.0,
                  tie_word_embeddings=False, attention_bias=False, bos_token_id=0, eos_token_id=0)


def _train(rank: int, world: int, root: str) -> str:
    from qtrain.parallel.dist import DistContext
    from qtrain.train.loop import run_training
    from qtrain.options import Options
    ctx = DistContext(rank=rank, world=world, local_rank=rank, device=torch.device("cpu"))
    opts = Options(model=os.path.join(root, "model"), from_scratch=True, model_dtype="bf16", opt_m_dtype="bf16",
                   opt_v_dtype="bf16", zero_level=3, batch_size=2, seq_len=16, grad_accumulation=2, steps=3,
                   learning_rate=1e-3, device="cpu", compile="off", train_file=os.path.join(root, "t.bin"),
                   out_dir=os.path.join(root, "out"), checkpoint_dir=os.path.join(root, "ckpt"),
                   log_file=os.path.join(root, "log.jsonl"), eval_num_steps=0)
    return run_training(opts, argv=[], ctx=ctx)["checkpoint_dir"]


def test_export_of_sharded_checkpoint_equals_final_export(tmp_path):
    from safetensors.torch import load_file

    from qtrain.cli.main import main
    from qtrain.data.token_files import write_token_file
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(CFG.to_hf_dict(dtype="bfloat16")))
    write_token_file(tmp_path / "t.bin", np.random.default_rng(1).integers(0, 96, 3000, dtype=np.int32), vocab_size=96)
    run_distributed(_train, 2, str(tmp_path))
    ckpts = sorted(os.listdir(tmp_path / "ckpt"))
    assert ckpts == ["qtrain-run.json", "step_00000003"]  # the run's marker and its final checkpoint
    ckpts = ckpts[1:]
    assert sorted(f for f in os.listdir(tmp_path / "ckpt" / ckpts[0]) if f.startswith("weights")) == [
        "weights.shard_000_of_002.safetensors", "weights.shard_001_of_002.safetensors"]
    assert main(["export", "--checkpoint-dir", str(tmp_path / "ckpt"), "--out-dir", str(tmp_path / "exported")]) == 0
    a = load_file(tmp_path / "out" / "model.safetensors")
    b = load_file(tmp_path / "exported" / "model.safetensors")
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        assert a[k].dtype == torch.bfloat16 and torch.equal(a[k], b[k]), k


def test_an_export_out_of_memory_is_one_line_after_the_final_checkpoint(tmp_path, monkeypatch, capsys):
    """The export runs out of memory (a merged MoE model, a gathered base): one line naming it and how to export
    the final checkpoint, exit code 2, the checkpoint there; before, torch's error escaped rank 0 as a traceback
    (and the other ranks waited for its broadcast until the collective timeout)."""
    import qtrain.train.trainer as trainer_mod
    from qtrain.cli.main import main
    from tests.run_utils import make_run_root, train_argv

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 58.00 GiB.")
    root = make_run_root(tmp_path)
    monkeypatch.setattr(trainer_mod, "save_hf_model", oom)
    capsys.readouterr()
    assert main(train_argv(root, steps=2)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qtrain: error: export to ") and len(err.splitlines()) == 1, err
    assert "ran out of memory (CUDA out of memory. Tried to allocate 58.00 GiB.)" in err and "qtrain export" in err
    assert (root / "ckpt" / "run" / "step_00000002" / "checkpoint.json").is_file()
