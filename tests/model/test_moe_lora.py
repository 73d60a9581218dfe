"""LoRA on an MoE model's routed experts (model/lora/tensors.py: gate,up,down of a routed layer are peft's
`target_parameters` mlp.experts.gate_up_proj / down_proj), against the real peft package over transformers' models,
fp32 CPU. The export's logits and gradients: tests/model/test_lora_families.py. Here:

- an adapter peft made itself (get_peft_model with target_modules gate_proj/up_proj/down_proj, peft's own v5
  conversion to target_parameters + rank_pattern; and target_parameters as a Mixtral user writes it), B random, read
  back as --lora-init-from reads it: qtrain's logits are peft's, and the merged weights (--lora-merge) give them too,
  as does peft's merge_and_unload of the same adapter loaded into transformers' model;
- recompute switches change no bit of the experts' adapter gradients, with and without dropout.

Tolerances: test_lora_families.py's (fp32; the MoE sums a token's experts in another order): logits 2e-5 of their
scale.
"""
from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")

from qtrain.model.hf_io import load_hf_weights  # noqa: E402
from qtrain.model.lora import LoraAdapter  # noqa: E402
from qtrain.model.lora.checks import spec_from_options  # noqa: E402
from qtrain.model.lora.merge import merged_params  # noqa: E402
from qtrain.model.lora.peft_io import read_adapter  # noqa: E402
from qtrain.model.lora.spec import LoraError  # noqa: E402
from qtrain.model.registry import config_from_hf_dict  # noqa: E402
from qtrain.model.transformer import RunOptions, Transformer  # noqa: E402
from qtrain.model.weights import internal_to_hf  # noqa: E402
from qtrain.parallel.weights.replicated import ParamWeights  # noqa: E402
from tests.model import family_fixtures as ff  # noqa: E402
from tests.model.test_lora import _close, _qtrain, adapter_grads  # noqa: E402

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
PEFT_CONFIGS = {  # case -> (MoE fixture, LoraConfig keywords): how a peft user adapts the experts
    # every layer routed, as Qwen3-30B-A3B (the fixture's dense layer: test_peft_adapter_of_a_dense_mlp_...)
    "qwen3_moe": ("qwen3_moe", dict(target_modules=ATTN + ["gate_proj", "up_proj", "down_proj"])),
    "olmoe": ("olmoe", dict(target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"])),
    # transformers 4's names, which peft converts to target_parameters
    "mixtral-v4-names": ("mixtral", dict(target_modules=["q_proj", "w1", "w2", "w3"])),
    "mixtral": ("mixtral", dict(target_modules=["o_proj"], target_parameters=EXPERTS,
                                rank_pattern={r".*\.gate_up_proj": 8}, alpha_pattern={r".*\.gate_up_proj": 10})),
}


@pytest.mark.parametrize("case", list(PEFT_CONFIGS))
def test_peft_made_expert_adapter_loads_and_merges(case, tmp_path):
    fixture, kw = PEFT_CONFIGS[case]
    model = ff.moe_hf_model(fixture, **({"mlp_only_layers": []} if fixture == "qwen3_moe" else {})).float().eval()
    model.save_pretrained(tmp_path / "base")
    cfg = config_from_hf_dict(model.config.to_dict())
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=5, init_lora_weights=False, **kw))
    pm.save_pretrained(tmp_path / "p")  # init_lora_weights=False: B random, not zero
    spec = spec_from_options({"lora_rank": 4, "lora_init_from": str(tmp_path / "p")}, cfg, check_adapter=True)
    assert {"gate", "up", "down"} <= set(spec.targets) and spec.alpha == 5.0  # the adapter's targets and alpha
    hf = {k: v.detach() for k, v in load_hf_weights(tmp_path / "base", cfg).items()}
    _, w = _qtrain(cfg, internal_to_hf(cfg, hf), spec, source=read_adapter(str(tmp_path / "p"), cfg, spec))
    inputs = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = pm.eval()(inputs).logits
        with pm.disable_adapter():
            assert (want - pm(inputs).logits).abs().max() > 1e-3  # the adapter does something
    _close(Transformer(cfg, RunOptions(adapter=LoraAdapter(cfg, spec))).logits(w.source, inputs), want)
    params = {n: t.detach() for n, t in w.params.items()}
    merged = merged_params(cfg, spec, params)
    _close(Transformer(cfg).logits(ParamWeights(cfg, merged), inputs), want)
    # the export's merge: a few experts at a time (8 at the most here: 3 makes several chunks and a ragged last one),
    # each matrix cast at once to the export dtype on the host -- the bits of casting the fp32 merge at save time
    import qtrain.model.lora.merge as merge_mod
    monkey = pytest.MonkeyPatch()
    monkey.setattr(merge_mod, "EXPERT_CHUNK", 3)
    try:
        chunked = merged_params(cfg, spec, params, dtype=torch.bfloat16, device="cpu")
    finally:
        monkey.undo()
    assert chunked.keys() == merged.keys()
    for n, t in merged.items():
        if t is params.get(n):  # not adapted: passed through as it is
            assert chunked[n] is params[n], n
        else:
            assert chunked[n].dtype == torch.bfloat16 and torch.equal(chunked[n], t.to(torch.bfloat16)), n
    # peft's own merge of the expert parameters is the same model
    with torch.no_grad():
        _close(pm.merge_and_unload()(inputs).logits, want)


