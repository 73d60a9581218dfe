"""Bad input to document masking and packing (issue 45): `--document-masking` on a file with nothing to split at,
`qtrain tokenize --pack-to` with a bad N, `--no-truncate` with an over-long example, a corrupt documents section
(out of range, not increasing, not starting at 0, cut short, a count that is no number), and tokenize's output folder
(read-only, missing). Each row asserts, in process through `qtrain.cli.main.main`: exit code 2, the one-line
`qtrain: error: ...` (or argparse's usage line) naming the option or file, no traceback, and that nothing under the
test's root changed or appeared (the refusal comes before the model is built and before anything is written).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from qtrain.cli.main import main
from qtrain.data.token_files import HEADER_BYTES, write_token_file
from tests.run_utils import CFG, make_run_root, train_argv

V = CFG.vocab_size  # the tiny model; its eos_token_id is 0
ROWS, T = 12, 16


def tree(root: Path) -> dict[str, bytes | None]:
    """Every file (bytes) and folder (None) under root."""
    out: dict[str, bytes | None] = {}
    for dirpath, dirs, files in os.walk(root):
        for d in dirs:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = None
        for f in files:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = Path(p).read_bytes()
    return out


def packed_file(path: Path) -> tuple[Path, int]:
    """A token file of ROWS rows of T tokens (+1 tail) with masks and a documents section (two documents a row);
    returns it and the byte offset of its documents section."""
    n = ROWS * T + 1
    tokens = np.random.default_rng(1).integers(1, V, n).astype(np.int32)
    starts = np.sort(np.r_[np.arange(0, n, T), np.arange(5, n - 1, T)])
    write_token_file(path, tokens, vocab_size=V, masks=np.ones(n, dtype=bool), starts=starts)
    return path, HEADER_BYTES + 4 * n + (n + 7) // 8


def poke_starts(values: dict[int, int]) -> Callable[[Path], None]:
    """Overwrite entries of packed.bin's documents section."""
    def setup(root: Path) -> None:
        path, at = packed_file(root / "packed.bin")
        with open(path, "r+b") as f:
            for i, v in values.items():
                f.seek(at + 4 * i)
                f.write(np.int32(v).tobytes())
    return setup


def cut_starts(root: Path) -> None:
    path, _ = packed_file(root / "packed.bin")
    os.truncate(path, path.stat().st_size - 6)


def bad_tag(root: Path) -> None:
    path, _ = packed_file(root / "packed.bin")
    with open(path, "r+b") as f:
        f.seek(128)
        f.write(b"documents=2x\0")


def no_eos(root: Path) -> None:
    write_token_file(root / "noeos.bin", np.random.default_rng(2).integers(1, V, 400).astype(np.int32), vocab_size=V)


def no_eos_id(root: Path) -> None:
    """The model's config names no eos_token_id, and the file is no qtrain tokenize output."""
    no_eos(root)
    cfg = json.loads((root / "model" / "config.json").read_text())
    cfg.pop("eos_token_id")
    (root / "model" / "config.json").write_text(json.dumps(cfg))


