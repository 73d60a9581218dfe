"""--use-cuda-graphs (qtrain/train/cuda_graphs.py): what it refuses, before the model is built; that the SR key
table it trains with gives the scalar path's bits (CPU, through the Trainer); and on a GPU that losses, norms
and weights are bitwise those of the same run without graphs (bf16 at grad accumulation 1 and 3, an fp32
master, e4m3 linears, and masked targets whose loss scale changes between steps).
"""
from __future__ import annotations

import pytest
import torch

from qtrain.model.config import ModelConfig
from qtrain.options import Options, OptionsError
from qtrain.parallel.dist import DistContext
from qtrain.train.cuda_graphs import check_cuda_graphs, status
from qtrain.train.preflight import preflight
from qtrain.train.trainer import Trainer
from tests.dist_utils import full_params_cpu
from tests.triton_interp import needs_cuda

CFG = ModelConfig(model_type="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0,
                  tie_word_embeddings=False, attention_bias=True, bos_token_id=None, eos_token_id=None)
B, T, LR = 2, 16, 3e-3


def options(model_dir: str, **kw) -> Options:
    base = dict(model=model_dir, from_scratch=True, seed=5, model_dtype="bf16", batch_size=B, seq_len=T,
                grad_accumulation=3, learning_rate=LR, memory_check=False)
    return Options(**{**base, **kw})


