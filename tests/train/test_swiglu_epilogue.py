"""--swiglu-epilogue (kernels/gated_mlp.py; issue 48): the compiled model-dtype MLP as one op whose GEMMs carry the
SwiGLU. Here, on the CPU (its plain-torch twin): where it applies and the one-line refusals of `on` where it does not,
the model with it exact against transformers (fp32: logits, loss, every gradient), `qtrain train` with it (the option
recorded as given: auto decides again on `--continue`), --fit-memory, ZeRO-3. The quack path itself:
tests/kernels/test_gated_mlp.py's GPU test.
"""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from qtrain.cli.main import main
from qtrain.model.transformer import RunOptions, Transformer
from qtrain.model.weights import hf_to_internal, internal_to_hf
from qtrain.options import Options, OptionsError
from qtrain.parallel.weights.replicated import ParamWeights
from qtrain.plan.resolution import resolve_run
from qtrain.train.checkpoint_io import META_FILE
from tests.model.family_fixtures import Collect, cosine
from tests.run_utils import CFG, make_run_root, train_argv

pytest.importorskip("transformers")
from tests.model.test_transformer import hf_model, tiny_cfg  # noqa: E402


def _resolve(cfg=CFG, device="cpu", **kw):
    return resolve_run(cfg, Options(model="x", **kw), device=device).swiglu_epilogue


def test_where_it_applies_and_one_line_where_it_does_not():
    assert _resolve() is False  # auto: the CPU never
    assert _resolve(swiglu_epilogue="on", compile="on") is True  # the twin, for tests
    assert _resolve(swiglu_epilogue="off", compile="on") is False
    refused = {
        "--compile off": dict(compile="off"),
        "the up/down linears run in FP8": dict(compile="on", matmul_dtype="e4m3", fp8_policy="all"),
        "--recompute-swiglu / --recompute-ffn": dict(compile="on", recompute_swiglu=True),
        "LoRA: the base is frozen": dict(compile="on", lora_rank=4),
        "LoRA: the base is frozen (the op": dict(compile="on", lora_rank=4, lora_targets="q,v"),
        "--debug-log-abs-max": dict(compile="on", debug_log_abs_max=2),
    }
    for why, kw in refused.items():
        assert _resolve(**kw) is False, why  # auto: off, silently
        with pytest.raises(OptionsError, match="^--swiglu-epilogue on: " + why.replace("(", r"\(").replace(")", r"\)")
                           .replace("+", r"\+")):
            _resolve(swiglu_epilogue="on", **kw)
    from tests.model.family_fixtures import qwen35_cfg
    with pytest.raises(OptionsError, match="an MoE model: its MLPs are routed experts"):
        _resolve(qwen35_cfg(moe=True), swiglu_epilogue="on", compile="on")
    assert _resolve(qwen35_cfg(), swiglu_epilogue="on", compile="on") is True  # a dense Qwen3.5's MLP takes it
    odd = replace(CFG, intermediate_size=60)
    with pytest.raises(OptionsError, match="intermediate size 60 must be multiples of 8"):
        _resolve(odd, swiglu_epilogue="on", compile="on")
    if not torch.cuda.is_available():  # a plan for a CUDA machine this one is not: `on` as given, auto off
        assert _resolve(device="cuda", swiglu_epilogue="on", compile="on") is True
        assert _resolve(device="cuda", compile="on") is False


