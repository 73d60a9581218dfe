"""`qtrain tokenize` outputs as whole sets (issue 41, items 3 and 4, and the data side of item 10).

* It writes only its own files, listed in its index `qtrain-tokenize.json`: the user's `train.bin`,
  `eval-000.bin`, `train-999.bin` are refused (exit 2) and left byte for byte; `--overwrite` replaces only
  its own earlier output (before: they were deleted, exit 0).
* It publishes a set as a whole: a real `qtrain tokenize` killed (SIGKILL through a fault point) after the
  3rd of 6 shard renames, or midway over an earlier output, leaves a state every reader refuses, naming the set
  (before: 3 shards trained with exit 0; new train shards beside the old eval.bin); the next tokenize sweeps what
  the killed one left and publishes a complete set.
* Hostile inputs are one line each, quickly: a garbage Parquet file, a malformed tokenizer.json, a FIFO as an
  input or as --train-file, a 1 MB `[[[...` pattern (before: tracebacks, hangs).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest

from qtrain.cli.main import main
from qtrain.data.loader import TokenLoader
from qtrain.data.token_files import HEADER_BYTES, read_token_file, read_token_file_header, write_token_file
from qtrain.data.token_sets import INDEX, TokenSetError, TokenSetWriter
from tests.run_utils import CFG, make_run_root, qtrain_run, snapshot, train_argv

V = CFG.vocab_size
WORDS = [f"w{i}" for i in range(80)]
SHARD_TOKENS = 100  # 60 documents of 9 words + EOS = 600 tokens: 6 shards


@pytest.fixture
def bounded(request):
    """A hang (a FIFO opened for reading, a glob that never ends) fails the test after 30 s instead of blocking."""
    def timeout(*_):
        raise TimeoutError(f"{request.node.name}: still running after 30 s")
    old = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def tiny_tokenizer(path: Path) -> Path:
    """A word-level tokenizer.json with ids below the tiny model's vocabulary (EOS `<|endoftext|>`)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    vocab = {"[UNK]": 0, "<|endoftext|>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(str(path))
    return path


def make_root(tmp_path: Path, docs: int = 60, seed: int = 0) -> Path:
    root = make_run_root(tmp_path, tokens=600)
    tiny_tokenizer(root / "tok.json")
    rng = np.random.default_rng(seed)
    lines = [" ".join(rng.choice(WORDS, 9)) for _ in range(docs)]
    (root / "docs.txt").write_text("\n".join(lines) + "\n")
    return root


def tokenize_argv(root: Path, *extra: str, cap: int = SHARD_TOKENS, inputs: str = "docs.txt",
                  tokenizer: Path | None = None) -> list[str]:
    return ["tokenize", str(root / inputs), "--out-dir", str(root / "tok"), "--tokenizer", str(tokenizer or root / "tok.json"),
            "--split-lines", "--eval-fraction", "0", "--max-tokens-per-file", str(cap), "--workers", "1",
            "--no-progress", *extra]


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("qtrain: error: "), err[-3000:]
    assert len(lines[0]) < 1000, len(lines[0])
    return lines[0]


def index(root: Path) -> dict:
    return json.loads((root / "tok" / INDEX).read_text())


def hidden(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "tok").iterdir() if p.name.startswith("."))


def train(root: Path, capsys, train_file: str, eval_file: str | None = None, steps: int = 2) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(train_argv(root, steps=steps, train_file=train_file, eval_file=eval_file, ckpt_interval=1000))
    return rc, capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- item 3

