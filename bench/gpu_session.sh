#!/usr/bin/env bash
# One device call: GPU tests, qtrain vs HF-baseline throughput (1 GPU), and 2-GPU data parallel per manager.
# Usage on the device machine: bash bench/gpu_session.sh   (needs .devshared/bench with hf_baseline.py)
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
git rev-parse --short HEAD 2>/dev/null
timeout 200 python3 -m pytest -q -m gpu -x tests/test_model_vs_hf.py tests/test_adamw.py tests/test_stochastic_rounding.py 2>&1 | tail -6
timeout 260 python3 bench/bench_train.py '[{"model":"Qwen2.5-0.5B","batch":16,"accum":2,"steps":6,"lmhead_chunks":4},
 {"model":"Qwen2.5-0.5B","batch":16,"accum":2,"steps":6,"lmhead_chunks":4,"opt_m_dtype":"bf16","opt_v_dtype":"bf16"},
 {"model":"Qwen2.5-1.5B","batch":16,"accum":2,"steps":6,"lmhead_chunks":4},
 {"model":"Qwen2.5-1.5B","batch":16,"accum":2,"steps":6,"lmhead_chunks":4,"opt_m_dtype":"bf16","opt_v_dtype":"bf16"}]' 2>&1 | tee $OUT/qtrain.jsonl | grep -v Warning
timeout 200 python3 .devshared/bench/hf_baseline.py '[{"size":"0.5B","batch":16,"seq":1024,"accum":2,"steps":6,"compile_":true},{"size":"1.5B","batch":16,"seq":1024,"accum":2,"steps":6,"compile_":true}]' 2>&1 | tee $OUT/hf.jsonl | grep -v Warning
