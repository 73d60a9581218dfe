#!/usr/bin/env bash
# Session 6, call C on nvidia-h200-x2 (issue 6), after the device-name fix of 79f1d2d's streaming.
# GPU 0: the GPU test of the streamed update; the offloaded 14B update alone, old vs new streaming (m, v; then
# m, v and the weight shards). GPU 1: Qwen2.5-7B at 256k tokens per step, moments offloaded or not.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
S='"model":"Qwen2.5-7B","opt_m_dtype":"bf16","opt_v_dtype":"bf16","compile_tuning":false,"steps":2,"warmup":1'
gpu0() {
  CUDA_VISIBLE_DEVICES=0 timeout 100 python3 -m pytest -q -m gpu tests/test_offload_optimizer.py > $OUT/pytest.txt 2>&1
  CUDA_VISIBLE_DEVICES=0 timeout 170 python3 -m bench.bench_offload_update --model Qwen2.5-14B > $OUT/offload.txt 2>&1
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m bench.bench_offload_update --model Qwen2.5-14B --master > $OUT/offload_master.txt 2>&1
}
row() {  # $1 tag, $2 JSON, $3 timeout
  CUDA_VISIBLE_DEVICES=1 timeout $3 python3 bench/bench_train.py "[{$S,$2}]" 2>&1 | grep '^{' \
    | sed "s/^{/{\"tag\":\"$1\",/" >> $OUT/rows.jsonl
}
gpu1() {
  row 7B-b16x16-off '"batch":16,"accum":16,"lmhead_chunks":8,"offload_opt_m":true,"offload_opt_v":true' 200
  row 7B-b8x32 '"batch":8,"accum":32,"lmhead_chunks":4' 200
}
echo "start $(date +%T)"
gpu0 & gpu1 & wait
echo "done $(date +%T)"
tail -3 $OUT/pytest.txt
tail -6 $OUT/offload.txt; tail -6 $OUT/offload_master.txt
python3 - <<'PY'
import json, os
for l in open(os.environ.get("OUT", "/tmp/out") + "/rows.jsonl"):
    r = json.loads(l)
    print(f"{r['tag']:15s} tps={r.get('tps')} step_ms={r.get('step_ms')} mfu={r.get('mfu')} peak={r.get('peak_gib')} plan={r.get('plan_gib')} {str(r.get('error',''))[:150]}")
PY
