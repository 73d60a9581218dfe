#!/usr/bin/env bash
# Session 4: FP8 GEMMs at the 1.5B shapes with split vs fast accumulation; 14B with e4m3 matmuls (b2 x 16).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
timeout 150 python3 -m bench.bench_fp8_gemm --models Qwen2.5-1.5B --samples 10 2>&1 | grep -v -i warn | tail -25 | tee $OUT/gemm15.txt
timeout 200 python3 bench/bench_train.py '[{"model":"Qwen2.5-14B","batch":2,"accum":16,"steps":2,"warmup":1,"lmhead_chunks":4,"opt_m_dtype":"bf16","opt_v_dtype":"bf16","matmul_dtype":"e4m3"}]' 2>&1 | grep -v -i warn | tee $OUT/e4m3_14b.jsonl
