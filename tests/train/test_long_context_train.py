"""Training past max_position_embeddings with RoPE scaling, end to end through `qtrain train`: a YaRN model (as
Qwen2.5's long-context config.json writes it: max_position_embeddings kept, factor 4 over the original context)
trains at 2x its max_position_embeddings, and its export carries the scaling to transformers."""
from __future__ import annotations

import json

import pytest
import torch

from qtrain.cli.main import main
from qtrain.observe.log import read_log
from tests.run_utils import make_run_root, train_argv

transformers = pytest.importorskip("transformers")

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def test_trains_past_max_positions_with_yarn_and_exports_it(tmp_path):
    root = make_run_root(tmp_path, tokens=2000)
    path = root / "model" / "config.json"
    d = json.loads(path.read_text())
    assert d["max_position_embeddings"] == 64
    d["rope_parameters"] = {**YARN, "rope_theta": 10000.0}
    path.write_text(json.dumps(d))
    assert main(train_argv(root, steps=2, name="yarn", **{"seq-len": 128, "batch-size": 1})) == 0
    out = root / "out" / "yarn"
    hf = transformers.AutoConfig.from_pretrained(out)
    assert {k: hf.rope_parameters[k] for k in YARN} == YARN and hf.max_position_embeddings == 64
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():  # the exported model runs at the length it was trained at
        assert torch.isfinite(model(input_ids=torch.arange(128)[None] % 96).logits).all()


def _exported(root, name: str) -> dict:
    from safetensors.torch import load_file
    return load_file(str(root / "out" / name / "model.safetensors"))


def test_rope_scaling_option_equals_editing_the_config_and_leaves_the_model_alone(tmp_path):
    """`--rope-scaling yarn` at 2x the model's positions trains exactly as the same model with that entry written into
    its config.json (bitwise: the same frequencies, the same steps), the export carries it as transformers reads it
    (factor --seq-len / positions, the original context recorded, max_position_embeddings kept), and the model's own
    config.json is not touched."""
    root = make_run_root(tmp_path / "option", tokens=2000)
    config = (root / "model" / "config.json").read_bytes()
    flags = {"seq-len": 128, "batch-size": 1}
    assert main(train_argv(root, steps=2, name="opt", extra=("--rope-scaling", "yarn"), **flags)) == 0
    assert (root / "model" / "config.json").read_bytes() == config
    hf = transformers.AutoConfig.from_pretrained(root / "out" / "opt")
    want = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}
    assert {k: hf.rope_parameters[k] for k in want} == want and hf.max_position_embeddings == 64
    said = [e["message"] for e in read_log(root / "logs" / "opt.jsonl") if e["log"] == "message"]
    assert any(m.startswith("--rope-scaling yarn: the model runs with rope_scaling") and "context 128" in m
               for m in said)

    edited = make_run_root(tmp_path / "edited", tokens=2000)
    d = json.loads(config)
    d["rope_parameters"] = {**want, "rope_theta": 10000.0}
    (edited / "model" / "config.json").write_text(json.dumps(d))
    assert main(train_argv(edited, steps=2, name="cfg", **flags)) == 0
    a, b = _exported(root, "opt"), _exported(edited, "cfg")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_resume_without_the_rope_scaling_it_trained_with_is_refused(tmp_path, capsys):
    """The checkpoint's model has the scaling; a --continue that leaves --rope-scaling out names the difference
    instead of resuming a model with other positions."""
    root = make_run_root(tmp_path, tokens=2000)
    flags = {"seq-len": 128, "batch-size": 1}
    assert main(train_argv(root, steps=2, name="r", extra=("--rope-scaling", "linear:2"), **flags)) == 0
    capsys.readouterr()
    assert main(train_argv(root, steps=4, name="r", extra=("--continue",), **{"seq-len": 64, "batch-size": 1})) == 2
    err = capsys.readouterr().err
    assert "rope_scaling" in err and "another model" in err
    # at the run's own length the forgotten option is named before the checkpoint's model is compared
    assert main(train_argv(root, steps=4, name="r", extra=("--continue",), **{"seq-len": 128, "batch-size": 1})) == 2
    assert "--rope-scaling TYPE" in capsys.readouterr().err


@pytest.mark.parametrize("value,config,seq,message", [
    ("ntk", None, 128, "the type must be one of linear, dynamic, yarn, llama3"),
    ("yarn:x", None, 128, "the factor must be a number >= 1"),
    ("yarn:0.5", None, 128, "the factor must be a number >= 1"),
    ("yarn", None, 64, "--seq-len 64 is within the model's 64 positions"),
    ("linear", YARN, 128, "already has other RoPE scaling ({'rope_type': 'yarn'"),
    ("yarn:2", YARN, 128, "already has other RoPE scaling"),  # the same type, another factor
])
def test_bad_rope_scaling_is_one_line_before_the_model_is_built(tmp_path, capsys, monkeypatch, value, config, seq,
                                                                message):
    from qtrain.train import loop
    root = make_run_root(tmp_path, tokens=2000)
    if config:
        d = json.loads((root / "model" / "config.json").read_text())
        d["rope_parameters"] = {**config, "rope_theta": 10000.0}
        (root / "model" / "config.json").write_text(json.dumps(d))
    monkeypatch.setattr(loop, "Trainer", None)  # building the model would fail differently
    assert main(train_argv(root, steps=1, name="bad", extra=("--rope-scaling", value),
                           **{"seq-len": seq, "batch-size": 1})) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qtrain: error: --rope-scaling") and message in err[0]
    assert not (root / "out").exists() and not (root / "ckpt").exists()


