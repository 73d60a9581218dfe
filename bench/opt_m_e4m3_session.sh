#!/usr/bin/env bash
# One short device call: --opt-m-dtype e4m3 (block-scaled FP8 Adam m) on the GPU, on the device and offloaded,
# next to bf16 m, 1.5B e4m3 matmuls, same call.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
S='"model":"Qwen2.5-1.5B","batch":16,"accum":2,"steps":3,"warmup":2,"lmhead_chunks":4,"matmul_dtype":"e4m3","opt_v_dtype":"bf16"'
timeout 150 python3 bench/bench_train.py "[{$S,\"opt_m_dtype\":\"e4m3\"},{$S,\"opt_m_dtype\":\"e4m3\",\"offload_opt_m\":true},{$S,\"opt_m_dtype\":\"bf16\"}]" 2>&1 | grep -v Warning | tee $OUT/qtrain.jsonl
