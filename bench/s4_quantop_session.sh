#!/usr/bin/env bash
# Session 4: compiled-graph FP8 quantization through the opaque Triton quantize+transpose op (abs-max left to
# inductor) vs inductor's own transposed write; e4m3 vs bf16 at 1.5B in the same call; FP8 GPU tests.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
timeout 200 python3 -m pytest -q -m gpu -p no:logging -p no:cacheprovider --tb=short tests/test_fp8.py tests/test_fp8_mlp.py > $OUT/gpu_tests.txt 2>&1; tail -3 $OUT/gpu_tests.txt
S='"model":"Qwen2.5-1.5B","seq":1024,"steps":4,"warmup":2,"lmhead_chunks":4,"opt_m_dtype":"bf16","opt_v_dtype":"bf16"'
timeout 420 python3 bench/bench_train.py "[{$S,\"batch\":16,\"accum\":2},{$S,\"batch\":16,\"accum\":2,\"matmul_dtype\":\"e4m3\",\"quant_op\":false},{$S,\"batch\":16,\"accum\":2,\"matmul_dtype\":\"e4m3\"},{$S,\"batch\":32,\"accum\":1,\"matmul_dtype\":\"e4m3\"},{$S,\"batch\":32,\"accum\":1}]" 2>&1 | grep -v -i warn | tee $OUT/quantop.jsonl
python3 - <<'PY'
import json, os
rows = [json.loads(l) for l in open(os.environ.get("OUT", "/tmp/out") + "/quantop.jsonl") if l.startswith("{")]
for r in rows:
    print(f"{r.get('batch')}x{r.get('accum')} {r.get('matmul_dtype','bf16'):5s} quant_op={r.get('quant_op', True)!s:5s} "
          f"tps={r.get('tps')} step_ms={r.get('step_ms')} peak={r.get('peak_gib')} {r.get('error','')}")
PY
