"""What a checkpoint says is checked before anything is built, and `--continue` never mixes a changed world into a
run silently (issue 41, items 6 and 7), through the real CLI (`qtrain.cli.main.main`, in process) on a finished
tiny run (`done`: 4 steps over the glob train*.bin of two files, checkpoints at steps 2 and 4, its export, its log):

* an edited checkpoint.json or shard file (each of the hostile tester's edits) is refused by `--continue` and by
  `qtrain export --checkpoint-dir` alike: exit code 2, one line naming the file and the field (or tensor), nothing
  built (no Trainer for --continue, no tensor read for the export), every file and folder as it was;
* a change that would move the data position or break the schedule is refused with the option and its
  old -> new value (the data: a train file appended to, truncated, rewritten, replaced; a glob that gained or lost
  a file), unless --new-data / --override-schedule say so; a run shorter than its checkpoint is always refused;
* every other changed option is accepted and reported, one line each, in the console and the JSON log;
* a checkpoint of the earlier format (no records) still resumes, saying what cannot be checked;
* `--continue` on a finished run says so and changes nothing; with its export gone it finishes the export;
* the tokenizer a run exports with is copied into its checkpoints (an export works after the source is gone);
* `--matmul-dtype bf16` with fp32 weights is refused (it would change nothing while the plan said bf16).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from qtrain.cli.main import main
from qtrain.data.token_files import write_token_file
from qtrain.model.hf_io import MANIFEST
from qtrain.observe.log import read_log
from qtrain.train.checkpoint_io import CheckpointFiles
from tests.reliability.test_bad_inputs import tree
from tests.run_utils import CFG, make_run_root, train_argv

CKPT = Path("ckpt") / "done" / "step_00000004"
META = CKPT / "checkpoint.json"


def _tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, CFG.vocab_size, n, dtype=np.int32)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """The tiny model, train.bin (4000 tokens) + train-b.bin (2000) and the finished run `done` trained on both."""
    root = make_run_root(tmp_path_factory.mktemp("base"))
    write_token_file(root / "train-b.bin", _tokens(2000, 11), vocab_size=CFG.vocab_size)
    assert main(train_argv(root, steps=4, name="done", train_file=root / "train*.bin")) == 0
    return root


def resume(root: Path, *, steps: int = 6, extra: tuple[str, ...] = (), **flags) -> list[str]:
    return train_argv(root, steps=steps, name="done", train_file=root / "train*.bin", extra=("--continue", *extra),
                      **flags)


def export(root: Path) -> list[str]:
    return ["export", "--checkpoint-dir", str(root / "ckpt" / "done"), "--out-dir", str(root / "exported")]


@pytest.fixture
def built(monkeypatch) -> list[str]:
    """Every model built for training ('trainer') and every tensor read from a checkpoint file ('tensor <the
    checkpoint's folder>'); the spies call the real thing."""
    import qtrain.train.loop as loop
    calls: list[str] = []
    real_trainer, real_load, real_get = loop.Trainer, CheckpointFiles.load, CheckpointFiles.get

    def trainer(*a, **k):
        calls.append("trainer")
        return real_trainer(*a, **k)

    def load(self, *a, **k):
        calls.append(f"tensor {self.path.name}")
        return real_load(self, *a, **k)

    def get(self, *a, **k):
        calls.append(f"tensor {self.path.name}")
        return real_get(self, *a, **k)

    monkeypatch.setattr(loop, "Trainer", trainer)
    monkeypatch.setattr(CheckpointFiles, "load", load)
    monkeypatch.setattr(CheckpointFiles, "get", get)
    return calls


def copy_of(base: Path, tmp_path: Path) -> Path:
    root = tmp_path / "root"
    shutil.copytree(base, root, symlinks=True)
    return root


def refused(root: Path, argv: list[str], match: str, capsys, built: list[str]) -> str:
    """Exit code 2, one line `qtrain: error: ...` matching `match`, nothing built or read, the tree unchanged. Only a
    checkpoint the line names as the newest that verifies (a shard file at fault: `test_checkpoint_integrity`) was
    read, whole, to say so."""
    before = tree(root)
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2, err[-3000:]
    assert len(lines) == 1 and lines[0].startswith("qtrain: error: ") and "Traceback" not in err, err[-3000:]
    assert re.search(match, lines[0]), (match, lines[0])
    named = re.search(r"the newest checkpoint that verifies is \S*/(step_\d+):", lines[0])
    assert [c for c in built if not (named and c == f"tensor {named[1]}")] == [], built
    assert tree(root) == before
    return lines[0]


# ---------------------------------------------------------------------------------------------- item 6: the meta

def edit_meta(**changes) -> Callable[[Path], None]:
    """Edit fields of step 4's checkpoint.json: a value replaces the field, a function maps it, _DROP deletes it."""
    def edit(root: Path) -> None:
        meta = json.loads((root / META).read_text())
        for k, v in changes.items():
            if v is _DROP:
                del meta[k]
            else:
                meta[k] = v(meta[k]) if callable(v) else v
        (root / META).write_text(json.dumps(meta))
    return edit


