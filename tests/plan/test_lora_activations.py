"""The memory plan's activations of a LoRA run (--lora-rank) against what autograd keeps for one block call.

Over a frozen base a linear keeps its input only for an adapter that reads it (PyTorch saves a matmul's input for the
weight's gradient), and a norm's frozen gain keeps no normalized value: the plan's `activations` row
(`ActivationSettings.frozen_base`, `adapter_inputs`) plus its `lora adapters` row (each target's A output; with
dropout its dropped input and mask; none for an adapter inside a recomputed step) must be what the block keeps. The
block runs as the trainer runs it (`transformer.make_block_fn` with the `LoraAdapter`, the base frozen, an e4m3 base
through `frozen_e4m3_linear`), on the CPU, eager; counted with `recompute.count_saved_bytes` (unique storages, the
weights, the block input and the RoPE tables excluded), as tests/model/test_activations.py counts the full
fine-tune's. Tolerance: 16 bytes per layer (0-dim scales the terms do not follow), as there.

Before: the plan counted every linear input and normalized value as kept whatever the targets, and the adapters' rows
inside recomputed steps: qwen2 tiny bf16 with q targeted kept 2016 bytes per token per layer, the plan said 2720.
The MoE experts' grouped GEMMs kept their inputs (the permuted tokens, the SwiGLU output) though frozen: k (C + F)
elements a token of each routed layer, 45 KB at Qwen3-30B-A3B's shape; now they keep them only for a weight gradient.
"""
from __future__ import annotations

import weakref

import pytest
import torch

from qtrain.kernels.fp8_quant import quantize_fp8
from qtrain.kernels.rope import rope_tables
from qtrain.model.activations import activation_terms, layer_activation_bytes
from qtrain.model.lora import LoraAdapter
from qtrain.model.lora.spec import LoraSpec
from qtrain.model.lora.tensors import adapter_tensors
from qtrain.model.matmul import block_linear
from qtrain.model.moe_router import RouterLosses
from qtrain.model.recompute import block_steps, count_saved_bytes, resolve_flags
from qtrain.model.transformer import make_block_fn
from qtrain.model.weight_source import FP8_INV_SCALE, FP8_WEIGHT
from qtrain.model.weights import block_shapes
from qtrain.numerics.frozen_e4m3 import frozen_e4m3_linear
from qtrain.options import Options
from qtrain.parallel.weights.e4m3_base import base_matrices
from qtrain.plan.memory import _lora_settings
from qtrain.plan.resolution import plan_memory
from tests.model.family_fixtures import qwen35_cfg
from tests.model.test_activations import small_cfg
from tests.model.test_moe_activations import CONFIGS as MOE_CONFIGS

DT = {"bf16": torch.bfloat16, "fp32": torch.float32}
B, T, RANK = 2, 32, 4
ALL = ("q", "k", "v", "o", "gate", "up", "down")


def measure(cfg, targets: tuple[str, ...], *, dtype: str = "bf16", base: str = "", fp8: bool = False,
            dropout: float = 0.0, flags=(), attn_chunks: int = 1, layer: int = 0) -> float:
    """Bytes per token one block call of layer `layer` keeps for backward, its base frozen, adapters of `targets`
    (none: the frozen base alone)."""
    g = torch.Generator().manual_seed(0)
    w = {n: (0.02 * torch.randn(s, generator=g)).to(DT[dtype]) for n, s in block_shapes(cfg, layer).items()}
    if getattr(cfg, "router", None):
        w.update(RouterLosses(cfg.router, B * T, torch.device("cpu"), z_loss=True).slot(layer))
    adapter = None
    if targets:
        adapter = LoraAdapter(cfg, LoraSpec(RANK, 2.0 * RANK, dropout, targets, base))
        for t in adapter_tensors(cfg, adapter.spec, layer):
            w[t.name] = (0.02 * torch.randn(t.shape, generator=g)).to(DT[dtype]).requires_grad_()
        adapter.bind_layers([w] * (layer + 1))
    linear = block_linear("e4m3" if fp8 else "")
    if base == "e4m3":  # the block matrices as codes, as E4m3BaseWeights.block hands them over
        for n in base_matrices(cfg, layer):
            q, inv = quantize_fp8(w[n].float())
            w[n], w[FP8_WEIGHT.format(n)], w[FP8_INV_SCALE.format(n)] = q, q, inv
        linear = frozen_e4m3_linear("e4m3" if fp8 else "")
    fn = make_block_fn(cfg, linear, recompute=block_steps(flags), adapter=adapter, attn_chunks=attn_chunks)
    cos, sin = rope_tables(cfg, T, "cpu", DT[dtype])
    x = torch.randn(B, T, cfg.hidden_size, generator=g).to(DT[dtype]).requires_grad_()
    with count_saved_bytes(exclude=[x, cos, sin, *w.values()]) as c:
        y = fn(x, w, cos, sin)
        n = c.bytes
    y.float().sum().backward()  # the recomputed steps rerun as they were kept (the Recomputer checks it)
    return n / (B * T)


