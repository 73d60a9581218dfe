"""SOL and MFU: llm.q's worked table (reference/llmq.md §6) and hand-computed values."""
import pytest
import torch

from qtrain.model.llama import LlamaConfig
from qtrain.model.registry import preset
from qtrain.observe.metrics import (PEAK_TABLE, canonical_dtype, device_peaks, mfu_bf16, model_flops_per_token,
                                  ns_per_token, peak_tflops, sol_fraction, sol_ops, sol_tokens_per_second,
                                  transformer_ops)

H100 = "NVIDIA H100 80GB HBM3"

# model, non-embedding params (M), fp8 ns/token, fp8 SOL k tok/s, bf16 ns/token, bf16 SOL k tok/s
LLMQ_TABLE = [
    ("Qwen2.5-0.5B", 357.8, 2042, 489.7, 3127, 319.8),
    ("Qwen2.5-1.5B", 1310.2, 5654, 176.9, 9627, 103.9),
    ("Qwen2.5-3B", 2774.5, 10755, 93.0, 19168, 52.2),
    ("Qwen2.5-7B", 6525.3, 23709, 42.2, 43496, 23.0),
    ("Qwen2.5-14B", 13212.1, 46301, 21.6, 86364, 11.6),
    ("Qwen2.5-32B", 31205.6, 101366, 9.9, 195990, 5.1),
]


@pytest.mark.parametrize("name,nonemb_m,fp8_ns,fp8_ktps,bf16_ns,bf16_ktps", LLMQ_TABLE)
def test_llmq_worked_table(name, nonemb_m, fp8_ns, fp8_ktps, bf16_ns, bf16_ktps):
    cfg = preset(name)
    for mm, ns_expected, ktps in (("e4m3", fp8_ns, fp8_ktps), ("bf16", bf16_ns, bf16_ktps)):
        ops = sol_ops(cfg, 1024, matmul_dtype=mm, model_dtype="bf16")
        # llm.q's "non-embedding params" is the block matmul count /6 (norms and biases excluded)
        assert ops.blocks // 6 / 1e6 == pytest.approx(nonemb_m, abs=0.05)
        # exact integers with llm.q's truncation ...
        assert ns_per_token(ops, H100, llmq_truncation=True) == ns_expected
        assert round(1e9 / ns_expected / 1e3, 1) == ktps
        # ... and within 0.1% with exact float arithmetic (truncation drops < 3 ns/token)
        ns = ns_per_token(ops, H100)
        assert ns == pytest.approx(ns_expected, rel=1e-3) and ns >= ns_expected
        tps = sol_tokens_per_second(cfg, 1024, matmul_dtype=mm, model_dtype="bf16", device_name=H100)
        assert tps == pytest.approx(1e9 / ns_expected, rel=1e-3)


def test_ops_by_hand_and_dtypes():
    # Qwen2.5-0.5B: L=24, C=896, F=4864, q_dim=896, qkv=64*(14+2*2)=1152, V=151936
    ops = sol_ops(preset("Qwen2.5-0.5B"), 1024, matmul_dtype=torch.float8_e4m3fn, model_dtype=torch.bfloat16)
    assert ops.blocks == 6 * 24 * 896 * (3 * 4864 + 896 + 1152) == 2_146_959_360
    assert ops.lm_head == 6 * 151936 * 896 == 816_807_936
    assert ops.attention == 6 * 24 * 896 * 1024 == 132_120_576
    assert ops.as_list() == [("fp8", ops.blocks), ("bf16", ops.lm_head), ("bf16", ops.attention)]
    # float: 2146959360/(1000*1978.9) + (816807936+132120576)/(1000*989.4)
    assert ns_per_token(ops, H100) == pytest.approx(1084.925 + 959.095, abs=1e-2)


def test_q_dim_differs_from_hidden():
    # Qwen3-style explicit head_dim: o_proj is q_dim x C, not C x C (llm.q would count C*C)
    ops = transformer_ops(n_layers=2, hidden=64, intermediate=128, q_dim=4 * 32, qkv_dim=4 * 32 + 2 * 2 * 32,
                          vocab=1000, seq_len=16)
    assert ops.blocks == 6 * 2 * 64 * (3 * 128 + 128 + 256)
    assert ops.attention == 6 * 2 * 128 * 16
    assert ops.matmul_dtype == ops.model_dtype == "bf16"


