"""FP8 weight copies made once per optimizer step (`train.fp8_weights.QuantizedWeights`): training with them
is bit-identical to quantizing in every linear call (same quantizer, same weights), each block matrix is
quantized once per step whatever the number of micro-steps, evaluation reuses the copies, and an update or a
checkpoint load drops them (a stale copy would silently train the old weights)."""
from __future__ import annotations

import pytest
import torch

from tests.dist_utils import write_model_dir
from qtrain.kernels.fp8_quant import fp8_quantize_torch
from qtrain.model.llama import LlamaConfig
from qtrain.model.transformer import FP8_INV_SCALE, FP8_WEIGHT, quantized_weight
from qtrain.parallel.weights.replicated import ParamWeights
from qtrain.model.llama import FP8_MATRICES
from qtrain.parallel.weights.quantized import QuantizedWeights
from qtrain.options import Options
from qtrain.train.trainer import Trainer

STEPS, ACCUM, B, T = 3, 2, 2, 32
CFG = LlamaConfig(model_type="qwen2", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0,
                  tie_word_embeddings=True, attention_bias=True)  # FP8 shapes: multiples of 16


@pytest.fixture(scope="module", autouse=True)
def model_dir(tmp_path_factory):
    global MODEL_DIR
    MODEL_DIR = write_model_dir(tmp_path_factory.mktemp("fp8w"), CFG)


def _trainer(**kw) -> Trainer:
    return Trainer(Options(model=MODEL_DIR, from_scratch=True, batch_size=B, seq_len=T, grad_accumulation=ACCUM, device="cpu", learning_rate=3e-3,
                           matmul_dtype="e4m3", fp8_policy="all", model_dtype="bf16", opt_m_dtype="bf16",
                           opt_v_dtype="bf16", compile="off", seed=5, **kw))


def _train(tr: Trainer) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        for _ in range(ACCUM):
            x = torch.randint(0, tr.cfg.vocab_size, (B, T + 1), generator=g)
            tr.micro_step(x[:, :-1], x[:, 1:])
        out.append(tr.update(lr=3e-3))
    return out


def test_once_per_step_equals_per_call_quantization():
    cached = _trainer(persistent_quants=True)
    assert isinstance(cached.weights, QuantizedWeights)
    plain = _trainer()  # the per-call path: every linear quantizes its weight
    assert isinstance(plain.weights, ParamWeights)
    a, b = _train(cached), _train(plain)
    assert a == b  # losses and norms, bit for bit
    for n, p in cached.full_params().items():
        assert torch.equal(p, plain.full_params()[n]), n
    L = cached.cfg.num_hidden_layers
    cache = cached.weights.cache
    # each micro-step asks for every block twice (forward, backward); only the first ask of a step quantizes
    assert cache.misses == len(FP8_MATRICES) * L * STEPS
    assert cache.hits == len(FP8_MATRICES) * L * (2 * ACCUM - 1) * STEPS


def test_copies_follow_the_weights_through_update_eval_and_load():
    tr = _trainer(persistent_quants=True)
    _train(tr)
    w = tr.weights.block(0)
    for n in FP8_MATRICES:  # after the last update the copies are of the current weights
        q, _, inv = fp8_quantize_torch(w[n].detach())
        got = quantized_weight(w, n)
        assert torch.equal(got[0].view(torch.uint8), q.view(torch.uint8)) and torch.equal(got[1], inv), n
    x = torch.randint(0, tr.cfg.vocab_size, (B, T + 1))
    tr.evaluate([(x[:, :-1], x[:, 1:])])  # quantizes the layers the last forward has not seen since the update
    misses = tr.weights.cache.misses
    assert misses == len(FP8_MATRICES) * tr.cfg.num_hidden_layers * (STEPS + 1)
    tr.evaluate([(x[:, :-1], x[:, 1:])])
    assert tr.weights.cache.misses == misses  # a second evaluation between updates reuses them all
    state = {k: {g: t.clone() for g, t in v.items()} for k, v in tr.state_tensors().items()}
    with torch.no_grad():
        for p in tr.params.values():
            p.zero_()  # bypasses nothing: a torch in-place write bumps the version the cache checks
    assert tr.weights.block(0)[FP8_WEIGHT.format("qkv")].float().abs().max() == 0
    tr.load_state_tensors(state, step=STEPS)
    assert len(tr.weights.cache) == 0  # the load dropped the copies
    w = tr.weights.block(0)
    q, _, _ = fp8_quantize_torch(w["qkv"].detach())
    assert torch.equal(w[FP8_WEIGHT.format("qkv")].view(torch.uint8), q.view(torch.uint8))
    assert FP8_INV_SCALE.format("qkv") in w and not w[FP8_WEIGHT.format("qkv")].requires_grad


