"""LoRA on the hybrid Qwen3.5 model against the real `peft` (fp32, CPU), as tests/model/test_lora.py checks the dense
families: the linear-attention layers' projections (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj) and the
full-attention ones' (q, k, v, o) are targets beside the MLP's; the adapter qtrain exports loads with
`peft.PeftModel.from_pretrained` and gives qtrain's logits, and one micro-step's adapter gradients equal peft's.
Tolerances as test_lora.py (logits within 2e-5 of their scale; per tensor cosine >= 0.99999, norm within 1e-4)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

peft = pytest.importorskip("peft")

from qtrain.model.lora import LoraAdapter, LoraError, LoraSpec  # noqa: E402
from qtrain.model.lora.checks import spec_from_options  # noqa: E402
from qtrain.model.lora.peft_io import save_adapter  # noqa: E402
from qtrain.model.lora.tensors import adapter_specs, known_targets  # noqa: E402
from qtrain.model.transformer import RunOptions, Transformer  # noqa: E402
from tests.model.test_lora import _close, _peft, _qtrain  # noqa: E402
from tests.model.test_qwen3_5 import Collect, hf_model, tiny_cfg  # noqa: E402
from tests.model.test_qwen3_next import next_cfg  # noqa: E402

CFG = dict(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"))


def test_targets_of_both_layer_kinds():
    assert known_targets(tiny_cfg(**CFG)) == ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out", "up",
                                              "gate", "down", "q", "k", "v", "o")
    # Qwen3-Next's in_proj rows interleave per key-head group: no row range of the fused matrix, so no target
    assert known_targets(next_cfg(moe=False, **CFG)) == ("out", "up", "gate", "down", "q", "k", "v", "o")


@pytest.mark.parametrize("targets", [("in_proj_qkv", "in_proj_a", "out", "q", "v", "o", "gate", "down"),
                                     ("in_proj_z", "in_proj_b", "k", "up")])
def test_export_loads_in_peft_with_equal_logits_and_gradients(targets, tmp_path):
    cfg = tiny_cfg(**CFG)
    spec = LoraSpec(rank=4, alpha=6.0, targets=targets)
    model = hf_model(cfg)
    _, w = _qtrain(cfg, model.state_dict(), spec)
    adapters = {n: w.params[n].detach() for n in adapter_specs(cfg, spec)}
    save_adapter(tmp_path / "a", cfg, spec, adapters, base="tiny", dtype=torch.float32)
    pm = _peft(model, tmp_path / "a")
    inputs = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    targets_ = inputs.roll(-1, 1)
    m = Transformer(cfg, RunOptions(adapter=LoraAdapter(cfg, spec)))
    with torch.no_grad():
        want = pm(inputs).logits
    _close(m.logits(w.source, inputs), want)

    sink = Collect()
    m.forward_backward(w.source, inputs, targets_, grads=sink, loss_scale=1 / inputs.numel())
    assert set(sink.grads) == set(adapters)
    loss = F.cross_entropy(pm(inputs).logits.reshape(-1, cfg.vocab_size), targets_.reshape(-1))
    loss.backward()
    got = {n.replace(".default", ""): p.grad for n, p in pm.named_parameters() if p.requires_grad}
    for name, s in adapter_specs(cfg, spec).items():
        flat, start = sink.grads[name].reshape(-1), 0
        for key, shape in s.hf:
            g, ref = flat[start:start + math.prod(shape)].view(shape), got[key]
            start += math.prod(shape)
            cos = F.cosine_similarity(g.reshape(1, -1).double(), ref.reshape(1, -1).double()).item()
            assert cos >= 0.99999 and abs(g.norm() / ref.norm() - 1) < 1e-4, (key, cos)


def test_moe_hybrid_is_refused_naming_each_layer_kind():
    with pytest.raises(LoraError, match=r"LoRA is not supported for qwen3_5_moe_text yet: .*layer 0: .*layer 1: "):
        spec_from_options({"lora_rank": 4}, tiny_cfg(moe=True, **CFG))
