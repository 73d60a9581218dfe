"""Checkpoints qtrain cannot trust are refused, and the user's symbolic links are never deleted through.

Corruptions of a real checkpoint (a tiny run's step 4; its step 2 is intact): a flipped exponent bit in a
weight, flipped bytes in Adam's m and v, a tensor rewritten in another dtype, two ranks' shard files swapped
(a `--gpus 2` run), and, in a checkpoint from before digests, one NaN and one negative v. Each is refused by
`qtrain train --continue` and by `qtrain export` with exit code 2 and one line naming the file and tensor and
the newest checkpoint that does verify (step 2), and the user's tree is left as it was. A checkpoint from before
digests (no "digests" in checkpoint.json) still resumes, with a warning, bit for bit like a verified one. The
tokenizer copied into each checkpoint is covered by the digests too.

Symbolic links (qtrain makes none, so one among the checkpoints is the user's): `--ckpt-keep-n` neither counts
nor deletes a linked checkpoint (nor one holding a link), stale sweeps pass leftovers holding a link, a run may
resume from a linked checkpoint, and `--start-over` (which would write over the link) is refused up front.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qtrain.cli.main import main
from qtrain.observe.log import read_log
from tests.reliability.test_resume_checks import _word_tokenizer
from tests.run_utils import make_run_root, qtrain_run, train_argv

STEP4, STEP2 = "step_00000004", "step_00000002"
SHARD = "shard_000_of_001.safetensors"


# ---------------------------------------------------------------------------------------------- fixtures and helpers

@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A finished 4-step run `run`: checkpoints of steps 2 and 4 (with digests), its export and log."""
    root = make_run_root(tmp_path_factory.mktemp("base"))
    assert main(train_argv(root, steps=4)) == 0
    return root


