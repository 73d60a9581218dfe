#!/usr/bin/env bash
# Session 4, nvidia-h200-x4 (lent late, ~6 device minutes left): Qwen2.5-1.5B e4m3, 4 GPUs with the two best
# managers of the 2-GPU runs, then 1 GPU on the same machine; same counting as dp_session.sh.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -c "
import numpy as np; from qtrain.train.data import write_token_file
write_token_file('/tmp/rand.bin', np.random.default_rng(0).integers(0, 151000, 40_000_000, dtype=np.int32), vocab_size=151936)"
for variant in "4 --zero-level 1" "1 " "4 --shard-gradients"; do
  set -- $variant; g=$1; shift
  timeout 70 python3 -m qtrain.cli.main train --model Qwen2.5-1.5B --from-scratch --train-file /tmp/rand.bin --gpus $g "$@" \
    --matmul-dtype e4m3 --steps 6 --batch-size 16 --grad-accumulation 2 --seq-len 1024 --lmhead-chunks 4 --opt-m-dtype bf16 --opt-v-dtype bf16 \
    --eval-num-steps 0 --no-save-training-state --out-dir /tmp/o --log-file /tmp/dp.jsonl --lr 1e-4 > /tmp/dp.txt 2>&1
  python3 -c "
import json; ev=[json.loads(l) for l in open('/tmp/dp.jsonl')]; s=[x for x in ev if x['log']=='step']
m=[x['peak'] for x in ev if x['log']=='memory']; t=[x['tokens_per_s'] for x in s[3:]]; G=2**30
print('DP e4m3 gpus=$g $*', 'tps', round(sum(t)/max(len(t),1)), 'steps', len(s), 'peak_gib', round(max(m)/G, 2) if m else None)" 2>/dev/null || (echo "FAILED gpus=$g $*"; grep -v -i warn /tmp/dp.txt | tail -3)
  rm -f /tmp/dp.jsonl
done 2>&1 | tee -a $OUT/dp4.txt
