"""Recompute, residual offload and batch-sliced attention change what is stored, never what is computed.

Every switch and the combinations below must give bit-identical losses and weight gradients to the plain
run (fp32 on the CPU; `torch.equal`, no tolerance): recomputation replays the same operations on the same
inputs, the autograd graph is the same one, and batch-sliced attention computes each sequence exactly as
the full call does (gradients are assembled in the same memory layout, so even the reductions that follow
sum in the same order). Memory is checked with hand-computed byte counts of what each switch drops.
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from qtrain.model.llama import LlamaConfig
from qtrain.model.init import init_params
from qtrain.model.recompute import (Recomputer, ResidualStash, block_steps, count_saved_bytes, resolve_flags)
from qtrain.model.transformer import RunOptions, Transformer, allocate_params, make_block_fn
from qtrain.parallel.weights.replicated import ParamWeights
from qtrain.options import Options, OptionsError

B, T = 4, 24  # B divisible by the attention chunk counts below; T not a power of two
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
MODELS = {
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True, attention_bias=True),
    "llama": dict(model_type="llama", tie_word_embeddings=False, rope_theta=500000.0,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 32}),
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=False, qk_norm=True, head_dim=32),
}


class Collect:
    """Gradient sink; also snapshots the saved-bytes counter when the head's gradients arrive, which is
    after every block's forward and before any block's backward."""

    def __init__(self, counter=None):
        self.grads: dict[str, torch.Tensor] = {}
        self.counter, self.forward_bytes = counter, None

    def accumulate_block(self, layer, grads):
        self.grads.update({f"layers.{layer}.{k}": v for k, v in grads.items()})

    def accumulate_non_block(self, grads):
        if self.counter is not None and self.forward_bytes is None:
            self.forward_bytes = self.counter.bytes
        self.grads.update(grads)


def make_model(name: str):
    cfg = LlamaConfig(**TINY, **MODELS[name])
    params = allocate_params(cfg, dtype=torch.float32, device="cpu")
    init_params(cfg, params, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-trivial norms and biases, so their gradients are checked too
        for n, p in params.items():
            if "norm" in n:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif n.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    inputs = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    targets[0, :5] = -100
    return cfg, params, inputs, targets


def run_options(**kw) -> RunOptions:
    """RunOptions from the test's keywords, `recompute_<flag>=True` spelled as Options spells it."""
    flags = frozenset(k.removeprefix("recompute_") for k in list(kw) if k.startswith("recompute_") and kw.pop(k))
    return RunOptions(recompute=flags, **kw)


def run(model, count: bool = False, **run_opts):
    """(loss, gradients, bytes kept for backward at the end of the forward pass) of one micro-step."""
    cfg, params, inputs, targets = model
    m = Transformer(cfg, run_options(**run_opts))
    with count_saved_bytes(exclude=params.values()) if count else _null() as counter:
        sink = Collect(counter)
        loss = m.forward_backward(ParamWeights(cfg, params), inputs, targets, grads=sink, loss_scale=1 / (B * T))
    return loss, sink.grads, sink.forward_bytes


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return None


@pytest.fixture(scope="module", params=list(MODELS))
def model_and_ref(request):
    """The model and its plain runs, one per LM-head chunking (the chunking is part of the reference)."""
    model, refs = make_model(request.param), {}

    def ref(lmhead_chunks: int):
        if lmhead_chunks not in refs:
            refs[lmhead_chunks] = run(model, lmhead_chunks=lmhead_chunks)
        return refs[lmhead_chunks]

    return model, ref