_DROP = object()


def edit_shard(name: str, change: Callable[[dict], dict]) -> Callable[[Path], None]:
    def edit(root: Path) -> None:
        path = root / CKPT / f"{name}.safetensors"
        save_file(change(load_file(path)), path)
    return edit


def _without(key: str) -> Callable[[dict], dict]:
    return lambda t: {k: v for k, v in t.items() if k != key}


def _shorter(key: str) -> Callable[[dict], dict]:
    return lambda t: {**t, key: t[key][:-1].clone()}


F = r"step_00000004/checkpoint\.json: "
META_CASES = {  # the tester's edits -> what the one line must say
    "m-missing-a-key": (edit_shard("adam.m.shard_000_of_001", _without("block.1")),
                        r"step_00000004/adam\.m\.shard_000_of_001\.safetensors: has no tensor block\.1 \(a shard of "
                        r"adam\.m holds one tensor per parameter group\)"),
    "wrong-size-weight": (edit_shard("weights.shard_000_of_001", _shorter("embed")),
                          r"weights\.shard_000_of_001\.safetensors: tensor embed has shape \[3071\], a shard of "
                          r"weights has \[3072\] here"),
    "step-negative": (edit_meta(step=-1), F + r"step must be in \[0, \d+\], got -1"),
    "epoch-negative": (edit_meta(data_loader=lambda d: {**d, "epoch": -7}),
                       F + r"data_loader\.epoch must be in \[0, \d+\], got -7"),
    "no-data-loader": (edit_meta(data_loader=_DROP), F + r"data_loader is missing"),
    "logger-malformed": (edit_meta(logger=lambda d: {**d, "loss_outliers": {"window": 100, "threshold": "x",
                                                                             "values": []}}),
                         F + r"logger\.loss_outliers\.threshold must be a finite number, got x"),
    "logger-not-an-object": (edit_meta(logger=lambda d: {**d, "norm_outliers": [1, 2]}),
                             F + r"logger\.norm_outliers must be a JSON object, got a list"),
    "no-distributed": (edit_meta(distributed=_DROP), F + r"distributed is missing"),
    "no-model": (edit_meta(model=_DROP), F + r"model is missing"),
    "tokenizer-etc-passwd": (edit_meta(tokenizer="/etc/passwd"), F + r"tokenizer must be null, a built-in .* got "
                                                                     r"/etc/passwd"),
    "step-of-another-dir": (edit_meta(step=3), F + r"step 3 differs from the step of its directory step_00000004"),
    "chunk-index-huge": (edit_meta(data_loader=lambda d: {**d, "chunk_index": 10 ** 9}),
                         F + r"data_loader is no position in the recorded training data: chunk_index 1000000000 is "
                             r"past the \d+ sequence\(s\)"),
    "version-99": (edit_meta(version=99), F + r"version 99 is not a checkpoint format this qtrain reads"),
    "no-options": (edit_meta(options=_DROP), F + r"options is missing"),
    "options-bad-dtype": (edit_meta(options=lambda o: {**o, "model_dtype": "fp64"}),
                          F + r"options\.model_dtype is not a value of --model-dtype: fp64"),
    "hints-not-a-list": (edit_meta(fp8_scale_hints={"0": 1}), F + r"fp8_scale_hints must be a list"),
    "memory-no-chunks": (edit_meta(memory=lambda m: {**m, "lmhead_chunks": 0}),
                         F + r"memory\.lmhead_chunks must be in \[1, \d+\], got 0"),
    "digests-not-strings": (edit_meta(digests={"weights.shard_000_of_001.safetensors": 5}),
                            F + r"digests must map file names to digest strings"),
    "digests-of-another-form": (edit_meta(digests={"weights.shard_000_of_001.safetensors": "blake2b:00"}),
                                F + r"digests must map file names to digest strings \(sha256-tree:<hex> for a shard "
                                    r"file, .*weights\.shard_000_of_001\.safetensors has blake2b:00"),
    "digests-of-no-file": (edit_meta(digests={"../../x.safetensors": "sha256-tree:" + "0" * 64}),
                           F + r"digests names \.\./\.\./x\.safetensors, which is no file of a checkpoint"),
}


