"""The functional MoE layer (qtrain/model/moe.py) and its router losses (qtrain/model/moe_router.py) against
transformers' own sparse MoE blocks and `load_balancing_loss_func` of Qwen3-MoE, OLMoE and Mixtral.

Tolerances: fp32 on the CPU; both sides compute the same products, and differ only in summation order (the
k-sum per token in routing order here, in expert order there; GEMMs over different row subsets), so outputs,
router logits and every gradient agree to a few fp32 ulps of their scale: rtol 1e-5 and atol 1e-5 x the
tensor's largest magnitude, per tensor (tests/model/test_transformer.py holds the dense families' logits to
~1e-6 relative, the issue asks <= 1e-5). The losses are fp32 sums of a few hundred terms: the same bound.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.models.mixtral import modeling_mixtral  # noqa: E402
from transformers.models.olmoe import modeling_olmoe  # noqa: E402
from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: E402

from qtrain.model.moe import moe_forward  # noqa: E402
from qtrain.model.moe_router import (aux_loss_grads, load_balancing_loss, load_balancing_loss_from_stats,  # noqa: E402
                                     route, router_stats, router_z_loss, router_z_loss_from_stats)

C, F = 32, 24  # hidden size, expert intermediate size


def _family(name: str, norm_topk_prob: bool | None = None):
    """(HF config, sparse block class, module holding load_balancing_loss_func, norm_topk_prob)."""
    if name == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(hidden_size=C, moe_intermediate_size=F, num_experts=8, num_experts_per_tok=3,
                                          norm_topk_prob=norm_topk_prob, router_aux_loss_coef=0.001)
        return cfg, modeling_qwen3_moe.Qwen3MoeSparseMoeBlock, modeling_qwen3_moe, norm_topk_prob
    if name == "olmoe":
        cfg = transformers.OlmoeConfig(hidden_size=C, intermediate_size=F, num_experts=8, num_experts_per_tok=2,
                                       router_aux_loss_coef=0.01)
        return cfg, modeling_olmoe.OlmoeSparseMoeBlock, modeling_olmoe, cfg.norm_topk_prob
    cfg = transformers.MixtralConfig(hidden_size=C, intermediate_size=F, num_local_experts=4, num_experts_per_tok=2,
                                     router_aux_loss_coef=0.02)
    return cfg, modeling_mixtral.MixtralSparseMoeBlock, modeling_mixtral, True  # Mixtral always renormalises


FAMILIES = [("qwen3_moe", True), ("qwen3_moe", False), ("olmoe", None), ("mixtral", None)]


def _hf_block(name, norm, experts_implementation="eager", seed=0):
    cfg, block_cls, _, norm = _family(name, norm)
    cfg._experts_implementation = experts_implementation
    torch.manual_seed(seed)
    block = block_cls(cfg).float()
    with torch.no_grad():  # expert weights start uninitialised and the router at zero: randomise all
        block.gate.weight.normal_(0.0, 1.0 / C**0.5)
        block.experts.gate_up_proj.normal_(0.0, 1.0 / C**0.5)
        block.experts.down_proj.normal_(0.0, 1.0 / F**0.5)
    return cfg, block, norm


def _ours(block) -> dict[str, torch.Tensor]:
    """The block's weights in qtrain's layout: transformers' fused experts are [gate; up], qtrain's [up; gate]."""
    gu = block.experts.gate_up_proj.detach()
    return {"router": block.gate.weight.detach().clone(),
            "up_gate": torch.cat([gu[:, F:], gu[:, :F]], dim=1),
            "down": block.experts.down_proj.detach().clone()}


def _hf_grads(block) -> dict[str, torch.Tensor]:
    gu = block.experts.gate_up_proj.grad
    return {"router": block.gate.weight.grad, "up_gate": torch.cat([gu[:, F:], gu[:, :F]], dim=1),
            "down": block.experts.down_proj.grad}


def _close(got, want, what=""):
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale, msg=lambda m: f"{what}: {m}")


def _inputs(seed=1, B=2, T=24):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, C, generator=g), torch.randn(B, T, C, generator=g)


def _run_both(cfg, block, norm, x, dy):
    """Forward and backward of transformers' block and of moe_forward on the same weights, input and d(out)."""
    xa = x.clone().requires_grad_(True)
    ref = block(xa)
    ref.backward(dy)
    logits_ref = block.gate(x.view(-1, C))[0]
    params = {n: t.requires_grad_(True) for n, t in _ours(block).items()}
    xb = x.clone().requires_grad_(True)
    got = moe_forward(xb, params["router"], params["up_gate"], params["down"], top_k=cfg.num_experts_per_tok,
                      norm_topk_prob=norm)
    got.out.backward(dy)
    return (ref, logits_ref, xa.grad, _hf_grads(block)), (got, xb.grad, {n: t.grad for n, t in params.items()})