# ---- refusals ------------------------------------------------------------------------------------------
REFUSED = {
    "zero3": ({"zero_level": 3}, "sharded weights"),
    "shard-weights": ({"shard_weights": True}, "sharded weights"),
    "zero2": ({"zero_level": 2}, "sharded gradients"),
    "offload-opt-m": ({"offload_opt_m": True}, "--offload-opt-m"),
    "offload-residual": ({"recompute_block": True, "offload_residual": True}, "--offload-residual"),
    "offload-gradients": ({"shard_gradients": True, "offload_gradients": True}, "--offload-gradients"),
    "persistent-quants": ({"matmul_dtype": "e4m3", "persistent_quants": True}, "--persistent-quants"),
    "abs-max": ({"debug_log_abs_max": 1}, "--debug-log-abs-max"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refuses_what_it_cannot_capture(name):
    kw, says = REFUSED[name]
    opts = Options(model="m", use_cuda_graphs=True, **kw).validate()
    with pytest.raises(OptionsError, match=f"--use-cuda-graphs does not support .*{says}"):
        check_cuda_graphs(opts, world=1, device_type="cuda")
    check_cuda_graphs(opts, world=1, device_type="cpu")  # no CUDA: graphs are not used, nothing to refuse
    check_cuda_graphs(Options(model="m", **kw).validate(), world=1, device_type="cuda")  # without the option


def test_refuses_several_processes_and_names_every_blocker():
    opts = Options(model="m", use_cuda_graphs=True, zero_level=3, offload_opt_v=True).validate()
    with pytest.raises(OptionsError) as e:
        check_cuda_graphs(opts, world=2, device_type="cuda")
    assert all(s in str(e.value) for s in ("2 processes", "sharded weights", "--offload-opt-v"))


@pytest.mark.parametrize("kw", [{}, {"matmul_dtype": "e4m3"}, {"master_dtype": "fp32"}, {"recompute_ffn": True},
                                {"recompute_block": True}, {"grad_accumulation": 1}])
def test_accepts_its_scope(kw):
    check_cuda_graphs(Options(model="m", use_cuda_graphs=True, **kw).validate(), world=1, device_type="cuda")


def test_preflight_refuses_before_anything_is_built(tmp_path):
    """The option check comes before the device check: a CPU-only machine says the same as the GPU one."""
    opts = Options(model=str(tmp_path / "no-such-model"), device="cuda", use_cuda_graphs=True, zero_level=3)
    with pytest.raises(OptionsError, match="--use-cuda-graphs does not support sharded weights"):
        preflight(opts, world=1)


def test_status_line():
    assert status(Options(model="m"), "cuda") is None
    assert "no CUDA device" in status(Options(model="m", use_cuda_graphs=True), "cpu")
    assert "captured in CUDA graphs" in status(Options(model="m", use_cuda_graphs=True), "cuda")


# ---- training: key table (CPU) and graphs (GPU) -----------------------------------------------------------
def batch(step: int, micro: int, *, masked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + micro)
    seq = torch.randint(0, CFG.vocab_size, (B, T + 1), generator=gen)
    inputs, targets = seq[:, :-1].clone(), seq[:, 1:].clone()
    if masked:  # a different number of valid targets per step: another loss scale
        targets.view(-1)[:step % 3] = -100
    return inputs, targets


def train(tr: Trainer, steps: int, *, masked: bool = False) -> list[dict]:
    out = []
    for s in range(steps):
        stats = tr.step([batch(s, m, masked=masked) for m in range(tr.opts.grad_accumulation)], lr=LR)
        out.append({"loss": stats["loss"], "norm": stats["norm"], "weights": full_params_cpu(tr)})
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_bitwise(a: list[dict], b: list[dict], what: str) -> None:
    for s, (x, y) in enumerate(zip(a, b, strict=True)):
        assert (x["loss"], x["norm"]) == (y["loss"], y["norm"]), (what, s, x["loss"], y["loss"], x["norm"], y["norm"])
        for k in x["weights"]:
            assert torch.equal(bits(x["weights"][k]), bits(y["weights"][k])), (what, k, s)


def test_key_table_trains_bitwise_like_the_scalar_keys_on_cpu(model_dir):
    """The gradient manager of a graph run (SR keys from the device table, refilled per micro-step) trains a
    bf16 model with SR-accumulated bf16 gradients bit for bit like the scalar-key path."""
    ctx = DistContext(rank=0, world=1, local_rank=0, device=torch.device("cpu"))
    opts = options(model_dir, device="cpu", compile="off")
    want = train(Trainer(opts, ctx), 2)
    tr = Trainer(opts, ctx)
    tr.grads.use_key_table()
    assert_bitwise(want, train(tr, 2), "key table on CPU")


GPU_CASES = {
    "bf16-ga1": {"grad_accumulation": 1},
    "bf16-ga3": {},
    "fp32-master-ga3": {"master_dtype": "fp32"},
    "e4m3-ga3": {"matmul_dtype": "e4m3", "fp8_policy": "all"},
    "bf16-ga3-recompute-ffn": {"recompute_ffn": True},
}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_graphs_train_bitwise_like_eager(model_dir, name):
    ctx = DistContext(rank=0, world=1, local_rank=0, device=torch.device("cuda"))
    kw = {"device": "cuda", **GPU_CASES[name]}
    want = train(Trainer(options(model_dir, **kw), ctx), 5)
    tr = Trainer(options(model_dir, use_cuda_graphs=True, **kw), ctx)
    got = train(tr, 5)
    phases = min(tr.opts.grad_accumulation, 3)
    assert tr.graphs is not None and tr.graphs.captures == phases and tr.graphs.replays > 0, vars(tr.graphs)
    assert_bitwise(want, got, name)


@pytest.mark.gpu
@needs_cuda
def test_gpu_another_loss_scale_runs_eagerly_with_the_same_bits(model_dir):
    """Masked targets change the loss scale (a GEMM alpha the graphs bake in): those micro-steps run eagerly."""
    ctx = DistContext(rank=0, world=1, local_rank=0, device=torch.device("cuda"))
    want = train(Trainer(options(model_dir, device="cuda"), ctx), 6, masked=True)
    tr = Trainer(options(model_dir, device="cuda", use_cuda_graphs=True), ctx)
    got = train(tr, 6, masked=True)
    assert tr.graphs.eager_other_scale > 0 and tr.graphs.replays > 0, vars(tr.graphs)
    assert_bitwise(want, got, "masked")


@pytest.mark.gpu
@needs_cuda
def test_gpu_cli_run_with_evaluations_logs_how_the_micro_steps_ran(model_dir, tmp_path, monkeypatch):
    """`qtrain train --use-cuda-graphs` end to end: evaluations and the time breakdown between replayed steps,
    the log says graphs are on and how many micro-steps replayed, and the losses are those of the same run
    without graphs."""
    import numpy as np

    from qtrain.cli.main import main
    from qtrain.data.token_files import write_token_file
    from qtrain.observe.log import read_log

    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    write_token_file("train.bin", rng.integers(0, CFG.vocab_size, 4000), vocab_size=CFG.vocab_size)
    write_token_file("eval.bin", rng.integers(0, CFG.vocab_size, 400), vocab_size=CFG.vocab_size)
    common = ["train", "--model", model_dir, "--from-scratch", "--train-file", "train.bin", "--eval-file", "eval.bin",
              "--steps", "6", "--eval-every-n-steps", "2", "--eval-num-steps", "1", "--seq-len", str(T),
              "--batch-size", str(B), "--grad-accumulation", "2", "--device", "cuda", "--gpus", "1",
              "--debug-time-breakdown", "--no-save-training-state"]
    logs = {}
    for name, extra in (("eager", []), ("graphs", ["--use-cuda-graphs"])):
        assert main([*common, *extra, "--log-file", f"{name}.jsonl", "--out-dir", f"out-{name}",
                     "--checkpoint-dir", f"ckpt-{name}"]) == 0
        logs[name] = read_log(f"{name}.jsonl")
    losses = {n: [(e["step"], e["loss"]) for e in ev if e["log"] in ("step", "eval")] for n, ev in logs.items()}
    assert losses["graphs"] == losses["eager"] and len(losses["eager"]) >= 6
    messages = [e["message"] for e in logs["graphs"] if e["log"] == "message"]
    assert any("captured in CUDA graphs" in m for m in messages)
    assert any("2 graphs captured, 8 micro-steps replayed, 0 run eagerly" in m for m in messages), messages
    assert not any("--use-cuda-graphs" in e["message"] for e in logs["eager"] if e["log"] == "message")
