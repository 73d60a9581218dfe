"""Hostile and broken inputs found outside the bad-input table: each is refused before anything is built or
written, quickly, with one line `qtrain: error: ...` of at most a few hundred characters naming the file, key or
option, and exit code 2; nothing the user had changes.

* checked only at the end of a run before: a malformed `--tokenizer` file or `tokenizer.json` in `--model` (a
  traceback at the export, after every step had trained), an `--out-dir` that is a symlink loop (`[Errno 17]` at
  the export); accepted silently before: `num_key_value_heads: 0` / `head_dim: 0` (replaced by defaults) and
  token ids outside the vocabulary in config.json;
* sizes and depths: a YAML "billion laughs" `--config` (69 s, 6.2 GB and a 2 GB error line before), deeply nested
  YAML / TOML / config.json / generation_config.json / tokenizer_config.json / safetensors index (RecursionError
  tracebacks), files of gigabytes (sparse, so nothing is really written), values of a megabyte (echoed whole);
* FIFOs as config files or weights (a read that never ends: the preflight hung);
* a malformed tokenizer.json for `qtrain generate` (a traceback).

Rows run in process through `qtrain.cli.main.main` under an alarm (a hang fails the row instead of the suite);
the billion laughs runs as a subprocess, to measure its peak memory.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

from qtrain.cli.main import main
from qtrain.model.hf_io import save_hf_model
from qtrain.model.weights import param_shapes
from tests.run_utils import CFG, make_run_root, subprocess_env, train_argv

V = CFG.vocab_size
# the message names a file (its path is the test's, counted as "ROOT"), shows at most ~200 characters of a value and
# says what is wrong
MAX_LINE = 400
ALARM_S = 30  # a hang fails the row; every row takes well under a second when it works


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """The tiny model's config (model/), its weights (weights/), token files, and a tiny character tokenizer."""
    root = make_run_root(tmp_path_factory.mktemp("hostile"))
    g = torch.Generator().manual_seed(1)
    params = {n: torch.randn(s, generator=g) * 0.02 for n, s in param_shapes(CFG).items()}
    save_hf_model(root / "weights", CFG, params, dtype=torch.float32)
    (root / "tokenizer.json").write_text(tiny_tokenizer_json())
    return root


def tiny_tokenizer_json() -> str:
    """A character-level tokenizer with the tiny model's vocabulary: printable ASCII, then <|endoftext|>."""
    from tokenizers import Tokenizer, models
    vocab = {chr(32 + i): i for i in range(V - 1)}
    vocab["<|endoftext|>"] = V - 1
    return Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|endoftext|>")).to_str()


def tree(root: Path) -> dict[str, bytes | str | None]:
    """Every file (bytes), folder (None), link and FIFO (a tag) under root; FIFOs are never opened."""
    out: dict[str, bytes | str | None] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = "link -> " + os.readlink(p)
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = None
            elif stat.S_ISREG(st.st_mode):
                out[rel] = Path(p).read_bytes() if st.st_blocks * 512 < (64 << 20) else f"sparse {st.st_size}"
            else:
                out[rel] = f"special {stat.S_IFMT(st.st_mode)}"
    return out


@dataclass
class Case:
    name: str
    argv: Callable[[Path], list[str]]
    match: str  # regex the one error line must contain
    setup: Callable[[Path], None] | None = None


class Hung(Exception):
    pass


def _alarm(signum, frame):
    raise Hung(f"no answer within {ALARM_S} s")


def run_case(case: Case, base: Path, tmp_path: Path, capsys) -> None:
    root = tmp_path / "root"
    shutil.copytree(base, root, symlinks=True)
    if case.setup is not None:
        case.setup(root)
    before = tree(root)
    capsys.readouterr()
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(ALARM_S)
    try:
        rc = main(case.argv(root))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    err = capsys.readouterr().err
    line = err.strip()
    assert rc == 2, err[-3000:]
    assert line.startswith("qtrain: error: ") and "\n" not in line, err[-3000:]
    assert len(line.replace(str(root), "ROOT")) <= MAX_LINE, f"{len(line)} characters: {line[:600]}"
    assert re.search(case.match, line), f"{case.match!r} not in {line!r}"
    after = tree(root)
    assert sorted(after) == sorted(before), sorted(set(after) ^ set(before))
    assert [k for k in before if before[k] != after[k]] == []