@pytest.mark.parametrize("name,norm", FAMILIES)
def test_block_matches_transformers(name, norm):
    cfg, block, norm = _hf_block(name, norm)
    x, dy = _inputs()
    (ref, logits_ref, dx_ref, grads_ref), (got, dx, grads) = _run_both(cfg, block, norm, x, dy)
    _close(got.out, ref, "output")
    _close(got.router_logits, logits_ref, "router logits")
    _close(dx, dx_ref, "d x")
    for n in grads_ref:
        _close(grads[n], grads_ref[n], f"d {n}")
    assert int(got.plan.counts.sum()) == x.shape[0] * x.shape[1] * cfg.num_experts_per_tok  # dropless


def test_block_matches_transformers_grouped_mm_experts():
    """transformers' default experts implementation (a sort and torch._grouped_mm, on the CPU in fp32) agrees too."""
    cfg, block, norm = _hf_block("qwen3_moe", True, experts_implementation="grouped_mm")
    x, dy = _inputs(seed=2)
    (ref, _, dx_ref, grads_ref), (got, dx, grads) = _run_both(cfg, block, norm, x, dy)
    _close(got.out, ref, "output")
    _close(dx, dx_ref, "d x")
    for n in grads_ref:
        _close(grads[n], grads_ref[n], f"d {n}")


def test_experts_without_tokens_get_zero_gradients():
    """Experts 5-7 can never win (their router rows are negative, every input positive): they get no token, an
    exact zero gradient and no NaN anywhere, and the rest still equals transformers."""
    cfg, block, norm = _hf_block("qwen3_moe", False, seed=3)
    with torch.no_grad():
        block.gate.weight[5:] = -1.0
    x, dy = _inputs(seed=4)
    x = x.abs() + 0.1
    (ref, _, dx_ref, grads_ref), (got, dx, grads) = _run_both(cfg, block, norm, x, dy)
    assert got.plan.counts[5:].tolist() == [0, 0, 0] and bool((got.plan.counts[:5] > 0).all())
    for n in ("up_gate", "down"):
        assert torch.equal(grads[n][5:], torch.zeros_like(grads[n][5:])), n
    for t in [got.out, dx, *grads.values()]:
        assert torch.isfinite(t).all()
    _close(got.out, ref, "output")
    _close(dx, dx_ref, "d x")
    for n in grads_ref:
        _close(grads[n], grads_ref[n], f"d {n}")


def test_bf16_block_close_to_transformers():
    """bf16 on the CPU: the same routing (the logits are the same bf16 GEMM), outputs within bf16 rounding of
    the chain (a few roundings of 2^-8 relative each)."""
    cfg, block, norm = _hf_block("qwen3_moe", True, seed=5)
    block = block.to(torch.bfloat16)
    x, _ = _inputs(seed=6)
    x = x.to(torch.bfloat16)
    ref = block(x)
    p = _ours(block)
    got = moe_forward(x, p["router"], p["up_gate"], p["down"], top_k=cfg.num_experts_per_tok, norm_topk_prob=norm)
    assert got.out.dtype == torch.bfloat16
    scale = ref.abs().max().item()
    torch.testing.assert_close(got.out.float(), ref.float(), rtol=2.0**-6, atol=2.0**-6 * scale)


def test_bad_shapes_and_top_k_are_refused():
    cfg, block, norm = _hf_block("mixtral", None)
    p = _ours(block)
    x = torch.zeros(3, C)
    with pytest.raises(ValueError, match="top_k must be in \\[1, 4\\]"):
        moe_forward(x, p["router"], p["up_gate"], p["down"], top_k=5, norm_topk_prob=True)
    with pytest.raises(ValueError, match="experts_up_gate \\(E, 2F, C\\)"):
        moe_forward(x, p["router"], p["up_gate"][:, :F], p["down"], top_k=2, norm_topk_prob=True)


