"""`qtrain` command line: argument parsing only; the work happens in the packages below.

    qtrain train                                   # embedded default: tiny model, embedded corpus
    qtrain train --model Qwen/Qwen2.5-0.5B --train-file 'data/*.bin' --eval-file data/eval.bin
    qtrain train --model Qwen2.5-0.5B --from-scratch --gpus 2 --shard-gradients
    torchrun --nproc-per-node 8 -m qtrain.cli.main train ...   # launcher-provided ranks (one or more nodes)
    qtrain tokenize --tokenizer qwen2 --out-dir data/mine docs/*.txt
    qtrain export --checkpoint-dir ckpt/run --out-dir output/run
    qtrain generate --model output/run --prompt "Once upon a time"
    qtrain plan --model Qwen2.5-7B --gpu-memory 80GiB --seq-len 1024 [--gpus 8]

Each subcommand is a module of this package with `add_arguments(parser)` and `run(ns, argv)`; `SUBCOMMANDS` names
it and its help line, so that listing the subcommands imports none of them, and a command line builds the parser of
its own subcommand only (`qtrain --help` and `qtrain train --help` import no torch).
"""
from __future__ import annotations

import argparse
import importlib
import signal
import sys
from typing import Iterable, Sequence

from qtrain import __version__, bytecode_cache, console
from qtrain.options import closest

# subcommand -> (module of this package, help line); `allow_abbrev` is off for those with many long flags
SUBCOMMANDS = {
    "train": ("train", "train or fine-tune a model"),
    "tokenize": ("tokenize", "text / JSON Lines / JSON / Parquet -> token files (with loss masks for chat / SFT data)"),
    "export": ("export", "training checkpoint -> Hugging Face model directory (weights, tokenizer, generation config)"),
    "generate": ("generate", "sample text from an export or Hugging Face model directory"),
    "plan": ("plan", "memory plan of the options, and the largest micro-batch that fits a GPU"),
    "eval": ("evaluate", "loss / perplexity of a Hugging Face model directory on token files"),
    "plot": ("plot", "plot run logs: loss + eval, lr, grad norm, tokens/s vs steps and tokens"),
    "export-wandb": ("wandb", "replay a run log into a Weights & Biases run (offline by default)"),
}
NO_ABBREV = {"train", "plan"}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each argument's default, except where there is none (None) or the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse with "did you mean ...?" for unknown flags, suggested from the subcommand's own flags."""

    subcommands: dict[str, argparse.ArgumentParser]

    def parse_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None):
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            sub = getattr(self, "subcommands", {}).get(getattr(ns, "command", None) or "", self)
            flags = [o for a in sub._actions for o in a.option_strings]
            words = []
            for x in extras:
                match = closest(x.split("=", 1)[0], flags) if x.startswith("--") else None
                words.append(f"{x} (did you mean {match}?)" if match else x)
            sub.error("unrecognized arguments: " + " ".join(words))
        return ns


def build_parser(commands: Iterable[str] | None = None) -> Parser:
    """The `qtrain` parser. Every subcommand is listed; those in `commands` (default: all) get their arguments,
    which imports their modules; the others parse nothing and import nothing."""
    full = set(SUBCOMMANDS if commands is None else commands)
    parser = Parser(prog="qtrain", description="Fast, memory-lean training of Llama-family LMs")
    parser.add_argument("--version", action="version", version=f"qtrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parser.subcommands = {}
    for name, (module, help_) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_, formatter_class=HelpFormatter,
                           **({"allow_abbrev": False} if name in NO_ABBREV else {}))
        if name in full:
            mod = importlib.import_module(f"qtrain.cli.{module}")
            mod.add_arguments(p)
            p.set_defaults(func=mod.run)
        parser.subcommands[name] = p
    return parser


def command_of(argv: Sequence[str]) -> str | None:
    """The subcommand a command line names: its first word that is not a flag (the top level's flags take no
    value), if it is one."""
    first = next((a for a in argv if not a.startswith("-")), None)
    return first if first in SUBCOMMANDS else None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = command_of(argv)
    if command:
        bytecode_cache.use()  # before the command imports torch (bytecode_cache.py says why)
    parser = build_parser([command] if command else [])
    ns = parser.parse_args(argv)
    try:
        return _run(ns, argv)
    finally:
        console.flush_standard_streams()  # a console that went away is lost here, not in the interpreter's exit


def _run(ns: argparse.Namespace, argv: list[str]) -> int:
    try:
        return ns.func(ns, ["qtrain", *argv])
    except ValueError as e:  # qtrain's own errors (options, config, weights, data, checkpoints) are ValueErrors
        if not _ours(e):
            raise
        return _fail("error", e, 2)
    except OSError as e:  # a path the user gave that cannot be read or written (missing, read-only, full)
        if console.is_gone(e):
            console.flush_standard_streams()
            if console.lost():  # the console went away (`qtrain plan | head`): no one is left to tell
                return 128 + signal.SIGPIPE
        return _fail("error", f"{e.filename}: {e.strerror}" if e.filename and e.strerror else e, 2)
    except KeyboardInterrupt:
        return _fail("stopped", "interrupted", 130)
    except Exception as e:  # a run that stopped on purpose, or a failed rank: their message and exit code
        if not (_ours(e) and hasattr(e, "exit_code")):
            raise
        return _fail(getattr(e, "label", "error"), e, int(e.exit_code))


def _ours(e: BaseException) -> bool:
    return type(e).__module__.startswith("qtrain.")


def _fail(label: str, msg: object, code: int) -> int:
    """One line on stderr, and the exit code: no traceback for what the user can fix or chose."""
    console.write(f"qtrain: {label}: {msg}\n", sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
