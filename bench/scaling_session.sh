#!/usr/bin/env bash
# Data-parallel scaling (issue 8): one model and matmul dtype, 1 GPU and then each GPU count in $3 with every
# gradient manager and sharded weights; tokens/s (all GPUs together, steps 4..), efficiency vs the 1-GPU run
# of this call, peak memory of rank 0. Same counting as dp_session.sh.
#   bash bench/scaling_session.sh Qwen2.5-1.5B bf16 "2 4 8"
#   BATCH=8 ACCUM=4 bash bench/scaling_session.sh Qwen2.5-7B e4m3 "2 4"
# PER_RUN (s) bounds each run; the device call's own limit is 600 s, so split long sweeps over calls.
# BASE=<tokens/s> skips the 1-GPU run (a baseline measured in the same call, e.g. beside other runs on a
# spare GPU); WORK=<prefix> keeps the scratch files of sweeps that run side by side (on disjoint
# CUDA_VISIBLE_DEVICES) apart. Extra options for every run: EXTRA="--sdpa-backend cudnn".
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
MODEL=${1:-Qwen2.5-1.5B}; DTYPE=${2:-bf16}; COUNTS=${3-"2"}
BATCH=${BATCH:-16}; ACCUM=${ACCUM:-2}; STEPS=${STEPS:-6}; PER_RUN=${PER_RUN:-90}; CHUNKS=${CHUNKS:-4}
W=${WORK:-/tmp/scale}; EXTRA=${EXTRA:-}
MANAGERS=${MANAGERS:-"--zero-level=1|--shard-gradients|--shard-gradients --all-to-all-reduce|--zero-level=3"}
[ -f /tmp/rand.bin ] || python3 -c "
import numpy as np; from qtrain.data.token_files import write_token_file
write_token_file('/tmp/rand.bin', np.random.default_rng(0).integers(0, 151000, 40_000_000, dtype=np.int32), vocab_size=151936)"
run() {  # $1 = GPUs, rest = options
  local g=$1; shift
  timeout $PER_RUN python3 -m qtrain.cli.main train --model $MODEL --from-scratch --train-file /tmp/rand.bin --gpus $g "$@" $EXTRA \
    --matmul-dtype $DTYPE --steps $STEPS --batch-size $BATCH --grad-accumulation $ACCUM --seq-len 1024 \
    --lmhead-chunks $CHUNKS --opt-m-dtype bf16 --opt-v-dtype bf16 --eval-num-steps 0 --no-save-training-state \
    --out-dir $W.o --log-file $W.jsonl --lr 1e-4 > $W.txt 2>&1
  python3 -c "
import json, sys; ev=[json.loads(l) for l in open('$W.jsonl')]; s=[x for x in ev if x['log']=='step']
m=[x['peak'] for x in ev if x['log']=='memory']; t=[x['tokens_per_s'] for x in s[3:]]
base = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0; tps = sum(t) / max(len(t), 1)
eff = f'{tps / ($g * base):.3f}' if base else '-'
peak = f'{max(m) / 2**30:.2f}' if m else '-'
print(f'$MODEL $DTYPE gpus=$g $* $EXTRA | steps {len(s)} | tps {tps:.0f} | efficiency {eff} | peak_gib {peak}')
open('$W.tps', 'w').write(str(tps))" ${BASE:-} 2>/dev/null || { echo "FAILED $MODEL $DTYPE gpus=$g $* $EXTRA"; grep -v -i warn $W.txt | tail -3; }
  rm -f $W.jsonl
}
{
  if [ -z "${BASE:-}" ]; then
    BASE= run 1
    BASE=$(cat $W.tps 2>/dev/null || echo 0)
  fi
  for n in $COUNTS; do
    IFS='|' read -ra variants <<< "$MANAGERS"
    for v in "${variants[@]}"; do BASE=$BASE run $n $v; done
  done
} 2>&1 | tee -a $OUT/scaling.txt
