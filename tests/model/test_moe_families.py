"""The MoE families (qwen3_moe, olmoe, mixtral) against transformers' own Qwen3MoeForCausalLM / OlmoeForCausalLM /
MixtralForCausalLM in fp32 on the CPU: logits, loss, the load-balancing loss and every parameter's gradient of
transformers' training loss with output_router_logits=True (cross-entropy + router_aux_loss_coef * aux_loss), plus a
router z-loss; and every recompute switch gives the same gradients.

The weights come from transformers' save_pretrained (per-expert names) through qtrain's loader; transformers' own
gradients are mapped into qtrain's tensors through the families' alternative layout of its fused parameters
(`TensorSpec.hf_alternatives`: gate_up_proj [gate; up] -> [up; gate]), so both mappings are checked too.

Tolerances: the dense families' (tests/model/test_transformer.py): fp32 with the same operation order up to GEMM
blocking and summation order (qtrain sums an MoE output over a token's k experts in fp32 in routing order,
transformers adds expert by expert), so logits agree to ~1e-6 relative (asserted 1e-5), losses to 1e-5 relative,
gradients to cosine >= 0.99999 and norms within 1e-4 per tensor. The routing is the same on both sides (the same
fp32 softmax of the same logits): a different top-k choice would move a gradient by O(1), far outside these bounds.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qtrain.model.hf_io import load_hf_weights  # noqa: E402
from qtrain.model.moe_router import router_z_loss  # noqa: E402
from qtrain.model.registry import config_from_hf_dict  # noqa: E402
from qtrain.model.transformer import RunOptions, Transformer  # noqa: E402
from qtrain.model.weights import hf_to_internal, tensor_specs  # noqa: E402
from qtrain.parallel.weights.replicated import ParamWeights  # noqa: E402
from tests.model.family_fixtures import MOE_BASE as BASE, MOE_CASES as CASES, Collect, cosine  # noqa: E402,F401
from tests.model.family_fixtures import moe_hf_model as hf_model  # noqa: E402

def to_internal(cfg, hf_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' module tensors (fused experts) as qtrain's, through the layouts loading accepts."""
    layouts = {}
    for name, spec in tensor_specs(cfg).items():
        if not all(h in hf_tensors for h, _ in spec.hf):
            layouts[name] = next(a for a in spec.hf_alternatives if all(h in hf_tensors for h, _ in a.hf))
    return dict(hf_to_internal(cfg, hf_tensors.__getitem__, layouts))


def batch(vocab: int, seed: int = 1, B: int = 2, T: int = 16):
    g = torch.Generator().manual_seed(seed)
    inputs, targets = (torch.randint(0, vocab, (B, T), generator=g) for _ in range(2))
    targets[0, :3] = -100  # ignored positions count for the router losses (every token is routed), not the CE
    return inputs, targets


def loaded(case: str, tmp_path):
    """(transformers model, qtrain config, qtrain parameters loaded from its save_pretrained directory)."""
    hf = hf_model(case)
    hf.save_pretrained(tmp_path)
    cfg = config_from_hf_dict(hf.config.to_dict())
    params = {n: t.requires_grad_(True) for n, t in load_hf_weights(tmp_path, cfg).items()}
    return hf, cfg, params


@pytest.mark.parametrize("case,z", [("qwen3_moe", 0.0), ("qwen3_moe-step", 0.01), ("olmoe", 0.0),
                                    ("mixtral", 0.003)])
def test_matches_transformers_with_router_losses(case, z, tmp_path):
    hf, cfg, params = loaded(case, tmp_path)
    assert cfg.router is not None and cfg.router.aux_loss_coef == hf.config.router_aux_loss_coef
    inputs, targets = batch(cfg.vocab_size)
    ref = hf(input_ids=inputs, output_router_logits=True)
    ce = torch.nn.functional.cross_entropy(ref.logits.view(-1, cfg.vocab_size), targets.view(-1))
    total = ce + hf.config.router_aux_loss_coef * ref.aux_loss + z * router_z_loss(ref.router_logits)
    total.backward()

    model, w = Transformer(cfg, RunOptions()), ParamWeights(cfg, params)
    logits = model.logits(w, inputs)
    rel = ((logits - ref.logits).norm() / ref.logits.norm()).item()
    assert rel <= 1e-5, f"logits relative error {rel:.2e}"
    sink = Collect()
    loss = model.forward_backward(w, inputs, targets, grads=sink, loss_scale=1.0 / int((targets != -100).sum()),
                                  router_z_loss=z)
    assert abs(loss.item() - ce.item()) <= 1e-5 * ce.item()
    router = model.router_losses
    assert abs(router.aux_loss().item() - ref.aux_loss.item()) <= 1e-5 * ref.aux_loss.item()
    assert abs(router.z_loss().item() - router_z_loss(ref.router_logits).item()) <= 1e-5 * router.z_loss().item()
    assert int(router.tokens_per_expert.sum()) == len(cfg.router.layers) * inputs.numel() * cfg.num_experts_per_tok

    want = to_internal(cfg, {n: p.grad for n, p in hf.named_parameters()})
    assert set(sink.grads) == set(want) == set(params)
    for name, theirs in want.items():
        ours = sink.grads[name]
        c, nerr = cosine(ours, theirs), abs(ours.norm().item() - theirs.norm().item()) / theirs.norm().item()
        assert c >= 0.99999 and nerr <= 1e-4, f"{name}: cosine {c:.7f}, norm error {nerr:.2e}"


