"""--delta-rule-precision from the model's run options to the Triton delta rule's launchers, on the CPU: each value is
`TUNED` with its products' precision (`gated_delta_rule_triton.launch_for`), both ops of the pair take it as an
argument of their schema, and a Qwen3.5 model built with it hands it to both launchers, the forward's and the
backward's, eager and in a torch.compile'd block, which stays one graph (the string is a constant of the graph, the op
opaque). The GPU's path is forced as tests/model/test_qwen3_5_compiled_memory.py forces it: the delta rule through its
op pair, whose launchers are replaced by recorders that run the twins (the Triton kernels need CUDA or the
interpreter: tests/kernels/test_gated_delta_rule_triton.py runs them at both precisions).
"""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from qtrain.kernels.delta_rule import CHUNK, causal_conv1d_silu_twin, gated_delta_rule_op
from qtrain.kernels.delta_rule.gated_delta_rule import chunk_core
from qtrain.kernels.delta_rule.gated_delta_rule_backward import chunk_core_backward
from qtrain.kernels.delta_rule.gated_delta_rule_triton import DEFAULT_PRECISION, PRECISIONS, TUNED, Launch, launch_for
from qtrain.kernels.rope import rope_tables
from qtrain.model.choices import AUTO_DELTA_RULE_PRECISION, DELTA_RULE_PRECISIONS
from qtrain.model.init import init_params
from qtrain.model.recompute import block_steps, resolve_flags
from qtrain.model.transformer import RunOptions, Transformer, allocate_params, make_block_fn
from qtrain.options import Options
from qtrain.parallel.weights.replicated import ParamWeights
from qtrain.plan.resolution import delta_rule_precision
from tests.model.family_fixtures import Collect, qwen35_cfg, qwen35_hf_model

B, T = 2, 2 * CHUNK
# a linear-attention layer and a full-attention one, heads the Triton delta rule serves (TRITON_HEAD_DIM_MIN)
SHAPE = dict(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"), linear_key_head_dim=32,
             linear_value_head_dim=32)


def test_each_precision_is_the_tuned_launch_with_its_products():
    assert set(PRECISIONS) == set(DELTA_RULE_PRECISIONS)  # the option's values (no torch there) and the kernels'
    assert DEFAULT_PRECISION == RunOptions().delta_rule_precision == "fp32"  # the model API's: the exact one
    # a run's: auto, resolved once to one pass (measured as fast as that and as good on a whole run: choices.py)
    assert Options().delta_rule_precision == "auto" and AUTO_DELTA_RULE_PRECISION == "tf32"
    assert [delta_rule_precision(Options(delta_rule_precision=p)) for p in ("auto", "fp32", "tf32")] == [
        "tf32", "fp32", "tf32"]
    assert launch_for("fp32") == TUNED and TUNED.prec == "tf32x3"  # three TF32 passes, as before the option
    assert launch_for("tf32") == Launch(bv=TUNED.bv, num_warps=TUNED.num_warps, prec="tf32")  # one pass
    with pytest.raises(ValueError, match="'bf16'"):
        launch_for("bf16")
    with pytest.raises(ValueError, match="delta_rule_precision"):
        RunOptions(delta_rule_precision="tf16")


def test_both_ops_take_the_precision_in_their_schema():
    for op in (torch.ops.qtrain.gated_delta_rule_chunks_fwd.default,
               torch.ops.qtrain.gated_delta_rule_chunks_bwd.default):
        arg = op._schema.arguments[-1]
        assert arg.name == "precision" and str(arg.type) == "str", op._schema


@pytest.fixture
def launches(monkeypatch) -> list[tuple[str, str]]:
    """The model's delta rule through its op pair as on CUDA, its launchers recorders that run the twins: (forward or
    backward, the products' precision of the Launch they got) per call."""
    seen: list[tuple[str, str]] = []

    def forward(q, k, v, g, beta, d, S0, tune: Launch):
        seen.append(("fwd", tune.prec))
        o, S = chunk_core(q, k, v, g, beta, d, S0)
        return o, S.clone()

    def backward(q, k, v, g, beta, d, S0, do, dSf, tune: Launch):
        seen.append(("bwd", tune.prec))
        return chunk_core_backward(q, k, v, g, beta, d, S0, do, dSf)

    monkeypatch.setattr("qtrain.kernels.delta_rule.use_triton", lambda t: True)  # the model's entry: the op pair
    monkeypatch.setattr(gated_delta_rule_op, "use_triton", lambda t: True)  # the op: its launchers
    monkeypatch.setattr(gated_delta_rule_op, "chunk_core_triton", forward)
    monkeypatch.setattr(gated_delta_rule_op, "chunk_core_backward_triton", backward)
    return seen