# ----------------------------------------------------------------------------------- auxiliary losses
def _router_layers(E, L=3, N=40, seed=7):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(N, C, generator=g) for _ in range(L)]
    ws = [(torch.randn(E, C, generator=g) / C**0.5).requires_grad_(True) for _ in range(L)]
    return xs, ws


@pytest.mark.parametrize("name,norm", FAMILIES[1:])
def test_load_balancing_loss_matches_transformers(name, norm):
    """The loss and its gradient with respect to every layer's router weight, with the config's coefficient and
    top-k, three ways: from concatenated logits, from per-layer statistics through autograd, and by injecting
    `aux_loss_grads` into each layer's probability sums (what a block-by-block backward does)."""
    cfg, _, module, norm = _family(name, norm)
    E, k, coef = cfg.num_experts, cfg.num_experts_per_tok, cfg.router_aux_loss_coef
    xs, ws = _router_layers(E)

    ref = coef * module.load_balancing_loss_func(tuple(x @ w.t() for x, w in zip(xs, ws)), E, k)
    grads_ref = torch.autograd.grad(ref, ws)

    loss = coef * load_balancing_loss([x @ w.t() for x, w in zip(xs, ws)], E, k)
    _close(loss, ref, "loss from logits")
    for a, b in zip(torch.autograd.grad(loss, ws), grads_ref):
        _close(a, b, "d router from logits")

    stats = [router_stats(route(x, w, top_k=k, norm_topk_prob=norm), E) for x, w in zip(xs, ws)]
    loss = coef * load_balancing_loss_from_stats(stats)
    _close(loss, ref, "loss from stats")
    for a, b in zip(torch.autograd.grad(loss, ws, retain_graph=True), grads_ref):
        _close(a, b, "d router from stats")

    d_prob_sum, _ = aux_loss_grads(stats, aux_coef=coef)
    injected = torch.autograd.grad([s.prob_sum for s in stats], ws, [d_prob_sum] * len(stats))
    for a, b in zip(injected, grads_ref):
        _close(a, b, "d router injected")


def test_layer_outputs_feed_the_losses():
    """What moe_forward returns for two layers (router logits, statistics) gives transformers' aux loss, with
    its gradient with respect to both routers, and the z-loss of those logits."""
    cfg, _, module, norm = _family("qwen3_moe", True)
    E, k, coef = cfg.num_experts, cfg.num_experts_per_tok, cfg.router_aux_loss_coef
    outs, routers = [], []
    for seed in (11, 12):
        _, block, _ = _hf_block("qwen3_moe", True, seed=seed)
        p = {n: t.requires_grad_(True) for n, t in _ours(block).items()}
        outs.append(moe_forward(_inputs(seed)[0], p["router"], p["up_gate"], p["down"], top_k=k, norm_topk_prob=norm))
        routers.append(p["router"])
    ref = coef * module.load_balancing_loss_func(tuple(o.router_logits for o in outs), E, k)
    loss = coef * load_balancing_loss_from_stats([o.stats for o in outs])
    _close(loss, ref, "loss")
    for a, b in zip(torch.autograd.grad(loss, routers, retain_graph=True), torch.autograd.grad(ref, routers)):
        _close(a, b, "d router")
    _close(router_z_loss_from_stats([o.stats for o in outs]), router_z_loss([o.router_logits for o in outs]),
           "z-loss")


def test_load_balancing_loss_with_attention_mask_matches_transformers():
    """Padding rows (mask 0) leave the counts, the probability sums and the row count."""
    cfg, _, module, _ = _family("olmoe")
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    xs, ws = _router_layers(E, N=2 * 20)
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[0, 15:] = 0
    mask[1, :3] = 0
    ref = module.load_balancing_loss_func(tuple(x @ w.t() for x, w in zip(xs, ws)), E, k, mask)
    loss = load_balancing_loss([x @ w.t() for x, w in zip(xs, ws)], E, k, mask)
    _close(loss, ref, "masked loss")
    for a, b in zip(torch.autograd.grad(loss, ws), torch.autograd.grad(ref, ws)):
        _close(a, b, "d router, masked")