@pytest.mark.parametrize("command", ["continue", "export"])
@pytest.mark.parametrize("case", sorted(META_CASES))
def test_an_edited_checkpoint_is_refused_before_anything_is_built(case, command, base, tmp_path, capsys, built):
    root = copy_of(base, tmp_path)
    setup, match = META_CASES[case]
    setup(root)
    refused(root, resume(root) if command == "continue" else export(root), match, capsys, built)


# ---------------------------------------------------------------------------------------------- item 7: a changed world

def _rewrite(n: int = 4000, *, seed: int | None = None, replace: bool = False) -> Callable[[Path], None]:
    """train.bin (make_run_root's 4000 ids, seed 7) rewritten in place: its first `n` ids (more: others appended),
    or `n` other ids (`seed`); with `replace`, as a new file renamed over it."""
    def edit(root: Path) -> None:
        ids = (_tokens(n, seed) if seed is not None
               else np.concatenate([_tokens(4000, 7), _tokens(max(n - 4000, 0), 99)])[:n])
        path, new = root / "train.bin", root / "train.bin.new"
        write_token_file(new, ids, vocab_size=CFG.vocab_size)
        if replace:
            os.replace(new, path)
            return
        data = new.read_bytes()
        new.unlink()
        with open(path, "r+b") as f:  # the same file (inode), as an editor or `cat >>` leaves it
            f.write(data)
            f.truncate()
    return edit


DATA_HINT = r"pass --new-data to restart it at the start of the training data"
SCHEDULE_HINT = r"pass --override-schedule to take them from this command"
CHANGE_CASES = {  # name -> (flags, setup, what the one line must say)
    "batch-size": (dict(batch_size=4), None, r"global batch 2 -> 4 sequences per step \(--batch-size 2 -> 4, "
                                             r"--grad-accumulation 1 -> 1, 1 -> 1 rank\(s\)\).*" + SCHEDULE_HINT),
    "grad-accumulation": (dict(grad_accumulation=2), None, r"global batch 2 -> 4 .*--grad-accumulation 1 -> 2"),
    "seq-len": (dict(seq_len=8), None, r"--seq-len 16 -> 8: the saved data position would serve other sequences.*"
                                       + DATA_HINT),
    "train-seed": (dict(train_seed=5), None, r"--train-seed 0x83b45442 -> 0x5.*" + DATA_HINT),
    "file-appended": ({}, _rewrite(4400), r"train\.bin was appended to \(17024 -> 18624 bytes\).*"
                                                       + DATA_HINT),
    "file-truncated": ({}, _rewrite(3600), r"train\.bin was truncated \(17024 -> 15424 bytes\)"),
    "file-rewritten": ({}, _rewrite(seed=8), r"train\.bin was changed \(same size, other content\)"),
    "glob-gained": ({}, lambda root: write_token_file(root / "train-c.bin", _tokens(2000, 12),
                                                      vocab_size=CFG.vocab_size),
                    r"the training files now include \S+/train-c\.bin"),
    "glob-lost": ({}, lambda root: (root / "train-b.bin").unlink(),
                  r"\S+/train-b\.bin is no longer among the training files"),
    "lr-schedule": (dict(lr_schedule="linear"), None, r"--lr-schedule cosine -> linear: .*" + SCHEDULE_HINT),
    "warmup": (dict(warmup=2), None, r"--warmup 0 -> 2"),
    "cooldown": (dict(cooldown=1), None, r"--cooldown 0 -> 1"),
    "steps-below-the-checkpoint": (dict(steps=3), None, r"--steps 3 ends before the checkpoint's step 4"),
    "steps-below-with-overrides": (dict(steps=3), None, r"--steps 3 ends before the checkpoint's step 4"),
}


