#!/usr/bin/env bash
# One device call (issues 3 and 4): GPU tests of the kernels changed for speed, then qtrain throughput
# (bf16 and e4m3, 0.5B and 1.5B) and the HF + torch.compile baseline in the same call.
# Usage on the device machine: bash bench/perf_session.sh   (needs .devshared/bench with hf_baseline.py)
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; git rev-parse --short HEAD
timeout 150 python3 -m pytest -q -m gpu tests/test_swiglu.py tests/test_adamw.py tests/test_fp8.py \
  tests/test_cross_entropy.py 2>&1 | grep -v Warn | tail -25
B='"batch":16,"accum":2,"steps":6,"lmhead_chunks":4,"opt_m_dtype":"bf16","opt_v_dtype":"bf16"'
timeout 240 python3 bench/bench_train.py "[
 {\"model\":\"Qwen2.5-0.5B\",$B},
 {\"model\":\"Qwen2.5-0.5B\",$B,\"opt_m_dtype\":\"fp32\",\"opt_v_dtype\":\"fp32\"},
 {\"model\":\"Qwen2.5-1.5B\",$B},
 {\"model\":\"Qwen2.5-1.5B\",$B,\"opt_m_dtype\":\"fp32\",\"opt_v_dtype\":\"fp32\"},
 {\"model\":\"Qwen2.5-1.5B\",$B,\"matmul_dtype\":\"e4m3\"},
 {\"model\":\"Qwen2.5-0.5B\",$B,\"matmul_dtype\":\"e4m3\"}
]" 2>&1 | grep -v Warning | tee $OUT/qtrain.jsonl
timeout 200 python3 .devshared/bench/hf_baseline.py '[{"size":"0.5B","batch":16,"seq":1024,"accum":2,"steps":5,"compile_":true},{"size":"1.5B","batch":16,"seq":1024,"accum":2,"steps":5,"compile_":true}]' 2>&1 | grep -v Warning | tee $OUT/hf.jsonl
