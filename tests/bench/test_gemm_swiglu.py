"""bench/gemm_swiglu.py's fused GEMM + SwiGLU kernels against their torch specification, under Triton's interpreter.

The kind itself runs only on an sm_90 GPU, where it checks every config against cuBLAS + qtrain's kernels before
timing it; this keeps its kernels' arithmetic (both accumulators, the u/h/du epilogues, partial row tiles, several
tiles per persistent program) checked in CI, so a later session's GPU run measures kernels known to be right."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from qtrain.kernels import dispatch
from tests.triton_interp import ROOT


@pytest.mark.skipif(not dispatch.HAS_TRITON, reason="no triton")
def test_fused_kernels_match_the_specification_under_the_interpreter():
    """`_selfcheck` (u within 1 bf16 ulp of the rounded fp32 product, h within 1 ulp of the fp32 formula on the
    kernel's u, du within 3 ulps of the specification, the h-only build's h equal to the full one's) for five configs,
    exiting 1 on any miss."""
    r = subprocess.run([sys.executable, "-m", "bench.gemm_swiglu"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0 and "self-check passed" in r.stdout, r.stdout[-4000:] + r.stderr[-3000:]
    assert r.stdout.count("-> ok") == 5
