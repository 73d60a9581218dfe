"""Low-precision training converges like fp32: a tiny model on real text (the embedded corpus as UTF-8 bytes,
so the vocabulary is 256 and the runs take seconds on a CPU)
trained in fp32, bf16 weights + bf16 Adam states with stochastic rounding, and FP8 (e4m3) block matmuls.

- bf16+SR and e4m3 reach a final eval loss within 2% of fp32 (the issue's bar);
- so does Adam's first moment in e4m3 with block scales (--opt-m-dtype e4m3 --opt-v-dtype bf16, bf16 weights);
- at a small learning rate, where most Adam updates are below half a bf16 ulp of the weight they
  update, bf16 with round-to-nearest stalls (the update rounds away) while bf16 with SR keeps learning.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from qtrain.model.llama import LlamaConfig
from qtrain.data.corpus import default_documents
from qtrain.data.token_files import write_token_file
from qtrain.train.loop import run_training
from qtrain.observe.log import read_log
from qtrain.options import Options


BYTE_MODEL = LlamaConfig(model_type="qwen2", vocab_size=256, hidden_size=96, intermediate_size=256,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=True,
                         bos_token_id=0, eos_token_id=0)


def byte_corpus(root) -> tuple[str, str]:
    """Train / eval token files of the embedded corpus' documents as bytes (0 = end of document)."""
    docs = [d.encode("utf-8") for d in default_documents()]
    ids = lambda ds: np.frombuffer(b"".join(d.replace(b"\0", b" ") + b"\0" for d in ds), dtype=np.uint8)
    train, evals = root / "train.bin", root / "eval.bin"
    write_token_file(train, ids(docs[:-20])[:400_000].astype(np.int32), vocab_size=256)
    write_token_file(evals, ids(docs[-20:])[:40_000].astype(np.int32), vocab_size=256)
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text(json.dumps(BYTE_MODEL.to_hf_dict(dtype="float32")))
    return str(train), str(evals)


LR_NOTE = """Why lr 1e-3: at 3e-3 this 60-step run is chaotic. FP8 perturbs every gradient by ~7% (per-tensor
scaling at these tiny shapes), and the final eval loss then moved by -1.8%..+8% against fp32 depending on the
seed (fp32 / e4m3: 3.160 / 3.176 at seed 3, 2.943 / 3.180 at seed 4, 3.056 / 2.999 at seed 5; measured in
session 3), so a single-seed 2% comparison tested luck. At 1e-3 every low-precision run of this file stayed
within 0.35% of fp32 at each of seeds 3, 4 and 5, and fp32 itself still learns (5.55 -> 3.14..3.17)."""


def train(tmp_path, tag: str, **kw) -> tuple[float, list[float]]:
    train_file, eval_file = str(tmp_path / "train.bin"), str(tmp_path / "eval.bin")
    base = dict(model=str(tmp_path / "model"), from_scratch=True, train_file=train_file, eval_file=eval_file,
                batch_size=8, seq_len=64, grad_accumulation=1, steps=60, learning_rate=1e-3, warmup=5,
                final_lr_fraction=0.1, eval_every_n_steps=1000, eval_num_steps=0, seed=3, device="cpu",
                compile="off", out_dir=str(tmp_path / f"out-{tag}"), checkpoint_dir=str(tmp_path / f"ckpt-{tag}"),
                log_file=str(tmp_path / f"{tag}.jsonl"), save_training_state=False)
    base.update(kw)
    res = run_training(Options(**base), argv=[])
    losses = [e["loss"] for e in read_log(base["log_file"]) if e["log"] == "step"]
    return res["final_eval_loss"], losses


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("conv")
    byte_corpus(root)
    return root


@pytest.fixture(scope="module")
def fp32_ref(corpus_dir) -> float:
    """Final eval loss of the fp32 run (weights and Adam states), shared by the comparisons."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(corpus_dir)
        ref, _ = train(corpus_dir, "fp32", model_dtype="fp32")
    assert ref < 3.2, f"fp32 run did not learn (final eval {ref:.3f}; uniform over bytes is 5.55)"
    return ref


def test_e4m3_first_moment_within_2_percent_of_fp32(corpus_dir, fp32_ref, monkeypatch):
    """m as e4m3 codes with one fp32 scale per 128-element block, stochastically rounded, v in bf16 (llm.q's
    (bf16, e4m3, bf16) combination). Measured (lr 1e-3, see `LR_NOTE`): -0.34% / -0.12% / -0.01% of fp32 at
    seeds 3 / 4 / 5."""
    monkeypatch.chdir(corpus_dir)
    e4m3_m, _ = train(corpus_dir, "e4m3-m", model_dtype="bf16", opt_m_dtype="e4m3", opt_v_dtype="bf16")
    assert abs(e4m3_m - fp32_ref) <= 0.02 * fp32_ref, (e4m3_m, fp32_ref)


def test_bf16_sr_and_fp8_within_2_percent_of_fp32(corpus_dir, fp32_ref, monkeypatch):
    """The issue's bar. Measured (lr 1e-3, see `LR_NOTE`), final eval loss vs fp32 at seeds 3 / 4 / 5:
    bf16+SR -0.27% / -0.10% / +0.02%, e4m3 matmuls -0.22% / -0.09% / -0.00%."""
    monkeypatch.chdir(corpus_dir)
    ref = fp32_ref
    bf16, _ = train(corpus_dir, "bf16", model_dtype="bf16", opt_m_dtype="bf16", opt_v_dtype="bf16")
    fp8, _ = train(corpus_dir, "e4m3", model_dtype="fp32", matmul_dtype="e4m3", fp8_policy="all")
    assert abs(bf16 - ref) <= 0.02 * ref, (bf16, ref)
    assert abs(fp8 - ref) <= 0.02 * ref, (fp8, ref)


def test_round_to_nearest_stalls_where_sr_learns(corpus_dir, monkeypatch):
    """lr 1e-5 with bf16 weights: an Adam step moves a weight by ~lr, below half a bf16 ulp for every weight
    with |w| > 256 * lr = 2.6e-3 (most of them: init std is 0.02, norm gains are 1). Round-to-nearest then
    discards the update; SR applies it in expectation. All three runs see the same batches, so the loss
    drops (mean of the first 3 steps minus mean of the last 3) compare paired; measured: fp32 0.084,
    SR 0.085, RN -0.02 (no learning; batch-to-batch noise is ~0.02)."""
    monkeypatch.chdir(corpus_dir)
    kw = dict(model_dtype="bf16", opt_m_dtype="fp32", opt_v_dtype="fp32", learning_rate=1e-5, warmup=0,
              final_lr_fraction=1.0, steps=40)
    drops = {}
    for tag, extra in (("fp32", {"model_dtype": "fp32"}), ("sr", {}), ("rn", {"stochastic_rounding": False})):
        _, losses = train(corpus_dir, f"stall-{tag}", **{**kw, **extra})
        drops[tag] = sum(losses[:3]) / 3 - sum(losses[-3:]) / 3
    assert drops["fp32"] > 0.04, f"the reference run did not learn: {drops}"
    assert drops["sr"] >= 0.7 * drops["fp32"], f"bf16 with SR fell behind fp32: {drops}"
    assert drops["rn"] <= 0.25 * drops["fp32"], f"bf16 with round-to-nearest did not stall: {drops}"
