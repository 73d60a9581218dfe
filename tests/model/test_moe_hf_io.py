"""The MoE families' configs and checkpoints against transformers (5.x): the config.json save_pretrained writes is read
as the same model, `to_hf_dict` loads in transformers as the same model, the checkpoint names are what save_pretrained
writes (per expert), the other layouts transformers reads load too, an export reads back in transformers with the same
logits, and the presets have the published models' sizes.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")

from qtrain.model.hf_io import expected_hf_shapes, load_hf_weights, save_hf_model  # noqa: E402
from qtrain.model.registry import config_from_hf_dict, config_from_json_file, preset  # noqa: E402
from qtrain.model.transformer import Transformer  # noqa: E402
from qtrain.model.weights import num_params  # noqa: E402
from qtrain.parallel.weights.replicated import ParamWeights  # noqa: E402
from tests.model.family_fixtures import MOE_CASES as CASES, moe_hf_model as hf_model  # noqa: E402


def _saved_names(path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


@pytest.mark.parametrize("case", list(CASES))
def test_save_pretrained_round_trip(case, tmp_path):
    """save_pretrained's config.json and per-expert tensors are read as the model; qtrain's export of it (config and
    tensors) is what transformers reads back as the same model: the same names, bit-identical weights, the same
    logits."""
    hf = hf_model(case)
    hf.save_pretrained(tmp_path / "hf")
    cfg = config_from_json_file(tmp_path / "hf" / "config.json")
    assert config_from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict()))) == cfg
    names = _saved_names(tmp_path / "hf")
    if cfg.tie_word_embeddings:
        names.pop("lm_head.weight", None)
    assert expected_hf_shapes(cfg) == names  # e.g. model.layers.0.mlp.experts.3.up_proj.weight (F, C)
    params = load_hf_weights(tmp_path / "hf", cfg)

    save_hf_model(tmp_path / "out", cfg, params, dtype=torch.float32)
    assert _saved_names(tmp_path / "out") == names
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    for (n, p), (n2, q) in zip(sorted(hf.state_dict().items()), sorted(back.state_dict().items())):
        assert n == n2 and torch.equal(p, q), n
    inputs = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = back(input_ids=inputs).logits
    got = Transformer(cfg).logits(ParamWeights(cfg, params), inputs)
    assert ((got - want).norm() / want.norm()).item() <= 1e-5
    assert all(torch.equal(a, b) for a, b in zip(params.values(), load_hf_weights(tmp_path / "out", cfg).values()))


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral"])
def test_the_other_layouts_transformers_reads_load_alike(case, tmp_path):
    """A checkpoint of transformers' module tensors (experts fused: gate_up_proj (E, 2F, C) with [gate; up] rows,
    down_proj (E, C, F), router mlp.gate) and, for Mixtral, the per-expert w1/w2/w3 under mlp. (transformers renames
    block_sparse_moe. on load) give the same parameters as the per-expert checkpoint save_pretrained writes."""
    hf = hf_model(case)
    hf.save_pretrained(tmp_path / "hf")
    cfg = config_from_json_file(tmp_path / "hf" / "config.json")
    want = load_hf_weights(tmp_path / "hf", cfg)
    layouts = {"fused": {k: v.contiguous() for k, v in hf.state_dict().items()}}
    if case == "mixtral":
        from safetensors.torch import load_file
        layouts["mlp"] = {k.replace(".block_sparse_moe.", ".mlp."): v
                          for k, v in load_file(str(tmp_path / "hf" / "model.safetensors")).items()}
    for name, tensors in layouts.items():
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
        save_file(tensors, str(d / "model.safetensors"))
        got = load_hf_weights(d, cfg)
        assert all(torch.equal(got[n], want[n]) for n in want), name
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\.(mlp|block_sparse_moe)\.experts\.0\."):
        tensors = dict(layouts["fused"])
        del tensors[next(k for k in tensors if k.endswith("experts.gate_up_proj"))]
        save_file(tensors, str(tmp_path / "fused" / "model.safetensors"))
        load_hf_weights(tmp_path / "fused", cfg)  # neither layout whole: the message names what export writes


@pytest.mark.parametrize("name,total,active", [("Qwen3-30B-A3B", 30.5e9, 3.3e9), ("OLMoE-1B-7B", 6.9e9, 1.3e9)])
def test_presets_are_the_published_shapes(name, total, active):
    """The presets' config.json builds transformers' model of the same parameter count (meta device), ~30.5B total
    / ~3.3B active for Qwen3-30B-A3B and ~6.9B / ~1.3B for OLMoE-1B-7B (their model cards)."""
    cfg = preset(name)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**cfg.to_hf_dict()))
    assert num_params(cfg) == sum(p.numel() for p in model.parameters())
    assert abs(num_params(cfg) - total) / total < 0.02
    C, F, L, k, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_hidden_layers, cfg.num_experts_per_tok, \
        cfg.num_experts
    active_params = num_params(cfg) - L * (E - k) * 3 * F * C
    assert abs(active_params - active) / active < 0.03
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok) == \
        ((2048, 48, 128, 8) if name.startswith("Qwen") else (2048, 16, 64, 8))
