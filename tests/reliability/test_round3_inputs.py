"""Round three of the hostile tester (the newest features: LoRA, packing and document masking, MoE and Qwen3.5,
the newer options): each row gives one command one broken input that was a traceback, a silent wrong result or a
plan of a run `qtrain train` refuses before its fix, and asserts the bad-input table's contract
(`test_bad_inputs.run_case`): exit code 2, one line `qtrain: error: ...` naming the option, file or tensor, nothing
under the root changed or added.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qtrain.model.hf_io import save_hf_model
from qtrain.model.weights import param_shapes
from tests.reliability.test_bad_inputs import Case, cmd, run_case, train
from tests.reliability.test_hostile_inputs import tiny_tokenizer_json
from tests.reliability.test_lora_inputs import moe_model
from tests.run_utils import CFG, make_run_root


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """The tiny model's config (model/), its weights (weights/), a character tokenizer, token files and a tiny
    qwen3_moe config (moe/, 8 experts)."""
    root = make_run_root(tmp_path_factory.mktemp("round3"))
    moe_model(root)
    g = torch.Generator().manual_seed(1)
    params = {n: torch.randn(s, generator=g) * 0.02 for n, s in param_shapes(CFG).items()}
    save_hf_model(root / "weights", CFG, params, dtype=torch.float32)
    (root / "tokenizer.json").write_text(tiny_tokenizer_json())
    return root


def interrupted_export_tokenizer(root: Path) -> None:
    """root/inc: the tokenizer of an export that was interrupted (its manifest says incomplete: the tokenizer files
    may be of two exports)."""
    (root / "inc").mkdir()
    (root / "inc" / "tokenizer.json").write_text(tiny_tokenizer_json())
    (root / "inc" / "qtrain-export.json").write_text(json.dumps(
        {"format": 1, "writer": "qtrain", "run_id": "r", "name": "old", "step": 2, "files": ["tokenizer.json"],
         "complete": False}))


def evaluate(*extra: str):
    return cmd("eval", "--model", "{root}/weights", "--eval-file", "{root}/eval.bin", "--seq-len", "16", "--device",
               "cpu", *extra)


def plan(*extra: str, model: str = "{root}/moe"):
    return cmd("plan", "--model", model, "--seq-len", "16", "--gpu-memory", "80GiB", "--no-propose", *extra)


def generate(*extra: str):
    return cmd("generate", "--model", "{root}/weights", "--tokenizer", "{root}/tokenizer.json", "--prompt", "hi",
               "--max-new-tokens", "2", "--device", "cpu", *extra)


def adapter_dir(root: Path) -> None:
    """root/adapter: a PEFT adapter's two files (no config.json: not a model)."""
    (root / "adapter").mkdir()
    (root / "adapter" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    (root / "adapter" / "adapter_model.safetensors").write_bytes(b"")


ADAPTER = r"adapter: a PEFT adapter \(adapter_config.json\), not a model: give a whole model"

CASES = [
    # a PEFT adapter given as the model: "config.json: file not found" said nothing of what the folder is
    Case("eval-model-is-an-adapter", cmd("eval", "--model", "{root}/adapter", "--eval-file", "{root}/eval.bin",
                                         "--seq-len", "16", "--device", "cpu"), ADAPTER, adapter_dir),
    Case("generate-model-is-an-adapter", cmd("generate", "--model", "{root}/adapter", "--tokenizer",
                                             "{root}/tokenizer.json", "--prompt", "hi", "--device", "cpu"),
         ADAPTER, adapter_dir),
    # a ValueError from the LM head's kernel after the weights had loaded: a traceback, exit code 1
    Case("eval-seq-len-beyond-positions", evaluate("--seq-len", "10000000"),
         r"qtrain eval: --seq-len 10000000 exceeds the model's max_position_embeddings \d+"),
    Case("eval-lmhead-chunks-0", evaluate("--lmhead-chunks", "0"), r"--lmhead-chunks must be >= 1, got 0"),
    Case("eval-lmhead-chunks-negative", evaluate("--lmhead-chunks", "-2"), r"--lmhead-chunks must be >= 1, got -2"),
    # every qtrain reader refuses an interrupted export (RELIABILITY, fault 8), the tokenizer's readers did not
    Case("train-tokenizer-interrupted-export", train(tokenizer="{root}/inc"),
         r"inc: an interrupted export \(qtrain-export\.json says it is incomplete", interrupted_export_tokenizer),
    Case("train-tokenizer-json-interrupted-export", train(tokenizer="{root}/inc/tokenizer.json"),
         r"inc: an interrupted export \(qtrain-export\.json says it is incomplete", interrupted_export_tokenizer),
    Case("tokenize-tokenizer-interrupted-export",
         cmd("tokenize", "{root}/t.txt", "--out-dir", "{root}/tok", "--tokenizer", "{root}/inc", "--no-progress",
             "--eval-fraction", "0"),
         r"inc: an interrupted export \(qtrain-export\.json says it is incomplete",
         lambda root: (interrupted_export_tokenizer(root), (root / "t.txt").write_text("hello there\n"))),
    # a NaN temperature passed `>= 0` and failed in torch.multinomial (a traceback); inf drew from a flat distribution
    Case("generate-temperature-nan", generate("--temperature", "nan"), r"--temperature must be a finite number >= 0"),
    Case("generate-temperature-inf", generate("--temperature", "inf"), r"--temperature must be a finite number >= 0"),
    # qtrain plan: what `qtrain train` refuses for the ranks was a traceback from the layout, or a plan of a run that
    # cannot start
    Case("plan-expert-parallel-one-rank", plan("--expert-parallel", "2"),
         r"--expert-parallel 2 must divide the number of ranks \(1\)"),
    Case("plan-expert-parallel-not-dividing-experts", plan("--expert-parallel", "3", "--gpus", "3"),
         r"--expert-parallel 3 must divide the model's 8 experts"),
    Case("plan-expert-parallel-dense", plan("--expert-parallel", "2", "--gpus", "2", model="{root}/model"),
         r"--expert-parallel 2: llama model has no experts"),
    Case("plan-context-parallel-moe", plan("--context-parallel", "2", "--gpus", "2"),
         r"--context-parallel 2: model_type 'qwen3_moe' is not supported yet"),
    Case("plan-cuda-graphs-document-masking", plan("--use-cuda-graphs", "--document-masking", model="{root}/model"),
         r"--use-cuda-graphs does not support --document-masking"),
    Case("plan-cuda-graphs-lora-dropout", plan("--use-cuda-graphs", "--lora-rank", "4", "--lora-dropout", "0.1",
                                               model="{root}/model"),
         r"--use-cuda-graphs does not support --lora-dropout"),
    Case("plan-shard-group-not-dividing", plan("--zero-level", "3", "--shard-group-size", "3", "--gpus", "2"),
         r"--shard-group-size 3 must divide the number of ranks \(2\)"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_round3_input(case: Case, base: Path, tmp_path: Path, capsys) -> None:
    run_case(case, base, tmp_path, capsys)
