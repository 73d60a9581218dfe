"""The names and defaults of the model's execution choices, without torch: what `qtrain.options` and the CLI list
and validate (importing torch for them cost every `qtrain` command seconds). Their meaning lives with their code:
the attention backends in `layers.py`, the FP8 policies and their thresholds in `fp8_policy.py` (its docstring
says how the thresholds were measured)."""
from __future__ import annotations

SDPA_BACKENDS = ("auto", "flash", "cudnn", "math")  # torch's memory-efficient kernel has no GQA: left out
DOCUMENT_ATTENTION = ("auto", "varlen", "masked")  # --document-attention: kernels/document_attention.py
CONTEXT_PARALLEL_MODES = ("allgather", "ring")  # --context-parallel-mode: parallel/context.py
FP8_POLICIES = ("all", "auto")
# --delta-rule-precision: the Triton delta rule's products (kernels/delta_rule/gated_delta_rule_triton.PRECISIONS)
DELTA_RULE_PRECISIONS = ("fp32", "tf32")
# the option's values: auto = AUTO_DELTA_RULE_PRECISION (plan/resolution.py resolves it)
DELTA_RULE_PRECISION_OPTIONS = ("auto", *DELTA_RULE_PRECISIONS)
# tf32 measured 1.25x fp32 a Qwen3.5-4B step (seq 4096, H100) with the same 30-step loss curve on real text (the
# last 10 steps' mean 7.220 against 7.211, every step within 0.05; BENCHMARKS.md, 2026-12-06)
AUTO_DELTA_RULE_PRECISION = "tf32"
FP8_MIN_SIZE = 400  # --fp8-min-size: a linear's GEMM size M*N*K/(M*K+M*N+N*K) from which FP8 pays
FP8_MIN_BLOCK_GFLOP = 2600  # --fp8-min-block-gflop: a block's GFLOP per micro-step from which the GPU sets the pace
# --swiglu-epilogue auto: quack's epilogue GEMMs (kernels/gated_mlp.py) from this many tokens per micro-batch (a rank's
# B x T): against cuBLAS + the SwiGLU kernel, in training on one H100 (BENCHMARKS.md, 2026-12-07): 1.058x at 1.5B and
# 1.021x at 0.5B with 32,768 tokens, 1.053x at 3B with 16,384; 0.996x at 3B with 8,192, 0.964x at 7B with 4,096
SWIGLU_EPILOGUE_MIN_TOKENS = 16384
