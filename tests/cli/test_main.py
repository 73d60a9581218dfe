"""`qtrain train` argument parsing: llm.q flag spellings land in the right Options fields, config files are
overridden by flags, bad flags / options exit 2 with a message naming them, --help shows the field
docstrings. Nothing here trains: parsing stops at Options, and `main` is only run on invalid options or
with the worker replaced by a recorder."""
from __future__ import annotations

import dataclasses
import typing

import pytest

import qtrain.cli.options as cli
import qtrain.cli.train as cli_train
from qtrain.cli.main import build_parser, main
from qtrain.cli.options import options_from_args
from qtrain.options import Options, OptionsError


MODEL = ["--model", "org/some-model"]  # with a model given, the embedded-default settings do not apply


def parse(*argv: str, model: bool = True) -> Options:
    return options_from_args(build_parser().parse_args(["train", *(MODEL if model else []), *argv]))


def namespace(*argv: str):
    return build_parser().parse_args(["train", *argv])


def test_no_flags_gives_the_dataclass_defaults():
    assert parse() == Options(model="org/some-model")


def test_without_model_the_embedded_defaults_apply_and_flags_override_them():
    emb = cli.embedded_defaults()
    o = parse(model=False)
    assert o.model == "" and o == Options(**emb)
    o = parse("--lr", "1e-4", "--seq-length", "64", "--name", "mine", model=False)
    assert (o.learning_rate, o.seq_len, o.name) == (1e-4, 64, "mine")
    assert o.batch_size == emb["batch_size"]  # the rest stays embedded


def test_without_model_config_values_override_embedded_defaults(tmp_path):
    path = _write(tmp_path, "run.toml", "lr = 1e-4\n")
    o = parse("--config", path, model=False)
    assert o.learning_rate == 1e-4 and o.name == cli.embedded_defaults()["name"]
    path = _write(tmp_path, "model.toml", 'model = "org/m"\n')
    assert parse("--config", path, model=False) == Options(model="org/m")  # model from the file: no embedded


@pytest.mark.parametrize("argv,field,value", [
    (["--batch", "8"], "batch_size", 8),
    (["--batch-size", "8"], "batch_size", 8),
    (["--seq-length", "256"], "seq_len", 256),
    (["--seq-len", "256"], "seq_len", 256),
    (["--lr", "3e-4"], "learning_rate", 3e-4),
    (["--learning-rate", "0.001"], "learning_rate", 1e-3),
    (["--lr=2e-5"], "learning_rate", 2e-5),
    (["--train-seed", "0x83b45442"], "train_seed", 0x83B45442),
    (["--eval-seed", "0x384B4524"], "eval_seed", 0x384B4524),
    (["--seed", "1234"], "seed", 1234),
    (["--grad-accumulation", "2"], "grad_accumulation", 2),
    (["--lmhead-chunks", "4"], "lmhead_chunks", 4),
    (["--model-dtype", "fp32"], "model_dtype", "fp32"),
    (["--lr-schedule", "linear"], "lr_schedule", "linear"),
    (["--final-lr-fraction", "0.1"], "final_lr_fraction", 0.1),
    (["--steps", "100"], "steps", 100),
    (["--ckpt-keep-n", "-1"], "ckpt_keep_n", -1),  # negative numbers are values, not flags
    (["--zero-level", "2"], "zero_level", 2),
    (["--train-file", "data/*.bin"], "train_file", "data/*.bin"),
    (["--model", "Qwen/Qwen2.5-0.5B"], "model", "Qwen/Qwen2.5-0.5B"),
    (["--from-scratch"], "from_scratch", True),
    (["--shard-gradients"], "shard_gradients", True),
    (["--no-save-training-state"], "save_training_state", False),
    (["--save-training-state"], "save_training_state", True),
])
def test_llmq_spellings_land_in_fields(argv, field, value):
    got = getattr(parse(*argv), field)
    assert got == value and type(got) is type(value)


