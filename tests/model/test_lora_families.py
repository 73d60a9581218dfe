"""LoRA on the MoE families (qwen3_moe with dense and routed layers, olmoe, mixtral) and on Qwen3.5 (dense and MoE,
linear-attention and full-attention layers), against the real peft package over transformers' models, fp32 CPU:
qtrain's logits with an exported adapter equal peft's, and one micro-step's adapter gradients equal peft's.

Targets are the block linears (the family's `fp8_matrices`): attention q,k,v,o everywhere; the dense MLP's
gate/up/down in a dense model (Qwen3.5 dense); Qwen3.5's linear-attention projections as targets in_proj_qkv,
in_proj_z, in_proj_b, in_proj_a, out, Qwen3-Next's in_proj_qkvz, in_proj_ba (rows interleaved: model/lora/tensors.py),
out. An adapter exists in the layers that have its target, as peft's target_modules
match. On an MoE model gate, up and down are its routed experts (peft's target_parameters mlp.experts.gate_up_proj /
down_proj, per-expert A and B: model/lora/tensors.py), checked here like any target; routers, Qwen3.5's shared expert
and an MoE model's dense layers' MLP are not targets (tests/reliability/test_lora_inputs.py, test_moe_lora_inputs.py).

Tolerances: tests/model/test_lora.py's (fp32, the same operations up to GEMM blocking; the MoE sums over a token's
experts in another order: tests/model/test_moe_families.py): logits 2e-5 of their scale, gradients cosine >= 0.99999
and norms within 1e-4 per tensor.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from qtrain.model.hf_io import load_hf_weights  # noqa: E402
from qtrain.model.lora import LoraAdapter, LoraSpec  # noqa: E402
from qtrain.model.lora.checks import spec_from_options  # noqa: E402
from qtrain.model.lora.peft_io import save_adapter  # noqa: E402
from qtrain.model.lora.tensors import adapter_specs  # noqa: E402
from qtrain.model.registry import config_from_hf_dict  # noqa: E402
from qtrain.model.transformer import RunOptions, Transformer  # noqa: E402
from qtrain.model.weights import to_hf  # noqa: E402
from tests.model import family_fixtures as ff  # noqa: E402
from tests.model.test_lora import _qtrain  # noqa: E402
from tests.model.family_fixtures import Collect  # noqa: E402

Q35_LINEAR = "in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,out"
CASES = {  # name -> (transformers model factory, --lora-targets ('' = the default))
    "qwen3_moe": (lambda: ff.moe_hf_model("qwen3_moe"), ""),
    "olmoe": (lambda: ff.moe_hf_model("olmoe"), ""),
    "mixtral": (lambda: ff.moe_hf_model("mixtral"), "q,v,o,gate,up,down"),
    "mixtral-down": (lambda: ff.moe_hf_model("mixtral"), "k,down"),  # one expert parameter: no '.base_layer'
    "olmoe-gate-up": (lambda: ff.moe_hf_model("olmoe"), "gate,up"),
    "qwen3_5": (lambda: ff.qwen35_hf_model(ff.qwen35_cfg()), Q35_LINEAR + ",q,k,v,o,gate,up,down"),
    "qwen3_5_moe": (lambda: ff.qwen35_hf_model(ff.qwen35_cfg(moe=True)), "in_proj_qkv,out,k,o,gate,up,down"),
    # the multimodal checkpoint (text model under model.language_model.): peft's keys over the VLM class
    "qwen3_5_multimodal": (ff.qwen35_multimodal_model, Q35_LINEAR + ",q,k,v,o,gate,up,down"),
    # Qwen3-Next's in_proj_qkvz / in_proj_ba hold their rows interleaved per key-head group (2 groups of 2 value heads
    # here): peft's B rows permuted onto qtrain's in_proj rows; one of the two alone, in an MoE model
    "qwen3_next": (lambda: _next_model(moe=False), "in_proj_qkvz,in_proj_ba,out,q,k,v,o,gate,up,down"),
    "qwen3_next_moe": (lambda: _next_model(moe=True), "in_proj_ba,o,gate,up,down"),
}


def _next_model(moe: bool):
    from tests.model.test_qwen3_next import hf_model, next_cfg
    return hf_model(next_cfg(moe=moe, num_hidden_layers=2, layer_types=("linear_attention", "full_attention")))


def _close(a, b, rel=2e-5):
    assert (a - b).abs().max().item() <= rel * b.abs().max().item(), (a - b).abs().max().item()


@pytest.mark.parametrize("case", list(CASES))
def test_adapter_logits_and_gradients_equal_peft(case, tmp_path):
    make, targets = CASES[case]
    model = make().float().eval()
    model.save_pretrained(tmp_path / "base")
    cfg = config_from_hf_dict(model.config.to_dict())
    spec = spec_from_options({"lora_rank": 2, "lora_alpha": 3.0, "lora_targets": targets}, cfg)
    hf = {k: v.detach() for k, v in load_hf_weights(tmp_path / "base", cfg).items()}
    from qtrain.model.weights import internal_to_hf
    _, w = _qtrain(cfg, internal_to_hf(cfg, hf), spec)
    adapters = {n: w.params[n].detach() for n in adapter_specs(cfg, spec)}
    save_adapter(tmp_path / "a", cfg, spec, adapters, base="tiny", dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(model, str(tmp_path / "a"), is_trainable=True).eval()
    inputs = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    m = Transformer(cfg, RunOptions(adapter=LoraAdapter(cfg, spec)))
    with torch.no_grad():
        want = pm(inputs).logits
    _close(m.logits(w.source, inputs), want)
    with torch.no_grad(), pm.disable_adapter():
        assert (want - pm(inputs).logits).abs().max() > 1e-4  # the adapters do something
    exported = {k for s in adapter_specs(cfg, spec).values() for k, _ in s.hf}
    assert set(peft.get_peft_model_state_dict(pm)) == exported  # peft's own names for this model, every one loaded

    sink = Collect()
    m.forward_backward(w.source, inputs, inputs.roll(-1, 1), grads=sink, loss_scale=1 / inputs.numel(),
                       router_loss_scale=0.0)
    assert set(sink.grads) == set(adapters)
    loss = F.cross_entropy(pm(inputs).logits.reshape(-1, cfg.vocab_size), inputs.roll(-1, 1).reshape(-1))
    loss.backward()
    got = {n.replace(".default", ""): p.grad for n, p in pm.named_parameters() if p.requires_grad}
    assert len(got) == sum(len(s.hf) for s in adapter_specs(cfg, spec).values())
    for name, s in adapter_specs(cfg, spec).items():
        for key, g in to_hf(s, sink.grads[name]).items():
            ref = got[key]
            cos = F.cosine_similarity(g.reshape(1, -1).double(), ref.reshape(1, -1).double()).item()
            assert cos >= 0.99999 and abs(g.norm() / ref.norm() - 1) < 1e-4, (key, cos)


def test_a_peft_made_qwen3_next_adapter_loads_and_merges_to_peft_logits(tmp_path):
    """--lora-init-from's path over Qwen3-Next's interleaved in_proj rows: peft's adapter of in_proj_qkvz and
    in_proj_ba (B random: init_lora_weights=False) read back gives peft's logits, and so do the merged weights."""
    from qtrain.model.lora.merge import merged_params
    from qtrain.model.lora.peft_io import read_adapter
    from qtrain.parallel.weights.replicated import ParamWeights
    model = _next_model(moe=False).eval()
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cfg = config_from_hf_dict(model.config.to_dict())
    lc = peft.LoraConfig(r=2, lora_alpha=3, target_modules=["in_proj_qkvz", "in_proj_ba"], init_lora_weights=False)
    pm = peft.get_peft_model(model, lc).eval()
    pm.save_pretrained(tmp_path / "p")
    spec = LoraSpec(2, 3.0, targets=("in_proj_qkvz", "in_proj_ba"))
    _, w = _qtrain(cfg, base, spec, source=read_adapter(str(tmp_path / "p"), cfg, spec))
    inputs = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = pm(inputs).logits
        _close(Transformer(cfg, RunOptions(adapter=LoraAdapter(cfg, spec))).logits(w.source, inputs), want)
        merged = merged_params(cfg, spec, {n: t.detach() for n, t in w.params.items()})
        _close(Transformer(cfg).logits(ParamWeights(cfg, merged), inputs), want)
        with pm.disable_adapter():
            assert (want - pm(inputs).logits).abs().max() > 1e-3  # the adapter does something


