"""Supervised fine-tuning (chat / instruction) data for `qtrain tokenize`: records -> tokens plus a keep-mask, so
the loss covers only what the model should learn to write (llm.q's masked datasets, `scripts/tokenize_data.py`).

Two record shapes (JSON Lines, JSON array elements or Parquet rows):

* prompt / response (`SFTFormat(prompt_field=..., response_field=...)`): tokens = prompt, response, EOS;
  mask 0 on the prompt, 1 on the response and its EOS (the model learns to stop).
* chat (`SFTFormat(messages_field=...)`): a list of {"role", "content"} messages rendered in ChatML,
  `<|im_start|>ROLE\\nCONTENT<|im_end|>\\n` per message (the format of Qwen2's chat template), then EOS. Mask 1
  on each assistant message's content and its `<|im_end|>`, 0 on everything else (system and user messages,
  role headers, the newlines between messages, the final EOS). Needs a tokenizer with the ChatML special
  tokens (qwen2, or a Qwen tokenizer.json).

The text of each part is encoded on its own (special-token strings inside it stay plain text), so the mask
boundaries are exact token boundaries. With `pad_to=T` each example becomes exactly T tokens (cut at T-1 keeping its
last token, the EOS, then under mask 0: a cut example did not end there; or padded with EOS under mask 0), so that
with `--seq-len T` every training sequence is one whole example that sees its own prompt. With `pack_to=N` examples
are packed whole into rows of N tokens instead (`qtrain.data.packing`: cut there, when longer). `truncate=False`
(--no-truncate) refuses an example longer than N (either option) instead of cutting it. The loader reads a mask bit
at the *target* position (`qtrain.data.loader`), so mask 1 means "this token is a training target".
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Protocol, TextIO

import numpy as np

from qtrain.data.packing import cut_to
from qtrain.fsio import shorten


class Tokenizer(Protocol):
    """What encoding a record needs of a tokenizer (`qtrain.data.tokenizers.Tokenizer` has it); a protocol, so
    this module, which tokenize.py reads records through, does not import it back."""
    name: str
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def special_id(self, token: str) -> int | None: ...

CHATML_START, CHATML_END = "<|im_start|>", "<|im_end|>"


class SFTError(ValueError):
    """A record or setting the SFT encoder cannot use; the message names the file / line or the setting."""


@dataclass(frozen=True)
class SFTFormat:
    prompt_field: str | None = None
    response_field: str | None = None
    messages_field: str | None = None
    pad_to: int | None = None
    pack_to: int | None = None
    truncate: bool = True

    @property
    def row_tokens(self) -> int | None:
        """The length examples are fitted to (--pad-to) or packed into (--pack-to), if any."""
        return self.pad_to or self.pack_to

    def validate(self) -> "SFTFormat":
        pr = (self.prompt_field, self.response_field)
        if self.pack_to is not None and self.pack_to < 2:
            raise SFTError(f"--pack-to must be >= 2 tokens (the row length: use --seq-len of training), got "
                           f"{self.pack_to}")
        if self.pack_to is not None and not (self.messages_field or any(pr)):
            raise SFTError("--pack-to packs chat or SFT records: give --messages-field, or --prompt-field and "
                           "--response-field")
        if self.pack_to is not None and self.pad_to is not None:
            raise SFTError("give either --pack-to (examples packed into rows) or --pad-to (one padded example per "
                           "row), not both")
        if not self.truncate and self.row_tokens is None:
            raise SFTError("--no-truncate goes with --pack-to or --pad-to (it refuses examples longer than their N)")
        if self.messages_field and any(pr):
            raise SFTError("give either --messages-field or --prompt-field/--response-field, not both")
        if not self.messages_field and not all(pr):
            raise SFTError("--prompt-field and --response-field go together (or use --messages-field)")
        if self.pad_to is not None and self.pad_to < 2:
            raise SFTError(f"--pad-to must be >= 2 tokens, got {self.pad_to}")
        return self

    @property
    def fields(self) -> tuple[str, ...]:
        return (self.messages_field,) if self.messages_field else (self.prompt_field, self.response_field)


RECORD_SUFFIXES = (".jsonl", ".json", ".parquet")  # the files records are read from (`iter_records`)


def _first_char(f: TextIO) -> str:
    """The first non-whitespace character of a text file ('' when there is none), then back to its start."""
    while (chunk := f.read(1 << 16)) and not chunk.strip():
        pass
    f.seek(0)
    return chunk.lstrip()[:1]


def iter_json(path: Path) -> Iterator[tuple[str, Any]]:
    """The values of a .jsonl or .json file, each with its position for messages. JSON Lines (a .jsonl file, or a
    .json file not starting with '[') streams one value per non-blank line at "file:line"; a .json file starting
    with '[' (as many datasets ship) is one array, read whole with json.load (so held in memory), its elements at
    "file:[i]" (i from 0). Hugging Face `datasets`' `to_json` writes JSON Lines (an array with lines=False)."""
    with open(path, encoding="utf-8") as f:
        if path.suffix == ".json" and _first_char(f) == "[":
            try:
                values = json.load(f)
            except json.JSONDecodeError as e:
                raise SFTError(f"{path}: not a JSON array ({e})") from None
            for i, value in enumerate(values):
                yield f"{path}:[{i}]", value
            return
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise SFTError(f"{path}:{lineno}: not JSON ({e})") from None
            yield f"{path}:{lineno}", value


