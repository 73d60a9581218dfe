#!/usr/bin/env bash
# run_tt.sh's TT_PYTHON in bench/torchtitan.py's runs: says when each Python process it starts was launched (on
# stderr, which run_tt.sh sends to the training run's log), then becomes that process. The kind reads the training
# log's stamp and its step-1 line: torchtitan's start, launch to first step, as the `start` kind measures qtrain's.
echo "TT-LAUNCH $(date +%s.%N)" >&2
exec "${TT_REAL_PYTHON:-python3}" "$@"
