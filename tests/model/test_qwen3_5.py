"""The Qwen3.5 family against `transformers` (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM) in fp32 on tiny random
configs: logits, loss and every parameter gradient, with the dense families' tolerances (test_transformer.py: logits
<= 1e-5 relative; per tensor gradient cosine >= 0.99999 and norm within 1e-4). The delta rule runs in fp32 in both
(qtrain's chunked twin, transformers' chunked torch reference), so they agree to rounding. One exception, measured:
the gradients of the decay rates (A_log, dt_bias) sum many cancelling terms through exp(cumulative decay), so fp32
rounding alone moves their norm by up to 8e-4 (qtrain's own fp32 run against its fp64 run, this config): for those
two the norm tolerance is 2e-3 (transformers and qtrain differ by 1.1e-4 there), the cosine still >= 0.99999.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qtrain.model.moe_router import router_z_loss
from qtrain.model.qwen3_5 import Qwen35Config
from qtrain.model.transformer import RunOptions, Transformer
from qtrain.model.weights import hf_to_internal, internal_to_hf
from qtrain.parallel.weights.replicated import ParamWeights
from tests.model.family_fixtures import (QWEN35_TINY as TINY, QWEN35_TINY_MOE as TINY_MOE,  # noqa: F401
                                         Collect, cosine, hf_grads, hf_state, qwen35_cfg as tiny_cfg,
                                         qwen35_hf_model as hf_model, randomize)

def check_against_hf(cfg: Qwen35Config, run: RunOptions | None = None, T: int = 40, router_z: float = 0.0):
    """An MoE config checks transformers' training loss with output_router_logits (cross-entropy +
    router_aux_loss_coef x load-balancing loss) plus `router_z` x the router z-loss, its values and gradients."""
    hf = hf_model(cfg)
    sd = hf_state(hf)
    params = {n: t.detach().clone().requires_grad_(True) for n, t in hf_to_internal(cfg, lambda k: sd[k])}
    model, w = Transformer(cfg, run or RunOptions()), ParamWeights(cfg, params)
    g = torch.Generator().manual_seed(1)
    inputs = torch.randint(0, cfg.vocab_size, (2, T), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (2, T), generator=g)
    targets[0, :5] = -100

    ref = hf(input_ids=inputs, output_router_logits=cfg.is_moe)
    ref_logits = ref.logits.float()
    ref_loss = torch.nn.functional.cross_entropy(ref_logits.view(-1, cfg.vocab_size), targets.view(-1))
    total = ref_loss
    if cfg.is_moe:
        total = ref_loss + cfg.router_aux_loss_coef * ref.aux_loss + router_z * router_z_loss(ref.router_logits)
    total.backward()

    logits = model.logits(w, inputs).float()
    rel = ((logits - ref_logits).norm() / ref_logits.norm()).item()
    assert rel <= 1e-5, f"logits relative error {rel:.2e}"
    sink = Collect()
    loss = model.forward_backward(w, inputs, targets, grads=sink, loss_scale=1.0 / int((targets != -100).sum()),
                                  router_z_loss=router_z)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    if cfg.is_moe:
        router = model.router_losses
        assert abs(router.aux_loss().item() - ref.aux_loss.item()) <= 1e-5 * ref.aux_loss.item()
        z = router_z_loss(ref.router_logits).item()
        assert abs(router.z_loss().item() - z) <= 1e-5 * z
        assert int(router.tokens_per_expert.sum()) == cfg.num_hidden_layers * inputs.numel() * cfg.num_experts_per_tok
    ours, theirs = internal_to_hf(cfg, sink.grads), hf_grads(hf, cfg.tie_word_embeddings)
    assert set(ours) == set(theirs), set(ours) ^ set(theirs)
    for name, ref in theirs.items():
        c = cosine(ours[name], ref)
        nerr = abs(ours[name].norm().item() - ref.norm().item()) / ref.norm().item()
        tol = 2e-3 if name.endswith(("A_log", "dt_bias")) else 1e-4
        assert c >= 0.99999 and nerr <= tol, f"{name}: cosine {c:.7f}, norm error {nerr:.2e}"
    return sink.grads


@pytest.mark.parametrize("tied", [False, True])
def test_dense_matches_transformers_fp32(tied):
    check_against_hf(tiny_cfg(tied=tied))


@pytest.mark.parametrize("z", [0.0, 0.01])
def test_moe_matches_transformers_with_router_losses_fp32(z):
    """transformers' Qwen3_5MoeForCausalLM with output_router_logits: its load-balancing loss (weighted by a
    router_aux_loss_coef large enough to move every router gradient) through the MoE families' per-layer statistics,
    plus a router z-loss."""
    check_against_hf(tiny_cfg(moe=True, num_hidden_layers=2, layer_types=("linear_attention", "full_attention"),
                              router_aux_loss_coef=0.05), router_z=z)


def test_longer_than_a_chunk_and_custom_layer_types():
    """Two chunks of the delta rule (T > 64, not a multiple) and a layout transformers' default does not make."""
    check_against_hf(tiny_cfg(num_hidden_layers=3, layer_types=("full_attention", "linear_attention",
                                                                "linear_attention")), T=80)