def test_last_of_repeated_spellings_wins():
    assert parse("--batch", "2", "--batch-size", "8").batch_size == 8
    assert parse("--learning-rate", "1e-3", "--lr", "1e-4").learning_rate == 1e-4


def test_llmq_command_line():
    o = parse("--model", "Qwen2.5-0.5B", "--from-scratch", "--init-proj-to-zero", "--batch", "16",
              "--seq-length", "2048", "--grad-accumulation", "8", "--lr", "3e-4", "--warmup", "100",
              "--cooldown", "200", "--steps", "1000", "--final-lr-fraction", "0.1", "--model-dtype", "bf16",
              "--opt-m-dtype", "bf16", "--opt-v-dtype", "bf16", "--train-seed", "0x83b45442",
              "--zero-level", "2", "--all-to-all-reduce", "--offload-gradients", "--recompute-block",
              "--name", "run1", "--out-dir", "out/%n", "--no-save-training-state")
    assert (o.batch_size, o.seq_len, o.grad_accumulation, o.learning_rate) == (16, 2048, 8, 3e-4)
    assert (o.warmup, o.cooldown, o.steps, o.final_lr_fraction) == (100, 200, 1000, 0.1)
    assert o.from_scratch and o.init_proj_to_zero and o.recompute_block and not o.save_training_state
    assert o.gradient_manager_kind == "all-to-all" and o.offload_gradients
    assert o.expand(o.out_dir) == "out/run1"


# ---- --continue [X] ----------------------------------------------------------------------------------------
def test_continue_absent():
    assert parse().continue_from is None


def test_continue_without_argument_means_latest():
    assert parse("--continue").continue_from == "latest"
    o = parse("--continue", "--new-data", "--steps", "5")  # a following flag is not taken as the argument
    assert (o.continue_from, o.new_data, o.steps) == ("latest", True, 5)


@pytest.mark.parametrize("arg", ["500", "ckpt/run/step_00000500", "ckpt/other"])
def test_continue_with_argument(arg):
    assert parse("--continue", arg).continue_from == arg
    assert parse(f"--continue={arg}").continue_from == arg


def test_new_data_without_continue_is_rejected_by_validation():
    with pytest.raises(OptionsError, match="--new-data"):
        parse("--new-data")


# ---- every field reachable by its flag ---------------------------------------------------------------------
def test_every_field_has_its_llmq_flag():
    hints = typing.get_type_hints(Options)
    sample = {int: ("7", 7), float: ("0.25", 0.25), str: ("xyz", "xyz")}
    for f in dataclasses.fields(Options):
        flag = "--continue" if f.name == "continue_from" else "--" + f.name.replace("_", "-")
        if f.name == "continue_from":
            assert getattr(namespace(flag, "9"), f.name) == "9"
        elif hints[f.name] in (bool, bool | None):
            assert getattr(namespace(flag), f.name) is True, flag
            assert getattr(namespace("--no-" + flag[2:]), f.name) is False, flag
        else:
            text, value = sample[hints[f.name]]
            got = getattr(namespace(flag, text), f.name)
            assert got == value and type(got) is type(value), flag


def test_flags_not_given_are_not_in_namespace():
    # so a config file's values are only overridden by flags actually given
    ns = namespace("--batch", "8")
    assert {k for k in vars(ns) if k in Options.field_names()} == {"batch_size"}


# ---- bad flags ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,names", [
    (["--batchsize", "8"], "--batchsize"),
    (["--learning", "1e-3"], "--learning"),  # no abbreviations: --learning-rate must be spelled out
    (["--no-batch-size"], "--no-batch-size"),
    (["--frobnicate"], "--frobnicate"),
])
def test_unknown_flag_exits_2_naming_it(argv, names, capsys):
    with pytest.raises(SystemExit) as ei:
        main(["train", *argv])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "error: unrecognized arguments" in err and names in err


