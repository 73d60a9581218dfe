#!/usr/bin/env bash
# Session 5, call B on nvidia-h200-x2 (x4 was no longer lent): qtrain's cuDNN attention op (--sdpa-backend cudnn).
#   R0: GPU tests of the op; bench_attention with the op; a real-text loss curve (Qwen2.5-0.5B from scratch on
#       the embedded corpus, Qwen2 tokens carried in .devshared/text) with flash twice and cudnn once, side by
#       side: cudnn must track flash as closely as flash tracks itself.
#   then: 1.5B e4m3 / bf16 at 48 x 1, flash vs cudnn side by side, then swapped GPUs (issue 4).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
[ -f /tmp/rand.bin ] || python3 -c "
import numpy as np; from qtrain.data.token_files import write_token_file
write_token_file('/tmp/rand.bin', np.random.default_rng(0).integers(0, 151000, 40_000_000, dtype=np.int32), vocab_size=151936)"
TXT=$(ls -d .devshared/text/default-qwen2-*)
curve() {  # $1 GPU, $2 tag, $3 backend
  CUDA_VISIBLE_DEVICES=$1 timeout 170 python3 -m qtrain.cli.main train --model Qwen2.5-0.5B --from-scratch \
    --train-file $TXT/train.bin --eval-file $TXT/eval.bin --batch-size 8 --seq-len 1024 --grad-accumulation 1 \
    --steps 30 --lr 6e-4 --warmup 5 --opt-m-dtype bf16 --opt-v-dtype bf16 --sdpa-backend $3 --eval-every-n-steps 1000 \
    --eval-num-steps 8 --no-save-training-state --out-dir /tmp/c$1 --log-file $OUT/curve_$2.jsonl > /tmp/curve$1.txt 2>&1 \
    || { echo "curve $2 FAILED"; grep -v -i warn /tmp/curve$1.txt | tail -5; }
}
S='"model":"Qwen2.5-1.5B","seq":1024,"steps":8,"warmup":2,"accum":1,"batch":48,"lmhead_chunks":6,"opt_m_dtype":"bf16","opt_v_dtype":"bf16"'
ab() {  # $1 GPU, $2 tag, $3 extra JSON
  CUDA_VISIBLE_DEVICES=$1 timeout 150 python3 bench/bench_train.py "[{$S,$3}]" 2>&1 | grep '^{' \
    | sed "s/^{/{\"tag\":\"$2\",\"gpu\":$1,/" >> $OUT/ab.jsonl
}
E4='"matmul_dtype":"e4m3"'
echo "R0 $(date +%T)"
( CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m pytest -q -m gpu tests/test_attention.py 2>&1 | tail -4 > $OUT/pytest.txt
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m bench.bench_attention --models Qwen2.5-1.5B Qwen2.5-7B 2>&1 \
    | grep -v -i warn > $OUT/attention.txt ) &
curve 1 flash-a flash &
wait
echo "R0b $(date +%T)"
curve 0 cudnn cudnn &
curve 1 flash-b flash &
wait
for dt in e4m3 bf16; do
  X='"sdpa_backend"'; [ $dt = e4m3 ] && X="$E4,$X"
  echo "R $dt $(date +%T)"
  ab 0 $dt-flash "$X:\"flash\"" &
  ab 1 $dt-cudnn "$X:\"cudnn\"" &
  wait
  ab 0 $dt-cudnn "$X:\"cudnn\"" &
  ab 1 $dt-flash "$X:\"flash\"" &
  wait
done
echo "done $(date +%T)"
cat $OUT/pytest.txt; tail -n 8 $OUT/attention.txt
python3 - <<'PY'
import json, os
out = os.environ.get("OUT", "/tmp/out")
def losses(tag):
    try:
        ev = [json.loads(l) for l in open(f"{out}/curve_{tag}.jsonl")]
    except OSError:
        return [], None
    s = [x["loss"] for x in ev if x["log"] == "step"]
    e = [x["loss"] for x in ev if x["log"] == "eval"]
    return s, (e[-1] if e else None)
a, b, c = losses("flash-a"), losses("flash-b"), losses("cudnn")
for tag, (s, e) in (("flash-a", a), ("flash-b", b), ("cudnn", c)):
    print(f"curve {tag:8s} steps {len(s)} first {s[:1]} last {s[-3:]} eval {e}")
if a[0] and b[0] and c[0]:
    d = lambda x, y: max(abs(p - q) for p, q in zip(x, y))
    print(f"max |loss diff| flash-a vs flash-b {d(a[0], b[0]):.4f}, flash-a vs cudnn {d(a[0], c[0]):.4f}, "
          f"flash-b vs cudnn {d(b[0], c[0]):.4f}")
for l in open(out + "/ab.jsonl"):
    r = json.loads(l)
    print(f"{r['tag']:11s} gpu{r['gpu']} tps={r.get('tps')} step_ms={r.get('step_ms')} peak={r.get('peak_gib')} {str(r.get('error',''))[:80]}")
PY
cat $OUT/scaling.txt 2>/dev/null