def test_only_with_persistent_quants_without_debug_instrumentation():
    assert not isinstance(_trainer().weights, QuantizedWeights)
    assert not isinstance(_trainer(persistent_quants=True, debug_log_abs_max=1).weights, QuantizedWeights)
    assert isinstance(Trainer(Options(model=MODEL_DIR, from_scratch=True, device="cpu", compile="off",
                                      batch_size=1, seq_len=16, grad_accumulation=1, matmul_dtype="e4m3",
                                      fp8_policy="all", model_dtype="bf16", persistent_quants=True)).weights, QuantizedWeights)
    assert quantized_weight({"qkv": torch.zeros(1)}, "qkv") is None


def test_the_plan_counts_the_cached_copies_once():
    """The copies are the plan's 'fp8 weights (e4m3, cached)' row (`QuantizedWeights.footprint_of`, byte for byte
    what the cache holds after a forward), and the linears keep views of them for backward, not copies: what one
    block saves besides them is the per-layer activation row without e4m3 weight copies."""
    from qtrain.model.activations import layer_activation_bytes
    from qtrain.kernels.rope import rope_tables
    from qtrain.model.matmul import block_linear
    from qtrain.model.transformer import make_block_fn
    from qtrain.plan.resolution import plan_for_trainer
    tr = _trainer(persistent_quants=True)
    with torch.no_grad():
        blocks = [tr.weights.block(layer) for layer in range(CFG.num_hidden_layers)]
    entries = tr.weights.cache._entries.values()
    cached = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for e in entries
              for t in (e.w_fp8, e.inv_scale, e.w_fp8_t)}
    row = plan_for_trainer(tr).item("fp8 weights")
    assert row.device == sum(row.parts.values()) == sum(cached.values())
    assert row.parts["quant_transposes"] == row.parts["quant_copies"]
    x = torch.randn(B, T, CFG.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = rope_tables(CFG, T, "cpu", torch.bfloat16)
    skip = {t.untyped_storage().data_ptr() for t in (x, cos, sin, *blocks[0].values())}
    seen: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        make_block_fn(CFG, block_linear("e4m3"))(x, blocks[0], cos, sin)
    kw = dict(model_dtype="bf16", matmul_dtype="e4m3")
    assert layer_activation_bytes(CFG, B * T, fp8_weight_copies=False, **kw) == pytest.approx(sum(seen.values()),
                                                                                              rel=0.10)


def test_a_compiled_block_reads_the_cached_transposes():
    """Under torch.compile (AOTAutograd, as the trainer compiles blocks; `aot_eager` on the CPU) a block given
    the e4m3 copies with their transposes (what `QuantizedWeights.block` hands it) computes what it computes
    from the copies alone and eagerly, bit for bit; and it does read them: zeroed transposes change dx."""
    from qtrain.kernels.rope import rope_tables
    from qtrain.model.matmul import block_linear, block_mlp
    from qtrain.model.transformer import FP8_WEIGHT_T, make_block_fn
    from qtrain.model.weights import block_shapes
    from qtrain.numerics.fp8 import Fp8WeightCache
    g = torch.Generator().manual_seed(0)
    w = {n: (0.05 * torch.randn(s, generator=g)).bfloat16().requires_grad_() for n, s in block_shapes(CFG).items()}
    x = torch.randn(B, T, CFG.hidden_size, generator=g).bfloat16().requires_grad_()
    dy = torch.randn(B, T, CFG.hidden_size, generator=g).bfloat16()
    cos, sin = rope_tables(CFG, T, "cpu", torch.bfloat16)
    cache = Fp8WeightCache()

    def weights(transposes: str) -> dict[str, torch.Tensor]:
        d = dict(w)
        for n in FP8_MATRICES:
            d[FP8_WEIGHT.format(n)], d[FP8_INV_SCALE.format(n)] = cache.get(w[n])
            if transposes:
                t = cache.transposed(w[n])
                d[FP8_WEIGHT_T.format(n)] = t if transposes == "cached" else torch.zeros_like(t)
        return d

    fn = make_block_fn(CFG, block_linear("e4m3"), compiled=True, mlp=block_mlp("e4m3"))
    compiled = torch.compile(fn, backend="aot_eager", dynamic=False)

    def run(f, transposes):
        y = f(x, weights(transposes), cos, sin)
        return [y.detach(), *torch.autograd.grad(y, [x, *w.values()], dy)]

    eager = run(fn, "")
    for f, transposes in ((fn, "cached"), (compiled, "cached"), (compiled, "")):
        for a, b in zip(eager, run(f, transposes)):
            assert torch.equal(a, b)
    zeroed = run(compiled, "zeroed")
    assert torch.equal(zeroed[0], eager[0]) and not torch.equal(zeroed[1], eager[1])
