#!/usr/bin/env bash
# Session 4, nvidia-h200-x2: Qwen2.5-1.5B e4m3 matmuls, 1 vs 2 GPUs, per gradient manager and with sharded
# weights (plain, persistent FP8 copies, offloaded FP8 copies); same counting as dp_session.sh.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -c "
import numpy as np; from qtrain.data.token_files import write_token_file
write_token_file('/tmp/rand.bin', np.random.default_rng(0).integers(0, 151000, 40_000_000, dtype=np.int32), vocab_size=151936)"
for variant in "1 " "2 --shard-gradients" "2 --shard-gradients --all-to-all-reduce" "2 --zero-level 1" "2 --zero-level 3" "2 --zero-level 3 --persistent-quants" "2 --zero-level 3 --persistent-quants --offload-quants"; do
  set -- $variant; g=$1; shift
  timeout 95 python3 -m qtrain.cli.main train --model Qwen2.5-1.5B --from-scratch --train-file /tmp/rand.bin --gpus $g "$@" \
    --matmul-dtype e4m3 --steps 6 --batch-size 16 --grad-accumulation 2 --seq-len 1024 --lmhead-chunks 4 --opt-m-dtype bf16 --opt-v-dtype bf16 \
    --eval-num-steps 0 --no-save-training-state --out-dir /tmp/o --log-file /tmp/dp.jsonl --lr 1e-4 > /tmp/dp.txt 2>&1
  python3 -c "
import json; ev=[json.loads(l) for l in open('/tmp/dp.jsonl')]; s=[x for x in ev if x['log']=='step']
m=[x['peak'] for x in ev if x['log']=='memory']; p=[x['device_total'] for x in ev if x['log']=='memory-plan']
t=[x['tokens_per_s'] for x in s[3:]]; G=2**30
print('DP e4m3 gpus=$g $*', 'tps', round(sum(t)/max(len(t),1)), 'steps', len(s), 'loss', s[-1]['loss'] if s else None,
      'peak_gib', round(max(m)/G, 2) if m else None, 'plan_gib', round(p[0]/G, 2) if p else None)" 2>/dev/null || (echo "FAILED gpus=$g $*"; grep -v -i warn /tmp/dp.txt | tail -4)
  rm -f /tmp/dp.jsonl
done 2>&1 | tee $OUT/dp_e4m3.txt
