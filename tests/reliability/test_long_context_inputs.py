"""Long-context bad inputs: RoPE scaling that qtrain does not compute (or that a config.json states ambiguously),
a --seq-len past the scaled context, and --context-parallel combinations it cannot serve: each is a one-line
`qtrain: error:` naming the file, key or option, exit 2, before the model is built and with nothing written; the
same table shape and checks as test_bad_inputs.py (`run_case`)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.reliability.test_bad_inputs import Case, model_json, run_case, train
from tests.run_utils import make_run_root


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """The tiny model's config.json and token files (no weights, no earlier run: these refusals need neither)."""
    return make_run_root(tmp_path_factory.mktemp("base"))


def rope(**params) -> dict:
    return {"rope_parameters": {"rope_theta": 10000.0, **params}}


ROPE_CASES = [Case(f"rope-{name}", train(), match, model_json(**changes)) for name, changes, match in [
    ("longrope", rope(rope_type="longrope", short_factor=[1.0], long_factor=[1.0]),
     r"config.json: rope_type 'longrope' is not supported \(supported: 'default', 'linear', 'dynamic', 'yarn', "
     r"'llama3'\)"),
    ("legacy-type", {"rope_scaling": {"type": "su", "factor": 2.0}, "rope_parameters": ...},
     r"rope_type 'su' is not supported"),
    ("linear-no-factor", rope(rope_type="linear"), r"linear rope scaling needs 'factor'"),
    ("linear-factor-zero", rope(rope_type="linear", factor=0), r"linear rope scaling factor must be a positive number"),
    ("dynamic-factor-string", rope(rope_type="dynamic", factor="4"), r"factor must be a finite number, got '4'"),
    ("linear-extra-key", rope(rope_type="linear", factor=2.0, low_freq_factor=1.0),
     r"linear rope scaling key\(s\) \['low_freq_factor'\] not understood"),
    ("yarn-truncate", rope(rope_type="yarn", factor=2.0, truncate="yes"), r"truncate must be true or false"),
    ("yarn-original-float", rope(rope_type="yarn", factor=2.0, original_max_position_embeddings=16.5),
     r"original_max_position_embeddings must be an integer"),
    ("llama3-freq-order", rope(rope_type="llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=4.0,
                               original_max_position_embeddings=16),
     r"llama3 rope scaling needs high_freq_factor > low_freq_factor"),
    ("both-disagree", {**rope(rope_type="linear", factor=2.0), "rope_scaling": {"type": "linear", "factor": 4.0}},
     r"rope_scaling .* and rope_parameters .* disagree; keep one of them"),
]] + [
    Case("seq-len-past-scaled-context", train(extra=("--seq-len", "512", "--batch-size", "1")),
         r"--seq-len 512 exceeds the model's max_position_embeddings 64 \(yarn rope scaling: 256\)",
         model_json(**rope(rope_type="yarn", factor=4.0, original_max_position_embeddings=64))),
]


CP_CASES = [Case(f"cp-{name}", train(extra=extra), match) for name, extra, match in [
    ("seq-len", ("--context-parallel", "2", "--seq-len", "18"),
     r"--context-parallel 2: --seq-len 18 must be a multiple of 4 \(each sequence is cut into 2 x 2 equal chunks\)"),
    ("ranks", ("--context-parallel", "2"), r"--context-parallel 2 must divide the number of ranks \(1\)"),
    ("zero", ("--context-parallel", "0"), r"--context-parallel must be >= 1, got 0"),
    # compiled blocks and recompute are served (parallel/context_ops.py): only the batch slices are named
    ("compile-and-chunks", ("--gpus", "2", "--context-parallel", "2", "--compile", "on", "--recompute-block",
                            "--batch-size", "2", "--attn-bwd-chunks", "2"),
     r"--context-parallel 2 does not support --attn-bwd-chunks 2 yet \(its attention"),
    ("document-attention-varlen", ("--gpus", "2", "--context-parallel", "2", "--document-masking",
                                   "--document-attention", "varlen"),
     r"--context-parallel 2 does not support --document-attention varlen yet"),
    # --device cuda: with --device cpu the CUDA-graphs line comes first; these are refused before any device is used
    ("cuda-graphs", ("--device", "cuda", "--gpus", "2", "--context-parallel", "2", "--use-cuda-graphs"),
     r"--context-parallel 2 does not support --use-cuda-graphs yet \(its attention"),
    ("expert-parallel", ("--gpus", "2", "--context-parallel", "2", "--expert-parallel", "2"),
     r"--context-parallel 2 does not support --expert-parallel 2 yet \(its attention"),
    ("ring-without-cp", ("--context-parallel-mode", "ring"),
     r"--context-parallel-mode ring needs --context-parallel N > 1"),
    ("mode-typo", ("--gpus", "2", "--context-parallel", "2", "--context-parallel-mode", "rings"),
     r"--context-parallel-mode.*'rings'"),
]]


@pytest.mark.parametrize("case", CP_CASES, ids=[c.name for c in CP_CASES])
def test_context_parallel_bad_input(case, base, tmp_path, capsys):
    run_case(case, base, tmp_path, capsys)


@pytest.mark.parametrize("case", ROPE_CASES, ids=[c.name for c in ROPE_CASES])
def test_long_context_bad_input(case, base, tmp_path, capsys):
    run_case(case, base, tmp_path, capsys)
