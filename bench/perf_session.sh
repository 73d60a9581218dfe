#!/usr/bin/env bash
# One device call (issues 3 and 4): GPU tests of the fused CE kernel and of FP8 inside compiled blocks, then
# qtrain throughput variants (fused CE, CUDA graphs, batch, Adam state dtypes, e4m3) and kernel-category
# profiles. Usage on the device machine: bash bench/perf_session.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 170 python3 -m pytest -q -m gpu tests/test_cross_entropy.py tests/test_fp8.py 2>&1 | tail -8
B='"batch":16,"accum":2,"steps":6,"lmhead_chunks":4,"opt_m_dtype":"bf16","opt_v_dtype":"bf16"'
timeout 330 python3 bench/bench_train.py "[
 {\"model\":\"Qwen2.5-0.5B\",$B},
 {\"model\":\"Qwen2.5-0.5B\",$B,\"fused_ce\":true},
 {\"model\":\"Qwen2.5-0.5B\",$B,\"fused_ce\":true,\"use_cuda_graphs\":true},
 {\"model\":\"Qwen2.5-0.5B\",\"batch\":32,\"accum\":1,\"steps\":6,\"lmhead_chunks\":8,\"opt_m_dtype\":\"bf16\",\"opt_v_dtype\":\"bf16\",\"fused_ce\":true},
 {\"model\":\"Qwen2.5-0.5B\",\"batch\":16,\"accum\":2,\"steps\":6,\"lmhead_chunks\":4,\"fused_ce\":true},
 {\"model\":\"Qwen2.5-0.5B\",$B,\"fused_ce\":true,\"matmul_dtype\":\"e4m3\"},
 {\"model\":\"Qwen2.5-1.5B\",$B,\"fused_ce\":true},
 {\"model\":\"Qwen2.5-1.5B\",$B,\"fused_ce\":true,\"matmul_dtype\":\"e4m3\"},
 {\"model\":\"Qwen2.5-1.5B\",\"batch\":16,\"accum\":2,\"steps\":6,\"lmhead_chunks\":4,\"fused_ce\":true}
]" 2>&1 | grep -v Warning | tee $OUT/qtrain.jsonl
timeout 60 python3 bench/profile_step.py "{\"model\":\"Qwen2.5-1.5B\",$B,\"fused_ce\":true}" 2>&1 | grep -v Warn | tee $OUT/prof15.txt
timeout 60 python3 bench/profile_step.py "{\"model\":\"Qwen2.5-0.5B\",$B,\"fused_ce\":true}" 2>&1 | grep -v Warn | tee $OUT/prof05.txt
timeout 60 python3 bench/profile_step.py "{\"model\":\"Qwen2.5-1.5B\",$B,\"fused_ce\":true,\"matmul_dtype\":\"e4m3\"}" 2>&1 | grep -v Warn | tee $OUT/prof15fp8.txt
