#!/usr/bin/env bash
# One short device call: 1.5B e4m3 with FP8 weight copies made once per step (compiled path) against bf16, same call.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
S='"batch":16,"accum":2,"steps":4,"warmup":2,"lmhead_chunks":4,"opt_m_dtype":"bf16","opt_v_dtype":"bf16"'
timeout 200 python3 bench/bench_train.py "[{\"model\":\"Qwen2.5-1.5B\",$S,\"matmul_dtype\":\"e4m3\"},{\"model\":\"Qwen2.5-1.5B\",$S}]" 2>&1 | grep -v Warning | tee $OUT/qtrain.jsonl
