"""`qtrain eval`: loss and perplexity of any Hugging Face model directory on token files
(`qtrain.train.evaluate`)."""
from __future__ import annotations

import argparse
import json
from typing import Sequence

from qtrain.model.choices import DELTA_RULE_PRECISION_OPTIONS, DOCUMENT_ATTENTION
from qtrain.train.evaluate import DTYPE_NAMES, evaluate_model, resolve_device, resolve_dtype


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF model directory, or ORG/NAME in the local HF cache")
    p.add_argument("--eval-file", required=True, help="token file(s) to score (a glob: quote it)")
    p.add_argument("--seq-len", type=int, default=1024, help="sequence length (default 1024)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per batch (default 4)")
    p.add_argument("--max-batches", type=int, default=None, help="score only the first N batches")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] (default auto)")
    p.add_argument("--dtype", choices=("auto", *DTYPE_NAMES), default="auto",
                   help="weights / activations dtype (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--lmhead-chunks", type=int, default=1, help="split the LM head into N row chunks (memory)")
    p.add_argument("--document-masking", action="store_true",
                   help="score each document on its own, as training with --document-masking does (attention "
                        "inside documents, positions from 0): documents recorded by qtrain tokenize --pack-to, "
                        "else split after each EOS")
    p.add_argument("--document-attention", choices=DOCUMENT_ATTENTION, default="auto",
                   help="attention with --document-masking: auto (varlen for bf16 on CUDA, else masked) | varlen | "
                        "masked")
    p.add_argument("--delta-rule-precision", choices=DELTA_RULE_PRECISION_OPTIONS, default="auto",
                   help="a Gated DeltaNet model's (Qwen3.5's) delta-rule products on CUDA: auto (tf32, as training "
                        "by default) | tf32 (one pass) | fp32 (three TF32 passes, fp32-accurate)")
    p.add_argument("--rope-scaling", default="", metavar="TYPE[:FACTOR]",
                   help="score past the model's positions with RoPE scaling (linear, dynamic, yarn, llama3; FACTOR "
                        "defaults to --seq-len over the positions, rounded up), as `qtrain train --rope-scaling`")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


def run(ns: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    dev = resolve_device(ns.device)
    dtype = resolve_dtype(ns.dtype, dev)
    r = evaluate_model(ns.model, ns.eval_file, seq_len=ns.seq_len, batch_size=ns.batch_size, device=dev, dtype=dtype,
                       max_batches=ns.max_batches, lmhead_chunks=ns.lmhead_chunks,
                       document_masking=ns.document_masking, document_attention=ns.document_attention,
                       delta_rule_precision=ns.delta_rule_precision, rope_scaling=ns.rope_scaling)
    if ns.json:
        print(json.dumps({**r, "model": str(ns.model), "eval_file": str(ns.eval_file), "seq_len": ns.seq_len,
                          "batch_size": ns.batch_size, "dtype": str(dtype).removeprefix("torch.")}))
    else:
        print(f"eval loss {r['loss']:.6f} | ppl {r['ppl']:.4f} | {r['tokens']:,} tokens in {r['batches']} batches "
              f"| {r['duration_ms'] / 1000:.1f} s")
    return 0
