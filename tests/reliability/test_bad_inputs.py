"""The bad-input table: each row gives qtrain one broken input (options, config files, model directories,
weights, token files, output paths, earlier runs' outputs, the other subcommands) and asserts, in process
through `qtrain.cli.main.main`:

  * the exit code (2: a user error; argparse's own errors exit 2 too),
  * the one-line message `qtrain: error: ...` naming the option, file, key or tensor (a regex per row),
  * no traceback, and that nothing the user had changed: every file and folder under the test's root is
    the same before and after, and nothing new appeared (the refusal comes before anything is written).

Disk-full cases (a small tmpfs, `ulimit -f`) are in test_disk_full.py; the rows here share one tiny model
and one finished run (module fixtures) and take well under a second each.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from qtrain.cli.main import main
from qtrain.model.hf_io import save_hf_model
from qtrain.model.weights import param_shapes
from tests.reliability.inputs import HEADER, raw_token_file
from tests.run_utils import CFG, make_run_root, train_argv

V = CFG.vocab_size


# ---------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A root with the tiny model (config + weights), token files, and one finished run named `done`."""
    root = make_run_root(tmp_path_factory.mktemp("base"))
    params = {n: torch.randn(s, generator=torch.Generator().manual_seed(1)) * 0.02 for n, s in param_shapes(CFG).items()}
    save_hf_model(root / "weights", CFG, params, dtype=torch.float32)
    assert main(train_argv(root, steps=4, name="done")) == 0
    return root


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


@dataclass
class Case:
    name: str
    argv: Callable[[Path], list[str]]  # root -> the command line
    match: str  # regex the error line must contain
    setup: Callable[[Path], None] | None = None
    code: int = 2


def run_case(case: Case, base: Path, tmp_path: Path, capsys) -> None:
    root = tmp_path / "root"
    shutil.copytree(base, root, symlinks=True)
    if case.setup is not None:
        case.setup(root)
    before = tree(root)
    capsys.readouterr()
    try:
        rc = main(case.argv(root))
    except SystemExit as e:  # argparse
        rc = e.code
    err = capsys.readouterr().err
    assert rc == case.code, err
    assert "Traceback" not in err
    assert re.search(case.match, err), f"{case.match!r} not in {err!r}"
    assert err.strip().startswith(("qtrain: error: ", "usage: ")), err
    after = tree(root)
    assert sorted(after) == sorted(before), sorted(set(after) ^ set(before))
    changed = [k for k in before if before[k] != after[k]]
    assert not changed, changed


def train(**flags) -> Callable[[Path], list[str]]:
    """`qtrain train` on the tiny model (run name `new`) with `flags`; "{root}" in values is the test's root,
    extra=(...) is appended as it is."""
    extra = tuple(flags.pop("extra", ()))
    name = flags.pop("name", "new")

    def argv(root: Path) -> list[str]:
        fl = {k: v.format(root=root) if isinstance(v, str) else v for k, v in flags.items()}
        return train_argv(root, steps=4, name=name, extra=tuple(a.format(root=root) for a in extra), **fl)
    return argv


def cmd(*args: str) -> Callable[[Path], list[str]]:
    return lambda root: [a.format(root=root) for a in args]


# ---------------------------------------------------------------------------------------------- options

NUMBER_FLAGS = {"lr": "learning-rate", "weight-decay": "weight-decay", "adam-epsilon": "adam-epsilon",
                "grad-clip": "grad-clip", "beta-1": "beta-1", "beta-2": "beta-2", "z-loss": "z-loss",
                "final-lr-fraction": "final-lr-fraction", "collective-timeout": "collective-timeout"}