def test_tokenize_refuses_the_users_files_and_leaves_them(tmp_path: Path, capsys) -> None:
    root = make_root(tmp_path)
    tok = root / "tok"
    tok.mkdir()
    write_token_file(tok / "train.bin", np.arange(50), vocab_size=V)
    (tok / "eval-000.bin").write_bytes(b"the user's eval shard")
    (tok / "train-999.bin").write_bytes(os.urandom(3000))
    before = snapshot(tok)
    for extra in ((), ("--overwrite",)):  # --overwrite replaces only what a qtrain tokenize wrote
        capsys.readouterr()
        assert main(tokenize_argv(root, *extra)) == 2
        line = one_error_line(capsys.readouterr().err)
        assert re.search(r"eval-000\.bin, train-999\.bin, train\.bin exist\(s\) and no qtrain tokenize wrote them",
                         line), line
        assert snapshot(tok) == before and sorted(p.name for p in tok.iterdir()) == sorted(before)


def test_overwrite_replaces_only_its_own_earlier_output(tmp_path: Path, capsys) -> None:
    root = make_root(tmp_path)
    assert main(tokenize_argv(root)) == 0
    first = index(root)
    assert first["complete"] and [s["name"] for s in first["shards"]] == [f"train-{i:03d}.bin" for i in range(6)]
    (root / "tok" / "notes.txt").write_text("the user's notes")
    capsys.readouterr()
    assert main(tokenize_argv(root)) == 2  # an earlier output is replaced only when asked
    assert "--overwrite replaces it" in one_error_line(capsys.readouterr().err)
    assert main(tokenize_argv(root, "--overwrite", cap=10_000)) == 0
    assert sorted(p.name for p in (root / "tok").iterdir()) == sorted([INDEX, "notes.txt", "train.bin"])
    assert (root / "tok" / "notes.txt").read_text() == "the user's notes"
    second = index(root)
    assert second["complete"] and second["set"] != first["set"] and second["files"] == ["train.bin"]
    rc, err = train(root, capsys, str(root / "tok" / "train*.bin"))
    assert rc == 0, err


# ---------------------------------------------------------------------------------------------- item 4

def test_kill_after_the_third_of_six_renames_is_refused_then_repaired(tmp_path: Path, capsys) -> None:
    root = make_root(tmp_path)
    r = qtrain_run(tokenize_argv(root), cwd=root, QTRAIN_FAULT="tokenize.rename:3")
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    man = index(root)
    assert not man["complete"] and len(man["shards"]) == 6
    assert sorted(p.name for p in (root / "tok").glob("train*.bin")) == ["train-000.bin", "train-001.bin",
                                                                          "train-002.bin"]
    assert len(hidden(root)) == 3  # the three staged shards not yet renamed
    rc, err = train(root, capsys, str(root / "tok" / "train*.bin"))
    assert rc == 2, err
    line = one_error_line(err)
    assert f"token set {man['set']}" in line and "incomplete" in line and "train-000.bin" in line, line
    # the same command again: sweeps what the killed one left, publishes the whole set
    capsys.readouterr()
    assert main(tokenize_argv(root)) == 0
    out = capsys.readouterr().out
    assert out.count("left by a qtrain tokenize that was killed") == 3, out
    assert hidden(root) == [] and index(root)["complete"]
    assert sorted(p.name for p in (root / "tok").iterdir()) == sorted([INDEX, *(f"train-{i:03d}.bin" for i in range(6))])
    rc, err = train(root, capsys, str(root / "tok" / "train*.bin"))
    assert rc == 0, err


