"""--use-cuda-graphs (qtrain/train/cuda_graphs.py): what it refuses, before the model is built; that the SR key
table it trains with gives the scalar path's bits (CPU, through the Trainer); and on a GPU that losses, norms
and weights are bitwise those of the same run without graphs (bf16 at grad accumulation 1 and 3, an fp32
master, e4m3 linears, and masked targets whose loss scale changes between steps).
"""
from __future__ import annotations

import pytest
import torch

from qtrain.model.llama import LlamaConfig
from qtrain.model.registry import preset
from qtrain.options import Options, OptionsError
from qtrain.parallel.dist import DistContext
from qtrain.plan.resolution import check_cuda_graphs, cuda_graphs_on
from qtrain.train.cuda_graphs import GraphSchedule, status
from qtrain.train.preflight import preflight
from qtrain.train.trainer import Trainer
from tests.dist_utils import full_params_cpu
from tests.triton_interp import needs_cuda

CFG = LlamaConfig(model_type="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
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
    assert status(Options(model="m"), "cuda", on=False) is None  # unset and off (a GPU-bound micro-step)
    assert status(Options(model="m", use_cuda_graphs=False), "cuda", on=False) is None
    assert "no CUDA device" in status(Options(model="m", use_cuda_graphs=True), "cpu", on=False)
    given = status(Options(model="m", use_cuda_graphs=True), "cuda", on=True)
    assert "(given)" in given and "captured in CUDA graphs" in given and "hung" not in given
    auto = status(Options(model="m"), "cuda", on=True)
    assert "(auto:" in auto and "--no-use-cuda-graphs" in auto
    assert "cold-compile start hung" in status(Options(model="m", use_cuda_graphs=True), "cuda", on=True,
                                               fp8_linears=True)


# ---- the default: on where graphs were measured faster -----------------------------------------------------
def graphs_on(size: str, batch: int, *, world: int = 1, device_type: str = "cuda", **kw) -> bool:
    opts = Options(model=f"Qwen2.5-{size}", seq_len=1024, batch_size=batch, **kw).validate()
    return cuda_graphs_on(preset(f"Qwen2.5-{size}"), opts, world=world, device_type=device_type)


def test_unset_turns_graphs_on_only_where_they_were_measured_faster():
    """Unset, graphs run where the session-9 runs measured them faster: one process, nothing blocking them, no
    FP8 linear, a block's GEMM work per micro-step at most CUDA_GRAPHS_AUTO_MAX_BLOCK_GFLOP (Qwen2.5-0.5B at
    micro-batch 4, 16 and 32 x 1024: 366, 1466 and 2931 GFLOP, measured 2.90x, 1.027x, 1.009x)."""
    from qtrain.model.fp8_policy import block_gflop
    from qtrain.plan.resolution import CUDA_GRAPHS_AUTO_MAX_BLOCK_GFLOP as LIMIT
    gflop = {(s, b): block_gflop(preset(f"Qwen2.5-{s}"), b * 1024) for s, b in
             (("0.5B", 4), ("0.5B", 32), ("0.5B", 64), ("1.5B", 4), ("1.5B", 32))}
    assert gflop[("0.5B", 32)] <= LIMIT < gflop[("0.5B", 64)] and gflop[("1.5B", 4)] <= LIMIT < gflop[("1.5B", 32)]
    assert graphs_on("0.5B", 4) and graphs_on("0.5B", 32) and graphs_on("1.5B", 4)
    assert not graphs_on("0.5B", 64) and not graphs_on("1.5B", 32)  # the GPU sets the pace there: not measured
    assert not graphs_on("0.5B", 4, device_type="cpu")
    assert not graphs_on("0.5B", 4, world=2)
    assert not graphs_on("0.5B", 4, offload_opt_m=True) and not graphs_on("0.5B", 4, zero_level=3)
    assert not graphs_on("0.5B", 4, use_cuda_graphs=False)
    assert not graphs_on("0.5B", 4, debug_log_allocations=64)  # a debugging run that locates allocations
    # e4m3: off where a linear runs in FP8 (0.5B at 32 x 1024 puts all four there), on where auto keeps bf16
    assert not graphs_on("0.5B", 32, matmul_dtype="e4m3") and graphs_on("0.5B", 4, matmul_dtype="e4m3")
    # given: on wherever it can run (what it cannot capture is refused by check_cuda_graphs, not turned off)
    assert graphs_on("1.5B", 32, use_cuda_graphs=True) and graphs_on("0.5B", 32, matmul_dtype="e4m3",
                                                                       use_cuda_graphs=True)
    assert not graphs_on("1.5B", 32, use_cuda_graphs=True, device_type="cpu")


def test_the_option_parses_as_on_off_or_unset(tmp_path):
    from qtrain.cli.main import build_parser
    from qtrain.cli.options import options_from_args
    def parse(*a: str) -> Options:
        return options_from_args(build_parser().parse_args(["train", *a]))
    assert parse().use_cuda_graphs is None
    assert parse("--use-cuda-graphs").use_cuda_graphs is True
    assert parse("--no-use-cuda-graphs").use_cuda_graphs is False
    for text, want in (("true", True), ("false", False), ('"auto"', None)):
        cfg = tmp_path / f"c-{want}.toml"
        cfg.write_text(f"use_cuda_graphs = {text}\n")
        assert parse("--config", str(cfg)).use_cuda_graphs is want
    cfg = tmp_path / "bad.toml"
    cfg.write_text('use_cuda_graphs = "yes"\n')
    with pytest.raises(OptionsError, match=r"bad.toml: option 'use_cuda_graphs' must be true, false or \"auto\""):
        parse("--config", str(cfg))


# ---- training: key table (CPU) and graphs (GPU) -----------------------------------------------------------
def batch(step: int, micro: int, *, masked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + micro)
    seq = torch.randint(0, CFG.vocab_size, (B, T + 1), generator=gen)
    inputs, targets = seq[:, :-1].clone(), seq[:, 1:].clone()
    if masked:  # a different number of valid targets per step: another loss scale
        targets.view(-1)[:step % 3] = -100
    return inputs, targets


def train(tr: Trainer, steps: int, *, masked: bool = False, short: tuple[int, ...] = ()) -> list[dict]:
    """`steps` steps; those in `short` on half-length sequences."""
    out = []
    for s in range(steps):
        micro = [batch(s, m, masked=masked) for m in range(tr.opts.grad_accumulation)]
        if s in short:
            micro = [(x[:, :T // 2].contiguous(), y[:, :T // 2].contiguous()) for x, y in micro]
        stats = tr.step(micro, lr=LR)
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


def simulate(schedule_steps: list[list[tuple[bool, float]]], release_on_eager: bool = False) -> list[list[str]]:
    """`GraphSchedule`'s answer for each micro-step of each step; a micro-step is (fits, loss scale)."""
    sched = GraphSchedule(release_on_eager)
    out = []
    for micro in schedule_steps:
        n = len(micro)
        out.append([sched.next((i == 0, i == n - 1), fits=f, loss_scale=ls) for i, (f, ls) in enumerate(micro)])
    return out


@pytest.mark.parametrize("ga", [1, 2, 3, 4, 6])
def test_schedule_warms_up_the_whole_first_step_and_never_after_a_capture(ga):
    """The order on the CPU (the GPU tests below run it): the first step all eager warm-up; the second captures each
    phase of the step once ((first), (middle), (last): at most three) and replays a phase seen again; later steps only
    replay. No warm-up after a capture: a warm-up beside the graphs' pool needs a second micro-step's memory, and an
    H100 ran out of it so at Qwen2.5-0.5B 32 x 4 (session 32)."""
    steps = simulate([[(True, 1.0)] * ga for _ in range(4)])
    assert steps[0] == ["warm-up"] * ga
    phases = min(ga, 3)
    assert steps[1].count("capture") == phases and steps[1].count("replay") == ga - phases
    assert all(how == "replay" for step in steps[2:] for how in step)
    flat = [how for step in steps for how in step]
    assert "warm-up" not in flat[flat.index("capture"):]


def test_schedule_runs_other_shapes_and_scales_eagerly_beside_the_graphs():
    """A micro-batch of another shape or another loss scale runs eagerly at any point (its counts), and does not end
    the warm-up of a first step; a first step whose last micro-step has another shape leaves the warm-up open."""
    steps = simulate([[(True, 1.0), (False, 1.0)], [(True, 1.0), (True, 1.0)], [(True, 1.0), (True, 2.0)],
                      [(True, 1.0), (True, 1.0)]])
    assert steps == [["warm-up", "other-shape"], ["warm-up", "warm-up"], ["capture", "other-scale"],
                     ["replay", "capture"]]
    # a middle micro-step of another shape in the first step: the step was not all warm-up, so the second warms up
    # whole and no warm-up runs after a capture (the reviewer's case: capture, warm-up, capture)
    middle = simulate([[(True, 1.0), (False, 1.0), (True, 1.0)]] + [[(True, 1.0)] * 3] * 3)
    assert middle[1] == ["warm-up"] * 3 and middle[2] == ["capture", "capture", "capture"]
    flat = [how for step in middle for how in step]
    assert "warm-up" not in flat[flat.index("capture"):]


def test_schedule_on_by_default_releases_the_graphs_at_the_first_eager_micro_step_after_a_capture():
    """Unset (on by default), the first micro-step of another loss scale or shape after a capture ends the graphs:
    masked targets change the scale nearly every step, so they would rarely replay while their pool held a
    micro-step's memory beside the eager ones' (not in the plan). Before any capture such a micro-step changes
    nothing; given, the graphs stay (the test above)."""
    masked = [[(True, 1.0)] * 2, [(True, 1.0)] * 2, [(True, 0.5)] * 2, [(True, 1.0)] * 2]
    assert simulate(masked, release_on_eager=True) == [["warm-up"] * 2, ["capture"] * 2, ["release", "off"],
                                                       ["off", "off"]]
    early = [[(False, 1.0), (True, 1.0)], [(True, 1.0)] * 2, [(True, 1.0)] * 2, [(True, 1.0)] * 2]
    assert simulate(early, release_on_eager=True) == [["other-shape", "warm-up"], ["warm-up", "warm-up"],
                                                      ["capture", "capture"], ["replay", "replay"]]
    assert simulate(masked) == [["warm-up"] * 2, ["capture"] * 2, ["other-scale"] * 2, ["replay"] * 2]


GPU_CASES = {
    "bf16-ga1": {"grad_accumulation": 1},
    "bf16-ga3": {},
    "fp32-master-ga3": {"master_dtype": "fp32"},
    "e4m3-ga3": {"matmul_dtype": "e4m3", "fp8_policy": "all"},
    "e4m3-ga3-fp8-head": {"matmul_dtype": "e4m3", "fp8_policy": "all", "fp8_head_backward": True},
    "bf16-ga3-recompute-ffn": {"recompute_ffn": True},
    # the MLP's SwiGLU in quack's GEMM epilogues (kernels/gated_mlp.py), both ways: the default with quack installed
    "bf16-ga3-swiglu-epilogue": {"swiglu_epilogue": "on"},
    "bf16-ga3-no-swiglu-epilogue": {"swiglu_epilogue": "off"},
}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_graphs_train_bitwise_like_eager(model_dir, name):
    ctx = DistContext(rank=0, world=1, local_rank=0, device=torch.device("cuda"))
    kw = {"device": "cuda", **GPU_CASES[name]}
    if kw.get("swiglu_epilogue") == "on":
        from qtrain.kernels.hopper import hopper_device, quack, quack_missing
        if not (hopper_device() and quack() is not None):
            pytest.skip(f"needs a Hopper GPU and quack-kernels ({quack_missing() or 'no sm90 GPU'})")
    want = train(Trainer(options(model_dir, use_cuda_graphs=False, **kw), ctx), 5)
    tr = Trainer(options(model_dir, use_cuda_graphs=True, **kw), ctx)
    got = train(tr, 5)
    phases = min(tr.opts.grad_accumulation, 3)
    assert tr.graphs is not None and tr.graphs.schedule.captures == phases and tr.graphs.schedule.replays > 0, vars(tr.graphs.schedule)
    assert_bitwise(want, got, name)


@pytest.mark.gpu
@needs_cuda
def test_gpu_first_step_runs_eagerly_and_captures_start_after_it(model_dir):
    """No capture in the first step: its micro-steps all warm up eagerly, so no eager micro-step runs beside a
    pool that holds a capture's allocations (at Qwen2.5-0.5B 32 x 4 the third micro-step's capture and the fourth's
    eager warm-up held two micro-steps' activations and ran out of memory on an H100, session 32). The second step
    captures each phase once."""
    ctx = DistContext(rank=0, world=1, local_rank=0, device=torch.device("cuda"))
    tr = Trainer(options(model_dir, device="cuda", use_cuda_graphs=True), ctx)
    train(tr, 1)
    assert tr.graphs.schedule.captures == 0 and tr.graphs.schedule.warm_step_done, vars(tr.graphs.schedule)
    train(tr, 2)
    assert tr.graphs.schedule.captures == 3 and tr.graphs.schedule.replays == tr.opts.grad_accumulation, vars(tr.graphs.schedule)


@pytest.mark.gpu
@needs_cuda
def test_gpu_another_loss_scale_runs_eagerly_with_the_same_bits(model_dir):
    """Masked targets change the loss scale (a GEMM alpha the graphs bake in): those micro-steps run eagerly."""
    ctx = DistContext(rank=0, world=1, local_rank=0, device=torch.device("cuda"))
    want = train(Trainer(options(model_dir, device="cuda", use_cuda_graphs=False), ctx), 6, masked=True)
    tr = Trainer(options(model_dir, device="cuda", use_cuda_graphs=True), ctx)
    got = train(tr, 6, masked=True)
    assert tr.graphs.schedule.eager_other_scale > 0 and tr.graphs.schedule.replays > 0, vars(tr.graphs.schedule)
    assert_bitwise(want, got, "masked")


@pytest.mark.gpu
@needs_cuda
def test_gpu_on_by_default_with_masked_targets_releases_the_graphs_with_the_same_bits(model_dir):
    """Unset (on: a tiny host-bound model) with masked targets: the graphs are released at the first step of another
    loss scale, their pool's memory given back, and every step has the bits of a run without graphs."""
    ctx = DistContext(rank=0, world=1, local_rank=0, device=torch.device("cuda"))
    want = train(Trainer(options(model_dir, device="cuda", use_cuda_graphs=False), ctx), 6, masked=True)
    tr = Trainer(options(model_dir, device="cuda"), ctx)
    assert tr.graphs is not None
    got = train(tr, 6, masked=True)
    s = tr.graphs.schedule
    assert s.released_at is not None and s.captures > 0 and not tr.graphs.graphs, vars(s)
    assert "released at micro-step" in tr.graphs.summary()
    from qtrain.observe.allocations import in_private_pool
    assert not [g for g in torch.cuda.memory._snapshot()["segments"] if in_private_pool(g)], "a pool segment kept"
    assert_bitwise(want, got, "masked, graphs released")


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
    for name, extra in (("eager", ["--no-use-cuda-graphs"]), ("graphs", ["--use-cuda-graphs"])):
        assert main([*common, *extra, "--log-file", f"{name}.jsonl", "--out-dir", f"out-{name}",
                     "--checkpoint-dir", f"ckpt-{name}"]) == 0
        logs[name] = read_log(f"{name}.jsonl")
    losses = {n: [(e["step"], e["loss"]) for e in ev if e["log"] in ("step", "eval")] for n, ev in logs.items()}
    assert losses["graphs"] == losses["eager"] and len(losses["eager"]) >= 6
    messages = [e["message"] for e in logs["graphs"] if e["log"] == "message"]
    assert any("captured in CUDA graphs" in m for m in messages)
    assert any("2 graphs captured, 8 micro-steps replayed, 0 run eagerly" in m for m in messages), messages
    assert not any("--use-cuda-graphs" in e["message"] for e in logs["eager"] if e["log"] == "message")


@pytest.mark.gpu
@needs_cuda
def test_gpu_unset_runs_graphs_and_another_shape_eagerly_with_the_same_bits(model_dir):
    """Unset on a tiny model (a host-bound micro-step) the graphs are on; a step of shorter sequences (the static
    buffers keep their shape) releases them, since on by default they end at the first eager micro-step after a
    capture, and every step has the bits of a run without."""
    ctx = DistContext(rank=0, world=1, local_rank=0, device=torch.device("cuda"))
    want = train(Trainer(options(model_dir, device="cuda", use_cuda_graphs=False), ctx), 5, short=(3,))
    tr = Trainer(options(model_dir, device="cuda"), ctx)
    assert tr.graphs is not None
    got = train(tr, 5, short=(3,))
    s = tr.graphs.schedule
    assert s.eager_other_shape == 1 and s.released_at == 3 * tr.opts.grad_accumulation and s.replays > 0, vars(s)
    assert_bitwise(want, got, "short step")
