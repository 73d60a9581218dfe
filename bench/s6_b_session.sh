#!/usr/bin/env bash
# Session 6, call B on nvidia-h200-x2 (issue 6). GPU 0: the GPU test of the streamed update (two copy
# streams, three slots), the offloaded update alone at 14B (old vs new streaming, PCIe ceiling), and whether
# the 14B GEMMs can run faster (cuBLASLt, inductor max-autotune) or hold their rate under sustained load.
# GPU 1: the 14B layouts with the most tokens/s (bf16), and 14B with e4m3 matmuls and offloaded moments.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
S='"model":"Qwen2.5-14B","opt_m_dtype":"bf16","opt_v_dtype":"bf16","compile_tuning":false'
OFF='"offload_opt_m":true,"offload_opt_v":true'
gpu0() {
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m pytest -q -m gpu tests/test_offload_optimizer.py > $OUT/pytest.txt 2>&1
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m bench.bench_offload_update --model Qwen2.5-14B > $OUT/offload.txt 2>&1
  CUDA_VISIBLE_DEVICES=0 timeout 270 python3 -m bench.gemm_variants --model Qwen2.5-14B --tokens 8192 --sustain 8 > $OUT/gemm_variants.txt 2>&1
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m bench.bench_offload_update --model Qwen2.5-14B --master > $OUT/offload_master.txt 2>&1
}
row() {  # $1 tag, $2 JSON, $3 timeout
  CUDA_VISIBLE_DEVICES=1 timeout $3 python3 bench/bench_train.py "[{$S,$2}]" 2>&1 | grep '^{' \
    | sed "s/^{/{\"tag\":\"$1\",/" >> $OUT/rows.jsonl
}
gpu1() {
  row b8x32-off "\"batch\":8,\"accum\":32,\"lmhead_chunks\":8,$OFF,\"steps\":2,\"warmup\":1" 230
  row b4x16-rsn '"batch":4,"accum":16,"lmhead_chunks":4,"recompute_swiglu":true,"recompute_norm":true,"steps":2,"warmup":1' 140
  row e4m3-b8x16-off "\"batch\":8,\"accum\":16,\"lmhead_chunks\":8,\"matmul_dtype\":\"e4m3\",$OFF,\"steps\":2,\"warmup\":1" 200
}
echo "start $(date +%T)"
gpu0 & gpu1 & wait
echo "done $(date +%T)"
tail -3 $OUT/pytest.txt
tail -5 $OUT/offload.txt; tail -5 $OUT/offload_master.txt
grep -A8 "^gemm " $OUT/gemm_variants.txt; grep -A9 "^sustained" $OUT/gemm_variants.txt | head -10
python3 - <<'PY'
import json, os
for l in open(os.environ.get("OUT", "/tmp/out") + "/rows.jsonl"):
    r = json.loads(l)
    print(f"{r['tag']:15s} tps={r.get('tps')} step_ms={r.get('step_ms')} mfu={r.get('mfu')} peak={r.get('peak_gib')} plan={r.get('plan_gib')} {str(r.get('error',''))[:150]}")
PY
