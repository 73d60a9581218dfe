"""LoRA on an MoE model's experts through `qtrain train` (in-process, CPU, fp32, a tiny random qwen3_moe base with a
routed and a dense layer): the default targets adapt the attention and the routed layer's experts (gate,up,down);
--continue is bitwise with dropout (the experts' masks are counter-keyed as a linear's); the exported adapter
(peft's target_parameters format) loads with `peft.PeftModel.from_pretrained` and gives the logits of the run's
--lora-merge model, which `qtrain export --lora-merge` from the checkpoint writes bitwise again.

Tolerance of the logits: tests/train/test_lora_training.py's (the merged model computes (W + s B A) x where peft
computes the same fold per expert: fp32 reassociation; asserted 1e-4 of the logits' scale).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from qtrain.cli.main import main  # noqa: E402
from qtrain.data.token_files import write_token_file  # noqa: E402
from tests.model.family_fixtures import moe_hf_model  # noqa: E402
from tests.run_utils import make_run_root, train_argv  # noqa: E402


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = make_run_root(tmp_path_factory.mktemp("moe_lora"))
    moe_hf_model("qwen3_moe").float().save_pretrained(root / "base")
    rng = np.random.default_rng(1)
    for name, n in (("train.bin", 2000), ("eval.bin", 300)):
        write_token_file(root / name, rng.integers(0, 64, n, dtype=np.int32), vocab_size=64)
    return root


def _argv(root: Path, name: str, *extra: str) -> list[str]:
    argv = train_argv(root, steps=3, name=name, model=root / "base", grad_accumulation=2,
                      extra=("--lora-rank", "2", "--lora-dropout", "0.2", "--quiet") + extra)
    argv.remove("--from-scratch")
    return argv


def test_expert_adapters_resume_bitwise_export_to_peft_and_merge(root):
    assert main(_argv(root, "e", "--lora-merge")) == 0
    ckpt, out = root / "ckpt" / "e", root / "out"
    keys = set(load_file(ckpt / "step_00000003" / "weights.shard_000_of_001.safetensors"))
    assert keys == {"block.0.lora", "block.1.lora"}  # the adapters only
    merged_first = (out / "e" / "model.safetensors").read_bytes()
    shutil.rmtree(ckpt / "step_00000003")
    assert main(_argv(root, "e", "--lora-merge", "--continue")) == 0
    assert (out / "e" / "model.safetensors").read_bytes() == merged_first  # bitwise the uninterrupted run's
    assert main(["export", "--checkpoint-dir", str(ckpt), "--out-dir", str(out / "em"), "--lora-merge"]) == 0
    assert (out / "em" / "model.safetensors").read_bytes() == merged_first
    assert main(["export", "--checkpoint-dir", str(ckpt), "--out-dir", str(out / "ea")]) == 0

    config = json.loads((out / "ea" / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert config["rank_pattern"] == {r".*\.gate_up_proj": 4} and config["lora_dropout"] == 0.0
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(out / "em", dtype=torch.float32).eval()
    inputs = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain, want = base(inputs).logits, merged(inputs).logits
        adapted = peft.PeftModel.from_pretrained(base, str(out / "ea")).eval()(inputs).logits
    assert (adapted - want).abs().max() <= 1e-4 * want.abs().max()
    assert (adapted - plain).abs().max() > 1e-4  # training moved the adapters off zero
    # the experts themselves learned: the merged stacks differ from the base's, the dense layer's MLP does not
    sd, ref = load_file(out / "em" / "model.safetensors"), load_file(root / "base" / "model.safetensors")
    for k in ("model.layers.0.mlp.experts.0.up_proj.weight", "model.layers.0.mlp.experts.3.down_proj.weight"):
        assert not torch.equal(sd[k], ref[k]), k
    for k in ("model.layers.1.mlp.up_proj.weight", "model.layers.0.mlp.gate.weight"):
        assert torch.equal(sd[k], ref[k]), k


@pytest.mark.slow  # two 2-process runs: ~25-35 s on 2 cores (the dense case runs in CI: test_lora_training.py)
def test_two_gloo_ranks_unsharded_and_sharded_gradients_agree(root):
    """2 gloo ranks: the unsharded manager and --shard-gradients average the same fp32 adapter gradients, the
    experts' adapters among them (the reduction regroups sums: 1e-6)."""
    from tests.run_utils import qtrain_run
    outs = {}
    for name, extra in (("g1", ()), ("g2", ("--shard-gradients",))):
        r = qtrain_run(_argv(root, name, "--gpus", "2", "--ckpt-interval", "100", *extra), cwd=root, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        outs[name] = load_file(root / "out" / name / "adapter_model.safetensors")
    assert outs["g1"].keys() == outs["g2"].keys() and any("experts" in k for k in outs["g1"])
    for k, v in outs["g1"].items():
        assert torch.allclose(v, outs["g2"][k], rtol=0, atol=1e-6), k