@pytest.mark.parametrize("case", sorted(CHANGE_CASES))
def test_a_change_that_moves_the_data_position_or_the_schedule_is_refused(case, base, tmp_path, capsys, built):
    root = copy_of(base, tmp_path)
    flags, setup, match = CHANGE_CASES[case]
    if setup is not None:
        setup(root)
    extra = ("--new-data", "--override-schedule") if case == "steps-below-with-overrides" else ()
    line = refused(root, resume(root, extra=extra, **{"steps": 6, **flags}), match, capsys, built)
    assert line.startswith(f"qtrain: error: --continue {root / CKPT}")


def test_a_token_file_rewritten_or_replaced_in_place_is_refused(tmp_path, capsys, built):
    """In the run's own tree (a copy has other inodes): the same size with other ids, written into the file itself
    or as a new file renamed over it."""
    root = make_run_root(tmp_path)
    write_token_file(root / "train-b.bin", _tokens(2000, 11), vocab_size=CFG.vocab_size)
    assert main(train_argv(root, steps=4, name="done", train_file=root / "train*.bin")) == 0
    built.clear()
    for setup, how in ((_rewrite(seed=8), "rewritten in place"), (_rewrite(seed=9, replace=True),
                                                                   "replaced by another file of the same size")):
        setup(root)
        refused(root, resume(root), rf"{root}/train\.bin was {how}.*" + DATA_HINT, capsys, built)


PATHS = {"--model", "--train-file", "--eval-file", "--checkpoint-dir", "--out-dir", "--log-file"}  # the copy's


def _reported(out: str) -> dict[str, str]:
    """option -> 'old -> new' of each `--continue: --opt old -> new (checkpoint step 4)` line, but for the paths that
    moved with the copied tree (each reported too)."""
    found = {m[1]: m[2] for m in re.finditer(r"^\[!\] --continue: (--[\w-]+) (.+?) \(checkpoint step 4\)$", out, re.M)}
    assert found.keys() & PATHS in (PATHS, set()), found  # all moved (a copy), or none (the format-1 record)
    return {k: v for k, v in found.items() if k not in PATHS}


def test_every_other_changed_option_is_accepted_and_reported(base, tmp_path, capsys):
    """--lr, --weight-decay, --beta-2, --grad-clip, --z-loss, eval options, more steps and another split of the same
    global batch (2 x 1 -> 1 x 2): one line each, in the console and the JSON log, and nothing else is reported."""
    root = copy_of(base, tmp_path)
    capsys.readouterr()
    assert main(resume(root, lr=5e-4, weight_decay=0.05, beta_2=0.99, grad_clip=0.5, z_loss=1e-4, eval_num_steps=1,
                       batch_size=1, grad_accumulation=2)) == 0
    want = {"--learning-rate": "0.001 -> 0.0005", "--weight-decay": "0.1 -> 0.05", "--beta-2": "0.95 -> 0.99",
            "--grad-clip": "1.0 -> 0.5", "--z-loss": "0.0 -> 0.0001", "--eval-num-steps": "0 -> 1",
            "--batch-size": "2 -> 1", "--grad-accumulation": "1 -> 2", "--steps": "4 -> 6"}
    assert _reported(capsys.readouterr().out) == want
    logged = {e["option"]: (e["old"], e["new"]) for e in read_log(root / "logs" / "done.jsonl")
              if e["log"] == "message" and "option" in e and f"--{e['option'].replace('_', '-')}" not in PATHS}
    assert logged == {"learning_rate": (1e-3, 5e-4), "weight_decay": (0.1, 0.05), "beta_2": (0.95, 0.99),
                      "grad_clip": (1.0, 0.5), "z_loss": (0.0, 1e-4), "eval_num_steps": (0, 1), "batch_size": (2, 1),
                      "grad_accumulation": (1, 2), "steps": (4, 6)}
    assert json.loads((root / "ckpt" / "done" / "step_00000006" / "checkpoint.json").read_text())["options"][
        "learning_rate"] == 5e-4


