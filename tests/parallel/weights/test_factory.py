"""`build_weights` (qtrain/parallel/weights/factory.py): the weight source of each setting, and its filling.

Each (sharded, quantized) setting gets its source class, with the tensors the optimizer updates in place;
replicated and sharded weights are filled with the same values, bit for bit (from-scratch init and a real
HF checkpoint saved by `transformers`), so the choice of layout never changes the model. (Sharded over
several ranks: tests/parallel/weights/test_sharded.py trains sharded weights bitwise like replicated ones.)
"""
from __future__ import annotations

import pytest
import torch

from qtrain.model.config import ModelConfig
from qtrain.model.llama import LlamaConfig
from qtrain.model.registry import config_from_json_file
from qtrain.model.hf_io import load_hf_weights
from qtrain.model.llama import FP8_MATRICES
from qtrain.parallel.comm import Communicator
from qtrain.parallel.layout import FlatLayout
from qtrain.parallel.weights import ParamWeights, QuantizedWeights, ShardedWeights, build_weights
from tests.hf_fixtures import save_tiny_hf_model

CPU = torch.device("cpu")
CFG = LlamaConfig(model_type="qwen2", vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, rope_theta=10000.0,
                  tie_word_embeddings=False, attention_bias=True, bos_token_id=None, eos_token_id=None)


def build(cfg: ModelConfig = CFG, *, sharded: bool, quantized: tuple[str, ...] = (), **kw):
    return build_weights(FlatLayout(cfg, 1), comm=Communicator.solo(CPU), dtype=torch.float32, device=CPU,
                         sharded=sharded, quantized=quantized, **kw)


def by_tensor(w, layout: FlatLayout) -> dict[str, torch.Tensor]:
    """Every tensor's values, read from the full buffers (replicated) or the world-1 shards (sharded)."""
    flat = w.buffers if w.buffers is not None else w.source.shards
    return {s.name: flat[g.key][s.start:s.start + s.numel].view(s.shape) for g in layout.groups for s in g.segments}


@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "sharded"])
@pytest.mark.parametrize("quantized", [(), FP8_MATRICES], ids=["bf16-matrices", "fp8-copies"])
def test_each_setting_gets_its_source(sharded, quantized):
    w = build(sharded=sharded, quantized=quantized, seed=3)
    assert w.sharded == sharded
    if sharded:
        assert type(w.source) is ShardedWeights and (w.source.quants is not None) == bool(quantized)
        assert w.buffers is None and w.params is None
        assert w.optimizer_weights() == {"shards": w.source.shards}
        return
    plain = w.source.source if quantized else w.source
    assert type(plain) is ParamWeights and plain.params is w.params
    if quantized:
        assert type(w.source) is QuantizedWeights and w.source.names == quantized
    assert w.optimizer_weights() == {"params": w.buffers}
    for name, p in w.params.items():  # parameters are views into the buffers the optimizer updates
        assert p.requires_grad and p.untyped_storage().data_ptr() in {
            b.untyped_storage().data_ptr() for b in w.buffers.values()}, name


@pytest.mark.parametrize("init_proj_to_zero", [False, True])
def test_from_scratch_fill_is_the_same_replicated_and_sharded(init_proj_to_zero):
    layout = FlatLayout(CFG, 1)
    rep = build(sharded=False, seed=3, init_proj_to_zero=init_proj_to_zero)
    sh = build(sharded=True, seed=3, init_proj_to_zero=init_proj_to_zero)
    a, b = by_tensor(rep, layout), by_tensor(sh, layout)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert float(a["layers.0.qkv"].abs().max()) > 0
    other = by_tensor(build(sharded=False, seed=4, init_proj_to_zero=init_proj_to_zero), layout)
    assert not torch.equal(other["layers.0.qkv"], a["layers.0.qkv"])  # the seed is used
    for g in layout.groups:  # padding stays zero in both
        end = g.segments[-1].start + g.segments[-1].numel
        assert not rep.buffers[g.key][end:].any() and not sh.source.shards[g.key][end:].any(), g.key


def test_hf_checkpoint_fill_is_the_same_replicated_and_sharded(tmp_path):
    model_dir = save_tiny_hf_model("qwen2", tmp_path / "hf")
    cfg = config_from_json_file(model_dir / "config.json")
    layout = FlatLayout(cfg, 1)
    want = load_hf_weights(model_dir, cfg, dtype=torch.float32)
    for sharded in (False, True):
        got = by_tensor(build(cfg, sharded=sharded, weights_dir=str(model_dir)), layout)
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), (sharded, k)