OPTION_CASES = [
    Case(f"{flag}={v}", train(extra=(f"--{flag}={v}",)), rf"--{field} must be a finite number, got {re.escape(v)}")
    for flag, field in NUMBER_FLAGS.items() for v in ("nan", "inf", "-inf")
] + [
    Case(name, train(extra=tuple(argv.split())), match) for name, argv, match in [
        ("batch-0", "--batch-size 0", r"--batch-size must be >= 1, got 0"),
        ("seq-len-0", "--seq-len 0", r"--seq-len must be >= 1, got 0"),
        ("grad-acc-0", "--grad-accumulation 0", r"--grad-accumulation must be >= 1"),
        ("steps-0", "--steps 0", r"--steps must be positive"),
        ("steps--5", "--steps -5", r"--steps must be positive"),
        ("epochs-0", "--steps -1 --epochs 0", r"--epochs must be >= 1"),
        ("eval-every-0", "--eval-every-n-steps 0", r"--eval-every-n-steps must be >= 1"),
        ("ckpt-interval-0", "--ckpt-interval 0", r"--ckpt-interval must be >= 1"),
        ("keep-n-0", "--ckpt-keep-n 0", r"--ckpt-keep-n 0 would delete each checkpoint right after writing it"),
        ("keep-n--2", "--ckpt-keep-n -2", r"--ckpt-keep-n must be -1 \(keep all\) or >= 1"),
        ("max-nonfinite--1", "--max-nonfinite-steps -1", r"--max-nonfinite-steps must be >= 0"),
        ("collective-timeout-0", "--collective-timeout 0", r"--collective-timeout must be > 0"),
        ("lr-0", "--lr 0", r"--learning-rate must be positive"),
        ("lr-neg", "--lr=-1e-3", r"--learning-rate must be positive"),
        ("beta-1", "--beta-1 1.0", r"--beta-1 and --beta-2 must be in \[0, 1\)"),
        ("beta2-neg", "--beta-2 -0.1", r"--beta-1 and --beta-2 must be in \[0, 1\)"),
        ("final-lr-2", "--final-lr-fraction 2", r"--final-lr-fraction must be in \[0, 1\]"),
        ("warmup-neg", "--warmup -1", r"--warmup and --cooldown must be >= 0"),
        ("warmup-over-steps", "--warmup 3 --cooldown 3", r"--warmup \(3\) \+ --cooldown \(3\) exceed --steps \(4\)"),
        ("adam-eps-0", "--adam-epsilon 0", r"--adam-epsilon must be > 0"),
        ("weight-decay-neg", "--weight-decay -0.1", r"--weight-decay and --z-loss >= 0"),
        ("zero-level-4", "--zero-level 4", r"--zero-level must be 0..3"),
        ("gpus-neg", "--gpus -1", r"--gpus must be >= 0"),
        ("abs-max-neg", "--debug-log-abs-max -1", r"--debug-log-abs-max must be >= 0"),
        ("lmhead-chunks", "--lmhead-chunks 7", r"--lmhead-chunks=7 must divide batch\*seq-len=32"),
        ("attn-chunks", "--attn-bwd-chunks 3", r"--attn-bwd-chunks=3 must divide --batch-size=2"),
        ("eval-num-neg", "--eval-num-steps -1", r"--eval-num-steps must be >= 0"),
        ("init-proj-no-scratch", "--init-proj-to-zero --no-from-scratch", r"--init-proj-to-zero needs --from-scratch"),
        ("new-data-no-continue", "--new-data", r"--new-data needs --continue"),
        ("start-over-continue", "--start-over --continue", r"--start-over and --continue exclude each other"),
        ("offload-residual", "--offload-residual", r"--offload-residual needs --recompute-block"),
        ("gradient-dtype", "--gradient-dtype e5m2", r"--gradient-dtype only applies with --matmul-dtype e4m3"),
        ("m-e4m3-v-fp32", "--model-dtype bf16 --opt-m-dtype e4m3", r"--opt-m-dtype e4m3 needs --opt-v-dtype bf16"),
        ("fp32-bf16-m", "--opt-m-dtype bf16", r"--model-dtype fp32 needs --opt-m-dtype fp32"),
        ("zero-and-shard", "--zero-level 2 --shard-gradients", r"--zero-level and --shard-gradients are mutually excl"),
        ("zero-and-weights", "--zero-level 3 --shard-weights", r"--zero-level and --shard-weights are mutually excl"),
        ("a2a-unsharded", "--all-to-all-reduce", r"--all-to-all-reduce needs sharded gradients"),
        ("offload-grads", "--offload-gradients", r"--offload-gradients needs sharded gradients"),
        ("offload-quants", "--offload-quants", r"--offload-quants needs --persistent-quants"),
        ("persistent-quants", "--persistent-quants", r"--persistent-quants .* only apply with --matmul-dtype e4m3"),
        ("offload-master", "--offload-master", r"--offload-master needs sharded weights"),
        ("zero-copy", "--use-zero-copy", r"--use-zero-copy needs offloaded state"),
        ("matmul-fp32-bf16", "--model-dtype bf16 --opt-m-dtype bf16 --opt-v-dtype bf16 --matmul-dtype fp32",
         r"--matmul-dtype fp32 with --model-dtype bf16 is not supported"),
        ("model-dtype-fp16", "--model-dtype fp16", r"--model-dtype='fp16': must be one of fp32, bf16"),
        ("matmul-int8", "--matmul-dtype int8", r"--matmul-dtype='int8': must be one of"),
        ("schedule", "--lr-schedule step", r"--lr-schedule='step': must be one of cosine, linear, wsd"),
        ("device-tpu", "--device tpu", r"--device='tpu': must be one of auto, cpu, cuda"),
        ("device-cuda", "--device cuda", r"--device cuda: no CUDA device is visible"),
        ("compile-maybe", "--compile maybe", r"--compile='maybe': must be one of auto, on, off"),
        ("sdpa", "--sdpa-backend fast", r"--sdpa-backend='fast': must be one of"),
        ("opt-v-e4m3", "--opt-v-dtype e4m3", r"--opt-v-dtype='e4m3': must be one of fp32, bf16"),
        ("name-parent", "--name ../../x", r"--name '\.\./\.\./x': a run name is one path component"),
        ("name-abs", "--name /tmp/x", r"--name '/tmp/x': a run name is one path component"),
        ("name-hidden", "--name .x", r"--name '\.x': a run name is one path component"),
        ("name-dotdot", "--name ..", r"--name '\.\.': a run name is one path component"),
        ("name-slash", "--name a/b", r"--name 'a/b': .* e\.g\. --name a_b"),
        ("name-empty", "--name=", r"--name '': a run name is one path component"),
        ("out-dir-empty", "--out-dir=", r"--out-dir must not be empty"),
        ("ckpt-dir-empty", "--checkpoint-dir= ", r"--checkpoint-dir must not be empty"),
        ("seq-len-positions", "--seq-len 128", r"--seq-len 128 exceeds the model's max_position_embeddings 64"),
        ("batch-too-big", "--batch-size 4096", r"--train-file .*sequences per rank are fewer than one step needs"),
    ]
] + [
    Case(name, train(extra=tuple(argv.split())), match) for name, argv, match in [
        ("lr-not-a-number", "--lr abc", r"argument --learning-rate/--lr: invalid float value: 'abc'"),
        ("batch-float", "--batch-size 1.5", r"argument --batch-size/--batch: invalid int value: '1.5'"),
        ("unknown-flag", "--learning-rat 1", r"unrecognized arguments: --learning-rat"),
    ]
]


