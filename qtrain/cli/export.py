"""`qtrain export`: a training checkpoint -> a Hugging Face model directory (`qtrain.train.export`)."""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from qtrain import console
from qtrain.train.export import export_checkpoint


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint-dir", required=True, help="a run's checkpoint directory (ckpt/NAME), or one step_N")
    p.add_argument("--out-dir", required=True,
                   help="HF model directory to write (only the export's own files in it are written)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--tokenizer", default="",
                   help="qwen2 | gpt2 | tokenizer.json | model directory (default: the one the run recorded)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an export of another run in --out-dir (files qtrain did not write are never replaced)")
    p.add_argument("--lora-merge", action="store_true",
                   help="a LoRA checkpoint: write the merged model (the adapters folded into the run's base) instead "
                        "of the PEFT adapter")
    p.add_argument("--base-model", default="",
                   help="with --lora-merge: the base model the run trained on (default: the run's --model)")


def run(ns: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    r = export_checkpoint(ns.checkpoint_dir, ns.out_dir, step=ns.step, tokenizer=ns.tokenizer, overwrite=ns.overwrite,
                          lora_merge=ns.lora_merge, base_model=ns.base_model)
    console.write(f"exported {r.checkpoint} -> {r.out_dir} (tokenizer: "
                  f"{r.tokenizer or 'none recorded; pass --tokenizer'})\n")
    if r.caveat:
        console.write(f"note: {r.caveat}\n", sys.stderr)
    if r.unverified:
        console.write(f"warning: {r.unverified}\n", sys.stderr)
    return 0