def test_eval_scores_past_the_positions_with_rope_scaling(tmp_path):
    """`qtrain eval --rope-scaling` scores a model past its positions as the same model with that entry in its
    config.json does, and refuses the length without it."""
    from qtrain.options import OptionsError
    from qtrain.train.evaluate import evaluate_model
    root = make_run_root(tmp_path, tokens=2000)
    assert main(train_argv(root, steps=1, name="base")) == 0  # an exported model of 64 positions
    out = root / "out" / "base"
    with pytest.raises(OptionsError, match="exceeds the model's max_position_embeddings 64; --rope-scaling TYPE"):
        evaluate_model(out, root / "eval.bin", seq_len=128, batch_size=1)
    got = evaluate_model(out, root / "eval.bin", seq_len=128, batch_size=1, rope_scaling="dynamic")
    d = json.loads((out / "config.json").read_text())
    d["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": d.get("rope_theta", 10000.0)}
    (out / "config.json").write_text(json.dumps(d))
    want = evaluate_model(out, root / "eval.bin", seq_len=128, batch_size=1)
    assert got["loss"] == want["loss"] and got["tokens"] == want["tokens"]


def test_rope_scaling_takes_a_model_that_already_has_exactly_that_scaling():
    """A model whose config.json already holds the scaling --rope-scaling asks for (the export of such a run, a LoRA
    run's base given it for the merge) is taken as it is; another scaling is refused."""
    from qtrain.model.context_extension import ContextExtensionError, extend_context
    from tests.run_utils import CFG
    once = extend_context(CFG, "yarn", 128)
    assert once.rope_scaling == {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}
    assert extend_context(once, "yarn", 128) is once and extend_context(once, "yarn:2", 4096) is once
    with pytest.raises(ContextExtensionError, match="already has other RoPE scaling"):
        extend_context(once, "yarn:4", 128)


def test_a_resume_at_another_seq_len_says_the_factor_came_from_it(tmp_path, capsys):
    root = make_run_root(tmp_path, tokens=2000)
    assert main(train_argv(root, steps=2, name="r", extra=("--rope-scaling", "yarn"), **{"seq-len": 128,
                                                                                         "batch-size": 1})) == 0
    capsys.readouterr()
    assert main(train_argv(root, steps=4, name="r", extra=("--continue", "--rope-scaling", "yarn"),
                           **{"seq-len": 192, "batch-size": 1})) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'factor': 2.0" in err[0] and "'factor': 3.0" in err[0] and "from --seq-len" in err[0]
    assert "its run: --rope-scaling yarn" in err[0]


def test_a_lora_adapter_export_says_its_base_needs_the_scaling(tmp_path):
    """The PEFT adapter holds no config: the run's start line and `qtrain export`'s note say which rope_scaling the
    base needs (as JSON to paste); the merged export carries the scaling itself; a LoRA run without the option has no
    such note."""
    from qtrain.train.export import export_checkpoint
    root = make_run_root(tmp_path, tokens=2000)
    assert main(train_argv(root, steps=2, name="l", extra=("--rope-scaling", "yarn", "--lora-rank", "4"),
                           **{"seq-len": 128, "batch-size": 1})) == 0
    said = [e["message"] for e in read_log(root / "logs" / "l.jsonl") if e["log"] == "message"]
    want = '{"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}'
    assert any(m.startswith("the run extended its base's context (--rope-scaling yarn)") and want in m for m in said)
    r = export_checkpoint(str(root / "ckpt" / "l"), str(tmp_path / "adapter"))
    assert r.caveat and "the run extended its base's context" in r.caveat and want in r.caveat
    merged = export_checkpoint(str(root / "ckpt" / "l"), str(tmp_path / "merged"), lora_merge=True)
    assert not (merged.caveat and "rope_scaling" in merged.caveat)
    hf = transformers.AutoConfig.from_pretrained(tmp_path / "merged")
    assert hf.rope_parameters["rope_type"] == "yarn" and hf.rope_parameters["factor"] == 2.0


def test_a_lora_adapter_export_without_rope_scaling_has_no_scaling_note(tmp_path):
    from qtrain.train.export import export_checkpoint
    root = make_run_root(tmp_path, tokens=2000)
    assert main(train_argv(root, steps=2, name="l", extra=("--lora-rank", "4"))) == 0
    r = export_checkpoint(str(root / "ckpt" / "l"), str(tmp_path / "adapter"))
    assert not (r.caveat and "rope" in r.caveat)
