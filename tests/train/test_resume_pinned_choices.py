"""`--continue` keeps the automatic choices that change the numbers as the checkpoint's run made them
(`resume_checks.PINNED_ON_RESUME`): the FP8 head backward, unset = auto since session 32, is on only where the plan
fits it on a GPU, so a resume on another GPU (or of a checkpoint written when it was off by default) would switch the
head's gradients mid-run. The checkpoint records the choice as made (`checkpoint_meta.options_record`); a command
that leaves the option unset takes it from there and continues bit for bit; one that gives it changes it, reported
as an accepted change. Through the real CLI on the CPU (the FP8 head's twin codes), e4m3 with a vocabulary and hidden
size that are multiples of 16."""
from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

from qtrain.cli.main import main
from qtrain.observe.log import read_log
from qtrain.options import Options
from qtrain.train.resume_checks import pinned_choices
from tests.run_utils import make_run_root, train_argv

E4M3 = {"model_dtype": "bf16", "matmul_dtype": "e4m3", "fp8_policy": "all"}


def _steps(root: Path, name: str) -> list[tuple[int, float]]:
    return [(e["step"], e["loss"]) for e in read_log(root / "logs" / f"{name}.jsonl") if e["log"] == "step"]


def _resume_from_step_2(root: Path, name: str, extra: tuple[str, ...]) -> list[str]:
    """Drop the run's step-4 checkpoint and export (the test's own files), resume it to step 4; the messages."""
    shutil.rmtree(root / "ckpt" / name / "step_00000004")
    shutil.rmtree(root / "out" / name)
    assert main(train_argv(root, steps=4, name=name, extra=("--continue", *extra), **E4M3)) == 0
    return [e["message"] for e in read_log(root / "logs" / f"{name}.jsonl") if e["log"] == "message"]


def test_resume_takes_the_fp8_head_choice_from_the_checkpoint_unless_given(tmp_path):
    root = make_run_root(tmp_path)
    for name in ("unset", "given-off"):
        assert main(train_argv(root, steps=4, name=name, extra=("--fp8-head-backward",), **E4M3)) == 0
        meta = json.loads((root / "ckpt" / name / "step_00000002" / "checkpoint.json").read_text())
        assert meta["options"]["fp8_head_backward"] is True  # recorded as made
    first = _steps(root, "unset")
    assert [s for s, _ in first] == [0, 1, 2, 3]
    _resume_from_step_2(root, "unset", ())
    assert _steps(root, "unset")[4:] == first[2:], "the resumed steps equal the uninterrupted run's, bit for bit"
    messages = _resume_from_step_2(root, "given-off", ("--no-fp8-head-backward",))
    again = _steps(root, "given-off")
    assert again[4][1] == again[2][1] and again[5][1] != again[3][1], "given off: step 3's loss moves"
    assert any("fp8-head-backward" in m for m in messages), messages  # the accepted change, reported


def test_pinned_choices_take_only_recorded_choices_of_options_left_unset():
    base = Options(model="x", **E4M3)
    assert pinned_choices({"fp8_head_backward": False}, base) == {"fp8_head_backward": False}  # before session 32
    assert pinned_choices({"fp8_head_backward": True}, base) == {"fp8_head_backward": True}
    assert pinned_choices({"fp8_head_backward": None}, base) == {}  # nothing recorded as made
    assert pinned_choices({}, base) == {}
    given = Options(model="x", fp8_head_backward=False, **E4M3)
    assert pinned_choices({"fp8_head_backward": True}, given) == {}


def test_the_one_pass_swiglu_is_pinned_so_that_the_fit_does_not_split_the_mlp():
    """The one-pass FP8 SwiGLU (auto: on with e4m3 unless a recompute switch splits the MLP) changes the numbers, and
    --fit-memory's --recompute-swiglu / --recompute-ffn turn it off: at Qwen2.5-1.5B e4m3 32 x 1024 on a 70 GiB device
    the fit adds --recompute-swiglu --recompute-norm, so a run that fitted as given on 80 GB, resumed there, would lose
    it mid-run. The checkpoint records it as made; a resume that leaves it unset pins it, and the fit then recomputes
    the whole block (which keeps the MLP one function) instead. A command of another matmul dtype pins no FP8 choice."""
    from qtrain.model.registry import preset
    from qtrain.plan.resolution import resolve_run
    from qtrain.train.checkpoint_meta import options_record
    cfg = preset("Qwen2.5-1.5B")
    opts = Options(model="Qwen2.5-1.5B", batch_size=32, seq_len=1024, grad_accumulation=2, lmhead_chunks=4,
                   opt_m_dtype="bf16", opt_v_dtype="bf16", **E4M3)
    first = resolve_run(cfg, opts, device="cuda", gpu_memory=int(79.18 * 2**30))
    assert first.memory_changes == () and first.fp8_swiglu_onepass
    old = options_record(opts, first)
    assert old["fp8_swiglu_onepass"] is True  # recorded as made
    gib70 = int(70 * 2**30)
    assert dict(resolve_run(cfg, opts, device="cuda", gpu_memory=gib70).memory_changes) == {
        "recompute_swiglu": True, "recompute_norm": True}  # unpinned: the MLP split, the one-pass off
    pins = pinned_choices(old, opts)
    assert pins["fp8_swiglu_onepass"] is True
    resumed = resolve_run(cfg, replace(opts, **pins), device="cuda", gpu_memory=gib70, keep=frozenset(pins))
    assert dict(resumed.memory_changes) == {"recompute_block": True} and resumed.fp8_swiglu_onepass
    assert pinned_choices(old, replace(opts, matmul_dtype="bf16")) == {}
