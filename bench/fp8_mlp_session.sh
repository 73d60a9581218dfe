#!/usr/bin/env bash
# One device call (issue 4): GPU tests of the fused FP8 MLP and its kernels, kernel tile variants, then
# 1.5B bf16 vs e4m3 throughput in the same call.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
timeout 200 python3 -m pytest -q -p no:logging --tb=short -m gpu tests/test_fp8_mlp.py tests/test_swiglu.py > $OUT/tests.txt 2>&1
grep -E "passed|failed|Error|assert" $OUT/tests.txt | grep -v Warn | tail -30
timeout 120 python3 bench/bench_swiglu_fp8.py 2>&1 | tee $OUT/kernels.txt
B='"batch":16,"accum":2,"steps":5,"lmhead_chunks":4,"opt_m_dtype":"bf16","opt_v_dtype":"bf16"'
timeout 200 python3 bench/bench_train.py "[
 {\"model\":\"Qwen2.5-1.5B\",$B,\"matmul_dtype\":\"e4m3\"},
 {\"model\":\"Qwen2.5-1.5B\",$B}
]" 2>&1 | grep -v Warning | tee $OUT/qtrain.jsonl