def planned(cfg, targets: tuple[str, ...], *, dtype: str = "bf16", base: str = "", fp8: bool = False,
            dropout: float = 0.0, flags=(), attn_chunks: int = 1) -> float:
    """The plan's bytes per token per layer of the same run: its activations row's largest layer + the LoRA row's
    share of a layer."""
    o = Options(model="tiny", device="cpu", compile="off", model_dtype=dtype, batch_size=B, seq_len=T,
                grad_accumulation=1, lora_rank=RANK, lora_alpha=2.0 * RANK, lora_targets=",".join(targets),
                lora_dropout=dropout, lora_base_dtype=base, attn_bwd_chunks=attn_chunks,
                **(dict(matmul_dtype="e4m3", fp8_policy="all") if fp8 else {}))
    plan = plan_memory(cfg, o, device="cpu", compiled=False, recompute=resolve_flags(flags))
    N, L = B * T, cfg.num_hidden_layers
    return plan.item("activations").parts["per_layer"] / N + plan.item("lora adapters").device / (N * L)


TOL = 16 / (B * T)  # bytes per token: 16 bytes per layer


def test_frozen_base_without_adapters():
    """The frozen base alone keeps no linear input and no normalized value: of qwen2's tiny block 1880 bytes per
    token of the full fine-tune's 2712 (the two norms' normalized values and outputs, the SwiGLU output)."""
    cfg = small_cfg("qwen2")
    frozen = layer_activation_bytes(cfg, B * T, model_dtype="bf16", frozen_base=True) / (B * T)
    assert abs(measure(cfg, ()) - frozen) <= TOL
    assert frozen < layer_activation_bytes(cfg, B * T, model_dtype="bf16") / (B * T)


@pytest.mark.parametrize("base", ["", "e4m3"])
@pytest.mark.parametrize("targets", [("q",), ("o",), ("up",), ("q", "v", "o", "gate", "down"), ALL])
def test_plan_is_what_a_lora_block_keeps(targets, base):
    """The table of the issue: each set of targets over a bf16 and an e4m3 base (the same bytes: the e4m3 linear
    keeps the held codes only)."""
    cfg = small_cfg("qwen2")
    assert abs(measure(cfg, targets, base=base) - planned(cfg, targets, base=base)) <= TOL


@pytest.mark.parametrize("flags", [("qkv",), ("ffn",), ("att",), ("norm", "swiglu")])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_plan_follows_recompute_and_dropout(flags, dropout):
    """A recomputed step reruns its adapters too (q's under qkv, up's under ffn), and with dropout an adapter keeps
    its dropped input and mask, not the linear's input."""
    cfg = small_cfg("qwen2")
    for targets in (("q", "v", "o", "gate", "down"), ("up",)):
        kw = dict(dropout=dropout, flags=flags)
        assert abs(measure(cfg, targets, **kw) - planned(cfg, targets, **kw)) <= TOL, targets


