"""`qtrain` command line: argument parsing only; the work happens in qtrain.train.

    qtrain train                                   # embedded default: tiny model, embedded corpus
    qtrain train --model Qwen/Qwen2.5-0.5B --train-file 'data/*.bin' --eval-file data/eval.bin
    qtrain train --model Qwen2.5-0.5B --from-scratch --gpus 2 --shard-gradients
    torchrun --nproc-per-node 8 -m qtrain.cli.main train ...   # launcher-provided ranks (one or more nodes)
    qtrain tokenize --tokenizer qwen2 --out-dir data/mine docs/*.txt
    qtrain export --checkpoint-dir ckpt/run --out-dir output/run
    qtrain plan --model Qwen2.5-7B --gpu-memory 80GiB --seq-len 1024 [--gpus 8]
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from typing import Any, Sequence

from ..train.options import ALIASES, Options, OptionsError, load_config_file, normalize_mapping  # noqa: F401

# llm.q spellings accepted besides the field names
_EXTRA_FLAGS = {"batch_size": ["--batch"], "seq_len": ["--seq-length"], "learning_rate": ["--lr"]}


def _field_help(name: str) -> str:
    doc = _FIELD_DOCS.get(name, "")
    return " ".join(doc.split()).replace("%", "%%")  # argparse %-formats help strings (`%n` in a path)


def _collect_field_docs() -> dict[str, str]:
    """Field docstrings (the string literal under each field) become the --help text."""
    import ast
    import inspect
    from ..train import options as mod
    tree = ast.parse(inspect.getsource(mod))
    docs: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "Options":
            body = node.body
            for a, b in zip(body, body[1:]):
                if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
                    docs[a.target.id] = str(b.value.value)
    return docs


_FIELD_DOCS = _collect_field_docs()


def add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML or YAML file of options; flags given here override it")
    hints = typing.get_type_hints(Options)
    for f in dataclasses.fields(Options):
        flag = "--" + f.name.replace("_", "-")
        names = [flag] + _EXTRA_FLAGS.get(f.name, [])
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


def _int(s: str) -> int:
    return int(s, 0)  # accepts 0x83b45442 like llm.q's seeds


_int.__name__ = "int"  # argparse names the type in "invalid int value: 'abc'"


def embedded_defaults() -> dict[str, Any]:
    """Settings for the embedded default run (no --model): a tiny model from scratch needs a far larger
    learning rate than llm.q's fine-tuning default, and short sequences keep a CPU run to a few minutes."""
    import torch
    return dict(learning_rate=3e-3, warmup=10, lr_schedule="cosine", final_lr_fraction=0.1, seq_len=256,
                batch_size=8, grad_accumulation=1, epochs=1, eval_every_n_steps=50, eval_num_steps=20,
                model_dtype="bf16" if torch.cuda.is_available() else "fp32", name="qtrain-default")


def options_from_args(ns: argparse.Namespace) -> Options:
    given = {k: v for k, v in vars(ns).items() if k not in ("command", "config", "func")}
    base: dict[str, Any] = {}
    if getattr(ns, "config", None):
        base = normalize_mapping(load_config_file(ns.config), source=f"--config {ns.config}")
    merged = {**base, **given}
    if not merged.get("model"):
        merged = {**embedded_defaults(), **merged}
    return Options(**merged).validate()


def _train(ns: argparse.Namespace, argv: Sequence[str]) -> int:
    opts = options_from_args(ns)
    from ..parallel.dist import launch_local, under_launcher
    nprocs = opts.gpus
    if nprocs == 0:
        import torch
        nprocs = torch.cuda.device_count() if (torch.cuda.is_available() and opts.device != "cpu") else 1
    if under_launcher() or nprocs == 1:
        _run_worker(opts, list(argv))
    else:
        launch_local(_run_worker, nprocs, opts, list(argv))
    return 0


def _run_worker(opts: Options, argv: list[str]) -> None:
    from ..parallel.dist import shutdown
    from ..train.loop import run_training
    try:
        run_training(opts, argv)
    finally:
        shutdown()


def _tokenize(ns: argparse.Namespace, argv: Sequence[str]) -> int:
    from ..train.tokenize import run_tokenize
    run_tokenize(ns)
    return 0


def _export(ns: argparse.Namespace, argv: Sequence[str]) -> int:
    from ..train.export import export_checkpoint
    export_checkpoint(ns.checkpoint_dir, ns.out_dir, step=ns.step)
    return 0


def _plot(ns: argparse.Namespace, argv: Sequence[str]) -> int:
    from ..tools.plot import run_plot
    return run_plot(ns)


def _eval(ns: argparse.Namespace, argv: Sequence[str]) -> int:
    from ..train.evaluate import run_eval
    return run_eval(ns)


def _export_wandb(ns: argparse.Namespace, argv: Sequence[str]) -> int:
    from ..tools.wandb_export import run_export_wandb
    return run_export_wandb(ns)


def _plan(ns: argparse.Namespace, argv: Sequence[str]) -> int:
    from ..train.memory_plan import run_plan
    return run_plan(ns)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qtrain", description="Fast, memory-lean training of Llama-family LMs")
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train or fine-tune a model", allow_abbrev=False)
    add_train_args(t)
    t.set_defaults(func=_train)
    from ..train.tokenize import add_tokenize_args
    k = sub.add_parser("tokenize", help="text / JSONL / Parquet -> token files")
    add_tokenize_args(k)
    k.set_defaults(func=_tokenize)
    e = sub.add_parser("export", help="training checkpoint -> Hugging Face model directory")
    e.add_argument("--checkpoint-dir", required=True)
    e.add_argument("--out-dir", required=True)
    e.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    e.set_defaults(func=_export)
    pl = sub.add_parser("plan", help="memory plan of the options, and the largest micro-batch that fits a GPU",
                        allow_abbrev=False)
    add_train_args(pl)
    from ..train.memory_plan import add_plan_args
    add_plan_args(pl)
    pl.set_defaults(func=_plan)
    from ..train.evaluate import add_eval_args
    v = sub.add_parser("eval", help="loss / perplexity of a Hugging Face model directory on token files")
    add_eval_args(v)
    v.set_defaults(func=_eval)
    from ..tools.plot import add_plot_args
    pl = sub.add_parser("plot", help="plot run logs: loss + eval, lr, grad norm, tokens/s vs steps and tokens")
    add_plot_args(pl)
    pl.set_defaults(func=_plot)
    from ..tools.wandb_export import add_export_wandb_args
    w = sub.add_parser("export-wandb", help="replay a run log into a Weights & Biases run (offline by default)")
    add_export_wandb_args(w)
    w.set_defaults(func=_export_wandb)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return ns.func(ns, ["qtrain", *argv])
    except ValueError as e:  # qtrain's own errors (options, config, weights, data, checkpoints) are ValueErrors
        if not type(e).__module__.startswith("qtrain."):
            raise
        print(f"qtrain: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