@pytest.mark.parametrize("case", ["qwen3_moe", "olmoe"])
def test_recompute_switches_give_the_same_gradients(case, tmp_path):
    """Routing is deterministic, so rerunning steps in backward (eager: `Recomputer`; --recompute-block: the whole
    block from its input) rebuilds exactly what the forward kept: the same loss, gradients and router statistics,
    bit for bit, the router losses' gradients included (a dense and a routed layer for qwen3_moe)."""
    _, cfg, params = loaded(case, tmp_path)
    inputs, targets = batch(cfg.vocab_size, seed=2)
    out = {}
    for flags in ((), ("block",), ("ffn",), ("swiglu",), ("att", "norm")):
        sink = Collect()
        model = Transformer(cfg, RunOptions(recompute=frozenset(flags)))
        loss = model.forward_backward(ParamWeights(cfg, params), inputs, targets, grads=sink, loss_scale=1 / 29,
                                      router_z_loss=0.01, router_loss_scale=0.5)
        out[flags] = (loss, sink.grads, model.router_losses.stats.clone())
    loss0, grads0, stats0 = out[()]
    for flags, (loss, grads, stats) in out.items():
        assert torch.equal(loss, loss0) and torch.equal(stats, stats0), flags
        for k in grads0:
            assert torch.equal(grads[k], grads0[k]), (flags, k)


def test_router_loss_scale_weights_only_the_router_losses(tmp_path):
    """router_loss_scale s: the gradients are the LM loss's plus s times the router losses' (linear in s), so two
    micro-steps at s = 1/2 sum to one at s = 1 -- what the trainer's 1 / grad_accumulation relies on."""
    _, cfg, params = loaded("mixtral", tmp_path)
    inputs, targets = batch(cfg.vocab_size, seed=4)
    grads = {}
    for s in (0.0, 0.5, 1.0):
        sink = Collect()
        Transformer(cfg).forward_backward(ParamWeights(cfg, params), inputs, targets, grads=sink, loss_scale=1 / 29,
                                          router_z_loss=0.01, router_loss_scale=s)
        grads[s] = sink.grads
    router = [n for n in grads[1.0] if n.endswith(".router")]
    assert router and all(not torch.equal(grads[0.0][n], grads[1.0][n]) for n in router)
    for n in grads[1.0]:
        torch.testing.assert_close(grads[0.5][n] * 2 - grads[0.0][n], grads[1.0][n], rtol=1e-4,
                                   atol=1e-6 * grads[1.0][n].abs().max().item())


def test_e4m3_runs_the_attention_projections_in_fp8_and_the_experts_in_bf16(tmp_path):
    """--matmul-dtype e4m3: the families' fp8_matrices are the attention projections (and a dense layer's MLP); the
    router and the expert stacks stay bf16, which the FP8 policy's start-of-run line says. With none of the FP8
    matrices in FP8 (the policy's choice) the step is the bf16 step bit for bit, so nothing else went through an FP8
    linear; with all of them it runs, finite, and moves (e4m3 rounding can flip a routing choice of this random tiny
    model, so no closeness bound is asserted per tensor)."""
    from qtrain.model.fp8_policy import choose_fp8
    _, cfg, params = loaded("qwen3_moe", tmp_path)
    choice = choose_fp8(cfg, 32, "all")
    assert choice.fp8 == ("qkv", "o", "up", "down") and choice.never == ("router", "experts_up_gate", "experts_down")
    assert "router/experts_up_gate/experts_down always in the model dtype" in choice.describe()
    params = {n: p.detach().to(torch.bfloat16).requires_grad_(True) for n, p in params.items()}
    inputs, targets = batch(cfg.vocab_size, seed=5)
    grads = {}
    for key, run in (("bf16", RunOptions()), ("none", RunOptions(matmul_dtype="e4m3", fp8_linears=())),
                     ("all", RunOptions(matmul_dtype="e4m3"))):
        sink = Collect()
        Transformer(cfg, run).forward_backward(ParamWeights(cfg, params), inputs, targets, grads=sink,
                                               loss_scale=1 / 29)
        grads[key] = sink.grads
    assert all(torch.equal(grads["none"][n], g) for n, g in grads["bf16"].items())
    assert all(torch.isfinite(g.float()).all() for g in grads["all"].values())
    assert not torch.equal(grads["all"]["layers.0.qkv"], grads["bf16"]["layers.0.qkv"])


