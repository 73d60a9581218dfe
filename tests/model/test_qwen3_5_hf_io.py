"""Qwen3.5 checkpoints through qtrain's HF load and export, bit for bit: a text checkpoint (Qwen3_5ForCausalLM, dense
and MoE), and a multimodal one (Qwen3_5ForConditionalGeneration, dense and MoE) whose text weights sit under
`model.language_model.`: it loads as the text model (the vision tower and an MTP head skipped with one line each) and
exports back in the layout that class reads, which transformers loads to the same text logits. An MoE checkpoint
may hold its experts one by one (what save_pretrained writes) or fused (transformers' module tensors); both load,
export writes the former.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from qtrain.model.hf_io import check_hf_weights, load_hf_weights, load_model_config, save_hf_model
from qtrain.model.qwen3_5 import Qwen35Config
from qtrain.model.registry import config_from_hf_dict
from qtrain.model.transformer import RunOptions, Transformer
from qtrain.parallel.weights.replicated import ParamWeights
from tests.model.family_fixtures import qwen35_cfg as tiny_cfg, qwen35_hf_model, qwen35_multimodal_model, randomize


def _tensors(path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("moe", [False, True])
def test_text_checkpoint_round_trips_exactly(tmp_path, moe):
    cfg = tiny_cfg(moe=moe, num_hidden_layers=2, layer_types=("linear_attention", "full_attention"))
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf_dict(dtype="float32"))
    randomize(transformers.AutoModelForCausalLM.from_config(hf_cfg).float()).save_pretrained(tmp_path / "src")
    loaded = load_model_config(tmp_path / "src")
    assert loaded == cfg and loaded.multimodal is None
    params = load_hf_weights(tmp_path / "src", loaded)
    save_hf_model(tmp_path / "out", loaded, params, dtype=torch.float32)
    src, out = _tensors(tmp_path / "src"), _tensors(tmp_path / "out")
    assert set(src) == set(out) and all(torch.equal(src[k], out[k]) for k in src)
    assert load_model_config(tmp_path / "out") == cfg


def _multimodal(tmp_path, moe: bool = False):
    """A tiny Qwen3.5 VLM checkpoint plus an MTP tensor (as the published ones carry)."""
    model = qwen35_multimodal_model(moe=moe)
    src = tmp_path / "vlm"
    model.save_pretrained(src)
    tensors = _tensors(src)
    tensors["mtp.fc.weight"] = torch.randn(64, 128)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    return model, src


# multimodal model_type -> (its text model_type, transformers' multimodal and text-only classes)
MULTIMODAL = {"qwen3_5": ("qwen3_5_text", "Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"),
              "qwen3_5_moe": ("qwen3_5_moe_text", "Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM")}


@pytest.mark.parametrize("model_type", list(MULTIMODAL))
def test_multimodal_checkpoint_loads_as_text_and_exports_where_transformers_reads(tmp_path, capsys, model_type):
    text_type, vlm_cls, text_cls = MULTIMODAL[model_type]
    model, src = _multimodal(tmp_path, moe=model_type == "qwen3_5_moe")
    capsys.readouterr()
    cfg = load_model_config(src)
    assert isinstance(cfg, Qwen35Config) and cfg.model_type == text_type and cfg.multimodal is not None
    check_hf_weights(src, cfg)
    notes = capsys.readouterr().err.strip().splitlines()
    assert len(notes) == 2 and "the vision tower" in notes[0] and "MTP" in notes[1], notes
    params = load_hf_weights(src, cfg)
    out = tmp_path / "out"
    save_hf_model(out, cfg, params, dtype=torch.float32)
    written, original = _tensors(out), _tensors(src)
    assert all(k.startswith(("model.language_model.", "lm_head.")) for k in written)
    assert all(torch.equal(written[k], original[k]) for k in written)
    assert set(original) - set(written) == {k for k in original if k.startswith(("model.visual.", "mtp."))}
    d = json.loads((out / "config.json").read_text())
    assert d["model_type"] == model_type and d["architectures"] == [vlm_cls]
    assert d["vision_config"]["depth"] == 1 and d["text_config"]["model_type"] == text_type
    assert load_model_config(out) == cfg

    # transformers reads the export: the multimodal class (its vision tower absent: initialised, with a warning) and
    # the text-only class give the original text logits
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        for cls in (getattr(transformers, vlm_cls), getattr(transformers, text_cls)):
            back = cls.from_pretrained(out, dtype=torch.float32).eval()
            assert torch.allclose(back(input_ids=ids).logits, ref, rtol=0, atol=1e-5), cls.__name__


@pytest.mark.parametrize("multimodal", [False, True])
def test_fused_experts_load_and_export_as_save_pretrained_writes(tmp_path, multimodal):
    """A checkpoint of transformers' own module tensors (Qwen3_5Moe's experts fused: mlp.experts.gate_up_proj
    (E, 2F, C) rows [gate; up], mlp.experts.down_proj (E, C, F)), text or multimodal, loads to the parameters of the
    per-expert checkpoint save_pretrained writes, bit for bit, and so to transformers' logits (test_qwen3_5.py's
    1e-5 relative: the same fp32 math, other kernels); the export is save_pretrained's layout (experts one by one in
    transformers 5.x) and transformers reads it back to the very logits it started from."""
    if multimodal:
        model = qwen35_multimodal_model(moe=True).eval()
    else:
        model = qwen35_hf_model(tiny_cfg(moe=True, num_hidden_layers=2,
                                         layer_types=("linear_attention", "full_attention"))).eval()
    model.save_pretrained(tmp_path / "pretrained")
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((tmp_path / "pretrained" / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(fused / "model.safetensors"),
              metadata={"format": "pt"})
    assert sum(k.endswith("mlp.experts.gate_up_proj") for k in _tensors(fused)) == 2  # one per (MoE) layer
    cfg = load_model_config(fused)
    params, want = load_hf_weights(fused, cfg), load_hf_weights(tmp_path / "pretrained", cfg)
    assert params.keys() == want.keys() and all(torch.equal(params[n], want[n]) for n in want)

    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        got = Transformer(cfg, RunOptions()).logits(ParamWeights(cfg, params), ids)
    assert ((got - ref).norm() / ref.norm()).item() <= 1e-5

    save_hf_model(tmp_path / "out", cfg, params, dtype=torch.float32)
    written, pretrained = _tensors(tmp_path / "out"), _tensors(tmp_path / "pretrained")
    assert set(written) == {k for k in pretrained if not k.startswith("model.visual.")}
    assert all(torch.equal(written[k], pretrained[k]) for k in written)
    back = type(model).from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, ref)


def test_rope_scaling_survives_export_beside_the_partial_rotary_factor():
    """The scaling keys share rope_parameters with partial_rotary_factor: transformers reads both from the export, and
    so does qtrain (the export once dropped the scaling)."""
    cfg = tiny_cfg(rope_scaling={"rope_type": "linear", "factor": 2.0})
    d = cfg.to_hf_dict(dtype="float32")
    hf = transformers.AutoConfig.for_model(**d).rope_parameters
    assert (hf["rope_type"], hf["factor"], hf["partial_rotary_factor"]) == ("linear", 2.0, cfg.partial_rotary_factor)
    assert config_from_hf_dict(d) == cfg


@pytest.mark.parametrize("name,total", [("Qwen3.5-4B", 4e9), ("Qwen3.5-9B", 9e9), ("Qwen3.5-27B", 27e9),
                                        ("Qwen3.5-35B-A3B", 35e9)])
def test_presets_build_transformers_models_of_their_names_size(name, total):
    """The presets' config.json builds transformers' own Qwen3.5 model (meta device) with exactly qtrain's parameter
    count, within 6% of the size in the model's name (4.21B, 8.95B, 26.90B and 34.66B as written: the names round)."""
    from qtrain.model.registry import preset
    from qtrain.model.weights import num_params
    cfg = preset(name)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg.to_hf_dict()))
    assert num_params(cfg) == sum(p.numel() for p in model.parameters())
    assert abs(num_params(cfg) - total) / total < 0.06
    assert sum(t == "full_attention" for t in cfg.layer_types) * 4 == cfg.num_hidden_layers  # every 4th layer