def train(**flags) -> Callable[[Path], list[str]]:
    """`qtrain train` on the tiny model (run `new`, 4 steps); "{root}" in values is the test's root."""
    extra = tuple(flags.pop("extra", ()))

    def argv(root: Path) -> list[str]:
        fl = {k: v.format(root=root) if isinstance(v, str) else v for k, v in flags.items()}
        return train_argv(root, steps=4, name="new", extra=tuple(a.format(root=root) for a in extra), **fl)
    return argv


def cmd(*args: str) -> Callable[[Path], list[str]]:
    return lambda root: [a.format(root=root) for a in args]


def write(rel: str, text: str | bytes) -> Callable[[Path], None]:
    def setup(root: Path) -> None:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return setup


def fifo(rel: str) -> Callable[[Path], None]:
    def setup(root: Path) -> None:
        (root / rel).unlink(missing_ok=True)
        os.mkfifo(root / rel)
    return setup


def sparse(rel: str, size: int) -> Callable[[Path], None]:
    """A file of `size` bytes that takes no disk space (a hole): a huge input without writing gigabytes."""
    def setup(root: Path) -> None:
        with open(root / rel, "wb") as f:
            f.truncate(size)
    return setup


def steps(*fns: Callable[[Path], None]) -> Callable[[Path], None]:
    def setup(root: Path) -> None:
        for fn in fns:
            fn(root)
    return setup


def copy_weights(rel: str, tokenizer: bool = False) -> Callable[[Path], None]:
    """weights/ copied to `rel` (with the tiny tokenizer.json when asked)."""
    def setup(root: Path) -> None:
        shutil.copytree(root / "weights", root / rel)
        if tokenizer:
            shutil.copy(root / "tokenizer.json", root / rel / "tokenizer.json")
    return setup


def model_json(**changes) -> Callable[[Path], None]:
    def setup(root: Path) -> None:
        d = json.loads((root / "model" / "config.json").read_text())
        d.update(changes)
        (root / "model" / "config.json").write_text(json.dumps(d))
    return setup


def loop(rel: str) -> Callable[[Path], None]:
    return lambda root: os.symlink(rel.rsplit("/", 1)[-1], root / rel)


DEEP_JSON = "[" * 200_000 + "]" * 200_000
MEGA = "x" * 1_000_000
GENERATE = ("generate", "--prompt", "hi", "--max-new-tokens", "2", "--device", "cpu")
EVAL = ("eval", "--eval-file", "{root}/eval.bin", "--seq-len", "16", "--device", "cpu")

# ---------------------------------------------------------------------------------------------- item 9: preflight

PREFLIGHT_CASES = [
    Case("tokenizer-file-garbage", train(tokenizer="{root}/bad.json"), r"bad.json: not a tokenizer.json qtrain can "
         r"read", write("bad.json", "{ this is not json")),
    Case("tokenizer-file-not-a-tokenizer", train(tokenizer="{root}/bad.json"), r"bad.json: not a tokenizer.json",
         write("bad.json", '{"version": "1.0", "model": 7}')),
    Case("tokenizer-file-not-utf8", train(tokenizer="{root}/bad.json"), r"bad.json: not a tokenizer.json",
         write("bad.json", b"\xff\xfe\x00garbage")),
    Case("model-tokenizer-garbage", train(model="{root}/tm"), r"tm/tokenizer.json: not a tokenizer.json qtrain can "
         r"read", steps(copy_weights("tm"), write("tm/tokenizer.json", "]]]"))),
    Case("model-tokenizer-garbage-with-config", train(model="{root}/tm"), r"tm/tokenizer.json: not a tokenizer.json",
         steps(copy_weights("tm"), write("tm/tokenizer.json", "{}"), write("tm/tokenizer_config.json", "{}"))),
    Case("out-dir-symlink-loop", train(out_dir="{root}/loop"), r"--out-dir .*loop: .*symlink", loop("loop")),
    Case("out-dir-inside-symlink-loop", train(out_dir="{root}/loop/sub"),
         r"--out-dir .*loop/sub: .*loop is a symlink loop",
         loop("loop")),
    Case("ckpt-dir-symlink-loop", train(checkpoint_dir="{root}/loop"), r"--checkpoint-dir .*loop: .*symlink",
         loop("loop")),
    Case("log-file-symlink-loop", train(log_file="{root}/loop.jsonl"), r"--log-file .*loop.jsonl: is a symlink loop",
         loop("loop.jsonl")),
    Case("out-dir-dangling-symlink", train(out_dir="{root}/gone"), r"--out-dir .*gone: .*symlink",
         lambda root: os.symlink(root / "nowhere" / "deeper", root / "gone")),
] + [
    Case(f"model-json-{name}", train(), match, model_json(**changes)) for name, changes, match in [
        ("kv-heads-0", {"num_key_value_heads": 0},
         r"config.json: num_key_value_heads must be a positive integer, got 0"),
        ("head-dim-0", {"head_dim": 0}, r"config.json: head_dim must be a positive integer, got 0"),
        ("eos-out-of-vocab", {"eos_token_id": 1_000_000}, rf"config.json: eos_token_id 1000000 is not a token id of "
         rf"the vocabulary \(0\.\.{V - 1}\)"),
        ("eos-list-out-of-vocab", {"eos_token_id": [0, 500]}, r"config.json: eos_token_id 500 is not a token id"),
        ("eos-negative", {"eos_token_id": -1}, r"config.json: eos_token_id -1 is not a token id"),
        ("bos-out-of-vocab", {"bos_token_id": V}, rf"config.json: bos_token_id {V} is not a token id"),
        ("pad-out-of-vocab", {"pad_token_id": 200}, r"config.json: pad_token_id 200 is not a token id"),
    ]
]