@pytest.mark.parametrize("argv,names", [
    (["--batch", "abc"], "--batch"),
    (["--lr", "fast"], "--lr"),
    (["--train-seed", "0xZZ"], "--train-seed"),
    (["--steps"], "--steps"),  # missing value
])
def test_bad_flag_value_exits_2_naming_it(argv, names, capsys):
    with pytest.raises(SystemExit) as ei:
        main(["train", *argv])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and names in err


def test_missing_command_exits_2(capsys):
    with pytest.raises(SystemExit) as ei:
        main([])
    assert ei.value.code == 2


# ---- --help ------------------------------------------------------------------------------------------------
def _help(capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "100000")  # no wrapping, so docstrings appear verbatim
    with pytest.raises(SystemExit) as ei:
        main(["train", "--help"])
    assert ei.value.code == 0
    return capsys.readouterr().out


def test_help_lists_every_option_with_field_docstring(capsys, monkeypatch):
    out = _help(capsys, monkeypatch)
    norm = " ".join(out.split())
    for f in dataclasses.fields(Options):
        flag = "--continue" if f.name == "continue_from" else "--" + f.name.replace("_", "-")
        assert flag in out, flag
        doc = cli._FIELD_DOCS.get(f.name)
        if doc:
            assert " ".join(doc.split()) in norm, f.name
    for extra in ("--batch ", "--seq-length", "--lr ", "--no-save-training-state", "--config"):
        assert extra in out
    # a few docstrings, literally
    assert "Micro-batch per GPU (sequences)." in out
    assert "Split the LM head + loss into N row chunks" in out
    assert "needs --from-scratch" in out


def test_field_docs_collected():
    # the docstring under each field, not the one of the next field
    assert cli._FIELD_DOCS["batch_size"] == "Micro-batch per GPU (sequences)."
    assert cli._FIELD_DOCS["seq_len"].startswith("Tokens per sequence")
    # every option is documented (its docstring is its --help text)
    assert [f.name for f in dataclasses.fields(Options) if not cli._FIELD_DOCS.get(f.name)] == []
    assert cli._FIELD_DOCS["continue_from"].startswith("`--continue [STEP|PATH]`")