def test_peft_adapter_of_a_dense_mlp_in_an_moe_model(tmp_path):
    """peft >= 0.22 adapts the MLP of an MoE model's dense layer (mlp_only_layers) too for target_modules
    gate_proj/up_proj/down_proj, which qtrain does not (its targets there are the experts): such an adapter is refused
    in one line naming the tensor; with an older peft (experts only) it loads."""
    from packaging.version import Version
    model = ff.moe_hf_model("qwen3_moe").float().eval()  # layer 1 dense
    assert model.config.mlp_only_layers == [1]
    cfg = config_from_hf_dict(model.config.to_dict())
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=5, target_modules=ATTN + [
        "gate_proj", "up_proj", "down_proj"]))
    pm.save_pretrained(tmp_path / "p")
    spec = spec_from_options({"lora_rank": 4, "lora_init_from": str(tmp_path / "p")}, cfg)
    if Version(peft.__version__) < Version("0.22"):
        assert read_adapter(str(tmp_path / "p"), cfg, spec, load=False) is None
        return
    with pytest.raises(LoraError, match=r"has tensor base_model\.model\.model\.layers\.1\.mlp\.\w+_proj\.lora_.\.weight: an "
                                        r"adapter of a dense MLP or shared expert in an MoE model") as e:
        read_adapter(str(tmp_path / "p"), cfg, spec, load=False)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_recompute_gives_the_same_expert_adapter_gradients_bitwise(dropout, tmp_path):
    """--recompute-ffn reruns the permutation + up/gate GEMM with its adapter (and the dropout mask it drew: the key
    names step, micro-step, layer and target), --recompute-swiglu the SwiGLU the down adapter reads: the adapters'
    gradients are the plain run's bits (eager, fp32); another micro-step draws other masks."""
    cfg = config_from_hf_dict(ff.moe_hf_model("qwen3_moe").config.to_dict())
    spec = spec_from_options({"lora_rank": 2, "lora_alpha": 3.0, "lora_dropout": dropout,
                              "lora_targets": "q,gate,up,down"}, cfg)
    ff.moe_hf_model("qwen3_moe").save_pretrained(tmp_path)
    _, w = _qtrain(cfg, internal_to_hf(cfg, load_hf_weights(tmp_path, cfg)), spec)
    inputs = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    runs = (((), (3, 1)), (("ffn", "swiglu"), (3, 1)), (("block",), (3, 1)), ((), (3, 2)))
    out = adapter_grads(cfg, spec, w, inputs, runs)
    assert any("experts" in k for k in out[0]) and out[0].keys() == out[1].keys()
    for k in out[0]:
        assert torch.equal(out[0][k], out[1][k]) and torch.equal(out[0][k], out[2][k]), k
        if "experts" in k:
            assert torch.equal(out[0][k], out[3][k]) == (dropout == 0), k


def test_peft_adapter_of_a_shared_expert_is_refused_in_one_line(tmp_path):
    """target_modules gate_proj/up_proj/down_proj over a Qwen3.5-MoE model: peft adapts its shared experts' linears
    (nn.Linear), which qtrain does not adapt (its MLP targets there are the routed experts): refused in one line
    that says so, not as an adapter of another model."""
    model = ff.qwen35_hf_model(ff.qwen35_cfg(moe=True))
    cfg = config_from_hf_dict(model.config.to_dict())
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=5, target_modules=ATTN[:1] + [
        "gate_proj", "up_proj", "down_proj"], target_parameters=EXPERTS, rank_pattern={r".*\.gate_up_proj": 8},
        alpha_pattern={r".*\.gate_up_proj": 10}))
    pm.save_pretrained(tmp_path / "p")
    spec = spec_from_options({"lora_rank": 4, "lora_init_from": str(tmp_path / "p")}, cfg)
    with pytest.raises(LoraError, match=r"has tensor .*\.mlp\.shared_expert\.\w+_proj\.lora_.\.weight: an adapter of "
                                        r"a dense MLP or shared expert in an MoE model") as e:
        read_adapter(str(tmp_path / "p"), cfg, spec, load=False)
    assert "\n" not in str(e.value)