# ---------------------------------------------------------------------------------------------- config files

def config(name: str, text: str) -> Callable[[Path], None]:
    return lambda root: (root / name).write_text(text)


CONFIG_CASES = [
    Case("config-missing", train(extra=("--config", "{root}/nope.toml")), r"--config .*nope.toml: file not found"),
    Case("config-bad-toml", train(extra=("--config", "{root}/c.toml")), r"--config .*c.toml: invalid TOML",
         config("c.toml", "lr = = 1\n")),
    Case("config-bad-yaml", train(extra=("--config", "{root}/c.yaml")), r"--config .*c.yaml: invalid YAML",
         config("c.yaml", "lr: [1,\n")),
    Case("config-not-table", train(extra=("--config", "{root}/c.yaml")), r"expected a table of options",
         config("c.yaml", "- 1\n- 2\n")),
    Case("config-unknown-key", train(extra=("--config", "{root}/c.toml")), r"unknown option\(s\) \['lerning_rate'\]",
         config("c.toml", "lerning_rate = 1e-3\n")),
    Case("config-twice", train(extra=("--config", "{root}/c.toml")), r"option 'learning_rate' given twice",
         config("c.toml", "lr = 1e-3\nlearning_rate = 1e-3\n")),
    Case("config-lr-string", train(extra=("--config", "{root}/c.toml")), r"option 'lr' must be a number, got 'abc'",
         config("c.toml", 'lr = "abc"\n')),
    Case("config-batch-string", train(extra=("--config", "{root}/c.yaml")), r"option 'batch' must be an integer",
         config("c.yaml", "batch: eight\n")),
    Case("config-bool", train(extra=("--config", "{root}/c.toml")), r"option 'from_scratch' must be true or false",
         config("c.toml", 'from_scratch = "yes"\n')),
    Case("config-continue-list", train(extra=("--config", "{root}/c.toml")), r"option 'continue' must be true, a step",
         config("c.toml", "continue = [1]\n")),
    Case("config-name-number", train(extra=("--config", "{root}/c.toml")), r"option 'name' must be a string",
         config("c.toml", "name = 3\n")),
    Case("config-wd-nan", train(extra=("--config", "{root}/c.toml")), r"--weight-decay must be a finite number",
         config("c.toml", "weight_decay = nan\n")),
    Case("config-not-utf8", train(extra=("--config", "{root}/c.toml")), r"invalid TOML",
         lambda root: (root / "c.toml").write_bytes(b"lr = \xff\xfe\n")),
]


# ---------------------------------------------------------------------------------------------- model dirs

def model_json(**changes) -> Callable[[Path], None]:
    def setup(root: Path) -> None:
        d = json.loads((root / "model" / "config.json").read_text())
        for k, v in changes.items():
            if v is ...:
                d.pop(k, None)
            else:
                d[k] = v
        (root / "model" / "config.json").write_text(json.dumps(d))
    return setup


MODEL_CASES = [
    Case("model-missing", train(model="{root}/nope"), r"model '.*nope' not found"),
    Case("model-no-config", train(model="{root}/empty"), r"empty/config.json: file not found",
         lambda root: (root / "empty").mkdir()),
    Case("model-bad-json", train(), r"config.json: not valid JSON",
         lambda root: (root / "model" / "config.json").write_text("{")),
    Case("model-json-list", train(), r"config.json: expected a JSON object",
         lambda root: (root / "model" / "config.json").write_text("[]")),
    Case("model-preset-unknown", lambda root: train_argv(root, model="Qwen9-1B", name="new", steps=4),
         r"model 'Qwen9-1B' not found"),
] + [
    Case(f"model-json-{name}", train(), match, model_json(**changes)) for name, changes, match in [
        ("no-model-type", {"model_type": ...}, r"missing key 'model_type'"),
        ("model-type", {"model_type": "gpt2"}, r"unknown model_type 'gpt2'"),
        ("unknown-key", {"use_magic": True}, r"unknown config key\(s\) \['use_magic'\]"),
        ("no-vocab", {"vocab_size": ...}, r"missing key 'vocab_size'"),
        ("rope-theta-string", {"rope_theta": "abc"}, r"rope_theta must be a finite number, got 'abc'"),
        ("rope-theta-nan", {"rope_theta": float("nan")}, r"rope_theta must be a finite number"),
        ("rope-theta-neg", {"rope_theta": -1.0}, r"rope_theta must be positive"),
        ("vocab-float", {"vocab_size": 1e9}, r"vocab_size must be an integer, got 1000000000.0"),
        ("vocab-neg", {"vocab_size": -1}, r"vocab_size must be a positive integer, got -1"),
        ("vocab-bool", {"vocab_size": True}, r"vocab_size must be an integer, got True"),
        ("hidden-string", {"hidden_size": "32"}, r"hidden_size must be an integer, got '32'"),
        ("heads-kv", {"num_key_value_heads": 3}, r"num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
        ("head-dim-odd", {"head_dim": 7}, r"head_dim=7 must be even for RoPE"),
        ("act", {"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
        ("act-type", {"hidden_act": 3}, r"hidden_act must be a string, got 3"),
        ("mlp-bias", {"mlp_bias": True}, r"mlp_bias=true is not supported"),
        ("sliding", {"use_sliding_window": True}, r"use_sliding_window=true is not supported"),
        ("layer-types", {"layer_types": ["sliding_attention", "full_attention"]}, r"layer_types other than"),
        ("rope-type", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0}},
         r"rope_type 'longrope' is not supported"),
        ("llama3-missing", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}},
         r"llama3 rope scaling needs 'low_freq_factor'"),
        ("llama3-string", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": "8",
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 64}},
         r"factor must be a finite number, got '8'"),
        ("rope-params-list", {"rope_parameters": [1]}, r"rope_parameters must be an object"),
        ("eps-zero", {"rms_norm_eps": 0.0}, r"rms_norm_eps must be in \(0, 1\)"),
        ("eps-string", {"rms_norm_eps": "1e-6"}, r"rms_norm_eps must be a finite number, got '1e-6'"),
        ("tie-string", {"tie_word_embeddings": "yes"}, r"tie_word_embeddings must be true or false"),
        ("eos-strings", {"eos_token_id": ["</s>"]}, r"eos_token_id must be an integer or a list of integers"),
        ("dropout", {"attention_dropout": 0.1}, r"attention_dropout != 0 is not supported"),
        ("tp", {"pretraining_tp": 2}, r"pretraining_tp != 1 is not supported"),
        ("positions-zero", {"max_position_embeddings": 0}, r"max_position_embeddings must be a positive integer"),
        ("huge-vocab", {"vocab_size": 2**31 - 1}, r"host memory: the CPU run needs .* GiB .* available"),
        ("huge-mlp", {"intermediate_size": 2**30}, r"host memory: the CPU run needs"),
    ]
]


