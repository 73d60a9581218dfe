#!/usr/bin/env bash
# Session 4: opaque abs-max of output gradients in compiled backwards (grad_amax_op) vs inductor's fused
# reduction, and e4m3 vs bf16, at 1.5B b48 x 1, interleaved and repeated in one call; FP8 GPU tests;
# sharded weights with persistent / offloaded FP8 copies (1 GPU) as a smoke run.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
timeout 150 python3 -m pytest -q -m gpu -p no:logging -p no:cacheprovider --tb=short tests/test_fp8.py > $OUT/gpu_tests.txt 2>&1; tail -3 $OUT/gpu_tests.txt
S='"model":"Qwen2.5-1.5B","seq":1024,"steps":3,"warmup":2,"accum":1,"batch":48,"lmhead_chunks":6,"opt_m_dtype":"bf16","opt_v_dtype":"bf16"'
E="{$S,\"matmul_dtype\":\"e4m3\"}"; EO="{$S,\"matmul_dtype\":\"e4m3\",\"grad_amax_op\":false}"; B="{$S}"
timeout 330 python3 bench/bench_train.py "[$E,$B,$EO,$E,$B,$EO]" 2>&1 | grep -v -i warn | tee $OUT/amax.jsonl
P='"model":"Qwen2.5-1.5B","seq":1024,"steps":2,"warmup":1,"accum":2,"batch":16,"lmhead_chunks":4,"opt_m_dtype":"bf16","opt_v_dtype":"bf16","matmul_dtype":"e4m3","shard_weights":true'
timeout 200 python3 bench/bench_train.py "[{$P},{$P,\"persistent_quants\":true},{$P,\"persistent_quants\":true,\"offload_quants\":true}]" 2>&1 | grep -v -i warn | tee $OUT/pq.jsonl
python3 - <<'PY'
import json, os
for f in ("amax.jsonl", "pq.jsonl"):
    for l in open(os.environ.get("OUT", "/tmp/out") + "/" + f):
        if l.startswith("{"):
            r = json.loads(l)
            print(f"{r.get('batch')}x{r.get('accum')} {r.get('matmul_dtype','bf16'):5s} amax_op={r.get('grad_amax_op', True)!s:5s} "
                  f"pq={r.get('persistent_quants', False)!s:5s} oq={r.get('offload_quants', False)!s:5s} sw={r.get('shard_weights', False)!s:5s} "
                  f"tps={r.get('tps')} step_ms={r.get('step_ms')} peak={r.get('peak_gib')} plan={r.get('plan_gib')} loss={r.get('loss')} {r.get('error','')[:200]}")
PY