@pytest.fixture(scope="module")
def base2(tmp_path_factory) -> Path:
    """The same run on 2 ranks (`--gpus 2`, gloo): every checkpoint holds two shard files of each kind."""
    root = make_run_root(tmp_path_factory.mktemp("base2"))
    r = qtrain_run(train_argv(root, steps=4, extra=("--gpus", "2")), cwd=root, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return root


def copy(base: Path, tmp_path: Path) -> Path:
    root = tmp_path / "root"
    shutil.copytree(base, root, symlinks=True)
    return root


def tree(root: Path) -> dict[str, object]:
    """Every file (bytes), folder (None) and symbolic link (its target) under root, links not followed."""
    out: dict[str, object] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            out[rel] = ("link", os.readlink(p)) if p.is_symlink() else None if p.is_dir() else p.read_bytes()
    return out


def refused(argv: list[str], root: Path, capsys) -> str:
    """Run `argv` in process; assert exit code 2, one line on stderr, no traceback and an unchanged tree."""
    before = tree(root)
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err[-3000:]
    assert err.startswith("qtrain: error: ") and err.count("\n") == 1 and "Traceback" not in err, err[-3000:]
    after = tree(root)
    assert sorted(after) == sorted(before), sorted(set(after) ^ set(before))
    assert [k for k in before if before[k] != after[k]] == []
    return err


def continue_argv(root: Path, **flags) -> list[str]:
    return train_argv(root, steps=6, extra=("--continue",), **flags)


def export_argv(root: Path, *extra: str) -> list[str]:
    return ["export", "--checkpoint-dir", str(root / "ckpt" / "run"), "--out-dir", str(root / "exported"), *extra]


def tensor_offset(path: Path, key: str) -> int:
    """Where tensor `key`'s bytes start in the safetensors file at `path` (read by the format's spec: an 8-byte
    header length, the JSON header, the tensors' bytes)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n + json.loads(f.read(n))[key]["data_offsets"][0]


def flip(path: Path, at: int, mask: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= mask
    path.write_bytes(bytes(data))


def edit_tensor(path: Path, key: str, fn) -> None:
    """Rewrite one tensor of a checkpoint file the way a user's script would (safetensors' own writer)."""
    tensors = load_file(path)
    tensors[key] = fn(tensors[key].clone())
    save_file(tensors, path)


def drop_digests(ckpt: Path) -> None:
    """Make a checkpoint look like one written before qtrain recorded digests."""
    meta_file = ckpt / "checkpoint.json"
    meta = json.loads(meta_file.read_text())
    meta.pop("digests", None)
    meta_file.write_text(json.dumps(meta))


# ---------------------------------------------------------------------------------------------- corruptions

def exponent_bit(ckpt: Path) -> None:
    """Bit 30 (the top exponent bit) of element 0 of layers.0.qkv (group block.0, element 32): a weight of
    ~0.02 becomes ~7e36, still finite, which only the digest can tell."""
    f = ckpt / f"weights.{SHARD}"
    at = tensor_offset(f, "block.0") + 4 * 32
    before = struct.unpack("<f", f.read_bytes()[at:at + 4])[0]
    flip(f, at + 3, 0x40)
    after = struct.unpack("<f", f.read_bytes()[at:at + 4])[0]
    assert abs(before) < 1 and 1e30 < abs(after) < float("inf"), (before, after)


def m_bytes(ckpt: Path) -> None:
    f = ckpt / f"adam.m.{SHARD}"
    flip(f, tensor_offset(f, "block.1") + 1001, 0xFF)


def v_bytes(ckpt: Path) -> None:
    f = ckpt / f"adam.v.{SHARD}"
    flip(f, tensor_offset(f, "lm_head") + 17, 0x01)


def m_dtype(ckpt: Path) -> None:
    edit_tensor(ckpt / f"adam.m.{SHARD}", "block.0", lambda t: t.to(torch.float16))


def legacy_nan(ckpt: Path) -> None:
    drop_digests(ckpt)
    edit_tensor(ckpt / f"weights.{SHARD}", "block.1", lambda t: t.index_fill_(0, torch.tensor([3140]), float("nan")))


def legacy_negative_v(ckpt: Path) -> None:
    drop_digests(ckpt)
    edit_tensor(ckpt / f"adam.v.{SHARD}", "embed", lambda t: t.index_fill_(0, torch.tensor([100]), -1e-12))


CORRUPTIONS = {
    "weight-exponent-bit": (exponent_bit, rf"weights\.{SHARD}: tensor block\.0: its bytes differ from the digest"),
    "m-byte-flip": (m_bytes, rf"adam\.m\.{SHARD}: tensor block\.1: its bytes differ from the digest"),
    "v-byte-flip": (v_bytes, rf"adam\.v\.{SHARD}: tensor lm_head: its bytes differ from the digest"),
    "m-wrong-dtype": (m_dtype, rf"adam\.m\.{SHARD}: tensor block\.0 is float16, this run keeps adam\.m in float32"),
    "legacy-nan": (legacy_nan, rf"weights\.{SHARD}: tensor block\.1 holds 1 NaN/inf value\(s\), the first at element "
                               r"3140 \(parameter layers\.1\.up, element 4\)"),
    "legacy-negative-v": (legacy_negative_v, rf"adam\.v\.{SHARD}: tensor embed holds 1 negative value\(s\) \(Adam's v "
                                             r"is a running mean of squares\), the first at element 100 \(parameter "
                                             r"embed, element 100\)"),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_a_corrupt_checkpoint_is_refused_by_continue_and_export(name, base, tmp_path, capsys):
    corrupt, problem = CORRUPTIONS[name]
    root = copy(base, tmp_path)
    corrupt(root / "ckpt" / "run" / STEP4)
    where = rf"ckpt/run/{STEP4}/{problem}.*; the newest checkpoint that verifies is \S*ckpt/run/{STEP2}: "
    err = refused(continue_argv(root), root, capsys)
    assert re.search(where + r"resume it with --continue 2$", err.strip()), err
    err = refused(export_argv(root), root, capsys)
    assert re.search(where + r"export it with --step 2$", err.strip()), err


def test_two_ranks_shards_swapped_are_refused(base2, tmp_path, capsys):
    """Rank 0's and rank 1's weight files swapped: the headers say so before anything is read (a resume on one
    rank reshards, so it would read both)."""
    root = copy(base2, tmp_path)
    ckpt = root / "ckpt" / "run" / STEP4
    a, b = ckpt / "weights.shard_000_of_002.safetensors", ckpt / "weights.shard_001_of_002.safetensors"
    a.rename(ckpt / "swap")
    b.rename(a)
    (ckpt / "swap").rename(b)
    where = (rf"ckpt/run/{STEP4}/weights\.shard_000_of_002\.safetensors: holds the shard written as "
             rf"weights\.shard_001_of_002\.safetensors \(files swapped or renamed.*; the newest checkpoint that "
             rf"verifies is \S*ckpt/run/{STEP2}: ")
    err = refused(continue_argv(root), root, capsys)
    assert re.search(where + r"resume it with --continue 2$", err.strip()), err
    err = refused(export_argv(root), root, capsys)
    assert re.search(where + r"export it with --step 2$", err.strip()), err


def test_two_ranks_agree_on_a_refusal_only_one_of_them_sees(base2, tmp_path):
    """A byte of rank 1's v flipped: only rank 1 reads that file; both ranks refuse (none waits for the other),
    and the launcher reports the one line with exit code 2; nothing changed."""
    root = copy(base2, tmp_path)
    f = root / "ckpt" / "run" / STEP4 / "adam.v.shard_001_of_002.safetensors"
    flip(f, tensor_offset(f, "block.0") + 8, 0x10)
    before = tree(root)
    r = qtrain_run(continue_argv(root, gpus=2), cwd=root, timeout=300)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("qtrain: ")]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]
    assert re.search(rf"adam\.v\.shard_001_of_002\.safetensors: tensor block\.0: its bytes differ from the digest.*"
                     rf"; the newest checkpoint that verifies is \S*{STEP2}: resume it with --continue 2$", lines[0])
    assert "Traceback" not in r.stderr
    assert tree(root) == before


def test_a_checkpoint_without_digests_still_resumes_bit_for_bit(base, tmp_path, capsys):
    """Written before qtrain recorded digests: resumed with a warning that says so, and to the same bits as the
    verified checkpoint."""
    finals = {}
    for kind in ("verified", "legacy"):
        root = copy(base, tmp_path / kind)
        if kind == "legacy":
            drop_digests(root / "ckpt" / "run" / STEP4)
        assert main(continue_argv(root)) == 0
        finals[kind] = load_file(root / "out" / "run" / "model.safetensors")
        warned = [e["message"] for e in read_log(root / "logs" / "run.jsonl") if "records no file digests" in
                  str(e.get("message", ""))]
        assert len(warned) == (1 if kind == "legacy" else 0), warned
        capsys.readouterr()
        assert main(export_argv(root, "--step", "4")) == 0
        assert ("records no file digests" in capsys.readouterr().err) == (kind == "legacy")
    assert finals["verified"].keys() == finals["legacy"].keys()
    assert all(torch.equal(finals["verified"][k], finals["legacy"][k]) for k in finals["verified"])


def test_the_tokenizer_copy_is_verified_and_goes_with_its_checkpoint(tmp_path, capsys):
    """The tokenizer files a checkpoint carries (tokenizer/, what its export writes) have digests like its shard
    files: one changed or added since is refused by --continue and export, naming step 2; keep-n deletes qtrain's
    own copies with their checkpoints (a folder of files, no link)."""
    root = make_run_root(tmp_path / "root")
    tok = _word_tokenizer(tmp_path / "tok.json")
    assert main(train_argv(root, steps=4, tokenizer=tok)) == 0
    ckpt = root / "ckpt" / "run"
    meta = json.loads((ckpt / STEP4 / "checkpoint.json").read_text())
    assert meta["digests"]["tokenizer/tokenizer.json"] == "sha256:" + hashlib.sha256(tok.read_bytes()).hexdigest()
    copy = ckpt / STEP4 / "tokenizer"
    original = (copy / "tokenizer.json").read_bytes()
    changes = {"changed": (lambda: (copy / "tokenizer.json").write_bytes(original + b"\n"),
                           r"tokenizer/tokenizer\.json: differs from the file copied into the checkpoint"),
               "added": (lambda: (copy / "vocab.json").write_text("{}"),
                         r"tokenizer/vocab\.json: not a file of the checkpoint's tokenizer copy")}
    for name, (change, problem) in changes.items():
        change()
        where = rf"ckpt/run/{STEP4}/{problem}.*; the newest checkpoint that verifies is \S*ckpt/run/{STEP2}: "
        err = refused(continue_argv(root, tokenizer=tok), root, capsys)
        assert re.search(where + r"resume it with --continue 2$", err.strip()), err
        err = refused(export_argv(root), root, capsys)
        assert re.search(where + r"export it with --step 2$", err.strip()), err
        (copy / "vocab.json").unlink(missing_ok=True)
        (copy / "tokenizer.json").write_bytes(original)
    assert main(train_argv(root, steps=6, tokenizer=tok, extra=("--continue", "--ckpt-keep-n", "1"))) == 0
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_")) == ["step_00000006"]
    assert (ckpt / "step_00000006" / "tokenizer" / "tokenizer.json").read_bytes() == original


# ---------------------------------------------------------------------------------------------- symbolic links

def users_copy(root: Path, step: str) -> Path:
    """The user's folder: a copy of a checkpoint and their README."""
    users = root / "users" / "copy"
    shutil.copytree(root / "ckpt" / "run" / step, users)
    (users / "README").write_text("my notes on this checkpoint\n")
    return users