# ---------------------------------------------------------------------------------------------- weights

def weights_edit(fn: Callable[[dict], dict]) -> Callable[[Path], None]:
    def setup(root: Path) -> None:
        f = root / "weights" / "model.safetensors"
        save_file(fn(load_file(f)), f, metadata={"format": "pt"})
    return setup


def _poke(t: dict, name: str, value: float) -> dict:
    t[name] = t[name].clone()
    t[name].view(-1)[5] = value
    return t


DOWN = "model.layers.1.mlp.down_proj.weight"
WEIGHT_CASES = [
    Case("weights-none", train(model="{root}/model", extra=("--no-from-scratch",)),
         r"model: no model.safetensors or model.safetensors.index.json"),
    Case("weights-corrupt", train(model="{root}/weights", extra=("--no-from-scratch",)),
         r"model.safetensors: not a readable safetensors file",
         lambda root: (root / "weights" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00garbage")),
    Case("weights-truncated", train(model="{root}/weights", extra=("--no-from-scratch",)),
         r"model.safetensors: not a readable safetensors file",
         lambda root: (root / "weights" / "model.safetensors").write_bytes(
             (root / "weights" / "model.safetensors").read_bytes()[:-100])),
    Case("weights-missing-tensor", train(model="{root}/weights", extra=("--no-from-scratch",)),
         rf"tensor '{DOWN}' missing", weights_edit(lambda t: {k: v for k, v in t.items() if k != DOWN})),
    Case("weights-shape", train(model="{root}/weights", extra=("--no-from-scratch",)),
         rf"tensor '{DOWN}' has shape \[32, 63\], expected \[32, 64\]",
         weights_edit(lambda t: {**t, DOWN: t[DOWN][:, :63].contiguous()})),
    Case("weights-int32", train(model="{root}/weights", extra=("--no-from-scratch",)),
         rf"tensor '{DOWN}' has dtype I32; weights must be floating point",
         weights_edit(lambda t: {**t, DOWN: t[DOWN].to(torch.int32)})),
    Case("weights-bool", train(model="{root}/weights", extra=("--no-from-scratch",)), r"has dtype BOOL",
         weights_edit(lambda t: {**t, DOWN: t[DOWN] > 0})),
    Case("weights-extra", train(model="{root}/weights", extra=("--no-from-scratch",)),
         r"unexpected tensor\(s\) \['model.layers.9.extra'\]",
         weights_edit(lambda t: {**t, "model.layers.9.extra": torch.zeros(2)})),
    Case("weights-nan", train(model="{root}/weights", extra=("--no-from-scratch",)),
         rf"tensor '{DOWN}' holds 1 NaN/inf value\(s\)", weights_edit(lambda t: _poke(t, DOWN, float("nan")))),
    Case("weights-inf", train(model="{root}/weights", extra=("--no-from-scratch",)),
         rf"tensor '{DOWN}' holds 1 NaN/inf value\(s\)", weights_edit(lambda t: _poke(t, DOWN, float("-inf")))),
]


def index(root: Path, weight_map_edit: Callable[[dict], None]) -> None:
    d = root / "weights"
    t = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    names = sorted(t)
    half = len(names) // 2
    save_file({k: t[k] for k in names[:half]}, d / "model-00001-of-00002.safetensors")
    save_file({k: t[k] for k in names[half:]}, d / "model-00002-of-00002.safetensors")
    wm = {k: ("model-00001-of-00002.safetensors" if i < half else "model-00002-of-00002.safetensors")
          for i, k in enumerate(names)}
    weight_map_edit(wm)
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))


def _outside(root: Path, wm: dict) -> None:
    shutil.copy(root / "weights" / "model-00002-of-00002.safetensors", root / "outside.safetensors")
    wm.update({k: "../outside.safetensors" for k, v in wm.items() if v.startswith("model-00002")})