def test_targets_exist_where_their_layers_have_them():
    """qwen3_moe with a dense layer (mlp_only_layers=[1]): attention targets only; Qwen3.5: the linear-attention
    projections' adapters in its linear-attention layers, q/k/v/o's in its full-attention layers."""
    from qtrain.model.lora.tensors import known_targets
    cfg = config_from_hf_dict(ff.moe_hf_model("qwen3_moe").config.to_dict())
    assert known_targets(cfg) == ("q", "k", "v", "o", "gate", "up", "down")
    assert {n.split(".")[1] for n in adapter_specs(cfg, LoraSpec(2, 4.0)) if "experts" in n} == {"0"}  # routed only
    cfg = ff.qwen35_cfg()
    spec = LoraSpec(2, 4.0, targets=("in_proj_z", "o"))
    assert {n.rsplit("_lora", 1)[0] for n in adapter_specs(cfg, spec)} == {
        f"layers.{i}.{'o' if t == 'full_attention' else 'in_proj'}" for i, t in enumerate(cfg.layer_types)}


@pytest.mark.parametrize("kind", ["masked", "varlen"])
def test_document_masking_with_adapters_equals_documents_alone(kind):
    """--document-masking with LoRA: a packed micro-batch's loss and adapter gradients are those of its documents run
    one at a time (tests/model/test_document_masking.py's check and tolerance: fp32 regrouping only)."""
    from tests.model import test_document_masking as dm
    from tests.model.test_transformer import tiny_cfg
    from qtrain.parallel.weights.replicated import ParamWeights
    cfg = tiny_cfg("qwen2", tied=False)
    spec = LoraSpec(2, 4.0, targets=("q", "v", "o", "gate", "down"))
    params = {n: t.detach().requires_grad_(False) for n, t in dm.params_of(cfg).items()}
    g = torch.Generator().manual_seed(4)
    for name, s in adapter_specs(cfg, spec).items():
        params[name] = (torch.randn(s.shape, generator=g) * 0.2).requires_grad_(True)
    inputs, targets, positions, docs = dm.packed_batch(cfg.vocab_size)
    adapter = LoraAdapter(cfg, spec)
    packed = dm.run_packed(cfg, params, RunOptions(adapter=adapter, document_attention=kind), inputs, targets,
                           positions)
    model, total, grads = Transformer(cfg, RunOptions(adapter=adapter)), torch.zeros(()), {}
    for tokens, tgt in docs:
        sink = Collect()
        total += model.forward_backward(ParamWeights(cfg, params), tokens[None], tgt[None], grads=sink, loss_scale=1.0)
        for k, v in sink.grads.items():
            grads[k] = grads[k] + v if k in grads else v.clone()
    assert set(grads) == set(adapter_specs(cfg, spec))
    dm.assert_same(packed, (total, grads))