@pytest.mark.parametrize("model_type,dtype", [("qwen3", "bf16"), ("llama", "fp32"), ("qwen3", "fp32")])
def test_plan_other_dense_families_and_dtypes(model_type, dtype):
    """qwen3's q/k norms keep no normalized value under a frozen gain either; fp32 keeps no fp32 copies."""
    cfg = small_cfg(model_type)
    for targets in (("q",), ("o", "down"), ALL):
        assert abs(measure(cfg, targets, dtype=dtype) - planned(cfg, targets, dtype=dtype)) <= TOL, targets


@pytest.mark.parametrize("flags", [(), ("qkv",), ("ffn",)])
@pytest.mark.parametrize("base", ["", "e4m3"])
def test_plan_with_e4m3_matmuls(base, flags):
    """--matmul-dtype e4m3: an FP8 linear over a frozen weight keeps no e4m3 copy of its input (no weight gradient);
    an adapter keeps the model-dtype input; an e4m3 base's linears keep no weight copy of their own."""
    cfg = small_cfg("qwen2")
    for targets in (("q", "v", "o", "gate", "down"), ("o",)):
        kw = dict(base=base, fp8=True, flags=flags)
        assert abs(measure(cfg, targets, **kw) - planned(cfg, targets, **kw)) <= TOL, targets


@pytest.mark.parametrize("targets", [("q",), ("o",), ALL])
def test_plan_with_attention_chunks(targets):
    """--attn-bwd-chunks: the concatenated slices are kept only for o's adapter."""
    cfg = small_cfg("qwen2")
    assert abs(measure(cfg, targets, attn_chunks=2) - planned(cfg, targets, attn_chunks=2)) <= TOL


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "olmoe-clip"])
@pytest.mark.parametrize("fp8", [False, True])
def test_moe_attention_adapters(name, fp8):
    """The MoE families (targets: the attention's): the attention part as the Llama block's; a frozen router keeps
    nothing of its input; the experts' GEMMs keep theirs (the routed MLP's terms as for a full fine-tune).
    Qwen3-MoE's layer 1 is a dense one (its MLP frozen: no target)."""
    cfg = MOE_CONFIGS[name]
    layers = (0, 1) if name == "qwen3_moe" else (0,)
    for targets in (("q",), ("q", "k", "v", "o")):
        plan = planned(cfg, targets, fp8=fp8)  # the largest layer
        measured = max(measure(cfg, targets, fp8=fp8, layer=layer) for layer in layers)
        assert abs(measured - plan) <= TOL, targets


@pytest.mark.parametrize("name", ["mixtral", "olmoe-clip"])
@pytest.mark.parametrize("flags,dropout", [((), 0.0), ((), 0.1), (("ffn",), 0.0), (("ffn",), 0.1), (("swiglu",), 0.1)])
def test_moe_expert_adapters(name, flags, dropout):
    """The experts' adapters (gate,up,down of a routed layer): per token each of its k rows keeps the A output (r'
    values: 2 r for gate_up, r for down) and with dropout the dropped input and its mask; per layer each stack's B
    in the grouped GEMM's expert-major order. The up/gate adapter runs inside the 'up' step (--recompute-ffn: it
    keeps nothing); the experts' GEMMs keep their inputs anyway, so the adapters' A reads them at no cost."""
    cfg = MOE_CONFIGS[name]
    for targets in (("gate", "up", "down"), ("q", "down"), ("gate", "up")):
        kw = dict(dropout=dropout, flags=flags)
        assert abs(measure(cfg, targets, **kw) - planned(cfg, targets, **kw)) <= TOL, targets


@pytest.mark.parametrize("flags", [("ffn",), ("swiglu",), ("att",)])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_moe_frozen_experts_follow_recompute_and_dropout(flags, dropout):
    """The frozen experts' GEMMs keep no input (the permuted tokens, the SwiGLU output) under every MLP switch."""
    cfg = MOE_CONFIGS["qwen3_moe"]
    for targets in (("q",), ("q", "k", "v", "o")):
        kw = dict(dropout=dropout, flags=flags)
        measured = max(measure(cfg, targets, layer=layer, **kw) for layer in (0, 1))
        assert abs(measured - planned(cfg, targets, **kw)) <= TOL, targets