def test_new_data_restarts_the_data_position_and_says_so(base, tmp_path, capsys):
    root = copy_of(base, tmp_path)
    _rewrite(4400)(root)
    capsys.readouterr()
    assert main(resume(root, seq_len=8, extra=("--new-data",))) == 0
    out = capsys.readouterr().out
    assert re.search(r"\[!\] --new-data: the data position restarts at the start of the training data \(the "
                     r"checkpoint was at epoch 0, file \d, sequence \d+\); --seq-len 16 -> 8, the training data "
                     r"changed since the checkpoint: \S+/train\.bin was appended to \(17024 -> 18624 bytes\)", out), out
    assert _reported(out) == {"--seq-len": "16 -> 8", "--steps": "4 -> 6"}
    meta = json.loads((root / "ckpt" / "done" / "step_00000006" / "checkpoint.json").read_text())
    assert [f["size"] for f in meta["data"]["files"]] == [9024, 18624]  # the new data is what it records now
    # the position restarted: 2 steps of 2 sequences of 8 from the start of epoch 0 (the first file of its order)
    assert meta["data_loader"]["epoch"] == 0 and meta["data_loader"]["chunk_index"] == 4


def test_override_schedule_takes_the_schedule_and_the_global_batch_from_the_command(base, tmp_path, capsys):
    root = copy_of(base, tmp_path)
    capsys.readouterr()
    assert main(resume(root, warmup=1, lr_schedule="linear", batch_size=4, extra=("--override-schedule",))) == 0
    assert _reported(capsys.readouterr().out) == {"--warmup": "0 -> 1", "--lr-schedule": "cosine -> linear",
                                                  "--batch-size": "2 -> 4", "--steps": "4 -> 6"}
    assert main(train_argv(root, name="x", extra=("--override-schedule",))) == 2  # only with --continue


def test_a_checkpoint_of_the_earlier_format_resumes_and_says_what_it_cannot_check(base, tmp_path, capsys):
    """Format 1 recorded five options, no training files, the tokenizer as a path: still resumed (with a warning),
    and the train seed its data position carries is still compared."""
    root = copy_of(base, tmp_path)
    edit_meta(version=1, options=lambda o: {k: o[k] for k in ("model_dtype", "master_dtype", "opt_m_dtype",
                                                              "opt_v_dtype", "seed")}, data=_DROP)(root)
    capsys.readouterr()
    assert main(resume(root, train_seed=5)) == 2
    assert re.search(r"--train-seed 0x83b45442 -> 0x5", capsys.readouterr().err)
    meta = json.loads((root / META).read_text())
    (root / META).write_text(json.dumps({**meta, "data_loader": {**meta["data_loader"], "chunk_index": 10 ** 9}}))
    assert main(resume(root)) == 2  # no records to check it with: checked against the files there are
    assert re.search(r"its data_loader is no position in the training files there are now \(chunk_index 1000000000 "
                     r"is past", capsys.readouterr().err)
    (root / META).write_text(json.dumps(meta))
    assert main(resume(root, lr=5e-4)) == 0
    out = capsys.readouterr().out
    assert re.search(r"\[!\] checkpoint \S+step_00000004 has format 1: it records 5 options and not the training "
                     r"files, so changes to the other options or to the data cannot be checked", out), out
    assert _reported(out) == {}  # what it does not record cannot be reported
    assert json.loads((root / "ckpt" / "done" / "step_00000006" / "checkpoint.json").read_text())["version"] == 2