INDEX_CASES = [
    Case("index-outside", train(model="{root}/weights", extra=("--no-from-scratch",)),
         r"shard name '\.\./outside.safetensors' is not a file name in the model directory",
         lambda root: index(root, lambda wm: _outside(root, wm))),
    Case("index-absolute", train(model="{root}/weights", extra=("--no-from-scratch",)),
         r"shard name '/etc/passwd' is not a file name",
         lambda root: index(root, lambda wm: wm.update({next(iter(wm)): "/etc/passwd"}))),
    Case("index-missing-shard", train(model="{root}/weights", extra=("--no-from-scratch",)),
         r"model-00003-of-00003.safetensors: shard named by .* does not exist",
         lambda root: index(root, lambda wm: wm.update({next(iter(wm)): "model-00003-of-00003.safetensors"}))),
    Case("index-bad-json", train(model="{root}/weights", extra=("--no-from-scratch",)),
         r"not a valid safetensors index",
         lambda root: (index(root, lambda wm: None),
                       (root / "weights" / "model.safetensors.index.json").write_text("{\"weight_map\": 3}"))),
]


# ---------------------------------------------------------------------------------------------- token files

def tokens(name: str, **kw) -> Callable[[Path], None]:
    return lambda root: raw_token_file(root / name, **kw)


def data(name: str = "bad.bin", *, train_file: bool = True) -> Callable[[Path], list[str]]:
    return (train(train_file="{root}/" + name) if train_file else train(eval_file="{root}/" + name))


TOKEN_CASES = [
    Case("train-missing", data("nope.bin"), r"nope.bin: no token files match"),
    Case("train-glob-none", data("none-*.bin"), r"none-\*.bin: no token files match"),
    Case("eval-missing", data("nope.bin", train_file=False), r"nope.bin: no token files match"),
    Case("train-is-dir", data("adir"), r"adir: cannot read token file", lambda root: (root / "adir").mkdir()),
    Case("train-empty-file", data(), r"bad.bin: truncated token file \(0 bytes", tokens("bad.bin", raw=b"")),
    Case("train-text-file", data(), r"bad.bin: .*(not a token file|truncated)", tokens("bad.bin", raw=b"hello\n" * 300)),
    Case("train-magic", data(), r"bad.bin: not a token file \(magic", tokens("bad.bin", magic=b"BIN.TOX\n")),
    Case("train-version", data(), r"unsupported token file version 3", tokens("bad.bin", version=3)),
    Case("train-bpt", data(), r"unsupported bytes per token 2", tokens("bad.bin", bpt=2)),
    Case("train-negative-n", data(), r"negative token count -5 in header", tokens("bad.bin", n=-5)),
    Case("train-truncated", data(), r"bad.bin: truncated token file", tokens("bad.bin", cut=6)),
    Case("train-oversized", data(), r"bad.bin: oversized token file", tokens("bad.bin", append=b"\0" * 4)),
    Case("train-masks-truncated", data(), r"truncated token file.* \+ masks", tokens("bad.bin", masks=1, mask_bytes=3)),
    Case("train-short-header", data(), r"truncated token file \(108 bytes, the header alone is 1024\)",
         tokens("bad.bin", raw=HEADER[:108])),
    Case("train-header-vocab", data(), r"token file vocab size 50257 exceeds the model's vocab size 96",
         tokens("bad.bin", vocab=50257)),
    Case("train-id-too-big", data(), rf"bad.bin: token id {V} at token offset 1234 \(byte {1024 + 4 * 1234}\) is "
         rf"outside the model's vocabulary \[0, {V}\)", tokens("bad.bin", poke={1234: V})),
    Case("train-id-negative", data(), r"bad.bin: token id -3 at token offset 7 ", tokens("bad.bin", poke={7: -3})),
    Case("train-id-huge", data(), r"token id 2147483647 at token offset 2999 ", tokens("bad.bin", poke={2999: 2**31 - 1})),
    Case("eval-id-too-big", data(train_file=False), rf"bad.bin: token id {V + 5} at token offset 10 ",
         tokens("bad.bin", poke={10: V + 5})),
    Case("train-too-few-tokens", data(), r"bad.bin: 10 tokens are too few for one sequence of seq_len=16",
         tokens("bad.bin", n=10)),
    Case("train-mixed-vocab", train(train_file="{root}/mix-*.bin"), r"token files have different vocab sizes",
         lambda root: (raw_token_file(root / "mix-a.bin", vocab=90), raw_token_file(root / "mix-b.bin", vocab=96))),
    Case("eval-too-few-tokens", data(train_file=False), r"bad.bin: 5 tokens are too few", tokens("bad.bin", n=5)),
]


# ---------------------------------------------------------------------------------------------- output paths

def mk(*paths: str, file: bool = False, text: str = "the user's") -> Callable[[Path], None]:
    def setup(root: Path) -> None:
        for p in paths:
            q = root / p
            q.parent.mkdir(parents=True, exist_ok=True)
            if file:
                q.write_text(text)
            else:
                q.mkdir(exist_ok=True)
    return setup


