"""``qtrain tokenize``: local text/jsonl/json/parquet -> llm.q token files.

The tokenizer comes from ``get_tokenizer(spec)`` (`qtrain.data.tokenizers`: a tokenizer.json or HF model directory,
or the built-in ``qwen2`` / ``gpt2``, all offline).

Text is encoded with special-token strings treated as plain text (llm.q uses
``split_special_tokens=True``), no BOS, and EOS appended after every document.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from qtrain.data.packing import Packer, PackStats
from qtrain.data.sft import RECORD_SUFFIXES, SFTFormat, encode_example, iter_records, record_text
from qtrain.data.token_files import DataError, TokenFileWriter
from qtrain.data.token_sets import TokenSetWriter
from qtrain.data.tokenizers import BUILTIN_TOKENIZERS, TokenizeError, Tokenizer, get_tokenizer
from qtrain.fsio import check_regular_file, expand_glob, fault_point, shorten


# ----------------------------------------------------------------------------------------------
# Reading documents

INPUT_SUFFIXES = (".txt", *RECORD_SUFFIXES)
# what a directory is searched for: not .json, which directories hold as metadata (config.json, qtrain-tokenize.json)
DIRECTORY_SUFFIXES = tuple(s for s in INPUT_SUFFIXES if s != ".json")


def expand_inputs(inputs: Sequence[str]) -> list[Path]:
    """Files, directories (searched recursively for DIRECTORY_SUFFIXES: a .json file there is taken only when
    named or matched by a glob) and glob patterns (a bounded matcher: `fsio.expand_glob`) -> files, sorted. A named
    input that is no regular file (a FIFO would block) is refused."""
    out: list[Path] = []
    for spec in inputs:
        hits = [Path(p) for p in expand_glob(spec, "input")]
        if not hits or not hits[0].exists():
            raise TokenizeError(f"{shorten(spec)}: no such input")
        for p in hits:
            if p.is_dir():
                out.extend(sorted(q for q in p.rglob("*") if q.suffix in DIRECTORY_SUFFIXES and q.is_file()))
            elif p.suffix in INPUT_SUFFIXES:
                out.append(check_regular_file(p, "input"))
            else:
                raise TokenizeError(f"{shorten(str(p))}: unsupported input type (use {', '.join(INPUT_SUFFIXES)})")
    return out


def iter_documents(path: Path, *, text_field: str = "text", split_lines: bool = False) -> Iterator[str]:
    """Documents of one input file: a .txt file is one document (or one per non-empty line); a .jsonl, .json or
    .parquet file one per record (`qtrain.data.sft.iter_records`: its `text_field`). Text that is not
    UTF-8 is a TokenizeError naming the file (not a traceback halfway through the tokenization)."""
    try:
        yield from _documents(path, text_field=text_field, split_lines=split_lines)
    except UnicodeDecodeError as e:
        where = f" at byte {e.start}" if path.suffix == ".txt" else ""
        raise TokenizeError(f"{path}: not UTF-8 text ({e.reason}{where}); convert it to UTF-8 or leave it out") from None


def _documents(path: Path, *, text_field: str, split_lines: bool) -> Iterator[str]:
    if path.suffix == ".txt":
        text = path.read_bytes().decode("utf-8")
        if split_lines:
            yield from (line for line in text.splitlines() if line.strip())
        else:
            yield text
    elif path.suffix in RECORD_SUFFIXES:
        for rec in iter_records(path, (text_field,)):
            if rec[text_field] is None and path.suffix == ".parquet":
                continue  # a missing value in a column
            yield record_text(rec, text_field)
    else:
        raise TokenizeError(f"{path}: unsupported input type")


# ----------------------------------------------------------------------------------------------
# Encoding (optionally in worker processes)

_worker_tok: Tokenizer | None = None
_worker_sft: SFTFormat | None = None
Encoded = tuple[np.ndarray, "np.ndarray | None"]  # one document's int32 tokens and its keep-mask (SFT) or None


def _init_worker(spec: str, sft: SFTFormat | None = None) -> None:
    global _worker_tok, _worker_sft
    _worker_tok, _worker_sft = get_tokenizer(spec), sft


def _encode_docs(tok: Tokenizer, docs: list[Any], sft: SFTFormat | None = None) -> list[Encoded]:
    """Documents -> their ids followed by EOS; SFT records -> (ids, mask) as `qtrain.data.sft` says."""
    if sft is not None:
        return [encode_example(tok, rec, sft) for rec in docs]
    return [(np.asarray([*tok.encode(d), tok.eos_id], dtype=np.int32), None) for d in docs]


def _encode_in_worker(docs: list[Any]) -> list[Encoded]:
    assert _worker_tok is not None
    return _encode_docs(_worker_tok, docs, _worker_sft)


def _batched(docs: Iterable[str], n: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for d in docs:
        batch.append(d)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def encode_stream(spec: str, docs: Iterable[Any], *, workers: int = 1, docs_per_task: int = 64,
                  sft: SFTFormat | None = None) -> Iterator[Encoded]:
    """Each document's (tokens incl. EOS, mask or None), in input order whatever the number of workers."""
    batches = _batched(docs, docs_per_task)
    if workers <= 1:
        tok = get_tokenizer(spec)
        for b in batches:
            yield from _encode_docs(tok, b, sft)
        return
    # spawn: never fork a process that may already run tokenizer/torch threads.
    with mp.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(spec, sft)) as pool:
        for arrs in pool.imap(_encode_in_worker, batches, chunksize=4):
            yield from arrs


