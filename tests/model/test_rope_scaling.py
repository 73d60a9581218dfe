"""RoPE scaling (kernels/rope_scaling.py) against `transformers`: for each rope_type (llama3, yarn, linear, dynamic),
the cos/sin tables equal HF's rotary embedding's, and a tiny Llama and Qwen2 built with transformers' config classes
give the same logits and every gradient at positions past the original context; a saved export loads back in
transformers with the same scaling and the same logits.

Tolerances: the tables follow HF's operations in the same order and dtypes, so they agree to a few fp32 units
(absolute 1e-6 on values in [-1.3, 1.3]; yarn's attention factor scales them). The model is the fp32 comparison of
tests/model/test_transformer.py: logits <= 1e-5 relative, gradients cosine >= 0.99999 and norms within 1e-4.
"""
from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qtrain.kernels.rope import rope_tables  # noqa: E402
from qtrain.model.hf_io import load_model_config, save_hf_model  # noqa: E402
from qtrain.model.registry import config_from_hf_dict  # noqa: E402
from qtrain.model.transformer import RunOptions, Transformer  # noqa: E402
from qtrain.model.weights import hf_to_internal, internal_to_hf  # noqa: E402
from qtrain.parallel.weights.replicated import ParamWeights  # noqa: E402
from tests.model.family_fixtures import Collect, cosine  # noqa: E402

MAX_POS, T = 64, 96  # every sequence runs past max_position_embeddings and the original context
SCALINGS = {
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
}
SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=MAX_POS, rms_norm_eps=1e-6, bos_token_id=1,
             eos_token_id=2)
HF_CLASSES = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}


def hf_config(model_type: str, scaling: dict, **overrides):
    """A transformers config of `model_type` with this scaling in its 5.x place (`rope_parameters`)."""
    rope = {**copy.deepcopy(scaling), "rope_theta": 10000.0}
    return HF_CLASSES[model_type](**{**SIZES, "rope_parameters": rope, "tie_word_embeddings": False, **overrides})


def _hf_tables(hf_cfg, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's cos, sin at positions 0..n-1 from a fresh rotary embedding (dynamic's first call at this length)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    cos, sin = LlamaRotaryEmbedding(hf_cfg)(torch.zeros(1, dtype=torch.float32), torch.arange(n)[None])
    return cos[0], sin[0]


@pytest.mark.parametrize("kind", list(SCALINGS) + ["yarn-mscale", "yarn-attention-factor", "yarn-untruncated"])
@pytest.mark.parametrize("n", [48, T, 4 * MAX_POS])  # inside the context, past it, far past it
def test_tables_equal_transformers(kind, n):
    scaling = {
        "yarn-mscale": {**SCALINGS["yarn"], "mscale": 0.8, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2},
        "yarn-attention-factor": {**SCALINGS["yarn"], "attention_factor": 0.75},
        "yarn-untruncated": {**SCALINGS["yarn"], "truncate": False},
    }.get(kind) or SCALINGS[kind]
    hf_cfg = hf_config("llama", scaling)
    cfg = config_from_hf_dict(hf_cfg.to_dict())
    assert cfg.rope_scaling == {k: v for k, v in scaling.items()}
    cos, sin = rope_tables(cfg, n, "cpu", torch.float32)
    ref_cos, ref_sin = _hf_tables(hf_cfg, n)
    torch.testing.assert_close(cos, ref_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, ref_sin, rtol=0, atol=1e-6)
    plain, _ = rope_tables(config_from_hf_dict(hf_config("llama", {"rope_type": "default"}).to_dict()), n, "cpu",
                           torch.float32)
    if kind != "dynamic" or n > MAX_POS:  # the scaling changes the tables (dynamic only past max_pos)
        assert (cos - plain).abs().max() > 1e-3


def _hf_model(hf_cfg, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa").float()
    with torch.no_grad():  # random norms and biases, so their gradients are checked non-trivially
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
            elif n.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model


def _ours(cfg, hf) -> tuple[Transformer, ParamWeights]:
    sd = dict(hf.state_dict())
    params = {n: t.detach().clone().requires_grad_(True) for n, t in hf_to_internal(cfg, lambda k: sd[k])}
    return Transformer(cfg, RunOptions()), ParamWeights(cfg, params)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", SCALINGS)
def test_logits_and_gradients_equal_transformers(model_type, kind):
    hf_cfg = hf_config(model_type, SCALINGS[kind])
    cfg = config_from_hf_dict(hf_cfg.to_dict())
    assert cfg.rope_scaling["rope_type"] == kind
    hf = _hf_model(hf_cfg)
    model, w = _ours(cfg, hf)
    g = torch.Generator().manual_seed(1)
    inputs, targets = (torch.randint(0, cfg.vocab_size, (2, T), generator=g) for _ in range(2))

    ref_logits = hf(input_ids=inputs).logits.float()
    ref_loss = torch.nn.functional.cross_entropy(ref_logits.view(-1, cfg.vocab_size), targets.view(-1))
    ref_loss.backward()
    logits = model.logits(w, inputs).float()
    rel = ((logits - ref_logits).norm() / ref_logits.norm()).item()
    assert rel <= 1e-5, f"logits relative error {rel:.2e}"

    sink = Collect()
    loss = model.forward_backward(w, inputs, targets, grads=sink, loss_scale=1.0 / targets.numel())
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    ours = internal_to_hf(cfg, sink.grads)
    for name, p in hf.named_parameters():
        c = cosine(ours[name], p.grad)
        nerr = abs(ours[name].norm().item() - p.grad.norm().item()) / p.grad.norm().item()
        assert c >= 0.99999 and nerr <= 1e-4, f"{name}: cosine {c:.7f}, norm error {nerr:.2e}"


@pytest.mark.parametrize("kind", ["yarn", "dynamic"])
def test_export_keeps_the_scaling(kind, tmp_path):
    """save_hf_model (what the run's export and `qtrain export` write) -> transformers.from_pretrained: the same
    rope_parameters, and the loaded model computes our logits past the original context."""
    hf_cfg = hf_config("llama", SCALINGS[kind])
    cfg = config_from_hf_dict(hf_cfg.to_dict())
    model, w = _ours(cfg, _hf_model(hf_cfg, seed=2))
    save_hf_model(tmp_path / "export", cfg, {k: v.detach() for k, v in w.params.items()}, dtype=torch.float32)
    assert load_model_config(tmp_path / "export") == cfg
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    assert {k: loaded.config.rope_parameters[k] for k in cfg.rope_scaling} == cfg.rope_scaling
    inputs = torch.randint(0, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = loaded(input_ids=inputs).logits.float()
        ours = model.logits(w, inputs).float()
    assert ((ours - ref).norm() / ref.norm()).item() <= 1e-5