# ---------------------------------------------------------------------------------------------- a finished run

def test_continue_on_a_finished_run_does_nothing_and_says_so(base, tmp_path, capsys, built):
    root = copy_of(base, tmp_path)
    before = tree(root)
    capsys.readouterr()
    assert main(resume(root, steps=4)) == 0
    out = capsys.readouterr().out
    assert re.search(r"^qtrain: run done \(\w{8}\) finished at step 4; its export is in \S+/out/done; nothing to "
                     r"do$", out, re.M), out
    assert tree(root) == before and built == []  # no evaluation, no export, not even a log line


def test_continue_on_a_finished_run_without_its_export_finishes_it(base, tmp_path, capsys):
    root = copy_of(base, tmp_path)
    shutil.rmtree(root / "out" / "done")
    capsys.readouterr()
    assert main(resume(root, steps=4)) == 0
    assert re.search(r"\[!\] run done \(\w{8}\) finished at step 4, but its export in \S+/out/done is missing: "
                     r"evaluating and exporting it", capsys.readouterr().out)
    man = json.loads((root / "out" / "done" / MANIFEST).read_text())
    assert man["step"] == 4 and man["complete"] is True and (root / "out" / "done" / "model.safetensors").is_file()
    assert main(resume(root, steps=4)) == 0
    assert "nothing to do" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- tokenizer, matmul

def _word_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(CFG.vocab_size - 2)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def test_the_export_tokenizer_is_copied_into_the_checkpoint(tmp_path, capsys):
    """A run's tokenizer file is recorded as the checkpoint's own copy (never a path outside it): `qtrain export`
    still writes it after the original is gone."""
    root = make_run_root(tmp_path)
    source = _word_tokenizer(tmp_path / "my-tokenizer.json")
    original = source.read_bytes()
    assert main(train_argv(root, steps=2, tokenizer=source)) == 0
    ckpt = root / "ckpt" / "run" / "step_00000002"
    assert json.loads((ckpt / "checkpoint.json").read_text())["tokenizer"] == "tokenizer"
    assert (ckpt / "tokenizer" / "tokenizer.json").read_bytes() == original
    source.unlink()
    assert main(["export", "--checkpoint-dir", str(root / "ckpt" / "run"), "--out-dir", str(tmp_path / "x")]) == 0
    assert (tmp_path / "x" / "tokenizer.json").read_bytes() == original


def test_bf16_matmuls_with_fp32_weights_are_refused(tmp_path, capsys):
    """The block linears run in the model dtype unless e4m3: with fp32 weights `--matmul-dtype bf16` would change
    nothing while the memory plan and the log header said "matmul bf16"."""
    root = make_run_root(tmp_path)
    before = tree(root)
    for argv in (train_argv(root, matmul_dtype="bf16"),
                 ["plan", "--model", str(root / "model"), "--from-scratch", "--gpu-memory", "8GiB", "--model-dtype",
                  "fp32", "--matmul-dtype", "bf16"]):
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("qtrain: error: --matmul-dtype bf16 with --model-dtype fp32 is not supported") and \
            len(err.strip().splitlines()) == 1, err
    assert tree(root) == before


def test_an_explicit_default_where_the_checkpoint_has_empty_is_no_change(base, tmp_path, capsys):
    """--matmul-dtype and --grad-accum-dtype given as what the checkpoint's '' meant (the model dtype) run the same
    numbers: no change line (only the longer run's --steps)."""
    root = copy_of(base, tmp_path)
    old = json.loads((root / "ckpt" / "done" / "step_00000004" / "checkpoint.json").read_text())["options"]
    assert old["matmul_dtype"] == old["grad_accum_dtype"] == ""  # '' recorded: the comparison is by meaning
    capsys.readouterr()
    dtype = old["model_dtype"]
    assert main(resume(root, extra=("--matmul-dtype", dtype, "--grad-accum-dtype", dtype))) == 0
    assert _reported(capsys.readouterr().out) == {"--steps": "4 -> 6"}