# ---------------------------------------------------------------------------------------------- item 10: sizes, depths

CONFIG_CASES = [
    Case("config-yaml-deep", train(extra=("--config", "{root}/c.yaml")), r"--config .*c.yaml: nested more than 64 "
         r"levels deep", write("c.yaml", "lr: " + "[" * 5000 + "]" * 5000 + "\n")),
    Case("config-yaml-deep-mapping", train(extra=("--config", "{root}/c.yaml")), r"--config .*c.yaml: nested more "
         r"than 64 levels deep", write("c.yaml", "lr: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n")),
    Case("config-yaml-aliases", train(extra=("--config", "{root}/c.yaml")), r"--config .*c.yaml: its aliases expand "
         r"to more than", write("c.yaml", "a: &a [" + ", ".join(["lol"] * 1000) + "]\nlr: [" + ", ".join(["*a"] * 1000)
                                + "]\n")),
    Case("config-toml-deep", train(extra=("--config", "{root}/c.toml")), r"--config .*c.toml: nested more than 64 "
         r"levels deep", write("c.toml", "lr = " + "[" * 5000 + "]" * 5000 + "\n")),
    Case("config-toml-deep-table", train(extra=("--config", "{root}/c.toml")), r"--config .*c.toml: nested more than "
         r"64 levels deep", write("c.toml", "lr = " + "{a = " * 3000 + "1" + "}" * 3000 + "\n")),
    Case("config-toml-huge", train(extra=("--config", "{root}/c.toml")), r"--config .*c.toml: 64.00 MiB is larger "
         r"than the 256.00 KiB", sparse("c.toml", 64 << 20)),
    Case("config-yaml-fifo", train(extra=("--config", "{root}/c.yaml")), r"--config .*c.yaml: is not a regular file",
         fifo("c.yaml")),
    Case("config-long-value", train(extra=("--config", "{root}/c.toml")), r"option 'lr' must be a number, got 'xxx",
         write("c.toml", f'lr = "{MEGA[:200_000]}"\n')),
    Case("config-long-yaml-list", train(extra=("--config", "{root}/c.yaml")), r"option 'lr' must be a number",
         write("c.yaml", "lr: [" + ", ".join(["abcdefgh"] * 5_000) + "]\n")),
    Case("config-many-unknown-keys", train(extra=("--config", "{root}/c.toml")), r"unknown option\(s\)",
         write("c.toml", "".join(f"k{i} = 1\n" for i in range(20_000)))),
    Case("config-long-key", train(extra=("--config", "{root}/c.toml")), r"unknown option\(s\)",
         write("c.toml", f"{MEGA[:200_000]} = 1\n")),
    Case("config-long-section-key", train(extra=("--config", "{root}/c.toml")), r"is a table inside a section",
         write("c.toml", f"[{MEGA[:100_000]}.{MEGA[:100_000]}]\nlr = 1\n")),
]

