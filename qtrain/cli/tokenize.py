"""`qtrain tokenize`: text / JSON Lines / JSON / Parquet files -> llm.q token files (`qtrain.data.tokenize`),
optionally with loss masks for chat / SFT records (`qtrain.data.sft`)."""
from __future__ import annotations

import argparse
import os
from typing import Sequence

from qtrain.data.sft import SFTFormat
from qtrain.data.tokenize import tokenize_files
from qtrain.fsio import shorten


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("inputs", nargs="+",
                        help="input .txt/.jsonl/.json/.parquet files, directories or globs (a .json file holds JSON "
                             "Lines or one array of objects; a directory is searched for all but .json, which is "
                             "taken only by name or glob)")
    parser.add_argument("--out-dir", required=True, help="directory for train*.bin / eval*.bin")
    parser.add_argument("--tokenizer", default="qwen2", help="qwen2 | gpt2 | tokenizer.json | HF model directory")
    parser.add_argument("--eval-inputs", nargs="+", default=[], help="separate eval documents (instead of --eval-fraction)")
    parser.add_argument("--eval-fraction", type=float, default=None, help="hold out whole documents for this fraction of the tokens (default 0.05 without --eval-inputs)")
    parser.add_argument("--text-field", default="text", help="JSON field / parquet column holding the text")
    parser.add_argument("--split-lines", action="store_true", help="treat each non-empty line of a .txt file as a document")
    parser.add_argument("--max-tokens-per-file", type=int, default=100_000_000, help="split outputs into NAME-000.bin... beyond this")
    parser.add_argument("--workers", type=int, default=max(1, min((os.cpu_count() or 2) // 2, 8)), help="tokenizer processes")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier qtrain tokenize output in --out-dir (only the files its index "
                             "qtrain-tokenize.json lists; files no qtrain tokenize wrote are never overwritten)")
    sft = parser.add_argument_group("chat / SFT data: the loss covers only the responses (files carry loss masks)")
    sft.add_argument("--prompt-field", default=None, help="field / column with the prompt (with --response-field)")
    sft.add_argument("--response-field", default=None, help="field / column with the response the model learns")
    sft.add_argument("--messages-field", default=None,
                     help="field / column with a chat: a list of {role, content}, rendered as ChatML; the loss "
                          "covers the assistant messages (needs a tokenizer with <|im_start|>, e.g. qwen2)")
    sft.add_argument("--pad-to", type=int, default=None,
                     help="make every example exactly N tokens (cut or padded with EOS, not trained on); use "
                          "N = --seq-len of training so each sequence is one whole example")
    sft.add_argument("--pack-to", type=int, default=None,
                     help="pack whole examples into rows of exactly N tokens (first-fit decreasing; a row's rest "
                          "is padding, not trained on) and record where each starts; train with --seq-len N "
                          "--document-masking so that each example attends only to itself")
    sft.add_argument("--no-truncate", action="store_true",
                     help="refuse an example longer than --pack-to / --pad-to N (default: cut it to its first N-1 "
                          "tokens and its EOS, and count it)")
    return parser


def run(ns: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    fraction = ns.eval_fraction if ns.eval_fraction is not None else (0.0 if ns.eval_inputs else 0.05)
    sft = None
    if (ns.prompt_field or ns.response_field or ns.messages_field or ns.pad_to is not None or ns.pack_to is not None
            or ns.no_truncate):
        sft = SFTFormat(prompt_field=ns.prompt_field, response_field=ns.response_field,
                        messages_field=ns.messages_field, pad_to=ns.pad_to, pack_to=ns.pack_to,
                        truncate=not ns.no_truncate).validate()
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
        sft=sft,
        overwrite=ns.overwrite,
    )
    for path in res.extra.get("swept", []):
        print(f"removed {path}, left by a qtrain tokenize that was killed")
    print(
        f"{res.documents:,} documents -> {res.train_tokens:,} train tokens in {len(res.train_files)} file(s), "
        f"{res.eval_tokens:,} eval tokens in {len(res.eval_files)} file(s) "
        f"[{res.tokenizer}, vocab {res.vocab_size}, eos {res.eos_id}{', loss masks' if sft else ''}] "
        f"in {res.seconds:.1f} s -> {ns.out_dir}"
    )
    both = res.extra.get("eval_also_train", [])
    if both:  # allowed (a check of fitting itself), but the eval loss then says nothing of what was not seen
        print(f"note: {len(both)} --eval-inputs file(s) are also training inputs ({shorten(both[0])}"
              f"{', ...' if len(both) > 1 else ''}): the eval loss will not measure text the model has not seen")
    p = res.extra.get("packing")
    if p:
        total = p["rows"] * p["pack_to"]
        print(f"packed {p['examples']:,} examples into {p['rows']:,} rows of {p['pack_to']} tokens: "
              f"{p['padding']:,} padding tokens ({100 * p['padding'] / max(total, 1):.1f}%), "
              f"{p['truncated']:,} example(s) longer than {p['pack_to']} cut to it")
    return 0
