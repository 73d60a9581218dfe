"""--delta-rule-precision through `qtrain train` on the CPU: the flag and a config file set it, a bad value and a model
without Gated DeltaNet layers are refused in one line before anything is built (as --fp8-experts for a model without
experts), and a tiny Qwen3.5 run records it in its checkpoints, where --continue compares it as any other accepted
option (one `--continue: --delta-rule-precision old -> new` line). On the CPU the delta rule runs its plain-torch
twin, which the option does not reach: tf32 trains bit for bit as fp32 (the kernels' own tests and the GPU test in
tests/kernels/test_gated_delta_rule_triton.py measure what tf32 changes there).
"""
from __future__ import annotations

import argparse
import json

import pytest

from qtrain.cli.main import main
from qtrain.cli.options import add_train_args, options_from_args
from qtrain.model.config import ModelConfig
from qtrain.model.registry import delta_rule_layers
from qtrain.options import Options, OptionsError
from qtrain.plan.resolution import check_model_support
from qtrain.train.checkpoint_io import META_FILE
from tests.model.family_fixtures import qwen35_cfg
from tests.run_utils import CFG, make_run_root, train_argv

FLAG = "--delta-rule-precision"


def _parse(*argv: str) -> Options:
    p = argparse.ArgumentParser()
    add_train_args(p)
    return options_from_args(p.parse_args(["--model", "tiny-qwen2", *argv]))


def _steps(path) -> dict[int, dict]:
    return {e["step"]: e for e in map(json.loads, open(path)) if e.get("log") == "step"}


def test_flag_and_config_file_set_it_and_a_bad_value_is_one_line(tmp_path, capsys):
    assert _parse().delta_rule_precision == "auto"
    assert _parse(FLAG, "tf32").delta_rule_precision == "tf32"
    toml = tmp_path / "run.toml"
    toml.write_text('delta-rule-precision = "tf32"\n')
    assert _parse("--config", str(toml)).delta_rule_precision == "tf32"
    assert _parse("--config", str(toml), FLAG, "fp32").delta_rule_precision == "fp32"  # flags over the file
    root = make_run_root(tmp_path / "bad")
    capsys.readouterr()
    assert main(train_argv(root, extra=(FLAG, "bf16"))) == 2
    err = capsys.readouterr().err.strip()
    assert err == "qtrain: error: --delta-rule-precision='bf16': must be one of auto, fp32, tf32", err
    assert not any((root / d).exists() for d in ("ckpt", "out", "logs"))


def test_refused_for_a_model_without_gated_deltanet_layers(tmp_path, capsys):
    root = make_run_root(tmp_path)  # tests/run_utils.CFG: a Llama-family model
    capsys.readouterr()
    assert main(train_argv(root, extra=(FLAG, "tf32"))) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("qtrain: error: --delta-rule-precision tf32 applies to models with "
                                              "Gated DeltaNet layers"), err
    assert f"this {CFG.model_type} model has none (drop it)" in err
    assert not any((root / d).exists() for d in ("ckpt", "out", "logs"))
    check_model_support(CFG, Options(delta_rule_precision="auto"), device_type="cuda")  # the default: every model's
    with pytest.raises(OptionsError, match="--delta-rule-precision fp32 applies"):
        check_model_support(CFG, Options(delta_rule_precision="fp32"), device_type="cuda")
    # a Qwen3.5 model counts its linear-attention layers; one of only full-attention layers has none
    assert delta_rule_layers(qwen35_cfg()) == 3 and delta_rule_layers(CFG) == 0
    full_only: ModelConfig = qwen35_cfg(num_hidden_layers=2, layer_types=("full_attention",) * 2)
    assert delta_rule_layers(full_only) == 0


def test_tf32_trains_as_fp32_on_the_cpu_is_recorded_and_continue_reports_a_change(tmp_path, capsys):
    root = make_run_root(tmp_path)
    cfg = qwen35_cfg(vocab_size=96, hidden_size=32, num_hidden_layers=2, head_dim=16, bos_token_id=0, eos_token_id=0,
                     layer_types=("linear_attention", "full_attention"), max_position_embeddings=64)
    (root / "model" / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    assert main(train_argv(root, steps=3, name="fp32", extra=(FLAG, "fp32"))) == 0
    assert main(train_argv(root, steps=3, name="tf32", extra=(FLAG, "tf32"))) == 0
    fp32, tf32 = _steps(root / "logs" / "fp32.jsonl"), _steps(root / "logs" / "tf32.jsonl")
    assert sorted(tf32) == [0, 1, 2] and all(tf32[s]["loss"] == fp32[s]["loss"] for s in tf32)  # the twin: no effect
    meta = json.loads((root / "ckpt" / "tf32" / "step_00000002" / META_FILE).read_text())
    assert meta["options"]["delta_rule_precision"] == "tf32"
    capsys.readouterr()
    assert main(train_argv(root, steps=3, name="resumed", extra=("--continue", "2", FLAG, "fp32"),
                           checkpoint_dir=root / "ckpt" / "tf32")) == 0
    out = capsys.readouterr()
    change = "--continue: --delta-rule-precision tf32 -> fp32 (checkpoint step 2)"
    assert sum(change in line for line in (out.out + out.err).splitlines()) == 1, out


def test_auto_resolves_once_and_the_model_runs_what_it_resolved(tmp_path):
    """The default (auto) reaches the model as the run resolved it (tf32: model/choices.py says why), an explicit value
    as given: the Trainer hands `run.delta_rule_precision` to the blocks, not the option's text."""
    from qtrain.train.trainer import Trainer
    root = make_run_root(tmp_path)
    cfg = qwen35_cfg(vocab_size=96, hidden_size=32, num_hidden_layers=2, head_dim=16, bos_token_id=0, eos_token_id=0,
                     layer_types=("linear_attention", "full_attention"), max_position_embeddings=64)
    (root / "model" / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    for given, runs in (("auto", "tf32"), ("fp32", "fp32")):
        trainer = Trainer(_parse(*train_argv(root, extra=(FLAG, given))[1:]))  # [1:]: without the command
        assert trainer.run.delta_rule_precision == trainer.model.run.delta_rule_precision == runs
