#!/usr/bin/env bash
# Session-3 probe (one device call): where an e4m3 step's time goes kernel by kernel, and whether batch
# 32 x 1 beats 16 x 2 at 1.5B for qtrain and for the HF + compile baseline.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
timeout 200 python3 bench/profile_step.py '{"model":"Qwen2.5-1.5B","batch":16,"accum":2,"lmhead_chunks":4,"opt_m_dtype":"bf16","opt_v_dtype":"bf16","matmul_dtype":"e4m3","top":45}' 2>&1 | grep -v Warn | tee $OUT/profile_e4m3.txt
B='"steps":5,"lmhead_chunks":4,"opt_m_dtype":"bf16","opt_v_dtype":"bf16"'
timeout 200 python3 bench/bench_train.py "[
 {\"model\":\"Qwen2.5-1.5B\",\"batch\":16,\"accum\":2,$B},
 {\"model\":\"Qwen2.5-1.5B\",\"batch\":32,\"accum\":1,$B}
]" 2>&1 | grep -v Warning | tee $OUT/qtrain.jsonl
timeout 180 python3 .devshared/bench/hf_baseline.py '[{"size":"1.5B","batch":16,"seq":1024,"accum":2,"steps":5,"compile_":true},{"size":"1.5B","batch":32,"seq":1024,"accum":1,"steps":5,"compile_":true}]' 2>&1 | grep -v Warning | tee $OUT/hf.jsonl