def test_kill_midway_over_an_earlier_output_never_mixes_sets(tmp_path: Path, capsys) -> None:
    root = make_root(tmp_path)
    eval_split = ("--eval-fraction", "0.2")
    argv = [a for a in tokenize_argv(root, cap=10_000) if a not in ("--eval-fraction", "0")]
    assert main([*argv, *eval_split]) == 0  # set A: train.bin, eval.bin
    old = {n: (root / "tok" / n).read_bytes() for n in ("train.bin", "eval.bin")}
    (root / "more.txt").write_text((root / "docs.txt").read_text().replace("w1", "w2"))
    # set B, other documents, the same names: killed after its train.bin replaced A's, before its eval.bin
    new = [a if a != str(root / "docs.txt") else str(root / "more.txt") for a in argv]
    r = qtrain_run([*new, *eval_split, "--overwrite"], cwd=root, QTRAIN_FAULT="tokenize.rename:1")
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    man = index(root)
    assert not man["complete"]
    assert (root / "tok" / "train.bin").read_bytes() != old["train.bin"]  # replaced by a rename, never missing
    assert (root / "tok" / "eval.bin").read_bytes() == old["eval.bin"]
    for train_file, eval_file in (("train.bin", "eval.bin"), ("train*.bin", None), ("eval.bin", None)):
        rc, err = train(root, capsys, str(root / "tok" / train_file), eval_file and str(root / "tok" / eval_file))
        assert rc == 2, (train_file, err)
        assert f"token set {man['set']}" in one_error_line(err), err
    capsys.readouterr()
    assert main([*new, *eval_split, "--overwrite"]) == 0
    assert hidden(root) == [] and index(root)["complete"] and index(root)["set"] == man["set"]
    rc, err = train(root, capsys, str(root / "tok" / "train.bin"), str(root / "tok" / "eval.bin"))
    assert rc == 0, err


def test_readers_check_shards_against_the_set(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    assert main(tokenize_argv(root)) == 0
    tok, man = root / "tok", index(root)
    loader = TokenLoader(str(tok / "train*.bin"), 16, model_vocab_size=V)  # the whole set: read
    assert len(loader.files) == 6 and loader.num_tokens == 600
    TokenLoader(str(tok / "train-00[0-2].bin"), 16, model_vocab_size=V)  # a part chosen beside its index: read
    # what llm.q reads is unchanged: ints 0..6 as write_token_file writes them; the set's tag at 256..511
    tokens, _ = read_token_file(tok / "train-003.bin")
    plain = Path(write_token_file(tmp_path / "plain.bin", tokens, vocab_size=man["vocab_size"])).read_bytes()
    shard = (tok / "train-003.bin").read_bytes()
    assert shard[:256] == plain[:256] and shard[HEADER_BYTES:] == plain[HEADER_BYTES:]
    assert shard[256:512].rstrip(b"\0") == f"tokenset={man['set']} train 3 6".encode()
    assert str(read_token_file_header(tok / "train-003.bin").token_set) == f"train shard 4 of 6 of token set {man['set']}"
    # shards copied without the index: the headers alone must show the whole split
    part = tmp_path / "part"
    part.mkdir()
    for i in range(3):
        shutil.copy(tok / f"train-00{i}.bin", part)
    with pytest.raises(TokenSetError, match=rf"3 of the 6 train shards of token set {man['set']} \(missing: "
                                            r"train-003.bin, train-004.bin, train-005.bin\)"):
        TokenLoader(str(part / "*.bin"), 16)
    for i in range(3, 6):
        shutil.copy(tok / f"train-00{i}.bin", part)
    TokenLoader(str(part / "*.bin"), 16)
    # a shard changed in place (a sampled block), or replaced by another set's shard of that name: refused
    data = bytearray((tok / "train-001.bin").read_bytes())
    data[HEADER_BYTES: HEADER_BYTES + 4] = np.int32(5).tobytes()
    (tok / "train-001.bin").write_bytes(bytes(data))
    with pytest.raises(TokenSetError, match=r"train-001.bin: train shard 2 of 6 .* does not match its index .*"
                                            r"sampled digest"):
        TokenLoader(str(tok / "train*.bin"), 16)
    shutil.copy(part / "train-001.bin", tok / "train-001.bin")
    other = make_root(tmp_path / "other", seed=1)
    assert main(tokenize_argv(other)) == 0
    shutil.copy(other / "tok" / "train-002.bin", tok / "train-002.bin")
    with pytest.raises(TokenSetError, match=rf"train-002.bin: .*token set {index(other)['set']}, but the index .*"
                                            rf"token set {man['set']}.* does not list it"):
        TokenLoader(str(tok / "train*.bin"), 16)
    # files that are no set's shards (llm.q's, write_token_file's) read as before, even beside an index
    write_token_file(tok / "mine.bin", np.arange(40) % V, vocab_size=V)
    TokenLoader(str(tok / "mine.bin"), 16)


def test_leftovers_of_killed_tokenizes_are_swept_and_a_live_one_is_refused(tmp_path: Path, capsys) -> None:
    root = make_root(tmp_path)
    tok = root / "tok"
    tok.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tok / f".train-part003.bin.tmp.{dead.pid}").write_bytes(b"x" * 1000)  # what qtrain < token sets left
    (tok / f".train-part001.bin.tmp.{os.getppid()}").write_bytes(b"a live writer's")
    (tok / f".train-part000.bin.tmp-{os.uname().nodename.replace('-', '_')}-{dead.pid}").write_bytes(b"y")
    with TokenSetWriter(tok):  # another tokenize holds the folder
        capsys.readouterr()
        assert main(tokenize_argv(root)) == 2
        assert "another qtrain tokenize is writing into it" in one_error_line(capsys.readouterr().err)
    assert main(tokenize_argv(root)) == 0
    assert hidden(root) == [f".train-part001.bin.tmp.{os.getppid()}"]


