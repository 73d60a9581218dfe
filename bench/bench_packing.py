"""Kind `packing`: what packed documents cost and buy, through `qtrain tokenize` and `qtrain train` as a user runs
them, on a synthetic chat set made in the run (no network, no downloaded data).

The data: `examples` chat records (a user prompt and an assistant response, ChatML through `--messages-field`)
whose lengths in tokens are log-normal (median `median_len`, log-space sigma `sigma`) clipped to
[`min_len`, `max_len`]: each word of the content is one token of the qwen2 tokenizer (" the", " cat", ...), so an
example has its drawn length up to ChatML's framing (~11 tokens, counted in it). With `examples` unset, enough
for both runs: at least (steps + 1) x batch x accum rows of `seq` tokens packed (with 30% to spare), and as many
examples. They are tokenized in-process by `qtrain.data.tokenize.tokenize_files` (what `qtrain tokenize` runs)
twice: `--pack-to seq` (first-fit decreasing, documents recorded) and `--pad-to seq` (one example per row); no
eval split.

`compare` picks the measurement, each one `qtrain train` run per side (bench/cli_train.py: median tokens/s of the
steady steps from the JSON log, all tokens of the rows counted, padding included):
* "masking": the packed rows with --document-masking against the same rows without it (the same file and seed,
  so the same rows in the same order): the cost of keeping documents apart. ratio = tps / base_tps (issue 45's
  bar: >= 0.95).
* "pack-vs-pad": the packed file with --document-masking against the padded file without it; what counts is
  the non-padding tokens per second, real_tps = tps x the file's non-padding fraction (the examples' tokens over
  the rows' tokens): an epoch's real tokens over its time, since a step's time does not depend on which rows it
  drew (a padded row costs a full row). ratio = real_tps / base_real_tps (issue 45's bar: >= 2.5).

Parameters: model, batch, accum, compare, steps (10), skip (3), seq (4096), flags (more `qtrain train` flags for
both sides, e.g. ["--matmul-dtype", "e4m3"]), examples, median_len (400), sigma (1.0), min_len (50),
max_len (4000), seed (0), tokenizer ("qwen2"), device. Result: ratio, tps / base_tps, real_tps / base_real_tps,
real_frac / base_real_frac, step_ms / base_step_ms, peak_gib / base_peak_gib, rows (packed) / base_rows,
examples, padding_pct (of the packed rows), truncated.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile

import numpy as np

from bench.cli_train import CUDA_ONLY_FLAGS, run_events, summarize
from bench.dry import tiny_model_dir

COMPARES = ("masking", "pack-vs-pad")
WORDS = (" the", " cat", " and", " of", " model", " data", " train", " run", " token", " set")  # one qwen2 token each
CHATML_FRAMING = 11  # <|im_start|> user \n ... <|im_end|> \n, the same for assistant, and the EOS


def example_lengths(n: int | None, *, median: float, sigma: float, lo: int, hi: int, seed: int,
                    rows_needed: int, seq: int) -> np.ndarray:
    """Log-normal example lengths (module docstring): n of them, or enough for `rows_needed` packed rows of `seq`
    tokens with 30% to spare and for `rows_needed` padded rows."""
    rng = np.random.default_rng(seed)
    if n is not None:
        return np.clip(rng.lognormal(math.log(median), sigma, n), lo, hi).astype(np.int64)
    out = np.empty(0, dtype=np.int64)
    while out.size < rows_needed or out.sum() < 1.3 * rows_needed * seq:
        more = np.clip(rng.lognormal(math.log(median), sigma, max(rows_needed, 256)), lo, hi).astype(np.int64)
        out = np.concatenate([out, more])
    return out


def write_chat_set(path: str, lengths: np.ndarray, seed: int) -> None:
    """One JSONL chat record per length: 30% of the content words in the prompt, the rest in the response."""
    rng = np.random.default_rng(seed + 1)
    with open(path, "w") as f:
        for n in lengths:
            words = max(int(n) - CHATML_FRAMING, 2)
            prompt = max(1, int(0.3 * words))
            ids = rng.integers(0, len(WORDS), words)
            text = "".join(WORDS[i] for i in ids)
            # content text as words: the prompt is the first `prompt` words
            cut = sum(len(WORDS[i]) for i in ids[:prompt])
            f.write(json.dumps({"messages": [{"role": "user", "content": text[:cut]},
                                             {"role": "assistant", "content": text[cut:]}]}) + "\n")


def tokenize(chat: str, out_dir: str, tokenizer: str, **sft) -> dict:
    """`qtrain tokenize CHAT --messages-field messages --eval-fraction 0` with --pack-to or --pad-to; the train
    file(s)' pattern and the packing counts."""
    from qtrain.data.sft import SFTFormat
    from qtrain.data.tokenize import tokenize_files
    fmt = SFTFormat(messages_field="messages", **sft).validate()
    res = tokenize_files([chat], out_dir, tokenizer=tokenizer, eval_fraction=0.0, progress=False, sft=fmt,
                         workers=max(1, min((os.cpu_count() or 2) // 2, 8)))
    return {"pattern": os.path.join(out_dir, "train*.bin"), "packing": res.extra.get("packing"),
            "train_tokens": res.train_tokens, "documents": res.documents}


def _side(model, batch, accum, steps, skip, seq, flags, device, train_file) -> dict:
    return summarize(run_events(model, batch, accum, steps, seq=seq, flags=list(flags), device=device,
                                train_file=train_file), skip)


def run(model: str, batch: int, accum: int, compare: str, steps: int = 10, skip: int = 3, seq: int = 4096,
        flags: list[str] = (), examples: int | None = None, median_len: float = 400, sigma: float = 1.0,
        min_len: int = 50, max_len: int = 4000, seed: int = 0, tokenizer: str = "qwen2",
        device: str | None = None) -> dict:
    if compare not in COMPARES:
        raise ValueError(f"compare must be one of {', '.join(COMPARES)}, got {compare!r}")
    if not all(isinstance(f, str) for f in flags) or "--document-masking" in flags:
        raise ValueError(f"flags must be strings without --document-masking (the kind sets it per side); got "
                         f"{list(flags)!r}")
    work = tempfile.mkdtemp(prefix="qtrain-bench-packing-")
    try:
        lengths = example_lengths(examples, median=median_len, sigma=sigma, lo=min_len, hi=max_len, seed=seed,
                                  rows_needed=(steps + 1) * batch * accum, seq=seq)
        chat = os.path.join(work, "chat.jsonl")
        write_chat_set(chat, lengths, seed)
        packed = tokenize(chat, os.path.join(work, "packed"), tokenizer, pack_to=seq)
        p = packed["packing"]
        rows, n = p["rows"], p["examples"]
        real = rows * seq - p["padding"]  # the examples' tokens (as cut to seq), in either file
        print(f"{n} examples, lengths {int(lengths.min())}..{int(lengths.max())} (median "
              f"{int(np.median(lengths))}, mean {lengths.mean():.0f}): {rows} packed rows of {seq} "
              f"({100 * p['padding'] / (rows * seq):.1f}% padding, {p['truncated']} cut)", flush=True)
        run_args = (model, batch, accum, steps, skip, seq)
        masked = _side(*run_args, [*flags, "--document-masking"], device, packed["pattern"])
        if compare == "masking":
            base, base_rows, base_frac = _side(*run_args, flags, device, packed["pattern"]), rows, real / (rows * seq)
        else:
            padded = tokenize(chat, os.path.join(work, "padded"), tokenizer, pad_to=seq)
            base_rows = padded["documents"]
            base, base_frac = _side(*run_args, flags, device, padded["pattern"]), real / (base_rows * seq)
        frac = real / (rows * seq)
        res = dict(system="qtrain", compare=compare, tps=masked["tps"], base_tps=base["tps"],
                   real_tps=round(masked["tps"] * frac), base_real_tps=round(base["tps"] * base_frac),
                   real_frac=round(frac, 4), base_real_frac=round(base_frac, 4), step_ms=masked["step_ms"],
                   base_step_ms=base["step_ms"], peak_gib=masked["peak_gib"], base_peak_gib=base["peak_gib"],
                   rows=rows, base_rows=base_rows, examples=n, padding_pct=round(100 * p["padding"] / (rows * seq), 2),
                   truncated=p["truncated"], loss=masked["loss"], base_loss=base["loss"])
        num, den = ("tps", "base_tps") if compare == "masking" else ("real_tps", "base_real_tps")
        res["ratio"] = round(res[num] / res[den], 4) if res[den] else None
        print(", ".join(f"{k} {v}" for k, v in res.items()), flush=True)
        return res
    finally:
        shutil.rmtree(work, ignore_errors=True)


def tiny_chat_tokenizer() -> str:
    """A word-level tokenizer.json of WORDS, the ChatML roles and tokens and an EOS (a vocabulary of 16), written
    once under the temp dir: the dry run's stand-in for qwen2, whose 151k-id vocabulary would make the tiny model's
    bf16 LM head take seconds per step on a CPU."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = os.path.join(tempfile.gettempdir(), "qtrain-bench-tiny", "chat-tokenizer")
    path = os.path.join(d, "tokenizer.json")
    if not os.path.isfile(path):
        words = ["<unk>", "user", "assistant", *(w.strip() for w in WORDS)]
        tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
        os.makedirs(d, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        tok.save(tmp)
        os.replace(tmp, path)
    return path


def dry_run(params: dict) -> dict:
    """The same comparison on the CPU: a tiny model of the family, a word-level tokenizer of the same words
    (`tiny_chat_tokenizer`), rows of 128 tokens, lengths 16..120 (median 40), 2 x 1 rows a step, 2 steps,
    uncompiled."""
    flags = [f for f in params.get("flags", []) if f not in CUDA_ONLY_FLAGS]
    return {**params, "model": tiny_model_dir(params["model"]), "batch": 2, "accum": 1, "steps": 2, "skip": 0,
            "seq": 128, "median_len": 40, "min_len": 16, "max_len": 120, "device": "cpu", "examples": None,
            "tokenizer": tiny_chat_tokenizer(), "flags": [*flags, "--compile", "off"]}
