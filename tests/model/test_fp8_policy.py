"""`--fp8-policy auto|all` (model/fp8_policy.py): which block linears run in FP8.

The rule (GEMM size M*N*K / (M*K + M*N + N*K) against --fp8-min-size) on hand-computed shapes, and what the
choice does to a run, each against an independent path: no linear chosen is the bf16 run bit for bit, all four
chosen is `--fp8-policy all` bit for bit, and a mixed choice quantizes exactly the chosen matrices (the cache of
once-per-step copies sees only them, per-call quantization gives the same bits) and trains differently from
both. Sharded weights with persistent e4m3 shards of the chosen matrices equal replicated weights bit for bit.
"""
from __future__ import annotations

import pytest
import torch

from qtrain.model.llama import LlamaConfig
from qtrain.model.registry import preset
from qtrain.model.fp8_policy import block_gflop, choose_fp8, gemm_shapes, gemm_size
from qtrain.options import Options
from qtrain.parallel.weights.quantized import QuantizedWeights
from qtrain.train.trainer import Trainer
from tests.dist_utils import full_params_cpu

STEPS, ACCUM, B, T = 2, 2, 2, 32
CFG = LlamaConfig(model_type="qwen2", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0,
                  tie_word_embeddings=True, attention_bias=True)  # FP8 shapes: multiples of 16
# at M = B*T = 64 tokens: qkv (64, 128, 64) 25.6, o (64, 64, 64) 21.3, up (64, 192, 64) 27.4, down (64, 64, 96) 24.0
MIXED = 25  # -> qkv and up in FP8, o and down not (the MLP then runs as two separate linears)


def test_gemm_sizes_and_the_rule():
    shapes = gemm_shapes(CFG, B * T)
    assert shapes == {"qkv": (64, 128, 64), "o": (64, 64, 64), "up": (64, 192, 64), "down": (64, 64, 96)}
    assert gemm_size(64, 64, 64) == pytest.approx(64 / 3)
    assert gemm_size(64, 128, 64) == 64 * 128 * 64 / (64 * 64 + 64 * 128 + 128 * 64)
    assert choose_fp8(CFG, B * T, "all").fp8 == ("qkv", "o", "up", "down")
    c = choose_fp8(CFG, B * T, "auto", MIXED, 0)
    assert c.fp8 == ("qkv", "up") and c.plain == ("o", "down")
    assert choose_fp8(CFG, B * T, "auto", 24, 0).fp8 == ("qkv", "up", "down")  # a size equal to the threshold: FP8
    assert choose_fp8(CFG, B * T, "auto", 0, 0).fp8 == ("qkv", "o", "up", "down")
    assert choose_fp8(CFG, B * T, "auto", MIXED).fp8 == ()  # the default block threshold: far above a tiny model's
    assert choose_fp8(CFG, B * T).fp8 == ()  # auto is the default
    text = c.describe()
    assert "e4m3 for qkv/up" in text and "bf16 for o/down" in text and "21, 24" in text and "--fp8-min-size 25" in text
    hint = choose_fp8(CFG, B * T, "all", MIXED, 0).describe()
    assert "e4m3 for qkv/o/up/down" in hint and "would keep o/down in bf16" in hint
    with pytest.raises(ValueError, match="fp8 policy"):
        choose_fp8(CFG, B * T, "some")


def test_the_block_threshold_on_real_shapes():
    """Qwen2.5-1.5B: a block's four linears hold 2048x1536 + 1536x1536 + 17920x1536 + 1536x8960 = 46,792,704
    weights, 6 x 4096 x that = 1150 GFLOP per micro-step of 4 x 1024 tokens. Below the default 2600 (1.5B b4 and
    b8, 0.5B up to b16: measured no faster in FP8) no linear is in FP8; at 1.5B b16 and 0.5B b32 (2931) all four
    are (every GEMM size is above 400)."""
    q15, q05 = preset("Qwen2.5-1.5B"), preset("Qwen2.5-0.5B")
    assert block_gflop(q15, 4096) == pytest.approx(6 * 4096 * 46_792_704 / 1e9)
    assert block_gflop(q15, 8192) == pytest.approx(2 * block_gflop(q15, 4096))
    low = choose_fp8(q15, 4096)
    assert low.fp8 == () and low.plain == ("qkv", "o", "up", "down")
    assert choose_fp8(q15, 8192).fp8 == () and choose_fp8(q15, 16384).fp8 == ("qkv", "o", "up", "down")
    assert "1150 GFLOP" in low.describe() and "--fp8-min-block-gflop 2600" in low.describe()
    assert "would run none in FP8" in choose_fp8(q15, 4096, "all").describe()
    assert low.keeps_bf16 and choose_fp8(q15, 4096, "all").keeps_bf16  # the run's start warns
    assert not choose_fp8(q15, 16384).keeps_bf16 and not choose_fp8(q15, 16384, "all").keeps_bf16
    assert choose_fp8(q05, 16384).fp8 == () and choose_fp8(q05, 32768).fp8 == ("qkv", "o", "up", "down")
    assert choose_fp8(q15, 4096, "auto", min_block_gflop=block_gflop(q15, 4096)).fp8 == ("qkv", "o", "up", "down")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.dist_utils import write_model_dir
    return write_model_dir(tmp_path_factory.mktemp("fp8-policy"), CFG)


