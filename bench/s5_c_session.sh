#!/usr/bin/env bash
# Session 5, call C on nvidia-h200-x2: Qwen2.5-7B on 1 and 2 GPUs (issue 8), every gradient manager and
# sharded weights in bf16, zero-1 in e4m3, all with --sdpa-backend cudnn; beside the 1-GPU runs, the cuDNN
# attention layout probe (bench/attention_layouts.py).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
[ -f /tmp/rand.bin ] || python3 -c "
import numpy as np; from qtrain.data.token_files import write_token_file
write_token_file('/tmp/rand.bin', np.random.default_rng(0).integers(0, 151000, 40_000_000, dtype=np.int32), vocab_size=151936)"
export BATCH=8 ACCUM=4 EXTRA="--sdpa-backend cudnn" PER_RUN=110
echo "P1 $(date +%T)"
( CUDA_VISIBLE_DEVICES=0 timeout 90 python3 -m bench.attention_layouts 2>&1 | grep -v -i warn > $OUT/layouts.txt
  CUDA_VISIBLE_DEVICES=0 WORK=/tmp/b_e4m3 bash bench/scaling_session.sh Qwen2.5-7B e4m3 "" > /dev/null ) &
CUDA_VISIBLE_DEVICES=1 WORK=/tmp/b_bf16 bash bench/scaling_session.sh Qwen2.5-7B bf16 "" > /dev/null &
wait
echo "P2 $(date +%T)"
BASE=$(cat /tmp/b_bf16.tps 2>/dev/null || echo 0) PER_RUN=95 bash bench/scaling_session.sh Qwen2.5-7B bf16 "2"
echo "P3 $(date +%T)"
BASE=$(cat /tmp/b_e4m3.tps 2>/dev/null || echo 0) PER_RUN=95 MANAGERS="--zero-level=1" bash bench/scaling_session.sh Qwen2.5-7B e4m3 "2"
echo "done $(date +%T)"
cat $OUT/layouts.txt
cat $OUT/scaling.txt