def examples(root: Path, long: bool = True) -> None:
    rows = [{"q": "what is one", "a": "one"}, {"q": "and two", "a": "two"}]
    if long:
        rows.insert(1, {"q": "count", "a": " ".join(str(i) for i in range(60))})
    (root / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@dataclass
class Case:
    name: str
    argv: Callable[[Path], list[str]]  # root -> the command line
    match: str  # regex the error line must contain
    setup: Callable[[Path], None] | None = None


def train(file: str, *, eval_file: str | None = None, extra: tuple[str, ...] = ("--document-masking",)):
    def argv(root: Path) -> list[str]:
        return train_argv(root, steps=2, train_file=root / file, eval_file=root / (eval_file or file),
                          eval_num_steps=1, extra=extra)
    return argv


def evaluate(file: str):
    return lambda root: ["eval", "--model", str(root / "model"), "--eval-file", str(root / file), "--seq-len", str(T),
                         "--batch-size", "2", "--device", "cpu", "--document-masking"]


def tokenize(*flags: str, out: str = "tok"):
    return lambda root: ["tokenize", str(root / "qa.jsonl"), "--out-dir", str(root / out), "--tokenizer", "gpt2",
                         "--prompt-field", "q", "--response-field", "a", "--eval-fraction", "0", "--no-progress",
                         "--workers", "1", *flags]


NO_EOS = r"noeos.bin: --document-masking: the file records no document boundaries .* and holds no EOS token \(id 0"
CORRUPT = r"packed.bin: corrupt documents section \(byte \d+\): "
CASES = [
    Case("masking-no-eos-train", train("noeos.bin"), NO_EOS, no_eos),
    Case("masking-no-eos-eval-file", train("packed.bin", eval_file="noeos.bin"), NO_EOS,
         lambda root: (no_eos(root), packed_file(root / "packed.bin"))),
    Case("masking-no-eos-qtrain-eval", evaluate("noeos.bin"), NO_EOS, no_eos),
    Case("masking-no-eos-id", train("noeos.bin"), r"noeos.bin: --document-masking: .* no EOS id is known", no_eos_id),
    Case("pack-to-0", tokenize("--pack-to", "0"), r"--pack-to must be >= 2 tokens .*got 0", examples),
    Case("pack-to-negative", tokenize("--pack-to=-4"), r"--pack-to must be >= 2 tokens .*got -4", examples),
    Case("pack-to-float", tokenize("--pack-to", "1.5"), r"argument --pack-to: invalid int value: '1.5'", examples),
    Case("pack-to-word", tokenize("--pack-to", "many"), r"argument --pack-to: invalid int value: 'many'", examples),
    Case("pack-to-plain-text", lambda root: ["tokenize", str(root / "qa.jsonl"), "--out-dir", str(root / "tok"),
                                             "--tokenizer", "gpt2", "--pack-to", "16"],
         r"--pack-to packs chat or SFT records: give --messages-field", examples),
    Case("no-truncate-over-long", tokenize("--pack-to", "16", "--no-truncate"),
         r"qa.jsonl:2: the example has \d+ tokens, more than --pack-to 16; --no-truncate refuses it", examples),
    Case("no-truncate-over-long-pad", tokenize("--pad-to", "16", "--no-truncate"),
         r"qa.jsonl:2: the example has \d+ tokens, more than --pad-to 16", examples),
    Case("no-truncate-alone", tokenize("--no-truncate"), r"--no-truncate goes with --pack-to or --pad-to", examples),
    Case("pack-and-pad", tokenize("--pack-to", "16", "--pad-to", "16"), r"either --pack-to .* or --pad-to", examples),
    Case("pack-to-over-max-tokens-per-file", tokenize("--pack-to", "16", "--max-tokens-per-file", "8"),
         r"--max-tokens-per-file 8 is below one row of --pack-to 16 tokens", examples),
    Case("pad-to-over-max-tokens-per-file", tokenize("--pad-to", "32", "--max-tokens-per-file", "31"),
         r"--max-tokens-per-file 31 is below one row of --pad-to 32 tokens", examples),
    Case("starts-out-of-range", train("packed.bin"), CORRUPT + r"its last entry 9999 is beyond the 193 tokens",
         poke_starts({ROWS * 2: 9999})),
    Case("starts-not-increasing", train("packed.bin"), CORRUPT + r"entry 4 \(3\) does not follow entry 3 \(21\)",
         poke_starts({4: 3})),
    Case("starts-first-not-0", train("packed.bin"), CORRUPT + r"its first entry is 2, not 0", poke_starts({0: 2})),
    Case("starts-negative", train("packed.bin"), CORRUPT + r"its first entry is -1, not 0", poke_starts({0: -1})),
    Case("starts-cut-short", train("packed.bin"),
         r"packed.bin: truncated token file: \d+ bytes, but the header's 193 tokens \+ masks \+ 25 document starts "
         r"need \d+", cut_starts),
    Case("starts-cut-short-qtrain-eval", evaluate("packed.bin"), r"packed.bin: truncated token file", cut_starts),
    Case("starts-bad-count", train("packed.bin"), r"packed.bin: corrupt documents tag in the header at byte 128",
         bad_tag),
    Case("starts-corrupt-qtrain-eval", evaluate("packed.bin"), CORRUPT + r"entry 4", poke_starts({4: 3})),
]


def run_case(case: Case, root: Path, capsys) -> None:
    if case.setup is not None:
        case.setup(root)
    before = tree(root)
    capsys.readouterr()
    try:
        rc = main(case.argv(root))
    except SystemExit as e:  # argparse
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    assert re.search(case.match, err), f"{case.match!r} not in {err!r}"
    assert err.strip().startswith(("qtrain: error: ", "usage: ")), err
    if err.strip().startswith("qtrain: error: "):
        assert len(err.strip().splitlines()) == 1, err
    after = tree(root)
    assert sorted(after) == sorted(before), sorted(set(after) ^ set(before))
    assert not [k for k in before if before[k] != after[k]]


@pytest.fixture
def root(tmp_path) -> Path:
    return make_run_root(tmp_path / "root", tokens=600)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_packing_input(case: Case, root: Path, capsys) -> None:
    run_case(case, root, capsys)


@pytest.fixture
def read_only_fs(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,ro", "tmpfs", str(d)], capture_output=True)
    if r.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root): " + r.stderr.decode().strip())
    yield d
    subprocess.run(["umount", str(d)], capture_output=True)


@pytest.mark.parametrize("where", ["folder", "missing-folder-below"])
def test_pack_to_into_read_only_output(where, root: Path, read_only_fs: Path, capsys) -> None:
    """A read-only --out-dir (a read-only file system: permissions do not bind root): refused before any work,
    naming the option and folder."""
    examples(root, long=False)
    out = read_only_fs if where == "folder" else read_only_fs / "new" / "tok"
    before = tree(root)
    rc = main(tokenize("--pack-to", "16", out=str(out))(root))  # root / an absolute path: that path
    err = capsys.readouterr().err
    assert rc == 2, err
    want = "is not writable" if where == "folder" else r"cannot be created \(Read-only file system\)"
    assert re.search(rf"^qtrain: error: --out-dir {re.escape(str(out))}: {want}", err), err
    assert tree(root) == before and os.listdir(read_only_fs) == []


def test_pack_to_into_missing_folder_and_over_earlier_output(root: Path, capsys) -> None:
    """A missing --out-dir (and its parents) is made; the files appear whole (written to temp names, then renamed);
    a second tokenize into it is refused without --overwrite, and replaces the set with it."""
    examples(root, long=False)
    argv = tokenize("--pack-to", "16", out="a/b/tok")
    assert main(argv(root)) == 0
    out = root / "a" / "b" / "tok"
    assert sorted(os.listdir(out)) == ["qtrain-tokenize.json", "train.bin"]
    first = tree(root)
    capsys.readouterr()
    assert main(argv(root)) == 2
    assert "holds the output of an earlier qtrain tokenize" in capsys.readouterr().err and tree(root) == first
    assert main(argv(root) + ["--overwrite"]) == 0 and tree(root) == first  # deterministic: the same bytes