# ----------------------------------------------------------------------------------------------
# Writing split files


class ShardedWriter:
    """Cuts one split's token stream into shards of at most ``max_tokens``, each staged under a temp name
    (`TokenFileWriter.finish`: fsynced, not yet published) until the whole set is published together
    (`token_sets.TokenSetWriter.publish`, which names them ``<name>.bin`` or ``<name>-000.bin``, ...).

    The token stream is cut exactly at ``max_tokens`` (documents may straddle files: the loader ignores
    document boundaries, and under --document-masking a file's first token starts a document, as a row's does).

    SFT data (``with_masks``): masks go along with the tokens. With ``align=T`` (examples padded to T tokens, or
    packed rows of T) the cap is rounded down to whole rows and each file ends with one ``tail`` token under mask 0,
    so its (N-1)//T loader chunks are exactly its rows, the last one included. ``with_documents`` (packed rows): each
    write says where its documents start, and the files record it (the tail is a document of its own).
    """

    def __init__(self, out_dir: Path, name: str, *, vocab_size: int, max_tokens: int, with_masks: bool = False,
                 tokenizer: str | None = None, align: int | None = None, tail: int | None = None,
                 with_documents: bool = False) -> None:
        self.out_dir, self.name = out_dir, name
        self.vocab_size = vocab_size
        self.max_tokens = max_tokens if not align else max(align, max_tokens // align * align)
        self.with_masks, self.tokenizer, self.tail = with_masks, tokenizer, tail if align else None
        self.with_documents = with_documents
        self.num_tokens = 0
        self._parts: list[TokenFileWriter] = []
        self._w: TokenFileWriter | None = None

    def write(self, tokens: np.ndarray, masks: np.ndarray | None = None, starts: np.ndarray | None = None) -> None:
        """Append tokens (their masks; with_documents, the offsets among them where documents start)."""
        starts = None if not self.with_documents else np.asarray([] if starts is None else starts, dtype=np.int64)
        while tokens.size:
            if self._w is None or self._w.num_tokens >= self.max_tokens:
                self._finish_part()
                self._w = TokenFileWriter(self.out_dir / f"{self.name}-part{len(self._parts):03d}.bin",
                                          vocab_size=self.vocab_size, with_masks=self.with_masks,
                                          tokenizer=self.tokenizer, with_documents=self.with_documents)
                self._parts.append(self._w)
            take = min(tokens.size, self.max_tokens - self._w.num_tokens)
            here = None
            if starts is not None:  # a document cut by a file's start starts anew there
                here, starts = starts[starts < take], starts[starts >= take] - take
                if self._w.num_tokens == 0 and (not here.size or here[0] != 0):
                    here = np.r_[0, here]
            self._w.write(tokens[:take], None if masks is None else masks[:take], here)
            self.num_tokens += take
            tokens = tokens[take:]
            masks = None if masks is None else masks[take:]

    def _finish_part(self) -> None:
        if self._w is not None:
            if self.tail is not None:
                self._w.write(np.asarray([self.tail], dtype=np.int32), np.zeros(1, dtype=bool),
                              np.zeros(1, dtype=np.int64) if self.with_documents else None)
            self._w.finish()
            self._w = None
            fault_point("tokenize.write")

    def finish(self) -> list[TokenFileWriter]:
        """The staged shards, in order, all finished."""
        self._finish_part()
        return list(self._parts)

    def abort(self) -> None:
        for w in self._parts:
            w.abort()
        self._parts, self._w = [], None


class HoldOut:
    """Deterministic hold-out of whole documents for about ``fraction`` of the *tokens*.

    A document goes to eval while eval holds less than its share of all tokens seen so far, so the
    eval set fills evenly along the input (not just from its end), is non-empty as soon as there
    are two documents, and tracks the fraction in tokens even when documents differ wildly in size.
    """

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction
        self.train_tokens = self.eval_tokens = 0

    def is_eval(self, num_tokens: int) -> bool:
        held = self.fraction > 0 and self.eval_tokens < self.fraction * (self.train_tokens + self.eval_tokens)
        if held:
            self.eval_tokens += num_tokens
        else:
            self.train_tokens += num_tokens
        return held


@dataclass
class TokenizeResult:
    train_files: list[str]
    eval_files: list[str]
    train_tokens: int
    eval_tokens: int
    documents: int
    tokenizer: str
    vocab_size: int
    eos_id: int
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


class _Progress:
    """tqdm on a TTY when installed, a plain carriage-return line otherwise on a TTY, silent if piped."""

    def __init__(self, enabled: bool) -> None:
        self.bar: Any = None
        self.plain = False
        self.t0 = self.last = time.time()
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(unit=" docs", file=sys.stderr)
            except ImportError:
                self.plain = True

    def update(self, docs: int, tokens: int) -> None:
        if self.bar is not None:
            self.bar.update(docs)
            self.bar.set_postfix(tokens=f"{tokens:,}", refresh=False)
        elif self.plain and time.time() - self.last > 0.5:
            self.last = time.time()
            print(f"\rtokenized {tokens:,} tokens", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.plain:
            print(file=sys.stderr)


def _first_missing(path: Path) -> Path | None:
    """The outermost of `path` and its parents that does not exist yet (None when `path` exists)."""
    missing = None
    for p in (path, *path.absolute().parents):
        if p.exists():
            return missing
        missing = p
    return missing


def _remove_empty(path: Path, up_to: Path | None) -> None:
    """Remove `path` and its parents up to `up_to` (the folders a failed tokenize made), each only if empty."""
    if up_to is None:
        return
    for p in (path.absolute(), *path.absolute().parents):
        try:
            p.rmdir()
        except OSError:
            return
        if p == up_to.absolute():
            return


def tokenize_files(
    inputs: Sequence[str],
    out_dir: str | os.PathLike[str],
    *,
    tokenizer: str = "qwen2",
    eval_inputs: Sequence[str] = (),
    eval_fraction: float = 0.0,
    text_field: str = "text",
    split_lines: bool = False,
    max_tokens_per_file: int = 100_000_000,
    workers: int = 1,
    progress: bool = True,
    sft: SFTFormat | None = None,
    overwrite: bool = False,
) -> TokenizeResult:
    """Tokenize documents into ``train*.bin`` (and ``eval*.bin``) under ``out_dir``.

    Eval documents come from ``eval_inputs`` or, if none, are whole documents held out for about
    ``eval_fraction`` of the tokens (``HoldOut``). Output is deterministic for a given input and tokenizer,
    whatever the number of workers. ``sft``: the inputs are prompt/response or chat records and the files
    carry loss masks (``qtrain.data.sft``); with ``sft.pack_to`` each split's examples are packed into rows
    (``qtrain.data.packing``) and the files record where each example starts (``extra["packing"]``: the
    counts). The files record the tokenizer in their header (a built-in's name or the absolute path of a
    tokenizer file / directory), so an export of a model trained on them can include it.

    The files form one token set (`qtrain.data.token_sets`): staged, then published with their index
    ``qtrain-tokenize.json`` as a whole. Files in ``out_dir`` that no qtrain tokenize wrote are never
    overwritten; an earlier tokenize's output there is replaced only with ``overwrite``. A tokenize that fails
    removes what it staged and the folders it made, so the disk is as it was.
    """
    if sft is not None:
        sft.validate()
    if eval_inputs and eval_fraction:
        raise TokenizeError("give either eval inputs or an eval fraction, not both")
    if not 0 <= eval_fraction < 1:
        raise TokenizeError(f"eval fraction must be in [0, 1), got {eval_fraction}")
    if max_tokens_per_file <= 0 or max_tokens_per_file > 2**31 - 1:
        raise TokenizeError(f"max tokens per file must be in [1, 2^31), got {max_tokens_per_file}")
    if workers < 1:
        raise TokenizeError(f"--workers must be >= 1, got {workers}")
    row = sft.row_tokens if sft is not None else None
    if row and max_tokens_per_file < row:  # a file holds whole rows: each file would be one row, over the limit
        raise TokenizeError(f"--max-tokens-per-file {max_tokens_per_file} is below one row of "
                            f"{'--pack-to' if sft.pack_to else '--pad-to'} {row} tokens (files hold whole rows)")
    t0 = time.time()
    tok = get_tokenizer(tokenizer)
    train_paths, eval_paths = expand_inputs(inputs), expand_inputs(eval_inputs) if eval_inputs else []
    out = Path(out_dir)

    def docs(paths: list[Path]) -> Iterator[Any]:
        for p in paths:
            if sft is not None:
                yield from iter_records(p, sft.fields)
            else:
                yield from iter_documents(p, text_field=text_field, split_lines=split_lines)

    label = tokenizer if tokenizer in BUILTIN_TOKENIZERS else str(Path(tokenizer).resolve())
    pack_to = sft.pack_to if sft is not None else None
    writers = {
        name: ShardedWriter(out, name, vocab_size=tok.vocab_size, max_tokens=max_tokens_per_file,
                            with_masks=sft is not None, tokenizer=label, align=sft and sft.row_tokens,
                            tail=tok.eos_id, with_documents=pack_to is not None)
        for name in ("train", "eval")
    }
    # --pack-to: examples go through a packer, which writes whole rows
    sinks: dict[str, Any] = ({name: Packer(w, pack_to, pad_id=tok.eos_id) for name, w in writers.items()}
                             if pack_to else writers)
    created = _first_missing(out)  # a failed tokenize leaves no folder behind that it made
    sets = TokenSetWriter(out, overwrite=overwrite)  # claims out_dir: refuses the user's files, sweeps leftovers
    bar = _Progress(progress)
    n_docs = n_tokens = 0
    try:
        hold_out = HoldOut(eval_fraction)
        for source, paths in (("train", train_paths), ("eval", eval_paths)):
            for arr, mask in encode_stream(tokenizer, docs(paths), workers=workers, sft=sft):
                held_out = source == "eval" or hold_out.is_eval(arr.size)
                sinks["eval" if held_out else "train"].write(arr, mask)
                n_docs += 1
                n_tokens += arr.size
                bar.update(1, n_tokens)
        packed = PackStats()
        if pack_to:
            for p in sinks.values():
                p.flush()
                packed.add(p.stats)
        if writers["train"].num_tokens == 0:
            raise DataError(f"{out}: no training documents in {', '.join(map(str, inputs))}")
        if (eval_fraction or eval_inputs) and writers["eval"].num_tokens == 0:
            raise DataError(
                f"{out}: eval split is empty ({n_docs} documents, eval fraction {eval_fraction}); "
                "use --split-lines, --eval-inputs or --eval-fraction 0"
            )
        published = sets.publish({name: w.finish() for name, w in writers.items()}, tokenizer=label,
                                 vocab_size=tok.vocab_size, eos_id=tok.eos_id, masks=sft is not None,
                                 **({"pack_to": pack_to} if pack_to else {}))
    except BaseException:
        for w in writers.values():
            w.abort()
        sets.close()
        _remove_empty(out, created)
        raise
    finally:
        bar.close()
        sets.close()
    return TokenizeResult(
        train_files=published["train"],
        eval_files=published["eval"],
        train_tokens=writers["train"].num_tokens,
        eval_tokens=writers["eval"].num_tokens,
        documents=n_docs,
        tokenizer=tok.name,
        vocab_size=tok.vocab_size,
        eos_id=tok.eos_id,
        seconds=time.time() - t0,
        extra={"swept": [str(p) for p in sets.swept], "replaced": sorted(sets.old),
               "eval_also_train": sorted(str(p) for p in {q.resolve() for q in eval_paths}
                                         & {q.resolve() for q in train_paths}),
               **({"packing": {"pack_to": pack_to, **vars(packed)}} if pack_to else {})},
    )