def adapter_gradients(cfg, experts_learn: bool, *, dtype: str, flags=()) -> dict[str, torch.Tensor]:
    """d(input) and the adapters' gradients of a routed layer over a frozen base (the experts learning or not)."""
    g = torch.Generator().manual_seed(0)
    w = {n: (0.1 * torch.randn(s, generator=g)).to(DT[dtype]) for n, s in block_shapes(cfg, 0).items()}
    w.update(RouterLosses(cfg.router, B * T, torch.device("cpu"), z_loss=True).slot(0))
    for name in ("experts_up_gate", "experts_down"):
        w[name].requires_grad_(experts_learn)
    adapter = LoraAdapter(cfg, LoraSpec(RANK, 2.0 * RANK, 0.0, ("q", "k", "v", "o"), ""))
    for t in adapter_tensors(cfg, adapter.spec, 0):
        w[t.name] = (0.1 * torch.randn(t.shape, generator=g)).to(DT[dtype]).requires_grad_()
    adapter.bind_layers([w])
    fn = make_block_fn(cfg, block_linear(""), recompute=block_steps(flags), adapter=adapter)
    cos, sin = rope_tables(cfg, T, "cpu", DT[dtype])
    x = torch.randn(B, T, cfg.hidden_size, generator=g).to(DT[dtype]).requires_grad_()
    fn(x, w, cos, sin).float().pow(2).sum().backward()
    return {"x": x.grad, **{n: t.grad for n, t in w.items() if "lora" in n}}


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("flags", [(), ("ffn",)])
def test_frozen_experts_change_no_gradient(dtype, flags):
    """Keeping no input in the frozen experts' GEMMs changes no bit: the gradients are those of the same block whose
    experts learn (and so keep their inputs, as every expert GEMM did before)."""
    cfg = MOE_CONFIGS["qwen3_moe"]
    frozen, learning = (adapter_gradients(cfg, learn, dtype=dtype, flags=flags) for learn in (False, True))
    assert frozen.keys() == learning.keys() and len(frozen) > 1
    for name in frozen:
        assert torch.equal(frozen[name], learning[name]), name


def lora_plan(cfg, targets: tuple[str, ...], *, dropout: float = 0.0, flags=(), lora: bool = True):
    o = Options(model="tiny", device="cpu", compile="off", model_dtype="bf16", batch_size=B, seq_len=T,
                grad_accumulation=1, **(dict(lora_rank=RANK, lora_alpha=2.0 * RANK, lora_targets=",".join(targets),
                                             lora_dropout=dropout) if lora else {}))
    return plan_memory(cfg, o, device="cpu", compiled=False, recompute=resolve_flags(flags))


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("name", ["qwen2", "qwen3_moe"])
def test_block_backward_over_a_frozen_base(name, dropout):
    """The workspace's block backward over a frozen base holds fresh gradients of the layer's adapters only, not of
    its base; with --recompute-block the rerun rebuilds what the plan without it keeps of a layer, the adapters'
    saved tensors included (the `lora adapters` row's share of a layer); with a step recomputed (qkv: q's adapter)
    that adapter's share (q's and v's A output, and their block-diagonal B)."""
    cfg = small_cfg(name) if name == "qwen2" else MOE_CONFIGS[name]
    targets, L, E, N = ("q", "v", "o"), cfg.num_hidden_layers, 2, B * T
    full, lora = lora_plan(cfg, targets, lora=False), lora_plan(cfg, targets, dropout=dropout)
    spec = LoraSpec(RANK, 2.0 * RANK, dropout, targets, "")
    layer = 0  # the largest layer (qwen3_moe: its routed one; layer 1 keeps a dense MLP)
    base = sum(int(torch.Size(s).numel()) for s in block_shapes(cfg, layer).values())
    adapters = sum(int(torch.Size(t.shape).numel()) for t in adapter_tensors(cfg, spec, layer))
    assert lora.phases["block_backward"] == full.phases["block_backward"] - E * (base - adapters)
    kept = lora.item("activations").parts["per_layer"] + lora.item("lora adapters").device // L
    blk = lora_plan(cfg, targets, dropout=dropout, flags=("block",))
    assert blk.phases["block_backward"] - lora.phases["block_backward"] == kept
    qkv = lora_plan(cfg, targets, dropout=dropout, flags=("qkv",))
    rebuilt = lora.item("activations").parts["per_layer"] - qkv.item("activations").parts["per_layer"]
    q_adapter = (lora.item("lora adapters").device - qkv.item("lora adapters").device) // L
    qkv_rows = block_shapes(cfg, layer)["qkv"][0]  # + their block-diagonal B (rows x 2 r), what the GEMM keeps
    assert q_adapter == N * (RANK * E * 2 + (2 * E * cfg.hidden_size * 2 if dropout else 0)) + qkv_rows * 2 * RANK * E
    assert qkv.phases["block_backward"] - lora.phases["block_backward"] == rebuilt + q_adapter