def test_world_size_divides_time():
    ops = sol_ops(preset("Qwen2.5-1.5B"), 1024, matmul_dtype="bf16", model_dtype="bf16")
    assert ns_per_token(ops, H100, world=8) == pytest.approx(ns_per_token(ops, H100) / 8)
    cfg = preset("Qwen2.5-1.5B")
    one = sol_tokens_per_second(cfg, 1024, matmul_dtype="bf16", model_dtype="bf16", device_name=H100)
    four = sol_tokens_per_second(cfg, 1024, matmul_dtype="bf16", model_dtype="bf16", device_name=H100, world=4)
    assert four == pytest.approx(4 * one)


@pytest.mark.parametrize("name,bf16,fp8", [
    ("NVIDIA H100 80GB HBM3", 989.4, 1978.9),
    ("NVIDIA H200", 989.4, 1978.9),  # dense, not llm.q's sparse H200 entry
    ("NVIDIA GH200 480GB", 989.4, 1978.9),
    ("NVIDIA H100 PCIe", 756.0, 1513.0),
    ("NVIDIA H100 NVL", 835.0, 1671.0),
    ("NVIDIA A100-SXM4-80GB", 312.0, None),
    ("NVIDIA GeForce RTX 4090", 165.2, 330.3),
    ("NVIDIA L40S", 362.05, 733.0),
    ("NVIDIA L40", 181.0, 362.0),
    ("NVIDIA RTX 6000 Ada Generation", 364.2, 728.5),
    ("NVIDIA B200", 2250.0, 4500.0),
])
def test_peak_table(name, bf16, fp8):
    assert peak_tflops(name, "bf16") == bf16
    assert peak_tflops(name, "e4m3") == fp8
    assert peak_tflops(name, "fp32") == device_peaks(name).tf32
    assert all(p.tf32 < p.bf16 for _, p in PEAK_TABLE)


@pytest.mark.parametrize("device", [None, "", "cpu", "Intel(R) Xeon(R)", "NVIDIA Tesla T4"])
def test_unknown_device_is_none_not_crash(device):
    cfg = preset("Qwen2.5-0.5B")
    assert device_peaks(device) is None
    assert sol_tokens_per_second(cfg, 1024, matmul_dtype="bf16", model_dtype="bf16", device_name=device) is None
    assert mfu_bf16(1e5, cfg, 1024, device) is None
    assert sol_fraction(None, 1000, 1.0) is None


def test_fp8_on_a100_has_no_sol():
    cfg = preset("Qwen2.5-0.5B")
    assert sol_tokens_per_second(cfg, 1024, matmul_dtype="e4m3", model_dtype="bf16",
                                 device_name="NVIDIA A100-SXM4-80GB") is None


def test_sol_fraction():
    # 2000 ns/token, 524288 tokens -> 1.048576 s at SOL; measured 2.097152 s -> 50%
    assert sol_fraction(2000.0, 524288, 2.097152) == pytest.approx(0.5)


def test_dtype_names():
    assert canonical_dtype("e5m2") == canonical_dtype(torch.float8_e5m2) == "fp8"
    assert canonical_dtype(torch.float32) == "fp32"
    with pytest.raises(ValueError, match="int8"):
        canonical_dtype("int8")


def test_model_flops_and_mfu_by_hand():
    cfg = LlamaConfig(model_type="llama", vocab_size=1000, hidden_size=64, intermediate_size=160,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, attention_bias=False,
                      tie_word_embeddings=True, rope_theta=1e4)
    # block: qkv 64*(64+2*32) + o 64*64 + mlp 3*64*160 + 2 norms*64 = 8192 + 4096 + 30720 + 128 = 43136
    # N_matmul = 2*43136 + 64 (final norm) + 1000*64 (tied LM head, counted once) = 150336
    n_matmul = 150_336
    assert model_flops_per_token(cfg, 128) == 6 * n_matmul + 6 * 2 * 64 * 128
    assert model_flops_per_token(cfg, 128, causal=False) == 6 * n_matmul + 12 * 2 * 64 * 128
    untied = cfg.replace(tie_word_embeddings=False)
    assert model_flops_per_token(untied, 128) == model_flops_per_token(cfg, 128)  # embedding lookup is free
    flops = model_flops_per_token(cfg, 128)
    assert mfu_bf16(1e6, cfg, 128, H100) == pytest.approx(1e6 * flops / 989.4e12)
    assert mfu_bf16(2e6, cfg, 128, H100, world=2) == pytest.approx(1e6 * flops / 989.4e12)


def test_mfu_bf16_equals_sol_for_bf16_qwen():
    # For a bf16 run on Qwen2.5 the two conventions differ only by norms/biases (~0.05%)
    cfg = preset("Qwen2.5-1.5B")
    tps = sol_tokens_per_second(cfg, 1024, matmul_dtype="bf16", model_dtype="bf16", device_name=H100)
    assert mfu_bf16(tps, cfg, 1024, H100) == pytest.approx(1.0, rel=1e-3)
