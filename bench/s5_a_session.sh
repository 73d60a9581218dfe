#!/usr/bin/env bash
# Session 5, call A on nvidia-h200-x4. Single-GPU runs go side by side on separate GPUs (one process per GPU,
# nothing shared but the host), then the 4-GPU runs go one at a time.
#   R1/R2: attention backends (bench_attention) and 1.5B e4m3 / bf16 at 48 x 1 with --sdpa-backend flash vs
#          cudnn (issue 4; each variant twice, on different GPUs where it fits), plus the 1-GPU 16 x 2
#          baselines of the scaling sweep.
#   R3:    1.5B at 4 GPUs with all-to-all and sharded weights (issue 8), against those baselines.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
[ -f /tmp/rand.bin ] || python3 -c "
import numpy as np; from qtrain.data.token_files import write_token_file
write_token_file('/tmp/rand.bin', np.random.default_rng(0).integers(0, 151000, 40_000_000, dtype=np.int32), vocab_size=151936)"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
S='"model":"Qwen2.5-1.5B","seq":1024,"steps":8,"warmup":2,"accum":1,"batch":48,"lmhead_chunks":6,"opt_m_dtype":"bf16","opt_v_dtype":"bf16"'
ab() {  # $1 GPU, $2 tag, $3 extra JSON
  CUDA_VISIBLE_DEVICES=$1 timeout 150 python3 bench/bench_train.py "[{$S,$3}]" 2>&1 | grep '^{' \
    | sed "s/^{/{\"tag\":\"$2\",\"gpu\":$1,/" >> $OUT/ab.jsonl
}
base() {  # $1 GPU, $2 dtype: the scaling sweep's 1-GPU run, tokens/s into /tmp/base_$2
  CUDA_VISIBLE_DEVICES=$1 WORK=/tmp/base_$2 PER_RUN=120 bash bench/scaling_session.sh Qwen2.5-1.5B $2 "" > /dev/null
}
E4='"matmul_dtype":"e4m3"'
echo "R1 $(date +%T)"
( CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m bench.bench_attention --models Qwen2.5-0.5B Qwen2.5-1.5B Qwen2.5-7B Qwen2.5-14B \
    2>&1 | grep -v -i warn > $OUT/attention.txt; base 0 bf16 ) &
ab 1 e4m3-flash "$E4,\"sdpa_backend\":\"flash\"" &
ab 2 e4m3-cudnn "$E4,\"sdpa_backend\":\"cudnn\"" &
ab 3 bf16-flash '"sdpa_backend":"flash"' &
wait
echo "R2 $(date +%T)"
ab 0 bf16-cudnn '"sdpa_backend":"cudnn"' &
ab 1 e4m3-cudnn "$E4,\"sdpa_backend\":\"cudnn\"" &
ab 2 e4m3-flash "$E4,\"sdpa_backend\":\"flash\"" &
base 3 e4m3 &
wait
echo "R3 $(date +%T)"
for d in e4m3 bf16; do
  BASE=$(cat /tmp/base_$d.tps 2>/dev/null || echo 0) PER_RUN=85 MANAGERS="--shard-gradients --all-to-all-reduce|--zero-level=3" \
    bash bench/scaling_session.sh Qwen2.5-1.5B $d "4"
done
echo "done $(date +%T)"
tail -n 30 $OUT/attention.txt
python3 - <<'PY'
import json, os
out = os.environ.get("OUT", "/tmp/out")
for l in open(out + "/ab.jsonl"):
    r = json.loads(l)
    print(f"{r['tag']:11s} gpu{r['gpu']} tps={r.get('tps')} step_ms={r.get('step_ms')} peak={r.get('peak_gib')} {str(r.get('error',''))[:80]}")
PY
cat $OUT/scaling.txt
