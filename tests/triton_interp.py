"""Shared harness for Triton kernels tested on the CPU through Triton's interpreter.

A kernel test file marks its interpreter tests `@interp_only` (named `test_interp_*`) and defines
`test_interpreter_subprocess = interpreter_subprocess_test(__file__)`: the interpreter must be switched on
before triton is imported, so those tests run in a child pytest with TRITON_INTERPRET=1.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qtrain.kernels import dispatch

ROOT = Path(__file__).resolve().parents[1]
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interp_only = pytest.mark.skipif(not INTERPRET, reason="runs in test_interpreter_subprocess (TRITON_INTERPRET=1)")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def interpreter_subprocess_test(test_file: str):
    """A test that re-runs `test_file`'s `interp` tests under TRITON_INTERPRET=1 and requires them to pass."""
    @pytest.mark.skipif(INTERPRET or not dispatch.HAS_TRITON, reason="already interpreting, or no triton")
    def test_interpreter_subprocess():
        r = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", "interp", test_file],
            env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=ROOT, capture_output=True, text=True, timeout=600,
        )
        assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-6000:] + r.stderr[-3000:]

    return test_interpreter_subprocess


def compile_for_hopper(kernel, signature: dict[str, str], constexprs: dict[str, object], **options) -> str:
    """Compile a Triton kernel for sm_90 on this machine (no GPU needed: Triton's own ptxas) and return its PTX.
    The interpreter never compiles, so a kernel the interpreter runs can still fail to build for the GPU (a
    constexpr default the code generator does not wrap, say): this catches that on the CPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    if INTERPRET:
        pytest.skip("compiles for the GPU: not under the interpreter")
    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
