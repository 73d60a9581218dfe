#!/usr/bin/env bash
# Session 4: where the 1.5B step idles (GPU gaps by the kernel that ends them), e4m3 and bf16, same call.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
C='"model":"Qwen2.5-1.5B","batch":16,"accum":2,"lmhead_chunks":4,"opt_m_dtype":"bf16","opt_v_dtype":"bf16","top":40'
timeout 150 python3 bench/profile_step.py "{$C,\"matmul_dtype\":\"e4m3\"}" 2>&1 | grep -v -i warn | tee $OUT/gaps_e4m3.txt
timeout 150 python3 bench/profile_step.py "{$C}" 2>&1 | grep -v -i warn | tee $OUT/gaps_bf16.txt