# ---------------------------------------------------------------------------------------------- item 10, data side

def _with_tokenizer(root: Path, tokenizer: str) -> list[str]:
    argv = tokenize_argv(root)
    return [*argv[:argv.index("--tokenizer") + 1], str(root / tokenizer), *argv[argv.index("--tokenizer") + 2:]]


PATTERN = "[" * (1 << 20)
HOSTILE = {  # name: (what to make, the command, the message)
    "tokenize-garbage-parquet": (lambda r: (r / "garbage.parquet").write_bytes(b"PAR1" + os.urandom(2000) + b"PAR1"),
                                 lambda r: tokenize_argv(r, inputs="garbage.parquet"),
                                 r"garbage.parquet: not a Parquet file pyarrow can read"),
    "tokenize-truncated-tokenizer-json": (lambda r: (r / "bad.json").write_text('{"model": {"type": "WordLevel", "v'),
                                          lambda r: _with_tokenizer(r, "bad.json"),
                                          r"bad.json: not a tokenizer.json qtrain can read"),
    "tokenize-empty-tokenizer-json": (lambda r: (r / "bad.json").write_text("{}"), lambda r: _with_tokenizer(r, "bad.json"),
                                      r"bad.json: not a tokenizer.json qtrain can read"),
    "tokenize-binary-tokenizer-json": (lambda r: (r / "bad.json").write_bytes(os.urandom(500)),
                                       lambda r: _with_tokenizer(r, "bad.json"),
                                       r"bad.json: not a tokenizer.json qtrain can read"),
    "tokenize-fifo-input": (lambda r: os.mkfifo(r / "fifo.txt"), lambda r: tokenize_argv(r, inputs="fifo.txt"),
                            r"fifo.txt: is not a regular file"),
    "tokenize-1MB-pattern": (lambda r: None, lambda r: [*tokenize_argv(r)[:1], PATTERN, *tokenize_argv(r)[2:]],
                             r"\[\[\[\.\.\. \(1048576 characters\): longer than any path"),
    "train-fifo": (lambda r: os.mkfifo(r / "fifo.bin"),
                   lambda r: train_argv(r, train_file=r / "fifo.bin", eval_file=None),
                   r"fifo.bin: cannot read token file \(is not a regular file"),
    "train-1MB-pattern": (lambda r: None, lambda r: train_argv(r, train_file=PATTERN, eval_file=None),
                          r"\[\[\[\.\.\. \(1048576 characters\): longer than any path"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_input_is_one_line(tmp_path: Path, capsys, bounded, case: str) -> None:
    make, argv, want = HOSTILE[case]
    root = make_root(tmp_path)
    make(root)
    before = snapshot(root, skip=("fifo",))
    capsys.readouterr()
    assert main(argv(root)) == 2, case
    assert re.search(want, one_error_line(capsys.readouterr().err)), want
    assert snapshot(root, skip=("fifo",)) == before


# ---------------------------------------------------------------------------------------------- every window

def _trace_points(trace: Path) -> list[tuple[str, int]]:
    seen: dict[str, int] = {}
    plan = []
    for p in trace.read_text().split():
        if p.startswith("tokenize."):
            seen[p] = seen.get(p, 0) + 1
            plan.append((p, seen[p]))
    return plan


@pytest.mark.slow
@pytest.mark.parametrize("earlier_cap,new_cap", [(SHARD_TOKENS, 10_000), (10_000, SHARD_TOKENS)])
def test_a_kill_in_every_window_over_an_earlier_output(tmp_path: Path, earlier_cap: int, new_cap: int) -> None:
    """SIGKILL at every fault point of a `--overwrite` tokenize over an earlier output (6 shards -> 1, and back).
    After each kill: the user's files are unchanged; a reader either refuses or reads one complete set; until the
    new set's index is complete every name of the earlier output exists; the same command again publishes
    exactly the uninterrupted run's files and leaves nothing else."""
    template = make_root(tmp_path / "template")
    eval_flags = ["--eval-fraction", "0.2"]

    def argv(root: Path, cap: int, inputs: str) -> list[str]:
        return [a for a in tokenize_argv(root, cap=cap, inputs=inputs, tokenizer=template / "tok.json")
                if a not in ("--eval-fraction", "0")] + eval_flags  # one tokenizer path: the headers record it

    (template / "more.txt").write_text((template / "docs.txt").read_text().replace("w1", "w2"))
    assert qtrain_run(argv(template, earlier_cap, "docs.txt"), cwd=template).returncode == 0
    earlier = index(template)
    (template / "tok" / "notes.txt").write_text("the user's notes")
    write_token_file(template / "tok" / "mine.bin", np.arange(40) % 80, vocab_size=earlier["vocab_size"])
    ref = tmp_path / "ref"
    shutil.copytree(template, ref)
    r = qtrain_run(argv(ref, new_cap, "more.txt") + ["--overwrite"], cwd=ref, QTRAIN_FAULT_TRACE=str(tmp_path / "t"))
    assert r.returncode == 0, r.stderr
    want = snapshot(ref / "tok")
    plan = _trace_points(tmp_path / "t")
    assert {p for p, _ in plan} >= {"tokenize.write", "tokenize.staged", "tokenize.rename", "tokenize.unlink",
                                    "tokenize.index.tmp", "tokenize.index.done"}
    for point, n in plan:
        root = tmp_path / f"{point}-{n}"
        shutil.copytree(template, root)
        mine = {k: v for k, v in snapshot(root / "tok").items() if k in ("notes.txt", "mine.bin")}
        cmd = argv(root, new_cap, "more.txt") + ["--overwrite"]
        r = qtrain_run(cmd, cwd=root, QTRAIN_FAULT=f"{point}:{n}")
        assert r.returncode == -signal.SIGKILL, (point, n, r.stderr[-2000:])
        assert {k: v for k, v in snapshot(root / "tok").items() if k in mine} == mine, (point, n)
        man = index(root)
        if not (man["complete"] and man["set"] != earlier["set"]):
            missing = [s["name"] for s in earlier["shards"] if not (root / "tok" / s["name"]).exists()]
            assert not missing, (point, n, missing)
        for train_file, eval_file in (("train*.bin", "eval*.bin"), ("*.bin", None)):
            try:
                loaders = [TokenLoader(str(root / "tok" / f), 16, model_vocab_size=V) for f in (train_file, eval_file)
                           if f]
            except TokenSetError:
                continue
            sets = {f.header.token_set.set_id for ld in loaders for f in ld.files if f.header.token_set}
            assert man["complete"] and sets == {man["set"]}, (point, n, sets, man["set"])
        r = qtrain_run(cmd, cwd=root)
        assert r.returncode == 0, (point, n, r.stderr[-2000:])
        assert snapshot(root / "tok") == want and hidden(root) == [], (point, n)