# ---------------------------------------------------------------------------------------------------- Qwen3.5
Q35_T = 128  # two delta-rule chunks of 64 per sequence (the statements hold at multiples of the chunk)
Q35_ALL = ("q", "k", "v", "o", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out", "gate", "up", "down")


def kept_after_forward(fn, x, w, cos, sin) -> int:
    """Bytes of the storages the graph still holds after one forward (weights, input, RoPE tables excluded). Not
    `count_saved_bytes`: the delta rule's last state update is saved and freed within the forward (nothing reads the
    final state), so its address may come back for a later tensor, which that count would merge with it."""
    refs, skip = [], {t.untyped_storage().data_ptr() for t in [x, cos, sin, *w.values()]}

    def pack(t):
        refs.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(x, w, cos, sin)
    alive = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (r() for r in refs)
             if t is not None and t.untyped_storage().data_ptr() not in skip}
    y.float().sum().backward()
    return sum(alive.values())


def q35_measure(cfg, layer: int, targets: tuple[str, ...], dtype: str, dropout: float) -> float:
    g = torch.Generator().manual_seed(0)
    w = {n: (0.02 * torch.randn(s, generator=g)).to(DT[dtype]) for n, s in block_shapes(cfg, layer).items()}
    if cfg.is_moe:
        w.update(RouterLosses(cfg.router, B * Q35_T, torch.device("cpu"), z_loss=True).slot(layer))
    adapter = None
    if targets:
        adapter = LoraAdapter(cfg, LoraSpec(RANK, 2.0 * RANK, dropout, targets, ""))
        for t in adapter_tensors(cfg, adapter.spec, layer):
            w[t.name] = (0.02 * torch.randn(t.shape, generator=g)).to(DT[dtype]).requires_grad_()
        adapter.bind_layers([w] * (layer + 1))
    fn = make_block_fn(cfg, block_linear(""), adapter=adapter)
    cos, sin = rope_tables(cfg, Q35_T, "cpu", DT[dtype])
    x = torch.randn(B, Q35_T, cfg.hidden_size, generator=g).to(DT[dtype]).requires_grad_()
    return kept_after_forward(fn, x, w, cos, sin) / (B * Q35_T)


