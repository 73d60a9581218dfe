"""LoRA against the real `peft` package in fp32 on the CPU: the adapter qtrain exports loads with
`peft.PeftModel.from_pretrained` and gives qtrain's logits; one micro-step's adapter gradients equal peft's; a peft-made
adapter read back (--lora-init-from's path) gives peft's logits; the merged weights give them too.

Tolerances (as tests/model/test_transformer.py): fp32 with the same operations up to GEMM blocking and the fused
qkv / up-gate GEMMs, so logits agree to ~1e-6 relative (asserted: 2e-5 of the logits' scale); gradients: cosine >=
0.99999 and norm within 1e-4 relative per tensor.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

peft = pytest.importorskip("peft")

from qtrain.model.lora import LoraAdapter, LoraSpec
from qtrain.model.lora.init import init_adapters
from qtrain.model.lora.merge import merged_params
from qtrain.model.lora.peft_io import read_adapter, save_adapter
from qtrain.model.lora.tensors import adapter_specs
from qtrain.model.transformer import RunOptions, Transformer
from qtrain.model.weights import hf_to_internal
from qtrain.parallel.comm import Communicator
from qtrain.parallel.layout import FlatLayout
from qtrain.parallel.weights import build_weights
from tests.model.test_transformer import Collect, hf_model, tiny_cfg

CASES = [("qwen2", False, ("q", "k", "v", "o", "gate", "up", "down")), ("qwen3", True, ("q", "v", "gate", "down")),
         ("llama", False, ("k", "o", "up"))]


def _qtrain(cfg, hf, spec, *, seed=3, source=None):
    """qtrain's weights for the HF state dict `hf` under adapters `spec` (B random unless `source` gives them)."""
    params = dict(hf_to_internal(cfg, lambda k: hf[k].detach().clone()))
    layout = FlatLayout(cfg, 1, lora=spec)

    def fill(views):
        init_adapters(cfg, spec, views, seed=seed, source=source)
        if source is None:
            gen = torch.Generator().manual_seed(seed)
            for n, t in views.items():
                if n.endswith("_lora_b"):
                    t.copy_(torch.randn(t.shape, generator=gen) * 0.2)

    w = build_weights(layout, comm=Communicator.solo("cpu"), dtype=torch.float32, device=torch.device("cpu"),
                      sharded=False, adapters=fill)
    with torch.no_grad():
        for n, p in params.items():
            w.params[n].copy_(p)
    return layout, w


def _peft(model, d):
    return peft.PeftModel.from_pretrained(model, str(d), is_trainable=True).eval()


def _close(a, b, rel=2e-5):
    assert (a - b).abs().max().item() <= rel * b.abs().max().item(), (a - b).abs().max().item()


@pytest.mark.parametrize("model_type,tied,targets", CASES)
def test_export_loads_in_peft_with_equal_logits_and_gradients(model_type, tied, targets, tmp_path):
    cfg = tiny_cfg(model_type, tied)
    spec = LoraSpec(rank=4, alpha=6.0, targets=targets)
    model = hf_model(cfg)
    layout, w = _qtrain(cfg, model.state_dict(), spec)
    adapters = {n: w.params[n].detach() for n in adapter_specs(cfg, spec)}
    save_adapter(tmp_path / "a", cfg, spec, adapters, base="tiny", dtype=torch.float32)
    pm = _peft(model, tmp_path / "a")
    inputs = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    targets_ = inputs.roll(-1, 1)
    m = Transformer(cfg, RunOptions(adapter=LoraAdapter(cfg, spec)))
    with torch.no_grad():
        want = pm(inputs).logits
    _close(m.logits(w.source, inputs), want)

    # one micro-step's gradients: only the adapters get one, and they are peft's
    sink = Collect()
    m.forward_backward(w.source, inputs, targets_, grads=sink, loss_scale=1 / inputs.numel())
    assert set(sink.grads) == set(adapters)
    pm.train()
    for mod in pm.modules():  # peft's dropout is 0 anyway; keep the base in eval semantics
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
    loss = F.cross_entropy(pm(inputs).logits.reshape(-1, cfg.vocab_size), targets_.reshape(-1))
    loss.backward()
    got = {}
    for n, p in pm.named_parameters():
        if p.requires_grad:
            got[n.replace(".default", "")] = p.grad
    for name, s in adapter_specs(cfg, spec).items():
        flat, start = sink.grads[name].reshape(-1), 0
        for key, shape in s.hf:
            g, ref = flat[start:start + math.prod(shape)].view(shape), got[key]
            start += math.prod(shape)
            cos = F.cosine_similarity(g.reshape(1, -1).double(), ref.reshape(1, -1).double()).item()
            assert cos >= 0.99999 and abs(g.norm() / ref.norm() - 1) < 1e-4, (key, cos)


