"""Bad Qwen3.5 configs and checkpoints: each is one `qtrain: error:` line naming the file, the key and the values,
exit code 2, before the model is built (nothing is written); the vision tower and an MTP head of a multimodal
checkpoint are skipped with one note line each (tests/model/test_qwen3_5_hf_io.py), never an error."""
from __future__ import annotations

import json

import pytest

from qtrain.cli.main import main
from tests.model.family_fixtures import qwen35_cfg as tiny_cfg
from tests.run_utils import make_run_root, train_argv


def _config(**over):
    cfg = tiny_cfg(vocab_size=96, hidden_size=32, num_hidden_layers=2, head_dim=16, bos_token_id=0, eos_token_id=0,
                   layer_types=("linear_attention", "full_attention"), max_position_embeddings=64)
    d = cfg.to_hf_dict()
    d.update(over)
    return d


CASES = {
    "layer_types too short": (dict(layer_types=["linear_attention"]),
                              r"layer_types must list 2 entries \(num_hidden_layers\).*got 1 entries"),
    "unknown layer type": (dict(layer_types=["linear_attention", "sliding_attention"]),
                           r"unsupported \['sliding_attention'\]"),
    "layer_types not a list": (dict(layer_types="full_attention"), r"layer_types must be a list of strings"),
    "key head dim too wide": (dict(linear_key_head_dim=512),
                              r"linear_key_head_dim=512: the delta-rule kernels serve head dims up to 256 in "
                              r"multiples of 16"),
    "value head dim not a multiple of 16": (dict(linear_value_head_dim=24), r"linear_value_head_dim=24"),
    "conv too wide": (dict(linear_conv_kernel_dim=8), r"linear_conv_kernel_dim=8: the convolution kernel serves "
                                                      r"widths 2..4"),
    "value heads not a multiple of key heads": (dict(linear_num_key_heads=3),
                                                r"linear_num_value_heads=4 is not a multiple of "
                                                r"linear_num_key_heads=3"),
    "ungated attention": (dict(attn_output_gate=False), r"attn_output_gate=false is not supported"),
    "odd rotary dims": (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                              "partial_rotary_factor": 0.1875}),
                        r"partial_rotary_factor=0.1875.*even number of rotated dims \(head_dim=16\)"),
    "negative head dim": (dict(linear_key_head_dim=-16), r"linear_key_head_dim must be a positive integer"),
    "negative load-balancing weight": (dict(model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2,
                                            moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                            router_aux_loss_coef=-0.01),
                                       r"router_aux_loss_coef must be a finite number >= 0, got -0.01"),
    "multimodal without text_config": ({"model_type": "qwen3_5", "vision_config": {}, "text_config": None},
                                       r"model_type 'qwen3_5' needs a 'text_config' object"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_config_is_one_line_before_the_model(tmp_path, capsys, case):
    over, pattern = CASES[case]
    root = make_run_root(tmp_path)
    d = over if "text_config" in over else _config(**over)
    (root / "model" / "config.json").write_text(json.dumps(d))
    capsys.readouterr()
    assert main(train_argv(root, steps=2)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qtrain: error: ") and str(root / "model" / "config.json") in err[0]
    import re
    assert re.search(pattern, err[0]), err[0]
    assert not (root / "ckpt").exists() and not (root / "out").exists()


def test_multimodal_text_config_of_another_family_is_refused(tmp_path, capsys):
    root = make_run_root(tmp_path)
    text = _config()
    text["model_type"] = "qwen3_5_moe_text"
    (root / "model" / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": text}))
    assert main(train_argv(root, steps=2)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "text_config.model_type 'qwen3_5_moe_text' does not belong to 'qwen3_5'" in err[0]


def test_persistent_quants_of_sharded_weights_train_for_the_hybrid_layers(tmp_path, capsys):
    """--zero-level 3 with --persistent-quants keeps e4m3 shards of each layer's own matrices (in_proj / out of the
    linear-attention layer, qkv / o of the full-attention one): the hybrid model trains (exit 0; bitwise against
    --zero-level 2: tests/parallel/weights/test_sharded_layer_quants.py). 8 value heads put `out` at a multiple of 16
    elements of its block, as the e4m3 view needs (real models' sizes do)."""
    root = make_run_root(tmp_path)
    (root / "model" / "config.json").write_text(json.dumps(_config(linear_num_value_heads=8)))
    capsys.readouterr()
    assert main(train_argv(root, steps=2, extra=("--zero-level", "3", "--persistent-quants", "--matmul-dtype", "e4m3",
                                                 "--fp8-policy", "all"))) == 0


def test_persistent_quants_of_a_matrix_off_the_fp8_alignment_are_one_line(tmp_path, capsys):
    """With the default 4 value heads `out` starts at element 6968 of the linear-attention block, not a multiple of
    16: its e4m3 view could not be an FP8 operand. One line naming the option and the matrix, exit 2, before the model
    is built (before, a traceback from the memory plan)."""
    root = make_run_root(tmp_path)
    (root / "model" / "config.json").write_text(json.dumps(_config()))
    capsys.readouterr()
    assert main(train_argv(root, steps=2, extra=("--zero-level", "3", "--persistent-quants", "--matmul-dtype", "e4m3",
                                                 "--fp8-policy", "all"))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qtrain: error: --persistent-quants with sharded weights"), err
    assert "'out'" in err[0] and "multiple of 16" in err[0]
    assert not (root / "ckpt").exists() and not (root / "out").exists()


def test_context_parallel_is_refused_for_the_hybrid_layers(tmp_path, capsys):
    """--context-parallel cuts each sequence over ranks; the Gated DeltaNet recurrence would need its state passed
    from rank to rank, which is not built: one line naming the option and the model type, exit 2, before the model is
    built."""
    root = make_run_root(tmp_path)
    (root / "model" / "config.json").write_text(json.dumps(_config()))
    capsys.readouterr()
    assert main(train_argv(root, steps=2, extra=("--gpus", "2", "--context-parallel", "2"))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--context-parallel 2: model_type 'qwen3_5_text' is not supported yet" in err[0], err
    assert not (root / "ckpt").exists() and not (root / "out").exists()