@pytest.mark.parametrize("precision", DELTA_RULE_PRECISIONS)
def test_the_model_hands_its_precision_to_both_launchers(launches, precision):
    cfg = qwen35_cfg(**SHAPE)
    params = allocate_params(cfg, dtype=torch.float32, device="cpu")
    init_params(cfg, params)
    model = Transformer(cfg, RunOptions(delta_rule_precision=precision))
    g = torch.Generator().manual_seed(0)
    inputs, targets = (torch.randint(0, cfg.vocab_size, (B, T), generator=g) for _ in range(2))
    sink = Collect()
    loss = model.forward_backward(ParamWeights(cfg, params), inputs, targets, grads=sink, loss_scale=1.0 / (B * T))
    assert torch.isfinite(loss) and sink.grads
    assert launches == [("fwd", PRECISIONS[precision]), ("bwd", PRECISIONS[precision])]  # one linear layer


@pytest.mark.parametrize("recompute", [(), ("att",)])
def test_a_compiled_block_stays_one_graph_and_launches_at_its_precision(launches, monkeypatch, recompute):
    """Layer 0 (linear attention) compiled with full graph (a graph break raises) through AOTAutograd, forward and
    backward: one graph, and every launch at tf32 (with --recompute-att the forward runs again in the backward)."""
    monkeypatch.setattr("qtrain.model.qwen3_5.linear_attention.causal_conv1d_silu", causal_conv1d_silu_twin)
    cfg = qwen35_cfg(**SHAPE)
    fn = make_block_fn(cfg, recompute=block_steps(resolve_flags(recompute)), compiled=True, swiglu="kernel",
                       rope="kernel", delta_rule_precision="tf32")
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=False)
    params = allocate_params(cfg, dtype=torch.float32, device="cpu")
    init_params(cfg, params)
    w = {k.split(".", 2)[2]: v.requires_grad_() for k, v in params.items() if k.startswith("layers.0.")}
    cos, sin = rope_tables(cfg, T, "cpu", torch.float32)
    x = torch.randn(B, T, cfg.hidden_size, requires_grad=True)
    for _ in range(2):  # a second call reuses the graph
        compiled(x, w, cos, sin).sum().backward()
    assert counter.frame_count == 1
    assert {p for _, p in launches} == {"tf32"}
    assert [k for k, _ in launches].count("bwd") == 2 and [k for k, _ in launches].count("fwd") == (4 if recompute
                                                                                                    else 2)


@pytest.mark.parametrize("given, launched", [("auto", "tf32"), ("fp32", "fp32"), ("tf32", "tf32")])
def test_qtrain_eval_runs_the_delta_rule_at_the_given_precision(launches, tmp_path, given, launched):
    """`qtrain eval --delta-rule-precision` reaches the forward launcher as training's option does (auto: training's
    default), and the loss is the model's whatever the precision (the recorders run the exact twins)."""
    import numpy as np

    from qtrain.cli.main import main
    from qtrain.data.token_files import write_token_file

    cfg = qwen35_cfg(**SHAPE)
    qwen35_hf_model(cfg, seed=1).save_pretrained(tmp_path / "model")
    write_token_file(tmp_path / "eval.bin", np.random.default_rng(0).integers(0, cfg.vocab_size, B * T + 1),
                     vocab_size=cfg.vocab_size)
    argv = ["eval", "--model", str(tmp_path / "model"), "--eval-file", str(tmp_path / "eval.bin"), "--seq-len",
            str(T), "--batch-size", str(B), "--device", "cpu", "--delta-rule-precision", given]
    assert main(argv) == 0
    assert launches == [("fwd", PRECISIONS[launched])]  # one batch, one linear-attention layer, no backward


def test_qtrain_eval_refuses_the_option_for_a_model_without_delta_rule(tmp_path, capsys):
    """An explicit value on a dense model is refused in one line naming the option, before any weight loads."""
    from qtrain.cli.main import main
    from tests.hf_fixtures import save_tiny_hf_model

    model_dir = save_tiny_hf_model("qwen2", tmp_path / "model")
    (model_dir / "model.safetensors").write_bytes(b"not a safetensors file")  # loading it would fail otherwise
    capsys.readouterr()  # what saving it printed
    code = main(["eval", "--model", str(model_dir), "--eval-file", str(tmp_path / "missing.bin"),
                 "--delta-rule-precision", "fp32", "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and "--delta-rule-precision fp32" in err[0] and "qwen2" in err[0], err
