#!/usr/bin/env bash
# Session 4, first device call: e4m3 Adam m on the GPU (opt_m_e4m3_session.sh), then where time goes in the
# 1.5B e4m3 step (top kernels) and in a 14B bf16 step (b2, the layout of the best 14B row).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
bash bench/opt_m_e4m3_session.sh
timeout 150 python3 bench/profile_step.py '{"model":"Qwen2.5-1.5B","batch":16,"accum":2,"lmhead_chunks":4,"matmul_dtype":"e4m3","opt_m_dtype":"bf16","opt_v_dtype":"bf16","top":40}' 2>&1 | grep -v Warning | tee $OUT/prof15.txt
timeout 240 python3 bench/profile_step.py '{"model":"Qwen2.5-14B","batch":2,"accum":2,"lmhead_chunks":4,"opt_m_dtype":"bf16","opt_v_dtype":"bf16","top":30}' 2>&1 | grep -v Warning | tee $OUT/prof14.txt