def _grads(cfg: Qwen35Config, run: RunOptions, params: dict[str, torch.Tensor], router_z: float = 0.0
           ) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    inputs = torch.randint(0, cfg.vocab_size, (2, 24), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (2, 24), generator=g)
    sink = Collect()
    Transformer(cfg, run).forward_backward(ParamWeights(cfg, params), inputs, targets, grads=sink, loss_scale=0.1,
                                           router_z_loss=router_z)
    return sink.grads


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("flags", [("norm",), ("att",), ("swiglu",), ("ffn",), ("block",)])
def test_recompute_switches_change_no_bit(flags, moe):
    """The block's steps carry the recompute vocabulary in both mixers and both MLPs (the MoE's routed experts and
    shared expert take the 'up' and 'swiglu' steps): every switch reruns them and the gradients are bit-identical to
    the plain run (eager Recomputer; --recompute-block through the loop). The MoE layers with the router losses
    (load balancing and z-loss), which reach the router through the rerun as without it: routing is deterministic."""
    extra = dict(router_aux_loss_coef=0.05) if moe else {}
    cfg = tiny_cfg(moe=moe, num_hidden_layers=2, layer_types=("linear_attention", "full_attention"), **extra)
    sd = hf_state(hf_model(cfg))
    params = {n: t.detach().clone().requires_grad_(True) for n, t in hf_to_internal(cfg, lambda k: sd[k])}
    z = 0.01 if moe else 0.0
    plain, rerun = _grads(cfg, RunOptions(), params, z), _grads(cfg, RunOptions(recompute=frozenset(flags)), params, z)
    assert set(plain) == set(rerun) and all(torch.equal(plain[n], rerun[n]) for n in plain)
    if moe:  # the router losses move every router's gradient (so the equality above includes them)
        no_losses = _grads(tiny_cfg(moe=True, num_hidden_layers=2, layer_types=("linear_attention", "full_attention"),
                                    router_aux_loss_coef=0.0), RunOptions(recompute=frozenset(flags)), params)
        routers = [n for n in plain if n.endswith(".router")]
        assert len(routers) == 2 and not any(torch.equal(plain[n], no_losses[n]) for n in routers)


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_activation_statements_hold_what_autograd_keeps(moe, dtype):
    """The memory plan's per-layer statements (memory.py) against the bytes autograd saves for one eager block
    forward (saved-tensor hooks), per layer kind. They are stated from the steps, not fitted: within 15% below and
    25% above what is measured (the full-attention layer's norms are stated high); the GPU path's (the op pairs)
    in test_qwen3_5_op_memory.py."""
    from qtrain.kernels.rope import rope_tables
    from qtrain.model.family import ActivationSettings
    from qtrain.model.init import init_params
    from qtrain.model.recompute import count_saved_bytes
    from qtrain.model.registry import family_of
    from qtrain.model.transformer import allocate_params, make_block_fn

    cfg = tiny_cfg(moe=moe, num_hidden_layers=2, layer_types=("linear_attention", "full_attention"))
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    params = allocate_params(cfg, dtype=dt, device="cpu")
    init_params(cfg, params)
    fn, (B, T) = make_block_fn(cfg), (2, 128)
    cos, sin = rope_tables(cfg, T, "cpu", dt)
    for layer in range(2):
        w = {k.split(".", 2)[2]: v for k, v in params.items() if k.startswith(f"layers.{layer}.")}
        x = torch.randn(B, T, cfg.hidden_size, dtype=dt, requires_grad=True)
        with count_saved_bytes(exclude=[*w.values(), cos, sin]) as c:
            fn(x, w, cos, sin)
        terms = family_of(cfg).activation_terms(cfg, layer, ActivationSettings(model_dtype=dtype))
        stated = sum(a.nbytes(B * T) for a in terms if a.kept)
        assert 0.85 <= stated / c.bytes <= 1.25, (layer, stated / (B * T), c.bytes / (B * T))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_moe_recompute_switches_drop_what_their_steps_keep(monkeypatch, dtype):
    """--recompute-swiglu and --recompute-ffn on an MoE layer (eager Recomputer): the statements (memory.moe_terms)
    against the bytes the block keeps, exact, both layer kinds (the delta rule as its op pair, whose statements are
    exact: test_qwen3_5_op_memory.py). What the MLP steps drop, worked out by hand per token (E bytes an element;
    k = 2 experts of F = 16, a shared expert of Fs = 40, C = 64: 2F != C tells the experts' input from their up/gate
    output): 'swiglu' the experts' SwiGLU output (k F) and the shared expert's silu(gate) and SwiGLU output (2 Fs);
    'up' (with LN2 already rerun by --recompute-norm) the experts' permuted input (k C) and up/gate output (2 k F) and
    the shared expert's up/gate output (2 Fs), besides. Before: the MoE MLP took no step, so both kept everything."""
    from qtrain.kernels.rope import rope_tables
    from qtrain.model.activations import activation_terms
    from qtrain.model.init import init_params
    from qtrain.model.moe_router import RouterLosses
    from qtrain.model.recompute import block_steps, count_saved_bytes, resolve_flags
    from qtrain.model.transformer import allocate_params, make_block_fn

    monkeypatch.setattr("qtrain.kernels.delta_rule.use_triton", lambda t: True)  # the op pairs (module docstring)
    cfg = tiny_cfg(moe=True, num_hidden_layers=2, layer_types=("linear_attention", "full_attention"),
                   linear_key_head_dim=32, linear_value_head_dim=32, moe_intermediate_size=16,
                   shared_expert_intermediate_size=40)
    dt, (B, T) = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype], (2, 128)
    params = allocate_params(cfg, dtype=dt, device="cpu")
    init_params(cfg, params)
    cos, sin = rope_tables(cfg, T, "cpu", dt)
    for layer in range(2):
        kept = {}
        for flags in ((), ("swiglu",), ("norm",), ("norm", "ffn")):
            w = {k.split(".", 2)[2]: v.requires_grad_() for k, v in params.items() if k.startswith(f"layers.{layer}.")}
            w.update(RouterLosses(cfg.router, B * T, torch.device("cpu"), z_loss=True).slot(layer))
            x = torch.randn(B, T, cfg.hidden_size, dtype=dt, requires_grad=True)
            with count_saved_bytes(exclude=[x, cos, sin, *w.values()]) as c:
                y = make_block_fn(cfg, recompute=block_steps(flags))(x, w, cos, sin)
                kept[flags] = c.bytes / (B * T)
            y.float().sum().backward()  # the recomputed steps rerun as they were kept (the Recomputer checks it)
            terms = activation_terms(cfg, layer=layer, model_dtype=dtype, seq_len=T, delta_rule_kernels=True,
                                     recompute=resolve_flags(flags))
            stated = sum(t.nbytes(B * T) for t in terms if t.kept and t.name != "input") / (B * T)
            assert kept[flags] == stated, (layer, flags)
        E, k, C, F, Fs = dt.itemsize, 2, 64, 16, 40
        assert kept[()] - kept[("swiglu",)] == E * (k * F + 2 * Fs)
        assert kept[("norm",)] - kept[("norm", "ffn")] == E * (k * F + 2 * Fs) + E * (k * C + 2 * k * F + 2 * Fs)


