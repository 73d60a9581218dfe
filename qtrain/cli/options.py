"""The training options on the command line: one flag per `Options` field (llm.q's spelling), and the one
function from parsed arguments to a validated `Options` that every subcommand taking them uses
(`qtrain train`, `qtrain plan`), so both start from the same settings.

Precedence: small-model defaults (without --model, or a tiny preset: `Options.SMALL_MODEL_DEFAULTS`) < --config
file < flags. --help groups the flags by `options.SECTIONS` and names both defaults where they differ.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
import typing
from typing import Any

from qtrain import console
from qtrain import options as options_module
from qtrain.cli.config_file import load_config_file
from qtrain.options import (CHOICES, EMBEDDED_NAME, SECTIONS, SMALL_MODEL_DEFAULTS, SMALL_MODEL_DTYPE, Options,
                            normalize_mapping, with_derived_name)

SMALL_MODELS = "the embedded default and the tiny-* presets"  # where SMALL_MODEL_DEFAULTS apply, for --help

# llm.q spellings accepted besides the field names (`--persist-quants` is how llm.q's README spells it)
EXTRA_FLAGS = {"batch_size": ["--batch"], "seq_len": ["--seq-length"], "learning_rate": ["--lr"],
               "persistent_quants": ["--persist-quants"]}

# llm.q switches that choose between its own CUDA/threads implementations; qtrain accepts them so llm.q command
# lines run unchanged, and says in one line what it does instead.
LLMQ_IMPLEMENTATION_FLAGS = {
    "--custom-matmul": "qtrain's matmuls are torch's cuBLAS(Lt) GEMMs (FP8: torch._scaled_mm), llm.q's hand-written "
                       "mma kernel does not exist here; --custom-matmul has no effect",
    "--memcpy-all-gather": "qtrain runs one process per GPU and all-gathers weights with NCCL (torch.distributed); "
                           "llm.q's threads-mode peer memcpy does not apply; --memcpy-all-gather has no effect",
    "--memcpy-send-recv": "qtrain exchanges gradient slices with NCCL all_to_all_single (torch.distributed); "
                          "llm.q's threads-mode peer memcpy does not apply; --memcpy-send-recv has no effect",
    "--write-combined": "qtrain pins offloaded state with torch's ordinary pinned allocator (no write-combined "
                        "mapping); --write-combined has no effect",
}
LLMQ_FLAG_ALIASES = {"--write-combined": ["--use-write-combined"]}  # README spelling


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


def _default_text(name: str, value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None:
        return "auto"
    if name.endswith("_seed"):
        return hex(value)
    return repr(value) if value == "" else str(value)


def _default_help(name: str, value: Any) -> str:
    """' (default: X)', with what a small model starts from instead where that differs (SMALL_MODEL_DEFAULTS)."""
    text = _default_text(name, value)
    if name == "model_dtype":
        where = {"cpu": "on a CPU", "cuda": "on CUDA"}
        small = ", ".join(f"{v} {where[d]}" for d, v in SMALL_MODEL_DTYPE.items() if v != value)
    elif name in SMALL_MODEL_DEFAULTS and SMALL_MODEL_DEFAULTS[name] != value:
        small = _default_text(name, SMALL_MODEL_DEFAULTS[name]) + (" (a tenth of a shorter --steps)"
                                                                   if name == "warmup" else "")
    else:
        small = ""
    return f" (default: {text}" + (f"; {small} for {SMALL_MODELS}" if small else "") + ")"


def _int(s: str) -> int:
    return int(s, 0)  # accepts 0x83b45442 like llm.q's seeds


_int.__name__ = "int"  # argparse names the type in "invalid int value: 'abc'"


def add_train_args(p: argparse.ArgumentParser) -> None:
    """--config and one flag per `Options` field; nothing is set unless given (argparse.SUPPRESS), so the
    precedence of `options_from_args` holds."""
    p.usage = "%(prog)s [-h] [--config FILE] [OPTION ...]"  # the options, by topic, follow (not a 78-line usage)
    p.add_argument("--config", metavar="FILE", help="TOML or YAML file of options (flat, or with one level of "
                                                    "[sections]); flags given here override it")
    hints = typing.get_type_hints(Options)
    groups = _section_groups(p)
    by_name = {f.name: f for f in dataclasses.fields(Options)}
    for f in (by_name[n] for n in groups):  # section by section
        flag = "--" + f.name.replace("_", "-")
        names = [flag] + EXTRA_FLAGS.get(f.name, [])
        help_ = _field_help(f.name)
        if f.name in CHOICES:
            help_ += " Choices: " + ", ".join(CHOICES[f.name]) + "."
        if f.name != "continue_from":
            help_ += _default_help(f.name, f.default).replace("%", "%%")
        g = groups[f.name]
        if f.name == "continue_from":
            g.add_argument("--continue", dest=f.name, nargs="?", const="latest", default=argparse.SUPPRESS,
                           help=help_)
            continue
        typ = hints[f.name]
        if typ in (bool, bool | None):
            g.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                           help=help_)
        else:
            conv: Any = {int: _int, float: float}.get(typ, str)
            metavar = "{" + ",".join(CHOICES[f.name]) + "}" if f.name in CHOICES else f.name.upper()
            g.add_argument(*names, dest=f.name, type=conv, default=argparse.SUPPRESS, metavar=metavar,
                           help=help_)
    g = p.add_argument_group("llm.q implementation switches (accepted, no effect in qtrain)")  # after the sections
    for flag, note in LLMQ_IMPLEMENTATION_FLAGS.items():
        g.add_argument(flag, *LLMQ_FLAG_ALIASES.get(flag, []), dest="llmq_" + flag[2:].replace("-", "_"),
                       action="store_true", default=argparse.SUPPRESS, help=note.replace("%", "%%"))


def _section_groups(p: argparse.ArgumentParser) -> dict[str, Any]:
    """Field name -> the --help group of its section (`options.SECTIONS`; a field in none: "other options"), in
    the sections' order."""
    out: dict[str, Any] = {}
    for title, names in SECTIONS.items():
        g = p.add_argument_group(f"{title} options")
        out.update({n: g for n in names})
    rest = [f.name for f in dataclasses.fields(Options) if f.name not in out]
    if rest:
        g = p.add_argument_group("other options")
        out.update({n: g for n in rest})
    return out


