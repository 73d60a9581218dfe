"""`qtrain tokenize`: text / JSONL / Parquet files -> llm.q token files (`qtrain.data.tokenize`)."""
from __future__ import annotations

import argparse
import os
from typing import Sequence

from qtrain.data.tokenize import tokenize_files

HELP = "text / JSONL / Parquet -> token files"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("inputs", nargs="+", help="input .txt/.jsonl/.parquet files, directories or globs")
    parser.add_argument("--out-dir", required=True, help="directory for train*.bin / eval*.bin")
    parser.add_argument("--tokenizer", default="qwen2", help="qwen2 | gpt2 | tokenizer.json | HF model dir (default qwen2)")
    parser.add_argument("--eval-inputs", nargs="+", default=[], help="separate eval documents (instead of --eval-fraction)")
    parser.add_argument("--eval-fraction", type=float, default=None, help="hold out whole documents for this fraction of the tokens (default 0.05 without --eval-inputs)")
    parser.add_argument("--text-field", default="text", help="jsonl field / parquet column holding the text")
    parser.add_argument("--split-lines", action="store_true", help="treat each non-empty line of a .txt file as a document")
    parser.add_argument("--max-tokens-per-file", type=int, default=100_000_000, help="split outputs into NAME-000.bin... beyond this")
    parser.add_argument("--workers", type=int, default=max(1, min((os.cpu_count() or 2) // 2, 8)), help="tokenizer processes")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def run(ns: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    fraction = ns.eval_fraction if ns.eval_fraction is not None else (0.0 if ns.eval_inputs else 0.05)
    res = tokenize_files(
        ns.inputs,
        ns.out_dir,
        tokenizer=ns.tokenizer,
        eval_inputs=ns.eval_inputs,
        eval_fraction=fraction,
        text_field=ns.text_field,
        split_lines=ns.split_lines,
        max_tokens_per_file=ns.max_tokens_per_file,
        workers=ns.workers,
        progress=not ns.no_progress,
    )
    print(
        f"{res.documents:,} documents -> {res.train_tokens:,} train tokens in {len(res.train_files)} file(s), "
        f"{res.eval_tokens:,} eval tokens in {len(res.eval_files)} file(s) "
        f"[{res.tokenizer}, vocab {res.vocab_size}, eos {res.eos_id}] in {res.seconds:.1f} s -> {ns.out_dir}"
    )
    return 0
