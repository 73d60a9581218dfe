"""Training past max_position_embeddings with RoPE scaling, end to end through `qtrain train`: a YaRN model (as
Qwen2.5's long-context config.json writes it: max_position_embeddings kept, factor 4 over the original context)
trains at 2x its max_position_embeddings, and its export carries the scaling to transformers."""
from __future__ import annotations

import json

import pytest
import torch

from qtrain.cli.main import main
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