def test_help_groups_the_options_by_topic_with_the_defaults_a_run_uses(capsys, monkeypatch):
    """Issue 43: `train --help` was one group of ~90 options and showed bf16 / batch 4 / seq 1024 / accumulation 4
    where the embedded default runs fp32 on a CPU / 8 / 256 / 1. Now the topics of `options.SECTIONS`, in order,
    then llm.q's switches; and both defaults where a small model starts elsewhere (options.SMALL_MODEL_DEFAULTS)."""
    from qtrain.options import SECTIONS
    out = _help(capsys, monkeypatch)
    heads = [line[:-1] for line in out.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert heads == ["options", *(f"{t} options" for t in SECTIONS),
                     "llm.q implementation switches (accepted, no effect in qtrain)"]
    assert out.index("\n  --batch-size") > out.index("data and batch options:") > out.index("\n  --model MODEL")
    small = "for the embedded default and the tiny-* presets)"
    for flag, text in (("--batch-size", "(default: 4; 8 " + small), ("--seq-len", "(default: 1024; 256 " + small),
                       ("--grad-accumulation", "(default: 4; 1 " + small),
                       ("--learning-rate", "(default: 1e-05; 0.003 " + small),
                       ("--model-dtype", "(default: bf16; fp32 on a CPU " + small)):
        start = out.index(f"\n  {flag} ")
        entry = " ".join(out[start:out.index("\n  -", start + 1)].split())  # the flag's help, one line
        assert text in entry, entry
    assert "(default: 0.9)" in out and "(default: 0.9;" not in out  # the same for every run: one default
    assert out.splitlines()[0] == "usage: qtrain train [-h] [--config FILE] [OPTION ...]"


def test_tiny_presets_start_from_the_small_model_defaults():
    small = cli.small_model_defaults()
    for model in ("tiny-qwen2", "tiny-gpt2", "Tiny-GPT2", "qtrain-tiny"):
        o = options_from_args(namespace("--model", model))
        assert {k: getattr(o, k) for k in small} == small and o.name == Options().name, model
    o = options_from_args(namespace("--model", "tiny-qwen2", "--batch", "2", "--lr", "1e-3"))
    assert (o.batch_size, o.learning_rate, o.seq_len) == (2, 1e-3, small["seq_len"])
    assert options_from_args(namespace("--model", "Qwen2.5-0.5B", "--from-scratch")).batch_size == 4  # a preset
    assert cli.embedded_defaults(device="cpu")["model_dtype"] == "fp32"
    assert cli.embedded_defaults(steps=30)["warmup"] == 3 and cli.embedded_defaults()["name"] == "qtrain-default"


def test_help_survives_percent_in_docstrings(capsys, monkeypatch):
    monkeypatch.setitem(cli._FIELD_DOCS, "out_dir", "Export directory; %n = --name, 100% HF format")
    out = _help(capsys, monkeypatch)
    assert "Export directory; %n = --name, 100% HF format" in out


# ---- config files + flags ----------------------------------------------------------------------------------
def _write(tmp_path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


TOML = """
model = "Qwen/Qwen2.5-0.5B"
batch = 2
seq-length = 64
lr = 1e-4
steps = 50
warmup = 5
shard_gradients = true
name = "from-file"
"""


def test_toml_config_fills_options(tmp_path):
    o = parse("--config", _write(tmp_path, "run.toml", TOML), model=False)
    assert (o.model, o.batch_size, o.seq_len, o.learning_rate, o.steps, o.warmup) == \
        ("Qwen/Qwen2.5-0.5B", 2, 64, 1e-4, 50, 5)
    assert o.shard_gradients and o.name == "from-file"
    assert o.grad_accumulation == Options().grad_accumulation  # not in the file: default


def test_flags_override_config(tmp_path):
    path = _write(tmp_path, "run.toml", TOML)
    o = parse("--batch", "8", "--config", path, "--lr", "3e-4", "--no-shard-gradients", "--continue", model=False)
    assert (o.batch_size, o.learning_rate, o.shard_gradients, o.continue_from) == (8, 3e-4, False, "latest")
    assert o.model == "Qwen/Qwen2.5-0.5B"
    assert parse("--config", path, "--model", "org/other", model=False).model == "org/other"
    assert (o.seq_len, o.steps, o.name) == (64, 50, "from-file")  # the rest from the file


def test_validation_applies_to_merged_options(tmp_path):
    path = _write(tmp_path, "run.toml", "steps = 100\nwarmup = 60\n")
    assert parse("--config", path).warmup == 60
    with pytest.raises(OptionsError, match="--warmup"):
        parse("--config", path, "--cooldown", "50")
    # and a flag can repair a bad file
    bad = _write(tmp_path, "bad.toml", "lmhead_chunks = 3\n")
    with pytest.raises(OptionsError, match="--lmhead-chunks"):
        parse("--config", bad)
    assert parse("--config", bad, "--batch", "3").lmhead_chunks == 3


def test_yaml_config_and_override(tmp_path):
    pytest.importorskip("yaml")
    path = _write(tmp_path, "run.yaml", "batch-size: 2\nseq_len: 64\nlr: 3e-4\ntrain_seed: 0x1234\ncontinue: 300\n")
    o = parse("--config", path)
    assert (o.batch_size, o.seq_len, o.learning_rate, o.train_seed, o.continue_from) == (2, 64, 3e-4, 0x1234, "300")
    o = parse("--config", path, "--seq-length", "128", "--continue", "ckpt/x")
    assert (o.seq_len, o.continue_from, o.batch_size) == (128, "ckpt/x", 2)


def test_config_unknown_key_names_file_and_key(tmp_path):
    path = _write(tmp_path, "run.toml", "batch = 2\nbatch-sise = 4\n")
    with pytest.raises(OptionsError) as ei:
        parse("--config", path)
    assert path in str(ei.value) and "batch-sise" in str(ei.value)


def test_config_malformed_toml_names_file(tmp_path):
    path = _write(tmp_path, "run.toml", "batch = = 2\n")
    with pytest.raises(OptionsError) as ei:
        parse("--config", path)
    assert path in str(ei.value)


def test_config_ill_typed_value_names_file_and_key(tmp_path):
    path = _write(tmp_path, "run.toml", 'batch_size = "eight"\n')
    with pytest.raises(OptionsError) as ei:
        parse("--config", path)
    assert path in str(ei.value) and "batch_size" in str(ei.value)


# ---- main(): exit code 2 and 'qtrain: error:' for qtrain's own errors -----------------------------------------
@pytest.mark.parametrize("argv,names", [
    (["--init-proj-to-zero"], "--init-proj-to-zero needs --from-scratch"),
    (["--new-data"], "--new-data needs --continue"),
    (["--offload-gradients"], "unsharded gradients cannot be offloaded"),
    (["--zero-level", "2", "--shard-gradients"], "mutually exclusive"),
    (["--batch", "3", "--lmhead-chunks", "2", "--seq-len", "5"], "--lmhead-chunks"),
    (["--steps", "0"], "--steps"),
    (["--model-dtype", "fp16"], "--model-dtype"),
])
def test_main_returns_2_on_invalid_options(argv, names, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", *argv]) == 2
    cap = capsys.readouterr()
    assert cap.err.startswith("qtrain: error: ") and names in cap.err
    assert "Traceback" not in cap.err
    assert list(tmp_path.iterdir()) == []  # nothing started: no logs, checkpoints or outputs


@pytest.mark.parametrize("text,names", [
    ("batch = 2\nnot_an_option = 1\n", "not_an_option"),
    ("batch = [\n", "TOML"),
    ('lr = "fast"\n', "'lr'"),  # the key as spelled in the file
])
def test_main_returns_2_on_bad_config(text, names, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path, "run.toml", text)
    assert main(["train", "--config", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qtrain: error: --config ") and path in err and names in err


def test_main_returns_2_on_missing_config(capsys, tmp_path):
    path = str(tmp_path / "absent.toml")
    assert main(["train", "--config", path]) == 2
    assert path in capsys.readouterr().err


def test_main_reraises_foreign_value_errors(monkeypatch):
    def boom(ns, argv):
        raise ValueError("not one of qtrain's")
    monkeypatch.setattr(cli_train, "run", boom)  # build_parser binds func=run when main() runs
    with pytest.raises(ValueError, match="not one of qtrain's"):
        main(["train"])


def test_main_hands_validated_options_and_argv_to_the_worker(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(cli_train, "run_worker", lambda opts, argv: seen.append((opts, argv)))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--device", "cpu", "--gpus", "1", "--batch", "8", "--lr", "3e-4", "--continue"]
    assert main(argv) == 0
    [(opts, got_argv)] = seen
    assert isinstance(opts, Options) and got_argv == ["qtrain", *argv]
    assert (opts.batch_size, opts.learning_rate, opts.continue_from, opts.device) == (8, 3e-4, "latest", "cpu")


# ---- issue 19: --version, help text with defaults and choices, "did you mean" -------------------------------
def test_version(capsys):
    import qtrain
    with pytest.raises(SystemExit) as ei:
        main(["--version"])
    assert ei.value.code == 0
    assert capsys.readouterr().out.strip() == f"qtrain {qtrain.__version__}"
    assert qtrain.__version__.count(".") == 2 and all(p.isdigit() for p in qtrain.__version__.split("."))


def _subcommand_actions():
    import argparse
    parser = build_parser()
    for name, sub in parser.subcommands.items():
        for a in sub._actions:
            if not isinstance(a, argparse._HelpAction):
                yield name, sub, a


def test_every_flag_of_every_subcommand_has_help_with_its_default(capsys, monkeypatch):
    import argparse
    from qtrain.options import CHOICES
    monkeypatch.setenv("COLUMNS", "100000")
    checked = 0
    for name, sub, a in _subcommand_actions():
        flag = a.option_strings[0] if a.option_strings else a.dest
        assert a.help and len(a.help) > 10, f"qtrain {name} {flag}: no help text"
        text = sub.formatter_class(prog="x")._expand_help(a) if a.help else ""
        if a.option_strings and a.default not in (None, argparse.SUPPRESS) or name in ("train", "plan") and \
                a.dest in Options.field_names() and a.dest != "continue_from":
            assert "default" in text, f"qtrain {name} {flag}: help does not show the default: {text!r}"
        if a.dest in CHOICES and name in ("train", "plan"):
            assert all(c in text for c in CHOICES[a.dest]), f"qtrain {name} {flag}: choices missing: {text!r}"
        if a.choices:
            assert a.metavar is None or "{" in str(a.metavar)
        checked += 1
    assert checked > 150
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--model-dtype {fp32,bf16}" in out and \
        "Choices: fp32, bf16. (default: bf16; fp32 on a CPU for the embedded default and the tiny-* presets)" in out
    assert "--train-seed TRAIN_SEED" in out and "(default: 0x83b45442)" in out
    assert "--use-cuda-graphs, --no-use-cuda-graphs" in out and "--custom-matmul" in out


@pytest.mark.parametrize("argv,suggestion", [
    (["train", "--stesp", "3"], "--stesp (did you mean --steps?)"),
    (["train", "--lerning-rate=1e-3"], "--lerning-rate=1e-3 (did you mean --learning-rate?)"),
    (["train", "--recompute-swigl"], "(did you mean --recompute-swiglu?)"),
    (["tokenize", "x.txt", "--out-dir", "o", "--tokeniser", "gpt2"], "(did you mean --tokenizer?)"),
    (["export-wandb", "log.jsonl", "--project", "p", "--entitiy", "me"], "(did you mean --entity?)"),
])
def test_unknown_flag_gets_the_closest_match(argv, suggestion, capsys):
    with pytest.raises(SystemExit) as ei:
        main(argv)
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments" in err and suggestion in err, err


def test_far_off_flag_gets_no_suggestion(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--frobnicate"])
    assert "did you mean" not in capsys.readouterr().err


def test_unknown_config_key_gets_the_closest_match(tmp_path):
    path = _write(tmp_path, "run.toml", "batch = 2\nlearning-rat = 1e-4\n")
    with pytest.raises(OptionsError, match=r"'learning-rat' -> 'learning_rate'"):
        parse("--config", path)


# ---- issue 43: listing the subcommands and a subcommand's help import no torch ---------------------------------
def test_help_imports_no_torch():
    """`qtrain --help` lists the subcommands from a static table, and `qtrain train --help` builds only the train
    parser, whose options import no torch (torch's import took 7-13 s of `qtrain --help` on a cold machine)."""
    import subprocess
    import sys
    from tests.run_utils import subprocess_env
    code = """
import contextlib, io, sys
import qtrain.cli.main as m
m.build_parser([])
seen = ['torch' in sys.modules]
for argv in (['--help'], ['train', '--help'], ['plan', '--help']):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        try:
            m.main(argv)
        except SystemExit as e:
            assert e.code == 0, (argv, e.code)
    assert 'usage: qtrain' in out.getvalue()
    seen.append('torch' in sys.modules)
print(seen)
"""
    r = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[False, False, False, False]"


def test_a_command_line_builds_its_own_subcommand_only(capsys):
    from qtrain.cli.main import SUBCOMMANDS, command_of
    assert command_of(["train", "--steps", "3"]) == "train" and command_of(["--version"]) is None
    assert command_of(["bogus"]) is None
    parser = build_parser(["train"])
    assert parser.subcommands["train"]._actions[-1].option_strings and not \
        [a for a in parser.subcommands["plan"]._actions if a.option_strings != ["-h", "--help"]]
    with pytest.raises(SystemExit) as ei:  # an unknown subcommand: argparse lists the known ones
        main(["bogus"])
    err = capsys.readouterr().err
    assert ei.value.code == 2 and all(name in err for name in SUBCOMMANDS)
