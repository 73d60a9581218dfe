#!/usr/bin/env bash
# Session 6, call E on nvidia-h200-x2, after recompute.CheckpointSteps got its MUST_RECOMPUTE policy.
# GPU 0: what a compiled 14B-wide block saves per recompute switch (against the plan), the recompute and
# attention GPU tests. GPU 1: 14B B=4 with SwiGLU + norm recomputed (peak vs plan; was +4% over it), then
# what `qtrain plan` now recommends at 256 sequences per step (B=8, SwiGLU + norm, Adam m offloaded).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
S='"model":"Qwen2.5-14B","opt_m_dtype":"bf16","opt_v_dtype":"bf16","compile_tuning":false,"steps":2,"warmup":1'
R='"recompute_swiglu":true,"recompute_norm":true'
gpu0() {
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m bench.probe_recompute_saved Qwen2.5-14B > $OUT/probe.txt 2>&1
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m pytest -q -m gpu tests/test_recompute.py tests/test_attention.py tests/test_memory_plan.py > $OUT/pytest.txt 2>&1
}
row() {  # $1 tag, $2 JSON, $3 timeout
  CUDA_VISIBLE_DEVICES=1 timeout $3 python3 bench/bench_train.py "[{$S,$2}]" 2>&1 | grep '^{' \
    | sed "s/^{/{\"tag\":\"$1\",/" >> $OUT/rows.jsonl
}
gpu1() {
  row b4x8-rsn "\"batch\":4,\"accum\":8,\"lmhead_chunks\":4,$R" 130
  row b8x32-rsn-offm "\"batch\":8,\"accum\":32,\"lmhead_chunks\":4,$R,\"offload_opt_m\":true" 230
}
echo "start $(date +%T)"
gpu0 & gpu1 & wait
echo "done $(date +%T)"
grep "^sac" $OUT/probe.txt; tail -2 $OUT/pytest.txt
python3 - <<'PY'
import json, os
for l in open(os.environ.get("OUT", "/tmp/out") + "/rows.jsonl"):
    r = json.loads(l)
    print(f"{r['tag']:15s} tps={r.get('tps')} step_ms={r.get('step_ms')} mfu={r.get('mfu')} peak={r.get('peak_gib')} plan={r.get('plan_gib')} err={r.get('plan_err')} {str(r.get('error',''))[:150]}")
PY