def q35_planned(cfg, layer: int, targets: tuple[str, ...], dtype: str, dropout: float) -> float:
    """Layer `layer`'s statements with the plan's LoRA settings, + its adapters' own (the `lora adapters` row's)."""
    spec = LoraSpec(RANK, 2.0 * RANK, dropout, targets, "")
    terms = activation_terms(cfg, layer=layer, model_dtype=dtype, seq_len=Q35_T, **_lora_settings(cfg, spec))
    N = B * Q35_T
    adapter, E = LoraAdapter(cfg, spec), DT[dtype].itemsize
    adapters = adapter.layer_saved_bytes_per_token(layer, E) + adapter.layer_saved_bytes(layer, E) / N if targets else 0
    return sum(t.nbytes(N) for t in terms if t.kept and t.name != "input") / N + adapters


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_qwen3_5_over_a_frozen_base(moe, dtype, dropout):
    """Qwen3.5 (a linear-attention and a full-attention layer; dense or MoE) over a frozen base: no adapters, some
    (q of the full-attention layers; o, out, down: the projections' inputs; in_proj's z alone), all. Before: the
    statements were a full fine-tune's, 6040 bytes a token stated where a bf16 full-attention layer keeps 3571,
    12488 for a linear-attention one keeping 11418. MoE: the routed experts' adapters (gate/up, down) keep the
    expert GEMMs' inputs (the statements had said none over a frozen base: 384 bytes a token under here)."""
    cfg = qwen35_cfg(moe=moe, num_hidden_layers=2, layer_types=("linear_attention", "full_attention"))
    tol = 16 / (B * Q35_T)
    for targets in ((), ("q",), ("o", "out", "down"), ("in_proj_z",), ("up",), Q35_ALL):
        for layer in (0, 1):
            measured = q35_measure(cfg, layer, targets, dtype, dropout)
            assert abs(measured - q35_planned(cfg, layer, targets, dtype, dropout)) <= tol, (targets, layer)


def test_a_frozen_head_makes_no_weight_gradient(tmp_path, monkeypatch):
    """LoRA freezes the LM head: a micro-step's head makes d(hidden) only, neither the (V, C) d(W_head) buffer nor its
    GEMM (2 N V C FLOPs, ~3.5% of a Qwen2.5-7B LoRA step), and the plan's lm-head phase is the full fine-tune's less
    that buffer; a full fine-tune's head still makes it."""
    from qtrain.cli.main import main
    from qtrain.kernels.cross_entropy import head as head_mod
    from qtrain.model import transformer
    from tests.run_utils import make_run_root, train_argv

    cfg = small_cfg("qwen2")
    full, lora = lora_plan(cfg, ("q", "v"), lora=False), lora_plan(cfg, ("q", "v"))
    assert full.phases["lm_head"] - lora.phases["lm_head"] == cfg.vocab_size * cfg.hidden_size * 2  # bf16
    made = []

    def spy(*args, **kwargs):  # the real head, its d(W) recorded
        out = head_mod.lm_head_loss_and_grads(*args, **kwargs)
        made.append(out[2] is not None)
        return out

    monkeypatch.setattr(transformer, "lm_head_loss_and_grads", spy)
    for extra, want in ((("--lora-rank", "2"), False), ((), True)):
        made.clear()
        root = make_run_root(tmp_path / ("lora" if extra else "full"))
        assert main(train_argv(root, steps=1, extra=extra)) == 0
        assert made and set(made) == {want}, (extra, made)


@pytest.mark.parametrize("base", ["", "e4m3"])
def test_compiled_fp8_over_a_frozen_base_keeps_the_model_dtype_inputs(base):
    """Compiled FP8 blocks over a frozen base keep no e4m3 input copy (no weight gradient) and the adapters the
    model-dtype inputs: on an H100 the saved tensors of Qwen2.5-7B LoRA over an e4m3 base (all seven targets, 8 x 1024,
    autograd's pack hook: `bench/bench_train.py` probe_saved, session 36) were those over a bf16 base, the codes
    aside; the plan said 889 MiB a layer for them against the 1,241 it plans over a bf16 base, its peak 31% under.
    (Eager, the block itself is measured above.) So: the activations of an FP8 run over a frozen base are the
    model-dtype run's, besides the e4m3 weight copies an FP8 linear over a bf16 base makes and keeps."""
    from qtrain.model.registry import preset
    cfg = preset("Qwen2.5-7B")
    kw = dict(model="x", batch_size=8, seq_len=1024, lora_rank=16, lora_base_dtype=base, opt_m_dtype="bf16",
              opt_v_dtype="bf16")
    plain = plan_memory(cfg, Options(**kw).validate(), compiled=True).item("activations")
    fp8 = plan_memory(cfg, Options(**kw, matmul_dtype="e4m3").validate(), compiled=True).item("activations")
    if base:  # the codes are the weights row's: nothing more
        assert fp8.device == plain.device
    else:  # plus each layer's e4m3 weight copies (1 byte a block matrix element + 8 a scale), forward to backward
        block = sum(s[0] * s[1] for s in block_shapes(cfg, 0).values() if len(s) == 2)
        assert fp8.device == plain.device + cfg.num_hidden_layers * (block + 4 * 8)


