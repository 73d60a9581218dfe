"""--document-masking as a run option: a packed token file trained without it says so in one line at the start, and
--continue accepts the option toggled, reporting it as any accepted option change.

* A file with a documents section (`qtrain tokenize --pack-to`) trained without --document-masking trains as any
  token file (documents attend across their boundaries, as in llm.q), which is allowed but rarely meant: one warning
  line at the start says so and names the option. Not with the option, not for a file without the section.
* Toggling --document-masking on --continue: the option changes the loss (which tokens see which, the targets at
  document ends) but not what the saved state means: the data position is (epoch, file, chunk) with or without it,
  and weights and Adam state are the same kind of state. `resume_checks` refuses only changes that make the saved
  state mean something else (the data position, the schedule, the global batch) and accepts every other option,
  loss-changing ones such as --z-loss included, with one `--continue: --OPTION old -> new` line. --document-masking
  is treated the same: accepted, reported in that line, and in effect from the first resumed step.
"""
from __future__ import annotations

import json

import pytest

from qtrain.cli.main import main
from qtrain.options import Options, OptionsError
from qtrain.train.preflight import preflight
from tests.run_utils import make_run_root, train_argv
from tests.train.test_document_masking_run import N, packed_root, steps_of

WARNING = "record packed documents (qtrain tokenize --pack-to) but --document-masking is off"


def _argv(root, name, *extra, **flags):
    return train_argv(root, steps=4, name=name, seq_len=N, ckpt_interval=2, extra=("--ckpt-keep-n", "-1", *extra),
                      **flags)


def _messages(root, name):
    return [e["message"] for e in map(json.loads, open(root / "logs" / f"{name}.jsonl")) if e.get("log") == "message"]


def test_packed_file_without_document_masking_warns_once(tmp_path, capsys):
    root = packed_root(tmp_path)
    capsys.readouterr()
    assert main(_argv(root, "plain")) == 0
    out = capsys.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if WARNING in line]
    assert len(lines) == 1, out
    # both files (train and eval) are packed: the line names the first and counts the other
    assert "train.bin and 1 more file(s)" in lines[0] and "add --document-masking" in lines[0]
    assert sum(WARNING in m for m in _messages(root, "plain")) == 1  # and the run log has it
    assert main(_argv(root, "masked", "--document-masking")) == 0
    assert not any(WARNING in m for m in _messages(root, "masked"))
    # a plain token file (no documents section): nothing to say
    plain = make_run_root(tmp_path / "plain")
    assert main(train_argv(plain, steps=1, name="p")) == 0
    assert not any(WARNING in m for m in _messages(plain, "p"))


def test_continue_accepts_document_masking_toggled_with_a_change_line(tmp_path, capsys):
    root = packed_root(tmp_path)
    for first, then, old, new in (("off", "on", "False", "True"), ("on", "off", "True", "False")):
        flag, a, b = ("--document-masking",), f"{first}-first", f"{then}-resumed"
        assert main(_argv(root, a, *(flag if first == "on" else ()))) == 0
        capsys.readouterr()
        assert main(_argv(root, b, *(flag if then == "on" else ()), "--continue", "2",
                          checkpoint_dir=root / "ckpt" / a)) == 0
        out = capsys.readouterr()
        change = f"--continue: --document-masking {old} -> {new} (checkpoint step 2)"
        assert sum(change in line for line in (out.out + out.err).splitlines()) == 1, out
        assert any(change in m for m in _messages(root, b))
        assert any(WARNING in m for m in _messages(root, b)) == (then == "off")
        before = {s["step"]: s["loss"] for s in steps_of(root / "logs" / f"{a}.jsonl")}
        after = {s["step"]: s["loss"] for s in steps_of(root / "logs" / f"{b}.jsonl")}
        assert sorted(after) == [2, 3] and after[2] != before[2]  # in effect from the first resumed step


def test_cuda_graphs_with_document_masking_are_refused_in_one_line_before_anything_is_built(tmp_path):
    """--use-cuda-graphs stays refused with --document-masking (docs/packing.md says why capture is not correct yet):
    the preflight's first checks, before the device, the model or the data are looked at; one line naming both
    options and what to drop, also beside another blocker."""
    root = packed_root(tmp_path)
    base = dict(model=str(root / "model"), from_scratch=True, train_file=str(root / "train.bin"), seq_len=N,
                batch_size=2, device="cuda", use_cuda_graphs=True, document_masking=True)
    for world, other in ((1, ""), (2, "2 processes")):
        with pytest.raises(OptionsError) as e:
            preflight(Options(**base), world=world)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith("--use-cuda-graphs does not support "), msg
        assert "--document-masking (the number of documents" in msg and "Drop --use-cuda-graphs" in msg
        assert other in msg