PATH_CASES = [
    Case("ckpt-dir-is-file", train(checkpoint_dir="{root}/f"), r"--checkpoint-dir .*f: exists and is not a directory",
         mk("f", file=True)),
    Case("out-dir-is-file", train(out_dir="{root}/f"), r"--out-dir .*f: exists and is not a directory", mk("f", file=True)),
    Case("out-dir-under-file", train(out_dir="{root}/f/out"), r"--out-dir .*: .*f is a file, so the directory cannot",
         mk("f", file=True)),
    Case("log-is-dir", train(log_file="{root}/d"), r"--log-file .*d: is a directory, not a file", mk("d")),
    Case("log-under-file", train(log_file="{root}/f/log.jsonl"), r"--log-file .*: its folder .*f: exists and is not",
         mk("f", file=True)),
    Case("log-is-out", train(log_file="{root}/o", out_dir="{root}/o"), r"--log-file .*o: is the --out-dir itself"),
    Case("log-is-ckpt", train(log_file="{root}/c", checkpoint_dir="{root}/c"), r"is the --checkpoint-dir itself"),
    Case("log-on-config", train(log_file="{root}/o/config.json", out_dir="{root}/o"),
         r"--log-file .*: the export writes its config.json there"),
    Case("log-on-weights", train(log_file="{root}/o/model.safetensors", out_dir="{root}/o"),
         r"the export writes its model.safetensors there"),
    Case("log-on-manifest", train(log_file="{root}/o/qtrain-export.json", out_dir="{root}/o"),
         r"the export writes its qtrain-export.json there"),
    Case("log-on-marker", train(log_file="{root}/c/qtrain-run.json", checkpoint_dir="{root}/c"),
         r"collides with the checkpoints' qtrain-run.json"),
    Case("log-in-checkpoint", train(log_file="{root}/c/step_00000002/log.jsonl", checkpoint_dir="{root}/c"),
         r"--log-file .*: lies inside a checkpoint"),
    Case("out-is-checkpoint", train(out_dir="{root}/c/step_00000100", checkpoint_dir="{root}/c"),
         r"--out-dir .*: is a checkpoint directory of --checkpoint-dir"),
    Case("out-in-checkpoint", train(out_dir="{root}/c/step_00000100/hf", checkpoint_dir="{root}/c"),
         r"--out-dir .*: lies inside a checkpoint of --checkpoint-dir"),
    Case("out-has-users-model", train(out_dir="{root}/o"), r"--out-dir .*o: config.json, model.safetensors exist\(s\) "
         r"and no qtrain export wrote them", mk("o/config.json", "o/model.safetensors", file=True)),
    Case("out-is-model-dir", train(out_dir="{root}/weights", model="{root}/weights", extra=("--no-from-scratch",)),
         r"config.json, model.safetensors exist\(s\) and no qtrain export wrote them",
         lambda root: (root / "weights" / "qtrain-export.json").unlink()),
    Case("out-has-users-tokenizer", train(out_dir="{root}/o"), r"tokenizer.json exist\(s\) and no qtrain export",
         mk("o/tokenizer.json", file=True)),
    Case("log-is-users-file", train(log_file="{root}/notes.txt"), r"--log-file .*notes.txt: exists and is not a qtrain log",
         mk("notes.txt", file=True)),
    Case("log-is-token-file", train(log_file="{root}/train.bin"), r"--log-file .*train.bin: exists and is not a qtrain log"),
]


def _readonly(root: Path, rel: str) -> None:
    os.chmod(root / rel, 0o555)


def _ro_cases() -> list[Case]:
    """Read-only folders: only meaningful where permissions bind (not for root, who writes anyway)."""
    if os.geteuid() == 0:
        return []
    return [
        Case("ckpt-parent-readonly", train(checkpoint_dir="{root}/ro/ckpt"), r"--checkpoint-dir .*: cannot be created",
             lambda root: (mk("ro")(root), _readonly(root, "ro"))),
        Case("out-readonly", train(out_dir="{root}/ro"), r"--out-dir .*ro: is not writable",
             lambda root: (mk("ro")(root), _readonly(root, "ro"))),
        Case("log-dir-readonly", train(log_file="{root}/ro/log.jsonl"), r"--log-file .*: .*not writable",
             lambda root: (mk("ro")(root), _readonly(root, "ro"))),
    ]


# ---------------------------------------------------------------------------------------------- earlier runs