def test_on_a_cuda_device_it_needs_bf16_a_hopper_gpu_and_quack(monkeypatch):
    """The device's side, with the CUDA device and quack stood in for (the CPU machine has neither)."""
    import qtrain.kernels.hopper as hopper
    from qtrain.plan.resolution import swiglu_epilogue
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def decide(sm90: bool, lib, **kw) -> bool:
        monkeypatch.setattr(hopper, "hopper_device", lambda device=None: sm90)
        monkeypatch.setattr(hopper, "quack", lambda: lib)
        missing = "" if lib else "ModuleNotFoundError: No module named 'quack'"
        monkeypatch.setattr(hopper, "quack_missing", lambda: missing)
        kw = {"batch_size": 16, "seq_len": 1024, **kw}  # 16,384 tokens a micro-batch: where auto turns it on
        return swiglu_epilogue(CFG, Options(model="x", **kw), "cuda", True, None, frozenset())
    assert decide(True, object()) is True  # auto: on
    assert decide(False, object()) is False and decide(True, None) is False  # auto: off, silently
    # auto: off below SWIGLU_EPILOGUE_MIN_TOKENS tokens a micro-batch (measured slower there); on: as asked
    assert decide(True, object(), batch_size=8) is False and decide(True, object(), batch_size=32, seq_len=512)
    assert decide(True, object(), batch_size=32, context_parallel=2, seq_len=1024) is True
    assert decide(True, object(), batch_size=16, context_parallel=2, seq_len=1024) is False  # a rank's 8,192
    assert decide(True, object(), batch_size=1, swiglu_epilogue="on") is True
    with pytest.raises(OptionsError, match="^--swiglu-epilogue on: needs --model-dtype bf16$"):
        decide(True, object(), swiglu_epilogue="on", model_dtype="fp32")
    with pytest.raises(OptionsError, match=r"^--swiglu-epilogue on: needs a Hopper GPU \(sm90\)$"):
        decide(False, object(), swiglu_epilogue="on")
    with pytest.raises(OptionsError, match=r"^--swiglu-epilogue on: quack-kernels does not import \(ModuleNotFound"
                                           r"Error: No module named 'quack'; pip install 'qtrain\[hopper\]'\)$"):
        decide(True, None, swiglu_epilogue="on")


def test_the_plan_counts_no_swiglu_output():
    opts = Options(model="x", compile="on", batch_size=2, seq_len=16)
    with_it = resolve_run(CFG, replace(opts, swiglu_epilogue="on"), device="cpu").plan
    without = resolve_run(CFG, opts, device="cpu").plan
    tokens, layers, F = 2 * 16, CFG.num_hidden_layers, CFG.intermediate_size
    saved = without.item("activations").device - with_it.item("activations").device
    assert saved == layers * tokens * F * 2  # the SwiGLU output, bf16 (Options' default model dtype)
    assert with_it.settings["swiglu_epilogue"] is True and without.settings["swiglu_epilogue"] is False


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_matches_transformers_fp32(model_type):
    """Compiled blocks with the epilogue MLP (its twin: the same op pair and interleaved layout as on the GPU) against
    HF's model: the bar of the dense families (logits and loss 1e-5 relative, every gradient cosine >= 0.99999)."""
    cfg = tiny_cfg(model_type, False)
    hf = hf_model(cfg, seed=5)
    sd = dict(hf.state_dict())
    params = {n: t.detach().clone().requires_grad_(True) for n, t in hf_to_internal(cfg, lambda k: sd[k])}
    model = Transformer(cfg, RunOptions(compile=True, swiglu_epilogue=True))
    assert model.block_fn is not None
    g = torch.Generator().manual_seed(1)
    inputs, targets = (torch.randint(0, cfg.vocab_size, (2, 32), generator=g) for _ in range(2))
    ref = hf(input_ids=inputs).logits.float()
    ref_loss = torch.nn.functional.cross_entropy(ref.view(-1, cfg.vocab_size), targets.view(-1))
    ref_loss.backward()
    sink = Collect()
    loss = model.forward_backward(ParamWeights(cfg, params), inputs, targets, grads=sink, loss_scale=1 / 64)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    ours = internal_to_hf(cfg, sink.grads)
    for name, p in hf.named_parameters():
        if name in ours:
            assert cosine(ours[name], p.grad) >= 0.99999, name
    assert any("mlp.up_proj" in n for n in ours)


def test_train_records_it_as_given_and_continue_decides_again(tmp_path, capsys):
    """Recorded as given: auto decides again on --continue (a pinned `on` would refuse a resume on a machine without
    quack, for a choice that changes bf16 rounding only)."""
    root = make_run_root(tmp_path)
    argv = train_argv(root, steps=2, name="on", compile="on", extra=("--swiglu-epilogue", "on"))
    assert main(argv) == 0
    meta = json.loads((root / "ckpt" / "on" / "step_00000002" / META_FILE).read_text())
    assert meta["options"]["swiglu_epilogue"] == "on"
    from qtrain.train.resume_checks import pinned_choices
    assert "swiglu_epilogue" not in pinned_choices(meta["options"], Options(model="x"))
    capsys.readouterr()
    assert main(train_argv(root, steps=3, name="on", compile="on",
                           extra=("--continue", "2", "--swiglu-epilogue", "on"))) == 0  # as given: no change
    out = capsys.readouterr()
    assert "--swiglu-epilogue" not in out.out + out.err