MODEL_CASES = [
    Case("model-json-deep", train(), r"model/config.json: nested more than 64 levels deep",
         write("model/config.json", DEEP_JSON)),
    Case("model-json-deep-in-object", train(), r"model/config.json: nested more than 64 levels deep",
         write("model/config.json", '{"rope_scaling": ' + "{\"a\": " * 100_000 + "1" + "}" * 100_001)),
    Case("model-json-huge", train(), r"model/config.json: 256.00 MiB is larger than",
         sparse("model/config.json", 256 << 20)),
    Case("model-json-fifo", train(), r"model/config.json: is not a regular file", fifo("model/config.json")),
    Case("model-json-long-type", train(), r"unknown model_type 'xxxx", model_json(model_type=MEGA)),
    Case("model-json-long-key", train(), r"unknown config key", model_json(**{MEGA: 1})),
    Case("model-json-long-value", train(), r"hidden_size must be an integer, got 'xxx", model_json(hidden_size=MEGA)),
    Case("model-json-eos-long-list", train(), r"eos_token_id must be an integer or a list of integers",
         model_json(eos_token_id=["x"] * 100_000)),
    Case("eval-model-json-fifo", cmd(*EVAL, "--model", "{root}/w2"), r"w2/config.json: is not a regular file",
         steps(copy_weights("w2"), fifo("w2/config.json"))),
    Case("index-deep", train(model="{root}/w2", extra=("--no-from-scratch",)),
         r"w2/model.safetensors.index.json: nested more than 64 levels deep",
         steps(copy_weights("w2"), write("w2/model.safetensors.index.json", DEEP_JSON))),
    Case("index-fifo", train(model="{root}/w2", extra=("--no-from-scratch",)),
         r"w2/model.safetensors.index.json: is not a regular file",
         steps(copy_weights("w2"), fifo("w2/model.safetensors.index.json"))),
    Case("index-long-shard-name", train(model="{root}/w2", extra=("--no-from-scratch",)),
         r"shard name 'xxx.* is not a file name",
         steps(copy_weights("w2"), write("w2/model.safetensors.index.json",
                                         json.dumps({"weight_map": {"a": "x" * 1_000_000 + "/"}})))),
    Case("weights-fifo", cmd(*EVAL, "--model", "{root}/w2"), r"w2/model.safetensors: is not a regular file",
         steps(copy_weights("w2"), fifo("w2/model.safetensors"))),
    Case("weights-header-huge", cmd(*EVAL, "--model", "{root}/w2"), r"w2/model.safetensors: not a readable "
         r"safetensors file", steps(copy_weights("w2"), write("w2/model.safetensors", (1 << 60).to_bytes(8, "little")
                                                                + b"{" * 64))),
]

GENERATE_CASES = [
    Case("generate-tokenizer-garbage", cmd(*GENERATE, "--model", "{root}/w2"), r"w2/tokenizer.json: not a "
         r"tokenizer.json qtrain can read", steps(copy_weights("w2"), write("w2/tokenizer.json", "{ nope"))),
    Case("generate-tokenizer-empty-object", cmd(*GENERATE, "--model", "{root}/w2"), r"w2/tokenizer.json: not a "
         r"tokenizer.json", steps(copy_weights("w2"), write("w2/tokenizer.json", "{}"))),
    Case("generate-tokenizer-option-garbage", cmd(*GENERATE, "--model", "{root}/weights", "--tokenizer",
                                                  "{root}/bad.json"), r"bad.json: not a tokenizer.json",
         write("bad.json", "[1, 2")),
    Case("generate-tokenizer-deep", cmd(*GENERATE, "--model", "{root}/w2"), r"w2/tokenizer.json: not a "
         r"tokenizer.json qtrain can read \(recursion limit", steps(copy_weights("w2"), write(
             "w2/tokenizer.json", '{"model": ' + '{"a": ' * 200_000 + "1" + "}" * 200_001))),
    Case("generate-tokenizer-config-deep", cmd(*GENERATE, "--model", "{root}/w2"),
         r"w2/tokenizer_config.json: nested more than 64 levels deep",
         steps(copy_weights("w2", tokenizer=True), write("w2/tokenizer_config.json", DEEP_JSON))),
    Case("generate-tokenizer-config-fifo", cmd(*GENERATE, "--model", "{root}/w2"),
         r"w2/tokenizer_config.json: is not a regular file",
         steps(copy_weights("w2", tokenizer=True), fifo("w2/tokenizer_config.json"))),
    Case("generate-generation-config-deep", cmd(*GENERATE, "--model", "{root}/w2"),
         r"w2/generation_config.json: nested more than 64 levels deep",
         steps(copy_weights("w2", tokenizer=True), write("w2/generation_config.json", DEEP_JSON))),
    Case("generate-generation-config-fifo", cmd(*GENERATE, "--model", "{root}/w2"),
         r"w2/generation_config.json: is not a regular file",
         steps(copy_weights("w2", tokenizer=True), fifo("w2/generation_config.json"))),
]

