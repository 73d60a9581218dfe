#!/usr/bin/env bash
# One device call (issue 6): Qwen2.5-7B and 14B on one H200, the largest micro-batch without and with host
# offload of the Adam moments (picked with the memory plan), tokens/s and measured peak against the plan.
# Usage on the device machine: bash bench/fit_session.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
C='"steps":2,"warmup":1,"opt_m_dtype":"bf16","opt_v_dtype":"bf16"'
timeout 560 python3 bench/bench_train.py "[
 {\"model\":\"Qwen2.5-14B\",\"batch\":2,\"accum\":16,\"lmhead_chunks\":4,$C},
 {\"model\":\"Qwen2.5-14B\",\"batch\":8,\"accum\":4,\"lmhead_chunks\":4,\"offload_opt_m\":true,\"offload_opt_v\":true,$C},
 {\"model\":\"Qwen2.5-7B\",\"batch\":8,\"accum\":4,\"lmhead_chunks\":4,$C},
 {\"model\":\"Qwen2.5-7B\",\"batch\":16,\"accum\":2,\"lmhead_chunks\":4,\"offload_opt_m\":true,\"offload_opt_v\":true,$C},
 {\"model\":\"Qwen2.5-14B\",\"batch\":32,\"accum\":1,\"lmhead_chunks\":8,\"recompute_block\":true,$C}
]" 2>&1 | grep -v Warning | tee $OUT/fit.jsonl