def trainer(model_dir: str, **kw) -> Trainer:
    base = dict(model=model_dir, from_scratch=True, batch_size=B, seq_len=T, grad_accumulation=ACCUM, device="cpu",
                learning_rate=3e-3, model_dtype="bf16", opt_m_dtype="bf16", opt_v_dtype="bf16", compile="off", seed=5)
    return Trainer(Options(**{**base, **kw}))


def train(tr: Trainer) -> dict:
    g = torch.Generator().manual_seed(0)
    stats = []
    for _ in range(STEPS):
        batches = []
        for _ in range(ACCUM):
            x = torch.randint(0, CFG.vocab_size, (B, T + 1), generator=g)
            batches.append((x[:, :-1], x[:, 1:]))
        stats.append(tr.step(batches, lr=3e-3))
    return {"stats": stats, "weights": full_params_cpu(tr)}


def same(a: dict, b: dict) -> bool:
    return a["stats"] == b["stats"] and all(torch.equal(t, b["weights"][n]) for n, t in a["weights"].items())


@pytest.fixture(scope="module")
def runs(model_dir) -> dict:
    return {"bf16": train(trainer(model_dir)),
            "all": train(trainer(model_dir, matmul_dtype="e4m3", fp8_policy="all")),
            "mixed": train(trainer(model_dir, matmul_dtype="e4m3", fp8_policy="auto", fp8_min_size=MIXED, fp8_min_block_gflop=0))}


def test_nothing_chosen_is_the_bf16_run(model_dir, runs):
    tr = trainer(model_dir, matmul_dtype="e4m3", fp8_policy="auto")
    assert tr.fp8.fp8 == () and tr.model.run.fp8_linears == () and tr.model.run.matmul_dtype == ""  # the bf16 model
    assert same(train(tr), runs["bf16"])


def test_everything_chosen_is_the_all_policy(model_dir, runs):
    assert same(train(trainer(model_dir, matmul_dtype="e4m3", fp8_policy="auto", fp8_min_size=0,
                                     fp8_min_block_gflop=0)), runs["all"])


def test_a_mixed_choice_quantizes_exactly_the_chosen_matrices(model_dir, runs):
    cached = trainer(model_dir, matmul_dtype="e4m3", fp8_policy="auto", fp8_min_size=MIXED, fp8_min_block_gflop=0, persistent_quants=True)
    assert isinstance(cached.weights, QuantizedWeights) and cached.weights.names == ("qkv", "up")
    assert same(train(cached), runs["mixed"])  # once-per-step copies of qkv/up == quantizing them in every call
    assert cached.weights.cache.misses == 2 * CFG.num_hidden_layers * STEPS  # two matrices per layer per step
    assert not same(runs["mixed"], runs["bf16"]) and not same(runs["mixed"], runs["all"])


def test_sharded_persistent_quants_of_a_mixed_choice(model_dir, runs):
    tr = trainer(model_dir, matmul_dtype="e4m3", fp8_policy="auto", fp8_min_size=MIXED, fp8_min_block_gflop=0, persistent_quants=True,
                 zero_level=3)
    assert tr.weights.quants.names == ("qkv", "up")
    assert same(train(tr), runs["mixed"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_mixed_choice_compiled(model_dir):
    """Compiled blocks with qkv/up in FP8 and o/down in bf16 (the MLP as two linears, FP8 up then bf16 down): the
    same losses as the eager blocks, to compile's rounding, and the chosen linears really quantize (the run
    differs from the bf16 one by more than that)."""
    kw = dict(device="cuda", matmul_dtype="e4m3", fp8_policy="auto", fp8_min_size=MIXED, fp8_min_block_gflop=0)
    compiled, eager = train(trainer(model_dir, compile="on", **kw)), train(trainer(model_dir, compile="off", **kw))
    bf16 = train(trainer(model_dir, device="cuda", compile="off"))
    for c, e, b in zip(compiled["stats"], eager["stats"], bf16["stats"]):
        assert abs(c["loss"] - e["loss"]) <= 2e-3 * abs(e["loss"]), (c, e)
    assert any(e["loss"] != b["loss"] for e, b in zip(eager["stats"], bf16["stats"]))