VARIANTS = [
    dict(recompute_swiglu=True),
    dict(recompute_norm=True),
    dict(recompute_ffn=True),
    dict(recompute_qkv=True),
    dict(recompute_att=True),
    dict(recompute_block=True),
    dict(recompute_norm=True, recompute_swiglu=True),  # LN2 dropped, MLP-up kept, SwiGLU dropped
    dict(recompute_norm=True, recompute_qkv=True),  # chain: QKV's input LN1 is itself recomputed
    dict(recompute_att=True, recompute_ffn=True, recompute_norm=True),  # everything but the block
    dict(recompute_block=True, recompute_swiglu=True),  # block implies the rest; nothing recomputed twice
    dict(recompute_block=True, offload_residual=True),
    dict(recompute_att=True, lmhead_chunks=3),
    dict(recompute_ffn=True, recompute_qkv=True, lmhead_chunks=4),
    dict(recompute_block=True, offload_residual=True, lmhead_chunks=3),
    dict(attn_bwd_chunks=2),
    dict(attn_bwd_chunks=4, recompute_att=True),
    dict(attn_bwd_chunks=2, recompute_block=True, offload_residual=True, lmhead_chunks=2),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: ",".join(f"{k}={v[k]}" for k in v))
def test_bitwise_equal_to_plain_run(model_and_ref, variant):
    model, ref = model_and_ref
    ref_loss, ref_grads, _ = ref(variant.get("lmhead_chunks", 1))
    loss, grads, _ = run(model, **variant)
    assert torch.equal(loss, ref_loss), (loss.item(), ref_loss.item())
    assert grads.keys() == ref_grads.keys()
    bad = [k for k in ref_grads if not torch.equal(grads[k], ref_grads[k])]
    assert not bad, f"gradients differ: {bad}"


def test_recompute_reduces_saved_activation_memory():
    """Bytes kept for backward at the end of the forward pass (weights excluded), against what each switch
    drops per layer, worked out by hand from the block (fp32, N = B*T rows, L layers):
      swiglu: silu(gate) (N, F) and the SwiGLU output (N, F)                           -> 2NF
      norm:   per norm the normalised x (N, C), the norm output (N, C), rstd (N, 1)     -> 2 (2NC + N)
      ffn:    LN2 as above, MLP-up (N, 2F), silu(gate), SwiGLU                          -> 2NC + N + 4NF
      block:  everything but the block input (N, C); offload moves that to the host   -> N C left"""
    cfg, *_ = model = make_model("qwen2")
    N, C, F_, L, f32 = B * T, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, 4
    b = {name: run(model, count=True, **kw)[2] for name, kw in {
        "plain": {}, "swiglu": dict(recompute_swiglu=True), "norm": dict(recompute_norm=True),
        "ffn": dict(recompute_ffn=True), "qkv": dict(recompute_qkv=True), "att": dict(recompute_att=True),
        "block": dict(recompute_block=True), "offload": dict(recompute_block=True, offload_residual=True)}.items()}
    assert b["plain"] - b["swiglu"] == L * 2 * N * F_ * f32
    assert b["plain"] - b["norm"] == L * 2 * (2 * N * C + N) * f32
    assert b["plain"] - b["ffn"] == L * (2 * N * C + N + 4 * N * F_) * f32
    assert b["block"] - b["offload"] == L * N * C * f32
    assert b["plain"] > b["swiglu"] > b["ffn"] > b["block"] > b["offload"]
    assert b["plain"] > b["norm"] > b["ffn"]
    assert b["plain"] > b["qkv"] > b["att"] > b["block"]


# ---- the implications, in the one place they are resolved ----
def test_llmq_implications():
    assert resolve_flags(["ffn"]) == {"ffn", "swiglu"}
    assert resolve_flags(["att"]) == {"att", "qkv"}
    assert resolve_flags(["block"]) == {"block", "att", "qkv", "ffn", "swiglu", "norm"}
    assert RunOptions(recompute=frozenset({"ffn"})).recompute == {"ffn", "swiglu"}
    assert block_steps(["att"]) == {"ln1", "qkv", "attention"}
    assert block_steps(["ffn"]) == {"ln2", "up", "swiglu"}
    assert block_steps(["norm", "swiglu"]) == {"ln1", "ln2", "swiglu"}
    assert block_steps(["block", "swiglu"]) == set()  # the loop reruns the whole block instead
    with pytest.raises(ValueError, match="unknown recompute switch 'mlp'"):
        resolve_flags(["mlp"])


