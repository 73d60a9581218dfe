#!/usr/bin/env bash
# One device call (issues 3 and 4, session 3): qtrain bf16 / e4m3 at 0.5B and 1.5B, two batch layouts with the
# same 32k tokens per optimizer step (16 x 2 and 32 x 1), and HF + torch.compile in the same call.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
S='"steps":5,"warmup":2,"lmhead_chunks":4,"opt_m_dtype":"bf16","opt_v_dtype":"bf16"'
B1="\"batch\":16,\"accum\":2,$S"; B2="\"batch\":32,\"accum\":1,$S"
timeout 420 python3 bench/bench_train.py "[
 {\"model\":\"Qwen2.5-1.5B\",$B1,\"matmul_dtype\":\"e4m3\"},
 {\"model\":\"Qwen2.5-1.5B\",$B1},
 {\"model\":\"Qwen2.5-1.5B\",$B2,\"matmul_dtype\":\"e4m3\"},
 {\"model\":\"Qwen2.5-1.5B\",$B2},
 {\"model\":\"Qwen2.5-0.5B\",$B1},
 {\"model\":\"Qwen2.5-0.5B\",$B1,\"matmul_dtype\":\"e4m3\"},
 {\"model\":\"Qwen2.5-1.5B\",$B1,\"opt_m_dtype\":\"fp32\",\"opt_v_dtype\":\"fp32\"}
]" 2>&1 | grep -v Warning | tee $OUT/qtrain.jsonl
timeout 170 python3 .devshared/bench/hf_baseline.py '[{"size":"0.5B","batch":16,"seq":1024,"accum":2,"steps":5,"compile_":true},{"size":"1.5B","batch":16,"seq":1024,"accum":2,"steps":5,"compile_":true}]' 2>&1 | grep -v Warning | tee $OUT/hf.jsonl
