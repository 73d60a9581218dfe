#!/usr/bin/env bash
# Session 4: 1.5B e4m3 vs bf16 at larger micro-batches (one optimizer step = one micro-batch), same call.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
S='"model":"Qwen2.5-1.5B","seq":1024,"steps":3,"warmup":2,"accum":1,"opt_m_dtype":"bf16","opt_v_dtype":"bf16"'
timeout 560 python3 bench/bench_train.py "[{$S,\"batch\":32,\"lmhead_chunks\":4,\"matmul_dtype\":\"e4m3\"},{$S,\"batch\":32,\"lmhead_chunks\":4},{$S,\"batch\":48,\"lmhead_chunks\":6,\"matmul_dtype\":\"e4m3\"},{$S,\"batch\":48,\"lmhead_chunks\":6},{$S,\"batch\":56,\"lmhead_chunks\":8,\"matmul_dtype\":\"e4m3\"}]" 2>&1 | grep -v -i warn | tee $OUT/batch.jsonl
python3 - <<'PY'
import json, os
for l in open(os.environ.get("OUT", "/tmp/out") + "/batch.jsonl"):
    if l.startswith("{"):
        r = json.loads(l)
        print(f"{r.get('batch')}x{r.get('accum')} {r.get('matmul_dtype','bf16'):5s} chunks={r.get('lmhead_chunks')} "
              f"tps={r.get('tps')} step_ms={r.get('step_ms')} peak={r.get('peak_gib')} {r.get('error','')[:80]}")
PY