# ---- the eager mechanism ----
def test_recomputer_reruns_each_step_once_and_chains_results():
    """A step reruns once however many backward nodes unpack its tensors, and a step whose input is
    another recomputed step's result reruns that step rather than keeping the result."""
    calls = {"norm": 0, "act": 0}

    def norm(x):
        calls["norm"] += 1
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def act(h):
        calls["act"] += 1
        return F.silu(h) * h

    x = torch.randn(3, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    ref = torch.autograd.grad((act(norm(x)) @ w).sum(), (x, w))
    calls.update(norm=0, act=0)
    with Recomputer(frozenset({"norm", "act"})) as rc:
        y = rc("act", act, rc("norm", norm, x)) @ w  # the GEMM saves act's result: dropped too
    assert calls == {"norm": 1, "act": 1}
    got = torch.autograd.grad(y.sum(), (x, w))
    assert calls == {"norm": 2, "act": 2}
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_recomputer_frees_kept_inputs_with_the_graph():
    """What a recomputed step keeps (here its input u) is freed by reference counting once backward has run,
    not left for the cyclic garbage collector (on a GPU that would hold activation memory for a while)."""
    gc.disable()
    try:
        x = torch.randn(4, 8, requires_grad=True)
        w = torch.randn(8, 4, requires_grad=True)
        u = x * 2
        with Recomputer(frozenset({"act"})) as rc:
            y = rc("act", lambda t: F.silu(t) * t, u) @ w
        kept = weakref.ref(u)
        del u
        assert kept() is not None  # held for backward
        y.sum().backward()
        del y, rc
        assert kept() is None
    finally:
        gc.enable()


def test_recomputer_rejects_a_rerun_that_saves_different_tensors():
    state = {"n": 0}

    def flaky(x):
        state["n"] += 1
        return x * x if state["n"] == 1 else x.exp()  # exp saves its result, mul its inputs

    x = torch.randn(4, requires_grad=True)
    with Recomputer(frozenset({"flaky"})) as rc:
        y = rc("flaky", flaky, x).sum()
    with pytest.raises(RuntimeError, match="recomputing block step 'flaky'.*deterministic"):
        y.backward()


def test_checkpoint_flavour_is_bitwise_equal_in_eager():
    """The torch.compile flavour (non-reentrant checkpoints) run eagerly: same numbers as plain."""
    cfg, params, inputs, _ = make_model("qwen3")
    w = ParamWeights(cfg, params).block(0)
    x = torch.randn(B, T, cfg.hidden_size, requires_grad=True)
    from qtrain.kernels.rope import rope_tables
    cos, sin = rope_tables(cfg, T, "cpu", torch.float32)
    steps = block_steps(["att", "ffn"])
    out = []
    for fn in (make_block_fn(cfg), make_block_fn(cfg, recompute=steps, compiled=True),
               make_block_fn(cfg, recompute=steps, attn_chunks=2)):
        y = fn(x, w, cos, sin)
        out.append((y, torch.autograd.grad(y, [x, *w.values()], torch.ones_like(y))))
    for y, g in out[1:]:
        assert torch.equal(y, out[0][0]) and all(torch.equal(a, b) for a, b in zip(g, out[0][1]))


def test_checkpoint_flavour_under_compile_drops_activations():  # ~10 s alone on the CI machine: not `slow`, CI runs it
    """Under torch.compile the checkpointed steps' results are not kept, even where a GEMM outside the step
    needs them (AOTAutograd's partitioner recomputes them). aot_eager_decomp_partition runs that partitioner
    without code generation, so the numbers stay those of the decomposed eager ops."""
    cfg, params, *_ = make_model("qwen2")
    w = ParamWeights(cfg, params).block(0)
    x = torch.randn(B, T, cfg.hidden_size, requires_grad=True)
    from qtrain.kernels.rope import rope_tables
    cos, sin = rope_tables(cfg, T, "cpu", torch.float32)
    res = []
    for steps in (frozenset(), block_steps(["ffn", "norm"])):
        torch._dynamo.reset()
        fn = torch.compile(make_block_fn(cfg, recompute=steps, compiled=True), backend="aot_eager_decomp_partition")
        with count_saved_bytes(exclude=params.values()) as c:
            y = fn(x, w, cos, sin)
        res.append((c.bytes, torch.autograd.grad(y, [x, *w.values()], torch.ones_like(y))))
    (plain_bytes, g0), (rc_bytes, g1) = res
    assert rc_bytes < plain_bytes
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))


