"""Throughput metrics: llm.q's speed-of-light (SOL) estimate and a BF16-equivalent MFU.

SOL (llm.q `src/utilities/sol.cpp`, reference/llmq.md §6) is the time one token would take if every
matmul ran at the spec-sheet peak *of the dtype it runs in*. Per-token FLOPs, in three groups (the block terms are
the family's statements, `ModelFamily.matmuls` and `attention_flops`; for the Llama family):

  blocks     6·L·C·(3·F + q_dim + qkv_dim)   matmul dtype (fp8 for --matmul-dtype e4m3)
  LM head    6·V·C                            model dtype (once, tied or not: the embedding lookup is no matmul)
  attention  6·L·q_dim·T                      model dtype (causal half of 12·L·q_dim·T)

time/token = Σ count / peak[dtype], divided by the number of GPUs; SOL tok/s = 1 / that; a step's
SOL% = (time/token · step tokens) / step time. Norm weights and biases are ignored, as in llm.q.

Differences from llm.q, both invisible for Qwen2.5/Llama (q_dim == C) and the worked table in §6:
* llm.q counts the attention output projection as C·C; here q_dim·C, which differs for Qwen3-style
  models whose explicit head_dim makes q_dim != C.
* llm.q truncates twice to integers (FLOPs/1000, then ns per group): up to ~3 ns/token, ~0.1% for
  0.5B. We keep floats; `ns_per_token(..., llmq_truncation=True)` reproduces llm.q's integers exactly.

The peak table is keyed by a substring of the device name (`torch.cuda.get_device_name()`), so
variants (H100 "80GB HBM3", H200, GH200) resolve without an exact-name list. All figures are *dense*
(no 2:4 sparsity). H200 maps to the H100 SXM numbers (same GH100 compute); llm.q has no H200 key, and
its unused H200 entry carries the sparse figures (reference/peers.md §1.1). FP8 uses the FP32-accumulate
rate (RTX 4090: 330.3, half its FP16-accumulate rate). An unknown device (or a CPU) has no SOL: every
function returns None instead of raising.

MFU follows the BF16-equivalent convention recommended in reference/peers.md §1.3: model FLOPs per
token = 6·N_matmul + 6·L·q_dim·T (torchtitan's N_matmul: all parameters except the input embedding,
the LM head counted once even when tied; of a Mixture-of-Experts only the active ones: the router, the k of E routed
experts a token runs, shared experts, the family's `matmuls` statements saying which matrices are expert stacks)
divided by the *BF16* dense peak, also for FP8 runs, so numbers compare across dtypes. Attention is counted
causal-halved by default (as llm.q's SOL and Megatron-Bridge); `causal=False` gives torchtitan's 12·L·q_dim·T count.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from qtrain.model.config import ModelConfig
from qtrain.model.registry import family_of
from qtrain.model.weights import num_params, sum_over_layers

DTYPES = ("fp32", "bf16", "fp16", "fp8")

_DTYPE_ALIASES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "tf32": "fp32",  # fp32 matmuls run as TF32
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "fp8": "fp8", "e4m3": "fp8", "e5m2": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
}


def canonical_dtype(dtype: object) -> str:
    """'bf16' / torch.bfloat16 / 'e4m3' ... -> one of DTYPES."""
    name = str(dtype).lower().removeprefix("torch.")
    try:
        return _DTYPE_ALIASES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r} for throughput metrics; known: "
                         f"{', '.join(sorted(_DTYPE_ALIASES))}") from None


@dataclass(frozen=True)
class PeakTFlops:
    """Dense tensor-core peaks in TFLOP/s; None where the chip has no such unit (A100: no FP8)."""

    tf32: float
    bf16: float
    fp16: float  # with FP32 accumulate
    fp8: float | None  # with FP32 accumulate

    def for_dtype(self, dtype: object) -> float | None:
        return getattr(self, {"fp32": "tf32"}.get(d := canonical_dtype(dtype), d))


_H100_SXM = PeakTFlops(tf32=494.7, bf16=989.4, fp16=989.4, fp8=1978.9)

# (substring, peaks); first match wins (case-insensitive), so specific names come before generic ones.
# Sources: NVIDIA datasheets/whitepapers as tabulated in llm.q sol.cpp; B200 from the HGX B200 datasheet.
PEAK_TABLE: tuple[tuple[str, PeakTFlops], ...] = (
    ("H100 PCIe", PeakTFlops(tf32=378.0, bf16=756.0, fp16=756.0, fp8=1513.0)),
    ("H100 NVL", PeakTFlops(tf32=417.5, bf16=835.0, fp16=835.0, fp8=1671.0)),
    ("H100", _H100_SXM),  # "NVIDIA H100 80GB HBM3" (SXM5)
    ("H200", _H100_SXM),  # "NVIDIA H200", "NVIDIA GH200 ...": same compute as H100 SXM
    ("B200", PeakTFlops(tf32=1100.0, bf16=2250.0, fp16=2250.0, fp8=4500.0)),
    ("A100", PeakTFlops(tf32=156.0, bf16=312.0, fp16=312.0, fp8=None)),
    ("RTX 4090", PeakTFlops(tf32=82.6, bf16=165.2, fp16=165.2, fp8=330.3)),
    ("L40S", PeakTFlops(tf32=183.0, bf16=362.05, fp16=362.05, fp8=733.0)),
    ("L40", PeakTFlops(tf32=90.5, bf16=181.0, fp16=181.0, fp8=362.0)),
    ("RTX 6000 Ada", PeakTFlops(tf32=182.1, bf16=364.2, fp16=364.2, fp8=728.5)),
)


def device_peaks(device_name: str | None) -> PeakTFlops | None:
    """Peaks for a device name, or None for a CPU / unknown device (no SOL, no crash)."""
    if not device_name:
        return None
    name = device_name.lower()
    for key, peaks in PEAK_TABLE:
        if key.lower() in name:
            return peaks
    return None


def peak_tflops(device_name: str | None, dtype: object) -> float | None:
    peaks = device_peaks(device_name)
    return None if peaks is None else peaks.for_dtype(dtype)


# ---- SOL (llm.q) ----

@dataclass(frozen=True)
class SolOps:
    """Per-token FLOPs of one training step (forward + backward), in the three SOL groups."""

    blocks: int
    lm_head: int
    attention: int
    matmul_dtype: str  # dtype of `blocks`
    model_dtype: str  # dtype of `lm_head` and `attention`

    def as_list(self) -> list[tuple[str, int]]:
        return [(self.matmul_dtype, self.blocks), (self.model_dtype, self.lm_head),
                (self.model_dtype, self.attention)]


def transformer_ops(*, n_layers: int, hidden: int, intermediate: int, q_dim: int, qkv_dim: int, vocab: int,
                    seq_len: int, matmul_dtype: object = "bf16", model_dtype: object = "bf16") -> SolOps:
    """llm.q's FLOP model from plain integers (Python ints: no overflow)."""
    L, C, F, T = n_layers, hidden, intermediate, seq_len
    return SolOps(blocks=6 * L * C * (3 * F + q_dim + qkv_dim), lm_head=6 * vocab * C,
                  attention=6 * L * q_dim * T, matmul_dtype=canonical_dtype(matmul_dtype),
                  model_dtype=canonical_dtype(model_dtype))


