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