def iter_records(path: Path, fields: tuple[str, ...]) -> Iterator[dict[str, Any]]:
    """The records of a .jsonl, .json (`iter_json`) or .parquet file, each with `fields` (checked here, naming
    file and line, element or row); each record carries `_where` ("file:line", "file:[i]", "file: row n") for later
    messages. Plain-text documents use it too (`qtrain.data.tokenize.iter_documents`)."""
    if path.suffix in (".jsonl", ".json"):
        for where, rec in iter_json(path):
            if not isinstance(rec, dict):
                raise SFTError(f"{where}: a record must be a JSON object, got {type(rec).__name__}")
            missing = [k for k in fields if k not in rec]
            if missing:
                raise SFTError(f"{where}: no field {', '.join(map(repr, missing))}")
            yield {**rec, "_where": where}
    elif path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise RuntimeError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from e
        import pyarrow as pa

        def unreadable(e: Exception) -> SFTError:  # a garbage file is pyarrow's ArrowInvalid: one line, no traceback
            return SFTError(f"{path}: not a Parquet file pyarrow can read ({shorten(str(e).splitlines()[0], 160)})")

        try:
            pf = pq.ParquetFile(path)
            names = pf.schema_arrow.names
        except (pa.ArrowException, OSError) as e:
            raise unreadable(e) from None
        missing = [k for k in fields if k not in names]
        if missing:
            raise SFTError(f"{path}: no column {', '.join(map(repr, missing))} (columns: {shorten(', '.join(names))})")
        row = 0
        batches = pf.iter_batches(columns=list(fields), batch_size=1024)
        while True:
            try:
                batch = next(batches, None)
            except (pa.ArrowException, OSError) as e:
                raise unreadable(e) from None
            if batch is None:
                break
            for rec in batch.to_pylist():
                row += 1
                yield {**rec, "_where": f"{path}: row {row}"}
    else:
        raise SFTError(f"{path}: SFT records come from {', '.join(RECORD_SUFFIXES)} files")


def record_text(rec: dict[str, Any], key: str) -> str:
    v = rec.get(key)
    if not isinstance(v, str):
        raise SFTError(f"{rec.get('_where', 'record')}: field {key!r} is {type(v).__name__}, not a string")
    return v


def _chatml_ids(tok: Tokenizer, where: str) -> tuple[int, int]:
    ids = tok.special_id(CHATML_START), tok.special_id(CHATML_END)
    if None in ids:
        raise SFTError(f"{where}: chat records need a tokenizer with the ChatML tokens {CHATML_START} and "
                       f"{CHATML_END} (qwen2, or a Qwen tokenizer.json); {tok.name} has none: use "
                       f"--prompt-field/--response-field")
    return ids  # type: ignore[return-value]


def encode_example(tok: Tokenizer, rec: dict[str, Any], fmt: SFTFormat) -> tuple[np.ndarray, np.ndarray]:
    """One record -> (int32 tokens, bool keep-mask) as the module docstring describes."""
    parts: list[tuple[list[int], bool]] = []  # (ids, trained)
    if fmt.messages_field:
        where = str(rec.get("_where", "record"))
        start, end = _chatml_ids(tok, where)
        messages = rec.get(fmt.messages_field)
        if not isinstance(messages, list) or not messages:
            raise SFTError(f"{where}: {fmt.messages_field!r} must be a non-empty list of messages")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise SFTError(f"{where}: each message needs string 'role' and 'content', got {m!r:.80}")
            assistant = m["role"] == "assistant"
            parts.append(([start, *tok.encode(m["role"] + "\n")], False))
            parts.append(([*tok.encode(m["content"]), end], assistant))
            parts.append((tok.encode("\n"), False))
        parts.append(([tok.eos_id], False))
    else:
        parts.append((tok.encode(record_text(rec, fmt.prompt_field)), False))
        parts.append(([*tok.encode(record_text(rec, fmt.response_field)), tok.eos_id], True))
    tokens = np.asarray([t for ids, _ in parts for t in ids], dtype=np.int32)
    mask = np.asarray([keep for ids, keep in parts for _ in ids], dtype=bool)
    n = fmt.row_tokens
    if not fmt.truncate and n is not None and tokens.size > n:
        flag = "--pack-to" if fmt.pack_to else "--pad-to"
        raise SFTError(f"{rec.get('_where', 'record')}: the example has {tokens.size} tokens, more than {flag} {n}; "
                       f"--no-truncate refuses it (without it, it is cut to its first {n - 1} tokens and its last)")
    if fmt.pad_to is not None:
        tokens, mask = _fit(tokens, mask, fmt.pad_to, tok.eos_id)
    return tokens, mask


def _fit(tokens: np.ndarray, mask: np.ndarray, n: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Exactly n tokens: too long -> cut as packing cuts (`packing.cut_to`: the first n-1 and the last one, the EOS,
    no longer a target); too short -> padded."""
    if tokens.size > n:
        return cut_to(tokens, mask, n)
    pad = n - tokens.size
    return np.r_[tokens, np.full(pad, pad_id, np.int32)], np.r_[mask, np.zeros(pad, bool)]
