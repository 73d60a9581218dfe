#!/usr/bin/env bash
# Session 5, call D's follow-ups, run on the same warm nvidia-h200-x2 right after s5_d_session.sh (so the
# compiled kernels were cached): 48 x 1 with GPUs swapped and a third tuned pair, then 32 x 1 tuned, swapped.
# (Run at 7d267b6 as two inline commands; this script is those commands.)
set -u
export PYTHONPATH=. OUT=${OUT:-/tmp/out}
S48='"model":"Qwen2.5-1.5B","seq":1024,"steps":8,"warmup":2,"accum":1,"batch":48,"lmhead_chunks":6,"opt_m_dtype":"bf16","opt_v_dtype":"bf16"'
S32='"model":"Qwen2.5-1.5B","seq":1024,"steps":8,"warmup":2,"accum":1,"batch":32,"lmhead_chunks":4,"opt_m_dtype":"bf16","opt_v_dtype":"bf16","compile_tuning":true'
ab() {  # $1 GPU, $2 tag, $3 settings, $4 extra JSON
  CUDA_VISIBLE_DEVICES=$1 timeout 200 python3 bench/bench_train.py "[{$3,$4}]" 2>&1 | grep '^{' \
    | sed "s/^{/{\"tag\":\"$2\",\"gpu\":$1,/" >> $OUT/ab.jsonl
}
E4='"matmul_dtype":"e4m3"'; TU='"compile_tuning":true'
ab 0 bf16-tuned "$S48" "$TU" & ab 1 e4m3-tuned "$S48" "$E4,$TU" & wait
ab 0 e4m3 "$S48" "$E4" & ab 1 bf16 "$S48" '"compile":"on"' & wait
ab 0 e4m3-tuned "$S48" "$E4,$TU" & ab 1 bf16-tuned "$S48" "$TU" & wait
ab 0 e4m3-tuned-32 "$S32" "$E4" & ab 1 bf16-tuned-32 "$S32" '"compile":"on"' & wait
ab 1 e4m3-tuned-32 "$S32" "$E4" & ab 0 bf16-tuned-32 "$S32" '"compile":"on"' & wait
python3 -c "
import json
for l in open('$OUT/ab.jsonl'):
    r = json.loads(l); print(r['tag'], r['gpu'], r.get('tps'), r.get('step_ms'), r.get('peak_gib'), str(r.get('error', ''))[:80])"