ALL = PREFLIGHT_CASES + CONFIG_CASES + MODEL_CASES + GENERATE_CASES


@pytest.mark.parametrize("case", ALL, ids=[c.name for c in ALL])
def test_hostile_input(case, base, tmp_path, capsys):
    run_case(case, base, tmp_path, capsys)


def test_generate_works_with_the_tiny_tokenizer(base, tmp_path, capsys):
    """The generate rows fail on their broken file, not on the setup: with the files intact, generate runs."""
    root = _copy(base, tmp_path)
    copy_weights("w2", tokenizer=True)(root)
    assert main([*GENERATE, "--model", str(root / "w2")]) == 0, capsys.readouterr().err


def test_manifest_fifo_is_not_read(base, tmp_path, capsys):
    """A FIFO where an export's manifest belongs never blocks a reader: the directory reads as a plain HF one."""
    root = _copy(base, tmp_path)
    fifo("weights/qtrain-export.json")(root)
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(ALARM_S)
    try:
        rc = main([*(a.format(root=root) for a in EVAL), "--model", str(root / "weights")])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert rc == 0, capsys.readouterr().err


def _copy(base: Path, tmp_path: Path) -> Path:
    root = tmp_path / "root"
    shutil.copytree(base, root, symlinks=True)
    return root


# ---------------------------------------------------------------------------------------------- billion laughs

# the peak RSS of this process image: VmHWM (getrusage's ru_maxrss survives exec, so a child forked from a large
# pytest process would report its parent's size)
RSS_PROBE = ("import re, sys\nfrom qtrain.cli.main import main\nrc = main(sys.argv[1:])\n"
             "hwm = re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)\n"
             "print('maxrss_kib', hwm, file=sys.stderr)\nsys.exit(rc)\n")


def billion_laughs() -> str:
    """Nine levels of ten aliases: 10^9 strings once expanded, from a file of under a kilobyte."""
    lines = ["l0: &l0 [" + ", ".join(["lol"] * 10) + "]"]
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]" for i in range(1, 9)]
    return "\n".join(lines + ["lr: *l8", ""])


def test_yaml_billion_laughs_is_refused_quickly_in_little_memory(base, tmp_path):
    """Refused in seconds with one short line, the process never growing past 1 GiB (importing qtrain and torch
    takes ~0.4 GiB; expanding the aliases took 6.2 GB, and echoing the value a 2 GB line)."""
    root = _copy(base, tmp_path)
    (root / "laughs.yaml").write_text(billion_laughs())
    before = tree(root)
    argv = train_argv(root, steps=4, name="new", extra=("--config", str(root / "laughs.yaml")))
    try:  # a hang guard, not a timing: the unbounded expansion ran for minutes
        r = subprocess.run([sys.executable, "-c", RSS_PROBE, *argv], cwd=root, env=subprocess_env(),
                           capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"still running after {e.timeout} s")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(lines) == 2 and lines[1].startswith("maxrss_kib "), r.stderr[-2000:]
    line, rss_kib = lines[0], int(lines[1].split()[1])
    assert line.startswith("qtrain: error: --config ") and len(line.replace(str(root), "ROOT")) <= MAX_LINE, line[:600]
    assert re.search(r"laughs.yaml: its aliases expand to more than", line), line
    assert rss_kib < (1 << 20), f"peak RSS {rss_kib / 1024:.0f} MiB"
    assert tree(root) == before