DONE = dict(name="done")
RUN_CASES = [
    Case("fresh-into-earlier-run", train(**DONE), r"an earlier run's outputs are in the way: --checkpoint-dir .*done "
         r"\(of run \w{8}, steps 2\.\.4\); the export in --out-dir .*done \(of run \w{8}\); --log-file .*done.jsonl "
         r"\(of run \w{8}\)\. Resume that run with --continue, or start over with --start-over"),
    Case("fresh-into-earlier-ckpt", train(checkpoint_dir="{root}/ckpt/done"), r"--checkpoint-dir .*done \(of run"),
    Case("fresh-into-earlier-export", train(out_dir="{root}/out/done"), r"the export in --out-dir .*done \(of run"),
    Case("fresh-into-earlier-log", train(log_file="{root}/logs/done.jsonl"), r"--log-file .*done.jsonl \(of run"),
    Case("fresh-into-legacy-ckpt", train(checkpoint_dir="{root}/ckpt/done"), r"\(of unknown run, steps 2\.\.4\)",
         lambda root: (root / "ckpt" / "done" / "qtrain-run.json").unlink()),
    Case("resume-into-other-runs-export", train(**DONE, out_dir="{root}/out/other", extra=("--continue",)),
         r"resuming run \w{8}, but the export in --out-dir .*other holds the outputs of run \w{8}",
         lambda root: (shutil.copytree(root / "out" / "done", root / "out" / "other"),
                       _set_manifest_run(root / "out" / "other", "f" * 32))),
    Case("resume-into-other-runs-log", train(**DONE, log_file="{root}/logs/other.jsonl", extra=("--continue",)),
         r"--log-file .*other.jsonl holds the outputs of run ffffffff",
         lambda root: (root / "logs" / "other.jsonl").write_text(json.dumps({"log": "run", "run_id": "f" * 32}) + "\n")),
    Case("continue-missing-step", train(**DONE, extra=("--continue", "7")),
         r"--continue 7: no checkpoint of step 7 in .*done \(it has steps 2, 4\)"),
    Case("continue-missing-path", train(**DONE, extra=("--continue", "{root}/ckpt/done/step_00000099")),
         r"--continue .*step_00000099: not a checkpoint"),
    Case("continue-other-dir-empty", train(**DONE, extra=("--continue", "{root}/nowhere")), r"--continue .*nowhere: not a "),
    Case("continue-incomplete", train(**DONE, extra=("--continue", "2")), r"--continue 2: no checkpoint of step 2",
         lambda root: (root / "ckpt" / "done" / "step_00000002" / "checkpoint.json").unlink()),
    Case("continue-corrupt-meta", train(**DONE, extra=("--continue",)), r"step_00000004/checkpoint.json: unreadable",
         lambda root: (root / "ckpt" / "done" / "step_00000004" / "checkpoint.json").write_text("{")),
    Case("continue-other-dtype", train(**DONE, extra=("--continue", "--model-dtype", "bf16", "--opt-m-dtype", "bf16",
                                                      "--opt-v-dtype", "bf16")),
         r"step_00000004: checkpoint has --model-dtype='fp32', this run 'bf16'"),
    Case("continue-other-seed", train(**DONE, extra=("--continue", "--seed", "5")),
         r"checkpoint has --seed=42, this run 5"),
    Case("continue-other-model", train(**DONE, model="{root}/model2", extra=("--continue",)),
         r"step_00000004: written for another model \(intermediate_size differ",
         lambda root: (shutil.copytree(root / "model", root / "model2"),
                       _edit_json(root / "model2" / "config.json", intermediate_size=128))),
    Case("continue-other-world-local-dir", train(**DONE, extra=("--continue",)),
         r"step_00000004: written by 2 rank\(s\) into a checkpoint directory local to each node \(this one, on "
         r"nodeA, holds the shards of ranks 0 only\); this run has 1: resharding reads every rank's shards",
         lambda root: _edit_json(root / "ckpt" / "done" / "step_00000004" / "checkpoint.json",
                                 distributed={"world": 2, "ranks": [0], "host": "nodeA"})),
    Case("export-missing-step", cmd("export", "--checkpoint-dir", "{root}/ckpt/done", "--out-dir", "{root}/x", "--step",
                                    "3"), r"--checkpoint-dir .*done: no checkpoint of step 3 \(it has steps 2, 4\)"),
    Case("export-missing-dir", cmd("export", "--checkpoint-dir", "{root}/nope", "--out-dir", "{root}/x"),
         r"--checkpoint-dir .*nope: no checkpoint"),
    Case("export-out-is-file", cmd("export", "--checkpoint-dir", "{root}/ckpt/done", "--out-dir", "{root}/train.bin"),
         r"train.bin: exists and is not a directory"),
    Case("export-into-users-model", cmd("export", "--checkpoint-dir", "{root}/ckpt/done", "--out-dir", "{root}/weights"),
         r"weights: config.json, model.safetensors exist\(s\) and no qtrain export wrote them",
         lambda root: (root / "weights" / "qtrain-export.json").unlink()),
    Case("export-into-other-runs-export", cmd("export", "--checkpoint-dir", "{root}/ckpt/done", "--out-dir",
                                              "{root}/out/done"),
         r"--out-dir .*done: holds the export of another run \(ffffffff, step 4\); .* --overwrite",
         lambda root: _set_manifest_run(root / "out" / "done", "f" * 32)),
    Case("export-corrupt-shard", cmd("export", "--checkpoint-dir", "{root}/ckpt/done", "--out-dir", "{root}/x"),
         r"weights.shard_000_of_001.safetensors: unreadable checkpoint file",
         lambda root: (root / "ckpt" / "done" / "step_00000004" / "weights.shard_000_of_001.safetensors").write_bytes(b"x")),
]


def _edit_json(path: Path, **changes) -> None:
    d = json.loads(path.read_text())
    d.update(changes)
    path.write_text(json.dumps(d))


def _set_manifest_run(out: Path, run_id: str) -> None:
    _edit_json(out / "qtrain-export.json", run_id=run_id)


# ---------------------------------------------------------------------------------------------- other subcommands