def llmq_notes(ns: argparse.Namespace) -> list[str]:
    """One line per llm.q implementation switch given on the command line: what qtrain does instead."""
    return [f"note: {note}" for flag, note in LLMQ_IMPLEMENTATION_FLAGS.items()
            if getattr(ns, "llmq_" + flag[2:].replace("-", "_"), False)]


def small_model_defaults(steps: int = -1, device: str = "auto") -> dict[str, Any]:
    """What a small model from scratch starts from (`options.SMALL_MODEL_DEFAULTS`: the embedded default and the
    tiny presets), for a run of `steps` on `device`: the warmup shrinks to a tenth of a shorter `--steps` (so
    `--steps 1` just works), the model dtype follows the device (SMALL_MODEL_DTYPE)."""
    import torch
    warmup = SMALL_MODEL_DEFAULTS["warmup"]
    if steps > 0:
        warmup = min(warmup, steps // 10)
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    return {**SMALL_MODEL_DEFAULTS, "warmup": warmup, "model_dtype": SMALL_MODEL_DTYPE["cuda" if cuda else "cpu"]}


def embedded_defaults(steps: int = -1, device: str = "auto") -> dict[str, Any]:
    """Settings for the embedded default run (no --model): the small-model defaults and its run name."""
    return {**small_model_defaults(steps, device), "name": EMBEDDED_NAME}


def options_from_args(ns: argparse.Namespace) -> Options:
    """Parsed arguments (of any subcommand that has `add_train_args`) -> validated `Options`. Keys that
    are not options (the subcommand's own arguments) are ignored."""
    names = Options.field_names()
    given = {k: v for k, v in vars(ns).items() if k in names}
    base: dict[str, Any] = {}
    if getattr(ns, "config", None):
        base = normalize_mapping(load_config_file(ns.config), source=f"--config {ns.config}")
    merged = with_derived_name({**base, **given})
    steps, device = int(merged.get("steps", -1)), str(merged.get("device", "auto"))
    if not merged.get("model"):
        merged = {**embedded_defaults(steps, device), **merged}
    else:
        from qtrain.model.resolve import is_tiny  # imports torch: parsing --help does not come here
        if is_tiny(str(merged["model"])):
            merged = {**small_model_defaults(steps, device), **merged}
    opts = Options(**merged).validate()
    if opts.tokenizer:  # an explicit export tokenizer must exist: say so now, not after training
        from qtrain.data.hf_tokenizer import export_tokenizer
        export_tokenizer(explicit=opts.tokenizer)
    for line in llmq_notes(ns):
        console.write(line + "\n", sys.stderr)
    return opts
