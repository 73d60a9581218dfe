#!/usr/bin/env bash
# Session 6, call D on nvidia-h200-x2. GPU 0: what a compiled 14B-wide block saves on the GPU per recompute
# switch (the plan under-predicted B=4 --recompute-swiglu --recompute-norm by 4%), with and without a
# MUST_RECOMPUTE selective-checkpoint policy. GPU 1: every GPU test.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
echo "start $(date +%T)"
CUDA_VISIBLE_DEVICES=0 timeout 330 python3 -m bench.probe_recompute_saved Qwen2.5-14B > $OUT/probe.txt 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout 330 python3 -m pytest -q -m gpu tests/ -x > $OUT/pytest_gpu.txt 2>&1 &
wait
echo "done $(date +%T)"
grep "^sac" $OUT/probe.txt; tail -4 $OUT/pytest_gpu.txt
