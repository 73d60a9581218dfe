"""--rope-scaling's config (model/context_extension.py) through every family's config.json both ways: what a run with
the option writes into its checkpoints and export reads back as the same model, and the option given again over that
model takes it as it is (a resume, a merge base, a run from the export). Qwen3.5 and Qwen3-Next keep their partial
rotary factor beside the scaling keys in `rope_parameters`: the reader must not take it for a scaling key."""
from __future__ import annotations

import pytest

from qtrain.model.context_extension import ContextExtensionError, extend_context, parse_rope_scaling
from qtrain.model.registry import config_from_hf_dict, preset

FAMILIES = ["Qwen2.5-7B", "Qwen3-30B-A3B", "OLMoE-1B-7B", "Qwen3.5-4B", "Qwen3.5-35B-A3B", "Qwen3-Next-80B-A3B"]


@pytest.mark.parametrize("option", ["yarn:2", "llama3:4", "linear:2", "dynamic:3", "yarn"])
@pytest.mark.parametrize("model", FAMILIES)
def test_the_scaled_config_reads_back_and_is_taken_again(model, option):
    cfg = preset(model)
    assert not cfg.rope_scaling
    seq = 3 * cfg.max_position_embeddings  # the default factor: 3
    scaled = extend_context(cfg, option, seq)
    kind, _, factor = option.partition(":")
    assert scaled.rope_scaling["rope_type"] == kind and scaled.rope_scaling["factor"] == float(factor or 3)
    assert scaled.context_length == int(float(factor or 3) * cfg.max_position_embeddings)
    back = config_from_hf_dict(scaled.to_hf_dict())
    assert back == scaled
    assert extend_context(back, option, seq) is back
    with pytest.raises(ContextExtensionError, match="already has other RoPE scaling"):
        extend_context(back, "linear:7", seq)


@pytest.mark.parametrize("text", ["yarn: 2", "yarn:2\n", "yarn:1_6", "yarn:-2", "yarn:1e3", "yarn:0.5", "yarn:",
                                  "Yarn:2", "longrope:2"])
def test_a_bad_value_is_refused_in_one_line(text):
    with pytest.raises(ContextExtensionError) as e:
        parse_rope_scaling(text)
    assert "\n" not in str(e.value) and str(e.value).startswith("--rope-scaling ")


def test_factors():
    assert parse_rope_scaling("yarn") == ("yarn", None)
    assert parse_rope_scaling("linear:2.5") == ("linear", 2.5) and parse_rope_scaling("llama3:8") == ("llama3", 8.0)