def test_document_mask_statements_hold_what_the_delta_rule_keeps():
    """--document-masking: a linear-attention layer keeps its documents' masks besides (memory.document_terms), and
    the chunks' own masks replace the layer's (C, C) causal one. What the graph holds after one eager block forward,
    with and without documents, against the statements (seq_len given: exact, 16 bytes of 0-dim scalars aside). The
    memory plan adds them once per linear-attention layer. Before (the statement of an earlier twin): within 10%."""
    from qtrain.kernels.delta_rule import CHUNK
    from qtrain.kernels.document_attention import document_mask
    from qtrain.kernels.rope import rope_tables
    from qtrain.model.activations import activation_memory, activation_terms
    from qtrain.model.family import ActivationSettings
    from qtrain.model.init import init_params
    from qtrain.model.qwen3_5.memory import document_terms
    from qtrain.model.transformer import allocate_params, make_block_fn
    from tests.plan.test_lora_activations import kept_after_forward

    cfg = tiny_cfg(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"))
    params = allocate_params(cfg, dtype=torch.float32, device="cpu")
    init_params(cfg, params)
    fn, (B, T) = make_block_fn(cfg), (2, 256)
    N = B * T
    positions = torch.cat([torch.arange(100), torch.arange(156)]).repeat(B, 1)  # two documents a row
    docs = document_mask(positions, kind="varlen")
    w = {k.split(".", 2)[2]: v for k, v in params.items() if k.startswith("layers.0.")}
    cos, sin = rope_tables(cfg, T, "cpu", torch.float32)
    for d in (None, docs):
        x = torch.randn(B, T, cfg.hidden_size, requires_grad=True)
        kept = kept_after_forward(lambda x, w, cos, sin: fn(x, w, cos, sin, d), x, w, cos, sin)
        terms = activation_terms(cfg, layer=0, model_dtype="fp32", seq_len=T, documents=d is not None)
        assert abs(kept - sum(t.nbytes(N) for t in terms if t.kept and t.name != "input")) <= 16, d
    stated = sum(t.per_token for t in document_terms(cfg, ActivationSettings(model_dtype="fp32", seq_len=T)))
    plan = activation_memory(cfg, N, model_dtype="fp32", seq_len=T, documents=True).blocks
    assert plan - activation_memory(cfg, N, model_dtype="fp32", seq_len=T).blocks == N * stated - CHUNK * CHUNK
