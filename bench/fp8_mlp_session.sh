#!/usr/bin/env bash
# One device call (issue 4): GPU tests of the fused FP8 MLP and its kernels, then 1.5B bf16 vs e4m3
# throughput in the same call, then a kernel profile of the e4m3 step.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
timeout 200 python3 -m pytest -q -m gpu tests/test_fp8_mlp.py tests/test_swiglu.py tests/test_fp8.py 2>&1 | grep -v Warn | tail -15
B='"batch":16,"accum":2,"steps":5,"lmhead_chunks":4,"opt_m_dtype":"bf16","opt_v_dtype":"bf16"'
timeout 200 python3 bench/bench_train.py "[
 {\"model\":\"Qwen2.5-1.5B\",$B,\"matmul_dtype\":\"e4m3\"},
 {\"model\":\"Qwen2.5-1.5B\",$B}
]" 2>&1 | grep -v Warning | tee $OUT/qtrain.jsonl
timeout 150 python3 bench/profile_step.py '{"model":"Qwen2.5-1.5B","batch":16,"accum":2,"lmhead_chunks":4,"opt_m_dtype":"bf16","opt_v_dtype":"bf16","matmul_dtype":"e4m3","top":30}' 2>&1 | grep -v Warn | tee $OUT/profile_e4m3.txt