def test_router_z_loss_is_mean_squared_logsumexp():
    """ST-MoE's z-loss: the mean over every layer's rows of (log sum_e exp(logit_e))^2, against the formula in
    float64; from statistics too, and `aux_loss_grads`' d(z_sum) is the coefficient over the row count."""
    xs, ws = _router_layers(8, L=2, N=30, seed=8)
    logits = [3 * x @ w.t() for x, w in zip(xs, ws)]
    direct = torch.cat([t.double().exp().sum(-1).log() for t in logits]).pow(2).mean()
    grads_direct = torch.autograd.grad(direct, ws, retain_graph=True)

    z = router_z_loss(logits)
    _close(z.double(), direct, "z-loss")
    stats = [router_stats(route(3 * x, w, top_k=2, norm_topk_prob=False), 8) for x, w in zip(xs, ws)]
    z_stats = router_z_loss_from_stats(stats)
    _close(z_stats.double(), direct, "z-loss from stats")
    for a, b in zip(torch.autograd.grad(z_stats, ws, retain_graph=True), grads_direct):
        _close(a, b, "d router of z-loss")
    _, d_z_sum = aux_loss_grads(stats, aux_coef=0.0, z_coef=0.5)
    for s in stats:
        (g,) = torch.autograd.grad(0.5 * router_z_loss_from_stats(stats), s.z_sum, retain_graph=True)
        _close(d_z_sum, g, "d z_sum")


# --------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_block_matches_transformers():
    """On the GPU in bf16 (Triton permutation, torch._grouped_mm) against transformers' grouped_mm experts on the
    same device: the routing is the same bf16 GEMM, so the same experts; outputs and gradients within a few bf16
    roundings (2^-5 of each tensor's scale; a wrong layout is off by O(1)). Experts 13-15 get no token: zero
    gradients, no NaN."""
    from qtrain.kernels.grouped_gemm import _fast_path_ok

    c, f = 256, 128
    cfg = transformers.Qwen3MoeConfig(hidden_size=c, moe_intermediate_size=f, num_experts=16, num_experts_per_tok=4,
                                      norm_topk_prob=True)
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(9)
    block = modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        block.gate.weight.normal_(0.0, 1.0 / c**0.5)
        block.gate.weight[13:] = -1.0
        block.experts.gate_up_proj.normal_(0.0, 1.0 / c**0.5)
        block.experts.down_proj.normal_(0.0, 1.0 / f**0.5)
    block = block.cuda().to(torch.bfloat16)
    g = torch.Generator().manual_seed(10)
    x = (torch.randn(2, 128, c, generator=g).abs() + 0.1).cuda().to(torch.bfloat16)
    dy = torch.randn(2, 128, c, generator=g).cuda().to(torch.bfloat16)

    xa = x.clone().requires_grad_(True)
    ref = block(xa)
    ref.backward(dy)
    gu = block.experts.gate_up_proj
    params = {"router": block.gate.weight.detach().clone(),
              "up_gate": torch.cat([gu[:, f:], gu[:, :f]], dim=1).detach().contiguous(),
              "down": block.experts.down_proj.detach().clone()}
    assert _fast_path_ok(x.view(-1, c), params["up_gate"]) and _fast_path_ok(x.view(-1, c), params["down"])
    params = {n: t.requires_grad_(True) for n, t in params.items()}
    xb = x.clone().requires_grad_(True)
    got = moe_forward(xb, params["router"], params["up_gate"], params["down"], top_k=4, norm_topk_prob=True)
    got.out.backward(dy)

    ggu = gu.grad
    want = {"out": ref, "dx": xa.grad, "router": block.gate.weight.grad,
            "up_gate": torch.cat([ggu[:, f:], ggu[:, :f]], dim=1), "down": block.experts.down_proj.grad}
    have = {"out": got.out, "dx": xb.grad, **{n: t.grad for n, t in params.items()}}
    assert got.plan.counts[13:].tolist() == [0, 0, 0]
    for n in want:
        assert torch.isfinite(have[n]).all(), n
        scale = want[n].abs().max().item()
        torch.testing.assert_close(have[n].float(), want[n].float(), rtol=2.0**-5, atol=2.0**-5 * scale,
                                   msg=lambda m, n=n: f"{n}: {m}")
    for n in ("up_gate", "down"):
        assert torch.equal(have[n][13:], torch.zeros_like(have[n][13:])), n
