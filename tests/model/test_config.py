"""The Llama family's config (LlamaConfig) against real transformers configs: parsing what save_pretrained writes, writing what
from_pretrained reads, defaults, presets, and error messages that name the file and the key."""
from __future__ import annotations

import json

import pytest
import torch

from tests.hf_fixtures import TINY_KINDS, tiny_hf_config
from qtrain.model.config import ConfigError
from qtrain.model.registry import PRESETS, config_from_hf_dict, config_from_json_file, preset
from qtrain.model.hf_io import expected_hf_shapes
from qtrain.model.weights import num_params

transformers = pytest.importorskip("transformers")


def _hf_shapes(hf_config) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of the transformers model for `hf_config` (meta device: no memory, no init)."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if hf_config.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    return shapes


def _write(tmp_path, d: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    return str(path)


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_reads_transformers_config_json(kind, tmp_path):
    hf = tiny_hf_config(kind)
    hf.save_pretrained(tmp_path)
    cfg = config_from_json_file(tmp_path / "config.json")
    model_type, tied, extra = TINY_KINDS[kind]
    assert (cfg.model_type, cfg.tie_word_embeddings) == (model_type, tied)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (128, 64, 96, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, getattr(hf, "head_dim", None) or 16)
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"]
    assert cfg.rms_norm_eps == hf.rms_norm_eps
    assert cfg.attention_bias == (model_type == "qwen2")
    assert cfg.qk_norm == (model_type == "qwen3")
    if "rope_scaling" in extra:
        assert cfg.rope_scaling == extra["rope_scaling"]
    else:
        assert cfg.rope_scaling is None
    assert expected_hf_shapes(cfg) == _hf_shapes(hf)


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_to_hf_dict_loads_in_transformers(kind, tmp_path):
    cfg = config_from_hf_dict(tiny_hf_config(kind).to_dict())
    d = cfg.to_hf_dict(dtype="bfloat16")
    assert config_from_hf_dict(d) == cfg
    _write(tmp_path, d)
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(hf).__name__.lower().startswith(cfg.model_type)
    assert hf.rope_parameters["rope_theta"] == cfg.rope_theta
    if cfg.rope_scaling:
        assert {k: hf.rope_parameters[k] for k in cfg.rope_scaling} == cfg.rope_scaling
    else:
        assert hf.rope_parameters["rope_type"] == "default"
    assert (hf.tie_word_embeddings, hf.rms_norm_eps) == (cfg.tie_word_embeddings, cfg.rms_norm_eps)
    assert hf.dtype == torch.bfloat16
    assert _hf_shapes(hf) == expected_hf_shapes(cfg)


@pytest.mark.parametrize("model_type", ["qwen2", "llama", "qwen3"])
def test_absent_keys_take_transformers_defaults(model_type):
    """A sparse config.json must mean the same model to qtrain and to transformers."""
    d = dict(model_type=model_type, vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)
    cfg = config_from_hf_dict(d)
    hf = transformers.AutoConfig.for_model(**d)
    assert (cfg.head_dim, cfg.rms_norm_eps, cfg.tie_word_embeddings, cfg.max_position_embeddings) == (
        getattr(hf, "head_dim", None) or 16, hf.rms_norm_eps, hf.tie_word_embeddings,
        hf.max_position_embeddings)
    assert expected_hf_shapes(cfg) == _hf_shapes(hf)


def test_rope_theta_top_level_or_inside_rope_parameters():
    base = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    legacy = config_from_hf_dict({**base, "rope_theta": 5e5, "rope_scaling": scaling})  # transformers 4.x
    nested = config_from_hf_dict({**base, "rope_parameters": {**scaling, "rope_theta": 5e5}})  # 5.x
    assert legacy == nested
    assert legacy.rope_theta == 5e5 and legacy.rope_scaling == scaling
    plain = config_from_hf_dict({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert plain.rope_theta == 1e4 and plain.rope_scaling is None
    with pytest.raises(ConfigError, match="rope_theta"):
        config_from_hf_dict(base)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_sizes_match_transformers(name):
    cfg = preset(name)
    hf = transformers.AutoConfig.for_model(**cfg.to_hf_dict())
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    assert num_params(cfg) == sum(p.numel() for p in model.parameters())  # tied params counted once


def test_preset_lookup():
    assert preset("Qwen/qwen2.5-0.5b") == preset("Qwen2.5-0.5B")
    assert num_params(preset("Qwen2.5-0.5B")) == 494_032_768  # published size
    assert num_params(preset("meta-llama/Llama-3.1-8B")) == 8_030_261_248
    with pytest.raises(ConfigError, match="unknown model preset 'nope'.*Qwen2.5-0.5B"):
        preset("nope")


@pytest.mark.parametrize("change, key", [
    ({"drop": "hidden_size"}, "hidden_size"),
    ({"drop": "model_type"}, "model_type"),
    ({"set": {"frobnicate_heads": 3}}, "frobnicate_heads"),
    ({"set": {"model_type": "mistral"}}, "mistral"),
    ({"set": {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0}}}, "longrope"),
    ({"set": {"hidden_act": "gelu"}}, "hidden_act"),
    ({"set": {"num_key_value_heads": 3}}, "num_key_value_heads"),
])
def test_errors_name_file_and_key(change, key, tmp_path):
    d = tiny_hf_config("qwen2").to_dict()
    d.pop(change.get("drop", ""), None)
    d.update(change.get("set", {}))
    path = _write(tmp_path, d)
    with pytest.raises(ConfigError) as e:
        config_from_json_file(path)
    assert path in str(e.value) and key in str(e.value)


def test_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        config_from_json_file(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON") as e:
        config_from_json_file(tmp_path / "config.json")
    assert str(tmp_path / "config.json") in str(e.value)


def test_every_eos_id_of_a_list_ends_a_document():
    """Llama 3's config.json lists three EOS ids: eos_token_id keeps the first (what is written back), and every one
    of them ends a document of an unannotated token file under --document-masking (a chat file's <|eot_id|> is the
    third); one outside the vocabulary is refused naming the list."""
    from qtrain.options import Options
    from qtrain.train.preflight import document_args
    d = preset("Qwen2.5-0.5B").to_hf_dict()
    cfg = config_from_hf_dict({**d, "eos_token_id": [151643, 151645, 7]})
    assert cfg.eos_token_id == 151643 and cfg.end_of_document_ids == (151643, 151645, 7)
    assert cfg.to_hf_dict()["eos_token_id"] == 151643
    assert document_args(Options(document_masking=True), cfg)["eos_ids"] == (151643, 151645, 7)
    one = config_from_hf_dict({**d, "eos_token_id": 5})
    assert one.end_of_document_ids == (5,) and config_from_hf_dict({**d, "eos_token_id": None}).end_of_document_ids == ()
    with pytest.raises(ConfigError, match=r"eos_token_id 999999 is not a token id"):
        config_from_hf_dict({**d, "eos_token_id": [1, 999999]})