def test_peft_made_adapter_loads_with_peft_logits_and_merges(tmp_path):
    cfg = tiny_cfg("qwen2", False)
    model = hf_model(cfg)
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    lc = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"], init_lora_weights=False)
    pm = peft.get_peft_model(model, lc)  # init_lora_weights=False: B is random, not zero
    pm.save_pretrained(tmp_path / "p")
    spec = LoraSpec(rank=4, alpha=8.0)
    source = read_adapter(str(tmp_path / "p"), cfg, spec)
    layout, w = _qtrain(cfg, base, spec, source=source)
    inputs = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = pm.eval()(inputs).logits
    got = Transformer(cfg, RunOptions(adapter=LoraAdapter(cfg, spec))).logits(w.source, inputs)
    _close(got, want)
    with torch.no_grad(), pm.disable_adapter():
        assert (want - pm(inputs).logits).abs().max() > 1e-3  # the adapter does something
    merged = merged_params(cfg, spec, {n: t.detach() for n, t in w.params.items()})
    from qtrain.parallel.weights.replicated import ParamWeights
    _close(Transformer(cfg).logits(ParamWeights(cfg, merged), inputs), want)


def adapter_grads(cfg, spec, w, inputs, runs) -> list[dict[str, torch.Tensor]]:
    """The gradients of one eager forward-backward per run (recompute switches, (step, micro-step) of the adapter's
    dropout key), each with a fresh adapter of seed 7 bound to `w`'s blocks."""
    out = []
    for rc, at in runs:
        adapter = LoraAdapter(cfg, spec, seed=7)
        adapter.bind_layers([w.source.block(i) for i in range(cfg.num_hidden_layers)])
        adapter.at(*at)
        sink = Collect()
        Transformer(cfg, RunOptions(adapter=adapter, recompute=frozenset(rc))).forward_backward(
            w.source, inputs, inputs.roll(-1, 1), grads=sink, loss_scale=1 / inputs.numel())
        out.append(sink.grads)
    return out


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("flags", [("qkv", "ffn"), ("block",), ("att", "norm", "swiglu")])
def test_recompute_gives_the_same_adapter_gradients_bitwise(flags, dropout):
    """Recompute switches change what is stored, never what is computed: the adapters' gradients are the bits of
    the plain run (eager, fp32), with dropout too (a recomputed projection draws its forward's masks: their key is
    (seed, step, micro-step, layer, target), not a generator's state)."""
    cfg = tiny_cfg("qwen2", False)
    spec = LoraSpec(rank=4, alpha=6.0, dropout=dropout, targets=("q", "k", "v", "o", "gate", "up", "down"))
    _, w = _qtrain(cfg, hf_model(cfg).state_dict(), spec)
    with torch.no_grad():  # B non-zero, so that A gets a gradient too
        for n, p in w.params.items():
            if n.endswith("_lora_b"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    inputs = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    out = adapter_grads(cfg, spec, w, inputs, (((), (3, 1)), (flags, (3, 1)), ((), (3, 2))))
    assert out[0].keys() == out[1].keys()
    for k in out[0]:
        assert torch.equal(out[0][k], out[1][k]), k
        # another micro-step draws other masks (and without dropout, the same gradients)
        assert torch.equal(out[0][k], out[2][k]) == (dropout == 0), k