def sol_ops(cfg: ModelConfig, seq_len: int, *, matmul_dtype: object = "bf16",
            model_dtype: object = "bf16") -> SolOps:
    """llm.q's FLOP model of `cfg` from its family's statements: 6 x the block matrices' weights per token, 3 x the
    forward attention FLOPs (`transformer_ops` for the Llama family)."""
    family = family_of(cfg)
    weights = sum_over_layers(cfg, lambda layer: sum(m.weights_per_token for m in family.matmuls(cfg, layer).values()))
    attention = sum_over_layers(cfg, lambda layer: family.attention_flops(cfg, layer, seq_len))
    return SolOps(blocks=6 * weights, lm_head=6 * cfg.vocab_size * cfg.hidden_size, attention=3 * attention,
                  matmul_dtype=canonical_dtype(matmul_dtype), model_dtype=canonical_dtype(model_dtype))


def ns_per_token(ops: SolOps | Sequence[tuple[str, int]], device_name: str | None, *, world: int = 1,
                 llmq_truncation: bool = False) -> float | None:
    """SOL nanoseconds per token over `world` GPUs; None when the device (or a dtype's unit) is unknown.

    `llmq_truncation` reproduces llm.q's integer arithmetic: trunc(trunc(count/1000)/peak) per group.
    """
    peaks = device_peaks(device_name)
    if peaks is None:
        return None
    items = ops.as_list() if isinstance(ops, SolOps) else list(ops)
    total = 0.0
    for dtype, count in items:
        peak = peaks.for_dtype(dtype)
        if peak is None:
            return None
        # count FLOP / (peak·1e12 FLOP/s) = count/peak·1e-12 s = count/(1000·peak) ns
        total += math.trunc((count // 1000) / peak) if llmq_truncation else count / (1000.0 * peak)
    return total / world


def sol_tokens_per_second(cfg: ModelConfig, seq_len: int, *, matmul_dtype: object, model_dtype: object,
                          device_name: str | None, world: int = 1) -> float | None:
    """Tokens/s all `world` GPUs together would reach at spec-sheet peak; None on an unknown device."""
    ns = ns_per_token(sol_ops(cfg, seq_len, matmul_dtype=matmul_dtype, model_dtype=model_dtype),
                      device_name, world=world)
    return None if not ns else 1e9 / ns


def sol_fraction(ns_per_tok: float | None, step_tokens: int, step_seconds: float) -> float | None:
    """Fraction of speed-of-light a step reached: SOL time for its tokens / its measured time."""
    if ns_per_tok is None or step_seconds <= 0:
        return None
    return ns_per_tok * step_tokens * 1e-9 / step_seconds


# ---- MFU (BF16-equivalent) ----

def model_flops_per_token(cfg: ModelConfig, seq_len: int, *, causal: bool = True) -> int:
    """6·N_matmul + attention. N_matmul = every parameter but the input embedding, LM head counted once, less the
    experts a token is not routed to (MFU counts the FLOPs a token runs, not the weights the model stores)."""
    n_matmul = num_params(cfg, include_embedding=False)
    if cfg.tie_word_embeddings:
        n_matmul += cfg.vocab_size * cfg.hidden_size  # the tied matrix still runs as the LM head matmul
    family = family_of(cfg)
    # an expert stack's statement runs k / E of its weights per token (`MatmulSpec.rows`); a dense matrix all of them
    # (0 here, an int: the dense families' count is unchanged)
    idle = sum_over_layers(cfg, lambda layer: sum(m.weights - m.weights_per_token
                                                  for m in family.matmuls(cfg, layer).values()))
    n_matmul -= round(idle)
    attn = (3 if causal else 6) * sum_over_layers(cfg, lambda layer: family.attention_flops(cfg, layer, seq_len))
    return 6 * n_matmul + attn


def mfu_bf16(tokens_per_s: float, cfg: ModelConfig, seq_len: int, device_name: str | None, *, world: int = 1,
             causal: bool = True) -> float | None:
    """Model FLOP utilisation against the BF16 dense peak (also for FP8 runs), as a fraction.

    `tokens_per_s` is the total over `world` GPUs. None on an unknown device.
    """
    peak = peak_tflops(device_name, "bf16")
    if peak is None:
        return None
    return tokens_per_s * model_flops_per_token(cfg, seq_len, causal=causal) / (world * peak * 1e12)
