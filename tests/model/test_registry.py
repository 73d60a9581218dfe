"""The model-family registry (`model/registry.py`) and the statements every family makes (`model/family.py`).

Every supported model_type resolves to its family and back to the same config.json; an unknown one is a
one-line error that lists the supported ones; and each family's statements agree with each other (its HF parts
hold exactly its tensors' elements, its matrices are tensors of its blocks, its FP8 matrices are matrices, its
activation terms have distinct names), so the family-independent code can trust them.
"""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from qtrain.model.config import ConfigError, ModelConfig
from qtrain.model.family import ActivationSettings, ModelFamily
from qtrain.model.llama import LLAMA, LlamaConfig
from qtrain.model.mixtral import MIXTRAL
from qtrain.model.olmoe import OLMOE
from qtrain.model.qwen3_5 import QWEN3_5, Qwen35Config
from qtrain.model.qwen3_moe import QWEN3_MOE
from qtrain.model.recompute import FLAGS, STEPS, resolve_flags
from qtrain.model.registry import (FAMILIES, MODEL_TYPES, PRESETS, config_from_hf_dict, config_from_json_file,
                                   family_for, family_of, preset)

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, rope_theta=10000.0)
# what each MoE model type adds (Qwen3-MoE with one dense layer, so both kinds of layer are checked)
MOE_KEYS = {"qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1]),
            "olmoe": dict(num_experts=4, num_experts_per_tok=2),
            "mixtral": dict(num_local_experts=4, num_experts_per_tok=2)}


def test_the_supported_model_types():
    assert MODEL_TYPES == ("qwen2", "llama", "qwen3", "qwen3_moe", "olmoe", "mixtral", "qwen3_5_text", "qwen3_5_moe_text",
                           "qwen3_5", "qwen3_5_moe", "qwen3_next")  # the order error messages list them in
    assert FAMILIES == (LLAMA, QWEN3_MOE, OLMOE, MIXTRAL, QWEN3_5)




@pytest.mark.parametrize("model_type", LLAMA.architectures)
def test_every_model_type_resolves_and_round_trips(model_type):
    cfg = config_from_hf_dict({"model_type": model_type, **SMALL, **MOE_KEYS.get(model_type, {})})
    family = family_for(model_type)
    assert family_of(cfg) is family and cfg.model_type == model_type
    assert isinstance(cfg, LlamaConfig) == (family is LLAMA) and (cfg.router is None) == (family is LLAMA)
    d = cfg.to_hf_dict()
    assert d["architectures"] == [family.architectures[model_type]]
    assert config_from_hf_dict(json.loads(json.dumps(d))) == cfg


def test_unknown_model_type_is_one_line_listing_the_supported(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "qwen2_moe", **SMALL}))  # its shared expert is not implemented
    supported = ("qwen2, llama, qwen3, qwen3_moe, olmoe, mixtral, qwen3_5_text, qwen3_5_moe_text, qwen3_5, qwen3_5_moe, "
                 "qwen3_next")
    with pytest.raises(ConfigError) as e:
        config_from_json_file(path)
    msg = str(e.value)
    assert "\n" not in msg and msg == f"{path}: unknown model_type 'qwen2_moe'; supported: {supported}"
    with pytest.raises(ConfigError, match=rf"^unknown model_type 'gpt2'; supported: {supported}$"):
        family_for("gpt2")
    with pytest.raises(ConfigError, match="unknown model_type 'gemma'"):
        family_of(ModelConfig(model_type="gemma"))  # the common fields alone name no family
    with pytest.raises(ConfigError, match="missing key 'model_type'"):
        config_from_hf_dict({"architectures": ["LlamaForCausalLM"], **SMALL})
    with pytest.raises(ConfigError, match="expected a JSON object"):
        config_from_hf_dict([])


def test_presets_come_from_the_families():
    assert set(PRESETS) == {name for f in FAMILIES for name in f.presets}
    for name in PRESETS:
        assert family_of(preset(name)).presets[name]().model_type == preset(name).model_type


def _small(model_type: str) -> ModelConfig:
    if model_type in MOE_KEYS:
        return config_from_hf_dict({"model_type": model_type, **SMALL, **MOE_KEYS[model_type]})
    if model_type.startswith("qwen3_5"):
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32) if "moe" in model_type else {}
        return Qwen35Config(model_type=model_type, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                            linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=False,
                            **{**SMALL, "num_hidden_layers": 4}, **moe)
    return LlamaConfig(model_type=model_type, attention_bias=model_type == "qwen2", qk_norm=model_type == "qwen3",
                       head_dim=32 if model_type == "qwen3" else 0, tie_word_embeddings=False,
                       **SMALL)


@pytest.mark.parametrize("model_type", [*LLAMA.architectures, "qwen3_5_text", "qwen3_5_moe_text"])
def test_a_familys_statements_agree(model_type):
    cfg = _small(model_type)
    family: ModelFamily = family_of(cfg)
    specs = [*family.non_block_tensors(cfg), *(t for layer in range(cfg.num_hidden_layers)
                                                for t in family.block_tensors(cfg, layer))]
    for t in specs:  # the HF tensors, back to back, are exactly the tensor's elements
        assert sum(math.prod(shape) for _, shape in t.hf) == math.prod(t.shape), t.name
    hf = [name for t in specs for name, _ in t.hf]
    assert len(hf) == len(set(hf))
    all_matmuls: set[str] = set()
    for layer in range(cfg.num_hidden_layers):
        tensors = {t.name: t for t in family.block_tensors(cfg, layer)}
        matmuls = family.matmuls(cfg, layer)
        all_matmuls |= set(matmuls)
        for name, m in matmuls.items():  # each GEMM is y = x W^T of a block matrix (of each expert of a stack)
            shape = (m.count, m.n, m.k) if m.count > 1 else (m.n, m.k)
            assert tensors[name].shape == shape and m.step in ("", *(s for f in FLAGS for s in STEPS[f]))
            assert (m.count > 1) == (tensors[name].experts > 0) and m.count in (1, tensors[name].experts)
        for flags in ((), ("ffn",), ("att",), ("block",)):
            s = ActivationSettings(matmul_dtype="e4m3", compiled=True, recompute=resolve_flags(flags))
            names = [a.name for a in family.activation_terms(cfg, layer, s)]
            assert len(names) == len(set(names)) and names[0] == "input"
    # a family serving dense and MoE configs (qwen3_5) names the dense MLP's matrices; an MoE config has no such matrix
    assert set(family.fp8_matrices) - ({"up", "down"} if getattr(cfg, "is_moe", False) else set()) <= all_matmuls


def test_the_common_config_names_no_family_fields():
    """What the family-independent code may read (model/config.py); a family's fields live in its own class."""
    common = {f.name for f in dataclasses.fields(ModelConfig)}
    assert {"intermediate_size", "attention_bias", "qk_norm"} & common == set()
    assert {"vocab_size", "hidden_size", "num_hidden_layers", "tie_word_embeddings", "rope_theta",
            "bos_token_id", "eos_token_id"} <= common