SUB_CASES = [
    Case("tokenize-py", cmd("tokenize", "--out-dir", "{root}/tok", "{root}/script.py"),
         r"script.py: unsupported input type \(use .txt, .jsonl, .json, .parquet\)", mk("script.py", file=True)),
    *(Case(f"tokenize-json-{name}", cmd("tokenize", "--out-dir", "{root}/tok", "--tokenizer", "gpt2", "{root}/d.json"),
           match, mk("d.json", file=True, text=text)) for name, text, match in [
        ("line", '{"text": "a"}\n\n{"text": "b"\n', r"d.json:3: not JSON \(Expecting ',' delimiter"),
        ("array", '[{"text": "a"}\n{"text": "b"}]',
         r"d.json: not a JSON array \(Expecting ',' delimiter: line 2 column 1 "),
        ("element", '[{"text": "a"}, 7]', r"d.json:\[1\]: a record must be a JSON object, got int"),
        ("no-field", '[{"text": "a"}, {"body": "b"}]', r"d.json:\[1\]: no field 'text'"),
        ("empty", "", r"tok: no training documents in .*d.json"),
    ]),
    Case("tokenize-json-missing", cmd("tokenize", "--out-dir", "{root}/tok", "{root}/missing.json"),
         r"missing.json: no such input"),
    Case("tokenize-bogus", cmd("tokenize", "--out-dir", "{root}/tok", "--tokenizer", "bogus", "{root}/a.txt"),
         r"unknown tokenizer 'bogus'", mk("a.txt", file=True)),
    Case("tokenize-missing", cmd("tokenize", "--out-dir", "{root}/tok", "{root}/missing.txt"),
         r"missing.txt: no such input"),
    Case("tokenize-fraction", cmd("tokenize", "--out-dir", "{root}/tok", "--eval-fraction", "2", "{root}/a.txt"),
         r"eval fraction must be in \[0, 1\), got 2.0", mk("a.txt", file=True)),
    Case("tokenize-fraction-nan", cmd("tokenize", "--out-dir", "{root}/tok", "--eval-fraction", "nan", "{root}/a.txt"),
         r"eval fraction must be in \[0, 1\), got nan", mk("a.txt", file=True)),
    Case("tokenize-workers", cmd("tokenize", "--out-dir", "{root}/tok", "--workers", "0", "{root}/a.txt"),
         r"--workers must be >= 1, got 0", mk("a.txt", file=True)),
    Case("tokenize-max-tokens", cmd("tokenize", "--out-dir", "{root}/tok", "--max-tokens-per-file", "0", "{root}/a.txt"),
         r"max tokens per file must be in \[1, 2\^31\)", mk("a.txt", file=True)),
    Case("tokenize-both-evals", cmd("tokenize", "--out-dir", "{root}/tok", "--eval-fraction", "0.1", "--eval-inputs",
                                    "{root}/a.txt", "--", "{root}/a.txt"),
         r"give either eval inputs or an eval fraction, not both", mk("a.txt", file=True)),
    Case("tokenize-tokenizer-dir", cmd("tokenize", "--out-dir", "{root}/tok", "--tokenizer", "{root}/model",
                                       "{root}/a.txt"), r"model: no tokenizer.json", mk("a.txt", file=True)),
    Case("eval-device-cuda", cmd("eval", "--model", "{root}/weights", "--eval-file", "{root}/eval.bin", "--device",
                                 "cuda"), r"--device cuda: no such CUDA device is visible"),
    Case("eval-device-bogus", cmd("eval", "--model", "{root}/weights", "--eval-file", "{root}/eval.bin", "--device",
                                  "foo"), r"--device foo: not a device"),
    Case("eval-model-missing", cmd("eval", "--model", "{root}/nope", "--eval-file", "{root}/eval.bin"),
         r"model '.*nope' not found"),
    Case("eval-seq-len", cmd("eval", "--model", "{root}/weights", "--eval-file", "{root}/eval.bin", "--seq-len", "0"),
         r"--seq-len, --batch-size and --max-batches must be positive"),
    Case("eval-bad-id", cmd("eval", "--model", "{root}/weights", "--eval-file", "{root}/bad.bin", "--seq-len", "16"),
         rf"bad.bin: token id {V} at token offset 3 ", tokens("bad.bin", poke={3: V})),
    Case("eval-nan-weights", cmd("eval", "--model", "{root}/weights", "--eval-file", "{root}/eval.bin", "--seq-len",
                                 "16"), r"holds 1 NaN/inf value", weights_edit(lambda t: _poke(t, DOWN, float("nan")))),
    Case("plan-bytes", cmd("plan", "--model", "{root}/model", "--from-scratch", "--gpu-memory", "lots"),
         r"--gpu-memory: not a memory size: 'lots'"),
    Case("plan-reserve", cmd("plan", "--model", "{root}/model", "--from-scratch", "--gpu-memory", "8GiB", "--reserve",
                             "x"), r"--reserve: not a memory size: 'x'"),
    Case("plan-no-gpu", cmd("plan", "--model", "{root}/model", "--from-scratch"), r"--gpu-memory is needed"),
    Case("plan-bad-model", cmd("plan", "--model", "{root}/nope", "--gpu-memory", "8GiB"), r"model '.*nope' not found"),
    Case("plan-bad-option", cmd("plan", "--model", "{root}/model", "--from-scratch", "--gpu-memory", "8GiB", "--lr",
                                "nan"), r"--learning-rate must be a finite number"),
    Case("plan-model-support", cmd("plan", "--model", "{root}/model", "--from-scratch", "--gpu-memory", "8GiB",
                                   "--delta-rule-precision", "tf32"), r"--delta-rule-precision tf32 applies to models "
                                                                      r"with Gated DeltaNet layers"),
    Case("plot-missing", cmd("plot", "{root}/nope.jsonl", "--out", "{root}/p.png", "--no-show"),
         r"nope.jsonl: cannot read log"),
    Case("plot-not-a-log", cmd("plot", "{root}/train.bin", "--out", "{root}/p.png", "--no-show"), r"train.bin: not a qtrain log"),
    Case("plot-smooth", cmd("plot", "{root}/logs/done.jsonl", "--smooth", "0", "--no-show"), r"--smooth must be >= 1"),
]

ALL = (OPTION_CASES + CONFIG_CASES + MODEL_CASES + WEIGHT_CASES + INDEX_CASES + TOKEN_CASES + PATH_CASES + _ro_cases()
       + RUN_CASES + SUB_CASES)


def test_the_table_has_at_least_150_distinct_cases():
    names = [c.name for c in ALL]
    assert len(names) == len(set(names)) and len(names) >= 150, (len(names), len(set(names)))


@pytest.mark.parametrize("case", ALL, ids=[c.name for c in ALL])
def test_bad_input(case, base, tmp_path, capsys):
    run_case(case, base, tmp_path, capsys)
