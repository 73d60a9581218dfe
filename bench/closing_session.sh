#!/usr/bin/env bash
# One device call (session 3, last): qtrain 1.5B bf16 with HF + torch.compile in the same call (issue 3),
# then the issue-6 runs the previous fit session lost (each row its own process and timeout).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
S='"steps":5,"warmup":2,"lmhead_chunks":4,"opt_m_dtype":"bf16","opt_v_dtype":"bf16"'
timeout 150 python3 bench/bench_train.py "[
 {\"model\":\"Qwen2.5-1.5B\",\"batch\":32,\"accum\":1,$S},
 {\"model\":\"Qwen2.5-1.5B\",\"batch\":16,\"accum\":2,$S}
]" 2>&1 | grep -v Warning | tee $OUT/qtrain.jsonl
timeout 120 python3 .devshared/bench/hf_baseline.py '[{"size":"1.5B","batch":16,"seq":1024,"accum":2,"steps":5,"compile_":true}]' 2>&1 | grep -v Warning | tee $OUT/hf.jsonl
C='"steps":1,"warmup":1,"opt_m_dtype":"bf16","opt_v_dtype":"bf16"'
for row in \
 "{\"model\":\"Qwen2.5-7B\",\"batch\":16,\"accum\":2,\"lmhead_chunks\":4,\"offload_opt_m\":true,\"offload_opt_v\":true,$C}" \
 "{\"model\":\"Qwen2.5-14B\",\"batch\":8,\"accum\":8,\"lmhead_chunks\":4,\"offload_opt_m\":true,\"offload_opt_v\":true,$C}" \
 "{\"model\":\"Qwen2.5-14B\",\"batch\":32,\"accum\":1,\"lmhead_chunks\":8,\"recompute_block\":true,$C}"; do
  timeout 110 python3 bench/bench_train.py "[$row]" 2>&1 | grep -v Warning | tail -2 | tee -a $OUT/fit.jsonl
  echo "rc=$?" | tee -a $OUT/fit.jsonl; free -g | head -2 | tail -1
done