# ---- residual offload ----
def test_residual_stash_offload_round_trip():
    stash = ResidualStash(offload=True)
    xs = [torch.randn(2, 3, 4) for _ in range(3)]
    for layer, x in enumerate(xs):
        stash.store(layer, x.requires_grad_(True))
    stash.prefetch(2)
    for layer in reversed(range(3)):
        got = stash.load(layer)
        stash.prefetch(layer - 1)
        assert torch.equal(got, xs[layer]) and got.data_ptr() != xs[layer].data_ptr() and not got.requires_grad
    stash.store(0, xs[1])  # a new micro-step: stale prefetches are dropped, host buffers reused
    stash.prefetch(0)
    stash.store(0, xs[2])
    assert torch.equal(stash.load(0), xs[2])
    kept = ResidualStash(offload=False)
    kept.store(0, xs[0])
    assert kept.load(0) is xs[0]


# ---- options ----
def test_run_options_validation():
    with pytest.raises(ValueError, match="offload_residual needs recompute 'block'"):
        RunOptions(offload_residual=True)
    with pytest.raises(ValueError, match="attn_bwd_chunks must be >= 1"):
        RunOptions(attn_bwd_chunks=0)
    with pytest.raises(ValueError, match="sdpa_backend must be one of"):
        RunOptions(sdpa_backend="fa3")


@pytest.mark.parametrize("variant", [dict(), dict(attn_bwd_chunks=2, recompute_att=True)], ids=["plain", "chunked"])
def test_sdpa_backend_is_a_speed_choice(model_and_ref, variant):
    """Forcing the attention kernel changes no result beyond its rounding: the CPU's flash kernel (torch's
    own pick for these fp32 inputs) and the math reference agree to fp32 accumulation-order error, and
    forcing 'flash' is bitwise the plain run (so the switch does reach every SDPA call, recomputed ones too)."""
    model, ref = model_and_ref
    ref_loss, ref_grads, _ = ref(1)
    loss, grads, _ = run(model, sdpa_backend="flash", **variant)
    assert torch.equal(loss, ref_loss) and all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
    loss, grads, _ = run(model, sdpa_backend="math", **variant)
    assert any(not torch.equal(grads[k], ref_grads[k]) for k in ref_grads), "'math' did not reach the SDPA calls"
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for k in ref_grads:  # fp32, values O(1e-2): reassociated sums differ by a few ulps of the largest terms
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-4, atol=1e-6, msg=k)
    # 'cudnn' is qtrain's op pair (kernels/attention.py), whose CPU implementation is the fp32 twin
    loss, grads, _ = run(model, sdpa_backend="cudnn", **variant)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-4, atol=1e-6, msg=k)


@pytest.mark.parametrize("kw,msg", [
    (dict(offload_residual=True), "--offload-residual needs --recompute-block"),
    (dict(batch_size=4, attn_bwd_chunks=3), "--attn-bwd-chunks=3 must divide --batch-size=4"),
    (dict(attn_bwd_chunks=0), "--attn-bwd-chunks must be >= 1"),
    (dict(sdpa_backend="fa3"), "--sdpa-backend='fa3': must be one of"),
])
def test_options_validation(kw, msg):
    with pytest.raises(OptionsError, match=msg):
        Options(**kw).validate()


def test_cli_flags():
    from qtrain.cli.main import build_parser
    from qtrain.cli.options import options_from_args
    argv = ["train", "--model", "org/m", "--recompute-swiglu", "--recompute-norm", "--recompute-ffn", "--recompute-qkv",
            "--recompute-att", "--recompute-block", "--offload-residual", "--attn-bwd-chunks", "2"]
    o = options_from_args(build_parser().parse_args(argv))
    assert (o.recompute_swiglu, o.recompute_norm, o.recompute_ffn, o.recompute_qkv, o.recompute_att,
            o.recompute_block, o.offload_residual, o.attn_bwd_chunks) == (True,) * 7 + (2,)
