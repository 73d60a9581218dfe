"""A tiny Qwen3.5 (dense and MoE hybrid) trains end to end through `qtrain train` on the CPU, and a run resumed from
its step-2 checkpoint continues bit for bit (losses, gradient norms, the MoE variant's router fields, the exported
weights); bf16 weights and Adam moments with stochastic rounding track the fp32 run."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from qtrain.cli.main import main
from qtrain.data.packing import Packer
from qtrain.data.token_files import TokenFileWriter
from qtrain.options import Options
from qtrain.parallel.dist import DistContext
from qtrain.train.router_metrics import STEP_FIELDS
from qtrain.train.trainer import Trainer
from tests.dist_utils import write_model_dir
from tests.model.family_fixtures import qwen35_cfg as tiny_cfg
from tests.run_utils import make_run_root, train_argv


N = 32  # packed rows (--pack-to, --seq-len)


def _steps(path):
    return {e["step"]: e for e in map(json.loads, open(path)) if e.get("log") == "step" or "loss" in e}


@pytest.mark.parametrize("model", ["dense", "moe", "qwen3_next"])
def test_trains_and_resumes_bitwise(tmp_path, model):
    """qwen3_next: an MoE layer and a dense one (mlp_only_layers), its interleaved in_proj rows through the export."""
    root = make_run_root(tmp_path)
    moe = model != "dense"
    shape = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, head_dim=16, bos_token_id=0, eos_token_id=0,
                 layer_types=("linear_attention", "full_attention"), max_position_embeddings=64)
    if model == "qwen3_next":
        from tests.model.test_qwen3_next import next_cfg
        cfg = next_cfg(moe=True, mlp_only_layers=(1,), **shape)
    else:
        cfg = tiny_cfg(moe=moe, **shape)
    (root / "model" / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    flags = {"router-z-loss": 0.001} if moe else {}
    assert main(train_argv(root, steps=4, name="full", **flags)) == 0
    assert main(train_argv(root, steps=4, name="resumed", extra=("--continue", "2"),
                           **{"checkpoint-dir": root / "ckpt" / "full"}, **flags)) == 0
    full, resumed = _steps(root / "logs" / "full.jsonl"), _steps(root / "logs" / "resumed.jsonl")
    assert {2, 3} <= set(resumed)
    fields = ("loss", "norm", *(STEP_FIELDS if moe else ()))
    for k in (2, 3):
        assert all(resumed[k][f] == full[k][f] for f in fields), k
    if moe:  # the router fields in the log as for the MoE families: every MoE layer routes B x T tokens to k experts
        B, T = 2, 16
        assert full[0]["expert_load_mean"] == B * T * cfg.num_experts_per_tok / cfg.num_experts
        assert len(cfg.router.layers) == (1 if model == "qwen3_next" else 2)
        assert full[0]["aux_loss"] > 0 and full[0]["router_z_loss"] > 0
    else:
        assert "aux_loss" not in full[0]
    a, b = load_file(root / "out" / "full" / "model.safetensors"), load_file(root / "out" / "resumed" /
                                                                                "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(k.endswith("linear_attn.A_log") for k in a) and all(torch.isfinite(t).all() for t in a.values())


def test_fp8_block_linears_train(tmp_path, capsys):
    """--matmul-dtype e4m3 --fp8-policy all: the four kinds of block linears (in_proj, out, qkv, o, and the MLP) run
    in FP8 (emulated on the CPU); the delta rule, conv and norms stay bf16 / fp32. N = 2 kd + 2 vd + 2H must be a
    multiple of 16 (8 value heads here; 32 or 48 in the real models). tests/model/test_qwen3_5_fp8.py bounds the
    blocks' outputs and gradients against the bf16 blocks'."""
    root = make_run_root(tmp_path)
    cfg = tiny_cfg(vocab_size=96, hidden_size=32, num_hidden_layers=2, head_dim=16, linear_num_value_heads=8,
                   layer_types=("linear_attention", "full_attention"), bos_token_id=0, eos_token_id=0,
                   max_position_embeddings=64)
    (root / "model" / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    assert main(train_argv(root, steps=3, name="fp8", **{"matmul-dtype": "e4m3", "model-dtype": "bf16",
                                                          "fp8-policy": "all"})) == 0
    losses = [e["loss"] for e in _steps(root / "logs" / "fp8.jsonl").values() if "loss" in e]
    assert losses and all(math.isfinite(v) for v in losses)


def test_document_masking_trains_and_resumes_bitwise(tmp_path):
    """`qtrain train --document-masking` on packed SFT examples with the hybrid MoE model: the delta-rule and
    convolution restarts (tests/model/test_qwen3_5_documents.py proves them exact) run through the loader's positions,
    and --continue repeats the steps bit for bit; without the option the losses differ."""
    root = make_run_root(tmp_path)
    rng = np.random.default_rng(1)
    for name, n in (("train.bin", 60), ("eval.bin", 10)):  # SFT-like examples ending in EOS 0, packed into rows of N
        w = TokenFileWriter(root / name, vocab_size=96, with_masks=True, with_documents=True)
        packer = Packer(w, N, pad_id=0)
        for _ in range(n):
            ids = np.r_[rng.integers(2, 96, int(rng.integers(2, 20))), 0].astype(np.int32)
            packer.write(ids, np.ones(ids.size, bool))
        packer.flush()
        w.write(np.array([0], np.int32), np.zeros(1, bool), np.zeros(1, np.int64))
        w.close()
    cfg = tiny_cfg(moe=True, vocab_size=96, hidden_size=32, num_hidden_layers=2, head_dim=16,
                   layer_types=("linear_attention", "full_attention"), bos_token_id=0, eos_token_id=0,
                   max_position_embeddings=64)
    (root / "model" / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    opts = dict(seq_len=N)
    extra = ("--document-masking", "--recompute-att")
    assert main(train_argv(root, steps=4, name="full", extra=extra, **opts)) == 0
    assert main(train_argv(root, steps=4, name="resumed", checkpoint_dir=root / "ckpt" / "full",
                           extra=(*extra, "--continue", "2"), **opts)) == 0
    full, resumed = _steps(root / "logs" / "full.jsonl"), _steps(root / "logs" / "resumed.jsonl")
    assert {2, 3} <= set(resumed)
    assert all(resumed[k][f] == full[k][f] for k in (2, 3) for f in ("loss", "norm", *STEP_FIELDS))
    assert main(train_argv(root, steps=1, name="plain", **opts)) == 0
    assert _steps(root / "logs" / "plain.jsonl")[0]["loss"] != full[0]["loss"]


def test_bf16_with_stochastic_rounding_trains(tmp_path):
    """As tests/train/test_moe_trainer.py's for the MoE families, on the hybrid MoE model (a Gated DeltaNet layer, a
    gated full-attention layer, both routed): bf16 weights, gradients and Adam moments (stochastically rounded) on a
    repeated batch fall as the fp32 run's losses do, step by step within 2^-6 relative. Why 2^-6: each bf16 rounding
    is within 2^-9 relative, and a loss carries a chain of them (the weights, rounded at every update; the activations
    of 2 blocks; the moments); stochastic rounding keeps them unbiased, so they grow like a random walk, not a sum:
    8 roundings' worth bounds the 6 steps (measured at most 1.0e-3, as ~1e-3 for the MoE families)."""
    cfg = tiny_cfg(moe=True, vocab_size=96, hidden_size=32, num_hidden_layers=2, head_dim=16, bos_token_id=0,
                   eos_token_id=0, layer_types=("linear_attention", "full_attention"), max_position_embeddings=64)
    model_dir = write_model_dir(tmp_path, cfg)
    seq = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    x, y = seq[:, :-1].clone(), seq[:, 1:].clone()
    losses = {}
    for dtype in ("fp32", "bf16"):
        opts = Options(model=model_dir, from_scratch=True, device="cpu", compile="off", seed=5, model_dtype=dtype,
                       opt_m_dtype=dtype, opt_v_dtype=dtype, batch_size=2, seq_len=16, grad_accumulation=1,
                       learning_rate=1e-2)
        assert opts.stochastic_rounding
        tr = Trainer(opts, DistContext(rank=0, world=1, local_rank=0, device=torch.device("cpu")))
        assert {p.dtype for p in tr.full_params().values()} == {torch.float32 if dtype == "fp32" else torch.bfloat16}
        losses[dtype] = []
        for _ in range(6):
            tr.micro_step(x, y, loss_scale=1 / y.numel())
            stats = tr.update(lr=1e-2)
            assert all(math.isfinite(stats[k]) for k in ("loss", "norm", *STEP_FIELDS))
            losses[dtype].append(stats["loss"])
    assert losses["bf16"][-1] < losses["bf16"][0] - 1.0  # ~4.57 -> ~3.12: it trains
    assert losses["bf16"] != losses["fp32"]  # and in bf16
    for a, b in zip(losses["bf16"], losses["fp32"]):
        assert a == pytest.approx(b, rel=2 ** -6)
