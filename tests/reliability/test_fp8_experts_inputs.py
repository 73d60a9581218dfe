"""Bad input for --fp8-experts (the MoE experts' GEMMs in e4m3, kernels/grouped_gemm_fp8.py), through `qtrain train`
in process as tests/reliability/test_moe_inputs.py does: each row asserts exit code 2, the one line
`qtrain: error: ...` naming the option and the reason, no traceback, and nothing under the test's root changed.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.model.family_fixtures import qwen35_cfg
from tests.reliability.test_moe_inputs import MOE, _root, refused, with_
from tests.run_utils import make_run_root, train_argv

E4M3 = ("--matmul-dtype", "e4m3", "--fp8-experts")
QWEN = with_("qwen3_moe", hidden_size=32, moe_intermediate_size=16)  # both multiples of 16: the sizes are fine

CASES = [  # (name, config.json or None for the root's dense model, flags, the message's regex)
    ("without-e4m3", QWEN, ("--fp8-experts",), r"--fp8-experts only applies with --matmul-dtype e4m3"),
    ("dense-model", None, E4M3, r"--fp8-experts applies to Mixture-of-Experts models; \w+ has no experts"),
    ("intermediate-not-16", with_("qwen3_moe", moe_intermediate_size=24), E4M3,
     r"--fp8-experts: the model's hidden_size 32 and moe_intermediate_size 24 must be multiples of 16"),
    ("hidden-not-16", with_("mixtral", hidden_size=40, num_attention_heads=4, num_key_value_heads=2), E4M3,
     r"--fp8-experts: the model's hidden_size 40 and moe_intermediate_size 16 must be multiples of 16"),
    ("e4m3-lora-base", QWEN, (*E4M3, "--lora-rank", "4", "--lora-base-dtype", "e4m3"),
     r"--fp8-experts with --lora-base-dtype e4m3 is not supported"),
    ("expert-parallel", MOE["olmoe"], (*E4M3, "--gpus", "2", "--expert-parallel", "2"),
     r"--fp8-experts with --expert-parallel is not supported yet"),
    # Qwen3.5-MoE's block calls its experts without the FP8 path: the option was accepted and did nothing
    ("qwen3_5-moe", qwen35_cfg(moe=True).to_hf_dict(), E4M3,
     r"--fp8-experts is not built for qwen3_5_moe_text yet \(its experts run in bf16"),
]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_run_root(tmp_path_factory.mktemp("fp8_experts_base"))


@pytest.mark.parametrize("name,config,flags,match", CASES, ids=[c[0] for c in CASES])
def test_fp8_experts_where_it_cannot_run_is_refused_in_one_line(name, config, flags, match, base, tmp_path, capsys):
    if config is None:
        root = tmp_path / "root"
        shutil.copytree(base, root)
    else:
        root = _root(base, tmp_path, config)
    refused(root, train_argv(root, steps=2, extra=tuple(flags)), match, capsys)
