"""The training options on the command line: one flag per `Options` field (llm.q's spelling), and the one
function from parsed arguments to a validated `Options` that every subcommand taking them uses
(`qtrain train`, `qtrain plan`), so both start from the same settings.

Precedence: embedded defaults (only without --model) < --config file < flags.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import typing
from typing import Any

from qtrain import options as options_module
from qtrain.cli.config_file import load_config_file
from qtrain.options import Options, normalize_mapping

# llm.q spellings accepted besides the field names
EXTRA_FLAGS = {"batch_size": ["--batch"], "seq_len": ["--seq-length"], "learning_rate": ["--lr"]}


def _collect_field_docs() -> dict[str, str]:
    """Field docstrings (the string literal under each field) become the --help text."""
    tree = ast.parse(inspect.getsource(options_module))
    docs: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "Options":
            body = node.body
            for a, b in zip(body, body[1:]):
                if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
                    docs[a.target.id] = str(b.value.value)
    return docs


_FIELD_DOCS = _collect_field_docs()


def _field_help(name: str) -> str:
    doc = _FIELD_DOCS.get(name, "")
    return " ".join(doc.split()).replace("%", "%%")  # argparse %-formats help strings (`%n` in a path)


def _int(s: str) -> int:
    return int(s, 0)  # accepts 0x83b45442 like llm.q's seeds


_int.__name__ = "int"  # argparse names the type in "invalid int value: 'abc'"


def add_train_args(p: argparse.ArgumentParser) -> None:
    """--config and one flag per `Options` field; nothing is set unless given (argparse.SUPPRESS), so the
    precedence of `options_from_args` holds."""
    p.add_argument("--config", help="TOML or YAML file of options; flags given here override it")
    hints = typing.get_type_hints(Options)
    for f in dataclasses.fields(Options):
        flag = "--" + f.name.replace("_", "-")
        names = [flag] + EXTRA_FLAGS.get(f.name, [])
        help_ = _field_help(f.name)
        if f.name == "continue_from":
            p.add_argument("--continue", dest=f.name, nargs="?", const="latest", default=argparse.SUPPRESS,
                           help=help_)
            continue
        typ = hints[f.name]
        if typ is bool:
            p.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                           help=help_)
        else:
            conv: Any = {int: _int, float: float}.get(typ, str)
            p.add_argument(*names, dest=f.name, type=conv, default=argparse.SUPPRESS, metavar=f.name.upper(),
                           help=help_)


def embedded_defaults() -> dict[str, Any]:
    """Settings for the embedded default run (no --model): a tiny model from scratch needs a far larger
    learning rate than llm.q's fine-tuning default, and short sequences keep a CPU run to a few minutes."""
    import torch
    return dict(learning_rate=3e-3, warmup=10, lr_schedule="cosine", final_lr_fraction=0.1, seq_len=256,
                batch_size=8, grad_accumulation=1, epochs=1, eval_every_n_steps=50, eval_num_steps=20,
                model_dtype="bf16" if torch.cuda.is_available() else "fp32", name="qtrain-default")


def options_from_args(ns: argparse.Namespace) -> Options:
    """Parsed arguments (of any subcommand that has `add_train_args`) -> validated `Options`. Keys that
    are not options (the subcommand's own arguments) are ignored."""
    names = Options.field_names()
    given = {k: v for k, v in vars(ns).items() if k in names}
    base: dict[str, Any] = {}
    if getattr(ns, "config", None):
        base = normalize_mapping(load_config_file(ns.config), source=f"--config {ns.config}")
    merged = {**base, **given}
    if not merged.get("model"):
        merged = {**embedded_defaults(), **merged}
    return Options(**merged).validate()