@pytest.mark.parametrize("linked", ["older", "latest", "inside"])
def test_keep_n_never_deletes_through_a_link(linked, base, tmp_path):
    """`--continue --ckpt-keep-n 1` over a checkpoint folder holding the user's links: a step_N that is one
    (older than the resumed checkpoint, or the latest: then it is the one resumed), a checkpoint holding one,
    and stale leftovers holding one. The links and everything behind them stay; keep-n counts only
    qtrain's own checkpoints."""
    root = copy(base, tmp_path)
    ckpt = root / "ckpt" / "run"
    step = {"older": STEP2, "latest": STEP4, "inside": STEP2}[linked]
    users = users_copy(root, step)
    if linked == "inside":
        os.symlink(users / "README", ckpt / step / "README")
    else:
        shutil.rmtree(ckpt / step)
        os.symlink(users, ckpt / step)
    os.symlink(users, ckpt / "step_00000003.del-host-999999")  # a "half-deleted" leftover that is a link
    (ckpt / "step_00000005.tmp-host-999999").mkdir()  # a "half-written" one holding a link
    os.symlink(users / "README", ckpt / "step_00000005.tmp-host-999999" / "README")
    theirs = tree(root / "users")
    assert main(train_argv(root, steps=8, extra=("--continue", "--ckpt-keep-n", "1"))) == 0
    assert tree(root / "users") == theirs
    assert os.readlink(ckpt / "step_00000003.del-host-999999") == str(users)
    assert (ckpt / "step_00000005.tmp-host-999999" / "README").is_symlink()
    if linked == "inside":
        assert (ckpt / step / "README").is_symlink() and (ckpt / step / "checkpoint.json").is_file()
    else:
        assert os.readlink(ckpt / step) == str(users)
    steps = sorted(p.name for p in ckpt.glob("step_????????"))
    assert steps == sorted({step, "step_00000008"}), steps  # the user's, and the newest of qtrain's
    resumed = [e["resume"] for e in read_log(root / "logs" / "run.jsonl") if e["log"] == "run"][-1]
    assert resumed == str(ckpt / STEP4)  # the linked latest one is read like any other


def test_start_over_over_a_linked_checkpoint_is_refused_up_front(base, tmp_path, capsys):
    """--start-over deletes qtrain's checkpoints, and the new run would write its step 2 where the user's link
    is: refused before anything is deleted, naming the link."""
    root = copy(base, tmp_path)
    ckpt = root / "ckpt" / "run"
    users = users_copy(root, STEP2)
    shutil.rmtree(ckpt / STEP2)
    os.symlink(users, ckpt / STEP2)
    err = refused(train_argv(root, steps=4, extra=("--start-over",)), root, capsys)
    assert re.search(rf"--checkpoint-dir \S*ckpt/run: {STEP2} is a symbolic link to \S*users/copy, which qtrain "
                     rf"never deletes or replaces, and --start-over deletes only the checkpoints qtrain wrote, and "
                     rf"the new run could write step 2 there; move it out of the folder first", err), err
