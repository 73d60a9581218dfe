"""Round three b (hostile pass 4): resuming and changing layouts with the newer modes. Each case gives `qtrain
train --continue` (or export) a change that alters what the checkpoint's state means and asserts the bad-input
table's contract (tests/reliability/test_bad_inputs.py's `run_case`): exit code 2, one line naming the option or
file, nothing under the root changed."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from qtrain.cli.main import main
from tests.reliability.test_bad_inputs import Case, run_case
from tests.reliability.test_lora_inputs import base_weights
from tests.run_utils import make_run_root, train_argv


@pytest.fixture(scope="module")
def scratch_lora(tmp_path_factory) -> Path:
    """A finished 2-step LoRA run `lr` whose base the run made from scratch (--seed 42's init), and root/w: weights
    of the same config."""
    root = make_run_root(tmp_path_factory.mktemp("scratch_lora"))
    assert main(train_argv(root, steps=2, name="lr", extra=("--lora-rank", "4", "--quiet"))) == 0
    base_weights(root / "w", 1)
    return root


def _resume_on_weights(root: Path) -> list[str]:
    argv = train_argv(root, steps=4, name="lr", model=root / "w", extra=("--lora-rank", "4", "--continue"))
    return [a for a in argv if a != "--from-scratch"]


SCRATCH_BASE_CASES = [
    # the adapters trained on the seed's random init: resuming them on real weights trains them on another base
    Case("continue-scratch-lora-on-weights", _resume_on_weights,
         r"--continue .*: the LoRA base of the checkpoint's run was made from scratch \(--seed 42\), this run reads "
         r"the weights in .*/w"),
    # a base made from scratch is the seed's init with the run's --init-proj-to-zero: another is another base
    Case("continue-scratch-lora-init-proj-to-zero",
         lambda root: train_argv(root, steps=4, name="lr", extra=("--lora-rank", "4", "--init-proj-to-zero",
                                                                  "--continue")),
         r"--continue .*: the LoRA base of the checkpoint's run was made from scratch with --no-init-proj-to-zero, "
         r"this run makes it with --init-proj-to-zero"),
]


@pytest.mark.parametrize("case", SCRATCH_BASE_CASES, ids=[c.name for c in SCRATCH_BASE_CASES])
def test_scratch_lora_base_changed(case: Case, scratch_lora: Path, tmp_path: Path, capsys) -> None:
    run_case(case, scratch_lora, tmp_path, capsys)


def test_scratch_lora_resumes_on_its_own_base(scratch_lora: Path, tmp_path: Path) -> None:
    """The same from-scratch command resumes (the refusal above is about the base only)."""
    import shutil
    root = tmp_path / "root"
    shutil.copytree(scratch_lora, root)
    assert main(train_argv(root, steps=3, name="lr", extra=("--lora-rank", "4", "--continue", "--quiet"))) == 0


def test_keep_n_never_deletes_the_checkpoint_it_just_wrote(tmp_path: Path, capsys) -> None:
    """A run resumed from an earlier checkpoint (`--continue 2` while step 6 is there) with --ckpt-keep-n 1: the
    checkpoints it writes are its work, and the one it ends with is what it names; keep-n counted the older run's
    step 6 as the newest and deleted the resumed run's step 4 the moment it was written (its work lost, and a later
    plain --continue went on from the other step 6)."""
    import json
    root = make_run_root(tmp_path)
    assert main(train_argv(root, steps=6, ckpt_keep_n=10, extra=("--quiet",))) == 0
    capsys.readouterr()
    assert main(train_argv(root, steps=4, ckpt_keep_n=1, extra=("--continue", "2"))) == 0
    out = capsys.readouterr().out
    mine = root / "ckpt" / "run" / "step_00000004"
    assert f"checkpoint: {mine}" in out
    assert json.loads((mine / "checkpoint.json").read_text())["step"] == 4
    assert not (root / "ckpt" / "run" / "step_00000002").exists()  # keep-n still removes the older ones


FP8_AUTO = dict(model_dtype="bf16", matmul_dtype="e4m3", fp8_min_size=0, fp8_min_block_gflop=0.0015)


def test_continue_says_when_the_fp8_policy_chooses_other_linears(tmp_path: Path, capsys) -> None:
    """--fp8-policy auto chooses the FP8 linears by the micro-batch's tokens, and another split of the same global
    batch is a resume qtrain accepts: the tiny model's block does 0.0018 GFLOP at 2 x 16 tokens (all four linears in
    e4m3 above the 0.0015 threshold) and half that at 1 x 16 (none). The resumed run went on in bf16 with no line
    saying that its precision changed at the checkpoint; the same split keeps the choice and says nothing."""
    root = make_run_root(tmp_path)
    assert main(train_argv(root, steps=4, ckpt_keep_n=10, batch_size=2, extra=("--quiet",), **FP8_AUTO)) == 0
    capsys.readouterr()
    assert main(train_argv(root, steps=4, batch_size=1, grad_accumulation=2, extra=("--continue", "2"),
                           **FP8_AUTO)) == 0
    out = capsys.readouterr().out
    assert ("--continue: the block linears in FP8 (--fp8-policy auto) qkv, o, up, down -> none: micro-batches of 32 "
            "-> 16 tokens (checkpoint step 2)") in out, out
    assert main(train_argv(root, steps=4, batch_size=2, out_dir=root / "o2", log_file=root / "l2.jsonl",
                           extra=("--continue", "2"), **FP8_AUTO)) == 0
    assert "block linears in FP8" not in capsys.readouterr().out


def test_continue_from_an_earlier_checkpoint_names_the_later_ones(tmp_path: Path, capsys) -> None:
    """`--continue 2` while steps 4 and 6 of the run are there: this run writes its step 4 over the older one, and
    step 6 (the other pass's) stays the newest, which a later plain --continue resumes; it said nothing of either."""
    root = make_run_root(tmp_path)
    assert main(train_argv(root, steps=6, extra=("--quiet",))) == 0
    capsys.readouterr()
    assert main(train_argv(root, steps=4, extra=("--continue", "2"))) == 0
    out = capsys.readouterr().out
    assert ("--continue: the checkpoint directory holds later checkpoints of the run than step 2 (step_00000004, "
            "step_00000006): this run replaces those of the steps it reaches, and a plain --continue resumes the "
            "newest of them (remove those you do not want resumed)") in out, out
    assert (root / "ckpt" / "run" / "step_00000006").is_dir()  # nothing of the other pass is deleted unasked
    assert main(train_argv(root, steps=6, out_dir=root / "o2", log_file=root / "l2.jsonl",
                           extra=("--continue", "latest"))) == 0
    assert "later checkpoints" not in capsys.readouterr().out


@pytest.mark.parametrize("first,then", [((), ("--master-dtype", "bf16")), (("--master-dtype", "bf16"), ())],
                         ids=["unset-then-bf16", "bf16-then-unset"])
def test_the_master_dtype_as_given_or_implied_is_the_same(first, then, tmp_path: Path, capsys) -> None:
    """--master-dtype '' means the model dtype: a bf16 run resumed with --master-dtype bf16 (or the other way) holds
    the same state, and was refused ("checkpoint has --master-dtype='', this run 'bf16'"); another master dtype is
    still refused."""
    root = make_run_root(tmp_path)
    assert main(train_argv(root, steps=2, model_dtype="bf16", extra=("--quiet", *first))) == 0
    assert main(train_argv(root, steps=3, model_dtype="bf16", extra=("--quiet", "--continue", *then))) == 0
    capsys.readouterr()
    assert main(train_argv(root, steps=4, model_dtype="bf16", master_dtype="fp32", extra=("--continue",))) == 2
    assert re.search(r"checkpoint has --master-dtype='?(bf16)?'?, this run 'fp32'", capsys.readouterr().err)


def test_export_takes_one_checkpoint_as_its_help_says(tmp_path: Path, capsys) -> None:
    """`qtrain export --checkpoint-dir` takes "a run's checkpoint directory (ckpt/NAME), or one step_N" (its help),
    and an interrupted export says to run `qtrain export --checkpoint-dir .../step_N --out-dir ...` again: a step_N
    was "no checkpoint" (the way out it names failed)."""
    import json
    root = make_run_root(tmp_path)
    assert main(train_argv(root, steps=4, extra=("--quiet",))) == 0
    one = root / "ckpt" / "run" / "step_00000002"
    assert main(["export", "--checkpoint-dir", str(one), "--out-dir", str(root / "x")]) == 0, capsys.readouterr().err
    assert json.loads((root / "x" / "qtrain-export.json").read_text())["step"] == 2
    assert main(["export", "--checkpoint-dir", str(one), "--step", "4", "--out-dir", str(root / "y")]) == 2
    assert "step_00000002: no checkpoint of step 4" in capsys.readouterr().err


def test_an_interrupted_merge_export_says_how_to_finish_it_merged(tmp_path: Path, capsys) -> None:
    """A `qtrain export --lora-merge` killed between its renames: the readers refuse the folder and say to run the
    export again; that command lacked --lora-merge, so following it wrote the PEFT adapter where the merged model was
    asked for. The command it names now finishes the merged model."""
    import shlex
    from tests.run_utils import qtrain_run
    root = make_run_root(tmp_path)
    assert main(train_argv(root, steps=2, name="lr", extra=("--lora-rank", "4", "--quiet"))) == 0
    merged = root / "merged"
    r = qtrain_run(["export", "--checkpoint-dir", str(root / "ckpt" / "lr"), "--lora-merge", "--out-dir", str(merged)],
                   cwd=root, timeout=120, QTRAIN_FAULT="export.rename:2")
    assert r.returncode == -9, r.stderr[-2000:]
    capsys.readouterr()
    assert main(["eval", "--model", str(merged), "--eval-file", str(root / "eval.bin"), "--seq-len", "16",
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    found = re.search(r"run `qtrain (export [^`]*)` again", err)
    assert found and "--lora-merge" in found.group(1), err
    assert main(shlex.split(found.group(1))) == 0
    assert (merged / "model.safetensors").is_file() and not (merged / "adapter_config.json").exists()