def test_on_where_it_does_not_apply_is_one_line_before_anything_is_built(tmp_path, capsys):
    root = make_run_root(tmp_path)
    capsys.readouterr()
    assert main(train_argv(root, steps=2, compile="off", extra=("--swiglu-epilogue", "on"))) == 2
    err = capsys.readouterr().err.strip()
    assert err == "qtrain: error: --swiglu-epilogue on: --compile off: the MLP runs as three steps", err
    assert not any((root / d).exists() for d in ("ckpt", "out", "logs"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_compiled_bf16_model_with_quack_agrees_with_the_three_steps():
    """On a Hopper GPU with quack: a compiled bf16 model's loss and gradients with the epilogue MLP against the same
    model without it. Both round in bf16 at different places (the SwiGLU output from the fp32 accumulator or from
    the rounded GEMM output; other GEMM kernels), so the bar is bf16's: loss within 1e-2 relative, each gradient's
    cosine >= 0.999 (the dense families' bf16 GPU tests' bar)."""
    from qtrain.kernels.hopper import hopper_device, quack, quack_missing
    if not (hopper_device() and quack() is not None):
        pytest.skip(f"needs a Hopper GPU and quack-kernels ({quack_missing() or 'no sm90 GPU'})")
    from qtrain.model.llama import LlamaConfig
    cfg = LlamaConfig(model_type="qwen2", vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attention_bias=True, tie_word_embeddings=False)
    g = torch.Generator().manual_seed(0)
    from qtrain.model.weights import param_shapes
    gains = ("ln1", "ln2", "norm")  # RMSNorm gains near 1, the rest small
    params = {n: (0.02 * torch.randn(s, generator=g) + (1.0 if n.split(".")[-1] in gains else 0.0)).cuda()
              .bfloat16().requires_grad_() for n, s in param_shapes(cfg).items()}
    inputs, targets = (torch.randint(0, cfg.vocab_size, (4, 256), generator=g).cuda() for _ in range(2))
    out = []
    for on in (False, True):
        sink = Collect()
        model = Transformer(cfg, RunOptions(compile=True, swiglu_epilogue=on))
        loss = model.forward_backward(ParamWeights(cfg, params), inputs, targets, grads=sink, loss_scale=1 / 1024)
        out.append((loss.float().item(), {k: v.float() for k, v in sink.grads.items()}))
    assert abs(out[1][0] - out[0][0]) <= 1e-2 * abs(out[0][0])
    for k, ref in out[0][1].items():
        assert cosine(out[1][1][k], ref) >= 0.999, k


def test_fit_memory_keeps_the_epilogue_mlp_whole(monkeypatch):
    """--fit-memory never splits the MLP of a run that asks for the epilogue (`on`): at Qwen2.5-1.5B 32 x 1024 on
    an 80 GB device the three-step MLP needs --recompute-swiglu --recompute-norm (as measured on the H100, session 34),
    the epilogue MLP keeps no SwiGLU output and fits as given; on a smaller device its changes leave SwiGLU whole.
    The device is a Hopper GPU with quack here by stand-in (the CPU has neither); the plan is arithmetic."""
    import qtrain.kernels.hopper as hopper
    from qtrain.model.registry import preset
    monkeypatch.setattr(hopper, "hopper_device", lambda device=None: True)
    monkeypatch.setattr(hopper, "quack", lambda: object())
    cfg = preset("Qwen2.5-1.5B")
    opts = Options(model="Qwen2.5-1.5B", batch_size=32, seq_len=1024, grad_accumulation=2, lmhead_chunks=4,
                   opt_m_dtype="bf16", opt_v_dtype="bf16")

    def changes(gib: float, **kw) -> dict:
        run = resolve_run(cfg, replace(opts, **kw), device="cuda", gpu_memory=int(gib * 2**30))
        return dict(run.memory_changes), run.swiglu_epilogue
    off, used = changes(79.18, swiglu_epilogue="off")
    assert off.get("recompute_swiglu") and not used
    assert changes(79.18, swiglu_epilogue="on") == ({}, True)
    tight, used = changes(50.0, swiglu_epilogue="on")
    assert tight and used and not (tight.get("recompute_swiglu") or tight.get("recompute_ffn")), tight


@pytest.mark.slow  # ~50 s: two compiles of the hybrid block on the CPU (the llama tests above cover the op in CI)
def test_a_dense_qwen3_5_with_it_equals_the_compiled_three_steps_fp32():
    """Qwen3.5's dense MLP takes the epilogue op too (its block's one-function MLP). Compiled on the CPU, Qwen3.5
    itself is 2.3e-5 from transformers' logits with or without the op (inductor's fp32 kernels; the eager family
    meets 1e-5 in tests/model/test_qwen3_5.py), so the op is checked against the compiled three steps: loss 1e-5
    relative, every gradient cosine >= 0.99999 (fp32: reduction order only)."""
    from tests.model.family_fixtures import hf_state, qwen35_cfg, qwen35_hf_model
    cfg = qwen35_cfg()
    sd = hf_state(qwen35_hf_model(cfg))
    params = {n: t.detach().clone().requires_grad_(True) for n, t in hf_to_internal(cfg, lambda k: sd[k])}
    g = torch.Generator().manual_seed(1)
    inputs, targets = (torch.randint(0, cfg.vocab_size, (2, 40), generator=g) for _ in range(2))
    out = []
    for on in (False, True):
        sink = Collect()
        loss = Transformer(cfg, RunOptions(compile=True, swiglu_epilogue=on)).forward_backward(
            ParamWeights(cfg, params), inputs, targets, grads=sink, loss_scale=1 / 80)
        out.append((loss.item(), sink.grads))
    assert abs(out[1][0] - out[0][0]) <= 1e-5 * abs(out[0][0])
    assert set(out[0][1]) == set(out[1][1])
    for k, ref in out[0][1].items():
        assert cosine(out[1][1][k], ref) >= 0.99999, k


def _sharded_worker(rank: int, world: int, model_dir: str) -> dict:
    from qtrain.parallel.dist import DistContext
    from qtrain.train.trainer import Trainer
    from tests.dist_utils import random_batch, train_steps
    ctx = DistContext(rank=rank, world=world, local_rank=rank, device=torch.device("cpu"))
    out = {}
    for name, kw in (("zero2", dict(zero_level=2)), ("zero3", dict(zero_level=3))):
        opts = Options(model=model_dir, from_scratch=True, device="cpu", compile="on", swiglu_epilogue="on", seed=5,
                       model_dtype="fp32", opt_m_dtype="fp32", opt_v_dtype="fp32", batch_size=2, seq_len=16,
                       grad_accumulation=2, learning_rate=3e-3, **kw)
        tr = Trainer(opts, ctx)
        assert tr.run.swiglu_epilogue
        batch = lambda step, micro, r: random_batch(CFG.vocab_size, 2, 16, step, micro, r)  # noqa: E731
        out[name] = train_steps(tr, range(2), batch, 2, 3e-3)
    return out


def test_sharded_weights_train_bitwise_like_replicated_ones_with_it(tmp_path):
    """The op saves the up and down weights for its backward; with sharded weights (ZeRO-3) those are views of the
    two rotating gather slots, which the weights' saved-tensor hooks keep as (slot, layer, version) handles and check
    when the backward (after gathering the layer again) unpacks them, as for a linear's saved weight: a slot holding
    another layer would raise there, other values would change the bits. ZeRO-3 trains bit for bit as ZeRO-2 (2 gloo
    ranks, compiled blocks, fp32), the bar of tests/parallel/weights/test_sharded_layers.py."""
    from tests.dist_utils import run_distributed, write_model_dir
    # three layers, two slots: layer 2's gather reuses layer 0's slot before layer 0's backward
    results = run_distributed(_sharded_worker, 2, write_model_dir(tmp_path, replace(CFG, num_hidden_layers=3)))
    for rank in results:
        for a, b in zip(rank["zero2"], rank["zero3"]):
            assert (a["loss"], a["norm"]) == (b["loss"], b["norm"])
            for k in a["weights"]:
                assert torch.equal(a["weights"][k], b["weights"][k]), k