def test_compiled_blocks_match_eager_with_the_router_losses(tmp_path):
    """torch.compile'd MoE blocks (inductor, on the CPU) give eager's loss, router statistics and gradients to fp32
    reduction order (cosine >= 0.99999), the router losses' gradients included: their node runs outside the compiled
    graph (`moe_router.with_router_grads`), since a compiled backward read them before the Transformer filled them
    (router gradient cosine 0.96 before)."""
    _, cfg, params = loaded("mixtral", tmp_path)
    inputs, targets = batch(cfg.vocab_size, seed=2)
    out = {}
    for compiled in (False, True):
        sink = Collect()
        model = Transformer(cfg, RunOptions(compile=compiled))
        loss = model.forward_backward(ParamWeights(cfg, params), inputs, targets, grads=sink, loss_scale=1 / 29,
                                      router_z_loss=0.01)
        out[compiled] = (loss, sink.grads, model.router_losses.stats)
    assert out[True][0].item() == pytest.approx(out[False][0].item(), rel=1e-5)
    torch.testing.assert_close(out[True][2], out[False][2], rtol=1e-5, atol=1e-5)
    for k, g in out[False][1].items():
        assert cosine(out[True][1][k], g) >= 0.99999, k


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["qwen3_moe", "olmoe", "mixtral"])
@pytest.mark.parametrize("compile_", [False, True])
def test_bf16_on_gpu_is_as_accurate_as_transformers(case, compile_, tmp_path):
    """bf16 on the GPU (Triton permutation, torch._grouped_mm experts; compiled or not) against transformers' bf16,
    both measured against transformers in fp32: ours no further from the fp32 truth than transformers' own bf16
    (within 1.5x of its error, plus 1e-3 relative), as tests/model/test_transformer.py asks of the dense families.
    Router losses included (transformers' loss with output_router_logits)."""
    cls, kw = CASES[case]
    sizes = dict(BASE, vocab_size=2048, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                 max_position_embeddings=1024)
    kw = {**kw, **({"moe_intermediate_size": 128} if "moe_intermediate_size" in kw else {"intermediate_size": 128})}
    kw.update({"num_experts": 16} if "num_experts" in kw else {"num_local_experts": 16})
    kw.pop("head_dim", None)
    hf_cfg = getattr(transformers, cls)(**sizes, **kw)
    hf32 = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa").float()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in hf32.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.05 if "norm" not in n else 0.1) + ("norm" in n))
    hf32.save_pretrained(tmp_path)
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).cuda()
    hf32 = hf32.cuda()
    cfg = config_from_hf_dict(hf_cfg.to_dict())
    inputs = torch.randint(0, cfg.vocab_size, (4, 256), generator=g).cuda()
    targets = torch.randint(0, cfg.vocab_size, (4, 256), generator=g).cuda()

    def hf_run(m):
        out = m(input_ids=inputs, output_router_logits=True)
        loss = torch.nn.functional.cross_entropy(out.logits.float().flatten(0, 1), targets.flatten())
        (loss + m.config.router_aux_loss_coef * out.aux_loss.float()).backward()
        return out.logits.float(), to_internal(cfg, {n: p.grad.float() for n, p in m.named_parameters()})

    ref_logits, ref_grads = hf_run(hf32)
    hf_logits, hf_grads = hf_run(hf16)
    params = {n: t.to(device="cuda", dtype=torch.bfloat16).requires_grad_(True)
              for n, t in load_hf_weights(tmp_path, cfg).items()}
    model, w = Transformer(cfg, RunOptions(compile=compile_)), ParamWeights(cfg, params)
    logits = model.logits(w, inputs).float()
    sink = Collect()
    model.forward_backward(w, inputs, targets, grads=sink, loss_scale=1.0 / targets.numel())

    def rel(a, b):
        return ((a.float() - b).norm() / b.norm()).item()

    assert rel(logits, ref_logits) <= 1.5 * rel(hf_logits, ref_logits) + 1e-3
    for name, ref in ref_grads.items():
        e_ours, e_hf = rel(sink.grads[name], ref), rel(hf_grads[name], ref)
        assert e_ours <= 1.5 * e_hf + 1e-3, f"{name}: ours {e_ours:.2e} vs transformers bf16 {e_hf:.2e}"