def measure_compiled(cfg, targets: tuple[str, ...], base: str = "") -> float:
    """`measure`'s bytes per token for a compiled block (torch.compile's partitioner decides what is kept; its
    aot_eager backend keeps what inductor's does without generating code: the partitioner is the same), counted with
    autograd's pack hook, which sees what the compiled graph saves."""
    g = torch.Generator().manual_seed(0)
    w = {n: (0.02 * torch.randn(s, generator=g)).to(torch.bfloat16) for n, s in block_shapes(cfg, 0).items()}
    adapter = LoraAdapter(cfg, LoraSpec(RANK, 2.0 * RANK, 0.0, targets, base))
    for t in adapter_tensors(cfg, adapter.spec, 0):
        w[t.name] = (0.02 * torch.randn(t.shape, generator=g)).to(torch.bfloat16).requires_grad_()
    adapter.bind_layers([w])
    linear = block_linear("")
    if base == "e4m3":
        for n in base_matrices(cfg, 0):
            q, inv = quantize_fp8(w[n].float())
            w[n], w[FP8_WEIGHT.format(n)], w[FP8_INV_SCALE.format(n)] = q, q, inv
        linear = frozen_e4m3_linear("")
    torch._dynamo.reset()
    fn = torch.compile(make_block_fn(cfg, linear, adapter=adapter, compiled=True, swiglu="autograd", rope="autograd"),
                       dynamic=False, backend="aot_eager_decomp_partition")
    cos, sin = rope_tables(cfg, T, "cpu", torch.bfloat16)
    x = torch.randn(B, T, cfg.hidden_size, generator=g).to(torch.bfloat16).requires_grad_()
    skip = {t.untyped_storage().data_ptr() for t in (x, cos, sin, *w.values())}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(x, w, cos, sin)
    y.float().sum().backward()
    return sum(seen.values()) / (B * T)


def planned_compiled(cfg, targets: tuple[str, ...], base: str = "") -> float:
    """The plan's bytes per token of that block: its compiled activation terms + the adapters' share of a layer."""
    spec = LoraSpec(RANK, 2.0 * RANK, 0.0, targets, base)
    adapter = LoraAdapter(cfg, spec)
    block = layer_activation_bytes(cfg, B * T, model_dtype="bf16", compiled=True, **_lora_settings(cfg, spec))
    return block / (B * T) + adapter.layer_saved_bytes_per_token(0, 2) + adapter.layer_saved_bytes(0, 2) / (B * T)


@pytest.mark.parametrize("base", ["", "e4m3"])
@pytest.mark.parametrize("targets", [("q", "v"), ALL])
def test_plan_is_what_a_compiled_lora_block_keeps(targets, base):
    """Compiled over a frozen base: the norm and SwiGLU outputs are kept only for the adapters that read them (q,v:
    qwen2's tiny block keeps 1352 bytes a token, the plan said 1800), and an e4m3 base's weight is dequantized inside
    its ops, so the partitioner keeps the codes, not a model-dtype copy of each block matrix (it kept one: 3280
    bytes a token against 1936 over a bf16 base, all seven targets)."""
    cfg = small_cfg("qwen2")
    assert abs(measure_compiled(cfg, targets, base) - planned_compiled(cfg, targets, base)) <= TOL
