"""`qwen3_next` (transformers' Qwen3NextForCausalLM) through the Qwen3.5 family in fp32 on the CPU: logits, loss (with
the load-balancing loss of output_router_logits) and every parameter's gradient equal transformers' on tiny random
configs, with test_qwen3_5.py's tolerances; HF load and export round trip bit for bit. What differs from Qwen3.5 is
data: the interleaved in_proj_qkvz / in_proj_ba rows (a row permutation in the HF mapping, `TensorSpec.hf_rows`), dense
layers inside an MoE model (mlp_only_layers, decoder_sparse_step), norm_topk_prob.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qtrain.model.hf_io import load_hf_weights, load_model_config, save_hf_model  # noqa: E402
from qtrain.model.moe_router import router_z_loss  # noqa: E402
from qtrain.model.qwen3_5.next_config import Qwen3NextConfig  # noqa: E402
from qtrain.model.qwen3_5.tensors import next_in_proj_rows  # noqa: E402
from qtrain.model.transformer import RunOptions, Transformer  # noqa: E402
from qtrain.model.weights import hf_to_internal, internal_to_hf  # noqa: E402
from qtrain.parallel.weights.replicated import ParamWeights  # noqa: E402
from tests.model.family_fixtures import (QWEN35_TINY as TINY, QWEN35_TINY_MOE as TINY_MOE,  # noqa: E402
                                         Collect, cosine, hf_grads, hf_state, randomize)


def next_cfg(*, moe: bool, **over) -> Qwen3NextConfig:
    kw = {**TINY, "vocab_size": 128, **(TINY_MOE if moe else {"num_experts": 0}), **over}
    return Qwen3NextConfig(**kw)


def hf_model(cfg: Qwen3NextConfig, seed: int = 0):
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf_dict(dtype="float32"))
    assert type(hf_cfg).__name__ == "Qwen3NextConfig"
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa").float()
    assert type(model).__name__ == "Qwen3NextForCausalLM"
    return randomize(model, seed)


CASES = {
    # an MoE layer, a dense one (mlp_only_layers), both mixers; renormalised top-k; untied
    "moe-mixed": dict(moe=True, num_hidden_layers=3, mlp_only_layers=(1,), router_aux_loss_coef=0.05,
                      layer_types=("linear_attention", "linear_attention", "full_attention")),
    # decoder_sparse_step 2, no renormalisation, 2 value heads per key head group (the interleave matters), tied
    "moe-step": dict(moe=True, num_hidden_layers=2, decoder_sparse_step=2, norm_topk_prob=False, tie_word_embeddings=True,
                     router_aux_loss_coef=0.02, layer_types=("linear_attention", "full_attention")),
    "dense": dict(moe=False, num_hidden_layers=2, linear_num_key_heads=1, layer_types=("linear_attention",
                                                                                         "full_attention")),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_transformers_fp32(case):
    cfg = next_cfg(**CASES[case])
    hf = hf_model(cfg)
    sd = hf_state(hf)
    params = {n: t.detach().clone().requires_grad_(True) for n, t in hf_to_internal(cfg, lambda k: sd[k])}
    model, w = Transformer(cfg, RunOptions()), ParamWeights(cfg, params)
    g = torch.Generator().manual_seed(1)
    inputs, targets = (torch.randint(0, cfg.vocab_size, (2, 70), generator=g) for _ in range(2))  # > one chunk
    targets[0, :5] = -100
    z = 0.01 if cfg.router else 0.0
    ref = hf(input_ids=inputs, output_router_logits=cfg.router is not None)
    ce = torch.nn.functional.cross_entropy(ref.logits.view(-1, cfg.vocab_size), targets.view(-1))
    total = ce + (cfg.router_aux_loss_coef * ref.aux_loss + z * router_z_loss(ref.router_logits) if cfg.router else 0)
    total.backward()

    logits = model.logits(w, inputs)
    rel = ((logits - ref.logits).norm() / ref.logits.norm()).item()
    assert rel <= 1e-5, f"logits relative error {rel:.2e}"
    sink = Collect()
    loss = model.forward_backward(w, inputs, targets, grads=sink, loss_scale=1.0 / int((targets != -100).sum()),
                                  router_z_loss=z)
    assert abs(loss.item() - ce.item()) <= 1e-5 * ce.item()
    if cfg.router:
        assert cfg.router.layers == tuple(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
        assert abs(model.router_losses.aux_loss().item() - ref.aux_loss.item()) <= 1e-5 * ref.aux_loss.item()
    ours, theirs = internal_to_hf(cfg, sink.grads), hf_grads(hf, cfg.tie_word_embeddings)
    assert set(ours) == set(theirs), set(ours) ^ set(theirs)
    assert any(k.endswith("in_proj_qkvz.weight") for k in ours)
    for name, want in theirs.items():
        c = cosine(ours[name], want)
        nerr = abs(ours[name].norm().item() - want.norm().item()) / want.norm().item()
        tol = 2e-3 if name.endswith(("A_log", "dt_bias")) else 1e-4
        assert c >= 0.99999 and nerr <= tol, f"{name}: cosine {c:.7f}, norm error {nerr:.2e}"


def test_in_proj_rows_are_a_permutation_of_the_fused_rows():
    cfg = next_cfg(moe=False, num_hidden_layers=2, layer_types=("linear_attention", "full_attention"))
    runs = next_in_proj_rows(cfg)
    rows = torch.cat([torch.arange(s, s + c) for s, c in runs])
    assert torch.equal(rows.sort().values, torch.arange(cfg.in_proj_dim))
    # group 0 of in_proj_qkvz starts with q head 0, then k head 0 (qtrain's rows Hk dk on)
    dk = cfg.linear_key_head_dim
    assert rows[:dk].tolist() == list(range(dk)) and rows[dk] == cfg.linear_key_dim


@pytest.mark.parametrize("case", ["moe-mixed", "dense"])
def test_checkpoint_round_trips_exactly(tmp_path, case):
    from safetensors.torch import load_file
    cfg = next_cfg(**CASES[case])
    hf_model(cfg).save_pretrained(tmp_path / "src")
    loaded = load_model_config(tmp_path / "src")
    assert isinstance(loaded, Qwen3NextConfig) and loaded == cfg
    params = load_hf_weights(tmp_path / "src", loaded)
    save_hf_model(tmp_path / "out", loaded, params, dtype=torch.float32)
    src, out = load_file(str(tmp_path / "src" / "model.safetensors")), load_file(str(tmp_path / "out" /
                                                                                     "model.safetensors"))
    assert set(src) == set(out) and all(torch.equal(src[k], out[k]) for k in src)
    assert load_model_config(tmp_path / "out") == cfg
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(again).__name__ == "Qwen3NextForCausalLM"


def test_fused_experts_load_like_the_per_expert_ones(tmp_path):
    """A checkpoint of transformers' module tensors (the experts fused, as Qwen3.5-MoE's: test_qwen3_5_hf_io.py)
    loads to the parameters of the per-expert one save_pretrained writes, bit for bit."""
    from safetensors.torch import save_file
    model = hf_model(next_cfg(**CASES["moe-mixed"]))
    model.save_pretrained(tmp_path / "src")
    (tmp_path / "fused").mkdir()
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "src" / "config.json").read_text())
    tied = model.config.tie_word_embeddings  # save_pretrained writes the shared matrix once
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in sd)
    save_file(sd, str(tmp_path / "fused" / "model.safetensors"), metadata={"format": "pt"})
    cfg = load_model_config(tmp_path / "fused")
    got, want = load_hf_weights(tmp_path / "fused", cfg), load_hf_weights(tmp_path / "src", cfg)
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
