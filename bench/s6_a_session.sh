#!/usr/bin/env bash
# Session 6, call A on nvidia-h200-x2 (issue 6: Qwen2.5-14B bf16 on one H200, bar 7.5k tokens/s).
# GPU 0: the bf16 GEMM ceiling of the 14B step at 2k-16k tokens per micro-batch, then kernel profiles of one
# b8 x 2 step (Adam moments offloaded) and one b2 x 4 step. GPU 1: throughput of the layouts that fit.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
git rev-parse --short HEAD
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
S='"model":"Qwen2.5-14B","opt_m_dtype":"bf16","opt_v_dtype":"bf16","compile_tuning":false'
OFF='"offload_opt_m":true,"offload_opt_v":true'
gpu0() {
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m bench.gemm_ceiling --model Qwen2.5-14B --tokens 2048,4096,8192,16384 > $OUT/gemm.txt 2>&1
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 bench/profile_step.py "{$S,\"batch\":8,\"accum\":2,\"lmhead_chunks\":8,$OFF,\"top\":30}" > $OUT/prof_b8.txt 2>&1
  CUDA_VISIBLE_DEVICES=0 timeout 180 python3 bench/profile_step.py "{$S,\"batch\":2,\"accum\":4,\"lmhead_chunks\":4,\"top\":30}" > $OUT/prof_b2.txt 2>&1
}
row() {  # $1 tag, $2 JSON, $3 timeout
  CUDA_VISIBLE_DEVICES=1 timeout $3 python3 bench/bench_train.py "[{$S,$2}]" 2>&1 | grep '^{' \
    | sed "s/^{/{\"tag\":\"$1\",/" >> $OUT/rows.jsonl
}
gpu1() {
  row b2x16 '"batch":2,"accum":16,"lmhead_chunks":4,"steps":2,"warmup":1' 150
  row b4x8-rsn '"batch":4,"accum":8,"lmhead_chunks":4,"recompute_swiglu":true,"recompute_norm":true,"steps":2,"warmup":1' 150
  row b8x16-off "\"batch\":8,\"accum\":16,\"lmhead_chunks\":8,$OFF,\"steps\":2,\"warmup\":1" 200
}
echo "start $(date +%T)"
gpu0 & gpu1 & wait
echo "done $(date +%T)"
cat $OUT/gemm.txt | tail -6
for f in $OUT/prof_b8.txt $OUT/prof_b2.txt; do head -14 $f; done
python3 - <<'PY'
import json, os
for l in open(os.environ.get("OUT", "/tmp/out") + "/rows.jsonl"):
    r = json.loads(l)
    print(f"{r['tag']:10s} tps={r.get('tps')} step_ms={r.get('step_ms')} host_ms={r.get('host_ms')} mfu={r.get('mfu')} peak={r.get('peak_gib')} plan={r.get('plan_gib')} {str(r.get('error',''))[:120]}")
PY
