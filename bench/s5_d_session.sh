#!/usr/bin/env bash
# Session 5, call D on nvidia-h200-x2: 1.5B e4m3 / bf16 at 48 x 1 with the new defaults (--sdpa-backend auto =
# cudnn on the H200), with and without --compile-tuning (inductor coordinate-descent tuning), side by side.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -c "
import torch; from qtrain.model.layers import resolve_sdpa_backend
print('auto ->', resolve_sdpa_backend('auto', torch.device('cuda')), torch.cuda.get_device_name())"
S='"model":"Qwen2.5-1.5B","seq":1024,"steps":8,"warmup":2,"accum":1,"batch":48,"lmhead_chunks":6,"opt_m_dtype":"bf16","opt_v_dtype":"bf16"'
ab() {  # $1 GPU, $2 tag, $3 extra JSON, $4 timeout
  CUDA_VISIBLE_DEVICES=$1 timeout $4 python3 bench/bench_train.py "[{$S,$3}]" 2>&1 | grep '^{' \
    | sed "s/^{/{\"tag\":\"$2\",\"gpu\":$1,/" >> $OUT/ab.jsonl
}
E4='"matmul_dtype":"e4m3"'; TU='"compile_tuning":true'
echo "R1 $(date +%T)"
ab 0 e4m3-tuned "$E4,$TU" 230 &
ab 1 bf16-tuned "$TU" 230 &
wait
echo "R2 $(date +%T)"
ab 0 bf16 '"sdpa_backend":"auto"' 120 &
ab 1 e4m3 "$E4" 120 &
wait
echo "done $(date +%T)"
python3 - <<'PY'
import json, os
for l in open(os.environ.get("OUT", "/tmp/out") + "/ab.jsonl"):
    r = json.loads(l)
    print(f"{r['tag']:11s} gpu{r['gpu']} tps={r.get('tps')} step_ms={r.get('step_ms')} peak={r.get('peak_gib')} {str(r.get('error',''))[:80]}")
PY
