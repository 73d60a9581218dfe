"""Where the documents of token files start, for --document-masking; and, per loader chunk, each token's position in
its document and the targets that cross from one document into the next.

A file's documents (`file_documents`):
  * recorded: its documents section (`qtrain tokenize --pack-to`; the format in token_files.py), as written;
  * else split after each EOS token: a document ends with its EOS and the next token starts the next one. The EOS id
    is the one the file's token set index records when the file is a `qtrain tokenize` shard (the id tokenize
    appended after every document), else the model's eos_token_id (config.json);
  * neither (no section, and no EOS id known or no EOS token anywhere in the file): refused with a DataError naming
    the file; every row would be one document, the run without the option, which is not what was asked.

A loader chunk c of a file (rows of T tokens) reads the window tokens[cT : cT+T+1]: inputs its first T, targets its
last T. For it `FileDocuments.chunk` gives:
  * positions (T,): each input token's position in its document. A row starts a new document: a document that began
    before the row's first token continues from position 0, and its part in this row does not see its part in
    another (rows are independent sequences, with or without the option). RoPE and attention read them
    (kernels/document_attention.py);
  * crossing (T,) bool: target j is a document's first token (token cT+j+1 starts a document, so input j is the
    last token of the one before: its EOS). The loader ignores those targets (-100): nothing is predicted across a
    boundary, as when each document runs alone, so the loss of a row of packed documents is the sum of theirs. A
    document cut by the row's end keeps its last target (the next token belongs to it).

Files that record documents read without --document-masking train as any token file: the documents of a row attend
to each other across their boundaries and RoPE positions run on through the row (what llm.q does with such a file).
That is allowed (pretraining-style runs do it on purpose), but rarely what a `--pack-to` output was made for, so a
run says it once at its start (`unmasked_documents_note`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from qtrain.data.token_files import DataError, TokenFile
from qtrain.data.token_sets import TokenSetError, read_index
from qtrain.fsio import shorten

SCAN_TOKENS = 1 << 22  # tokens per read while looking for an EOS (16 MiB)


@dataclass(frozen=True)
class FileDocuments:
    """One file's document boundaries: recorded `starts`, or after each token in `eos_ids`."""
    path: str
    starts: np.ndarray | None
    eos_ids: tuple[int, ...] = ()

    def chunk(self, start: int, window: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(positions (T,) int64, crossing (T,) bool) of the window tokens[start : start + T + 1] (given), as the
        module docstring defines them."""
        T = len(window) - 1
        begins = np.zeros(T + 1, dtype=bool)  # begins[i]: token start + i starts a document
        if self.starts is not None:
            lo = int(np.searchsorted(self.starts, start + 1))  # the starts in (start, start + T]
            hi = int(np.searchsorted(self.starts, start + T, side="right"))
            begins[self.starts[lo:hi] - start] = True
        else:
            begins[1:] = np.isin(window[:-1], self.eos_ids)
        crossing = begins[1:].copy()
        begins[0] = True  # a row starts a new document
        index = np.arange(T)
        return index - np.maximum.accumulate(np.where(begins[:T], index, 0)), crossing


def unmasked_documents_note(files: Sequence[TokenFile], document_masking: bool) -> str | None:
    """One line for the start of a run that reads files recording packed documents without --document-masking (the
    module docstring); None with the option, or when no file records documents."""
    packed = [f.path for f in files if f.header.documents]
    if document_masking or not packed:
        return None
    more = f" and {len(packed) - 1} more file(s)" if len(packed) > 1 else ""
    return (f"{shorten(packed[0])}{more} record packed documents (qtrain tokenize --pack-to) but --document-masking "
            f"is off: the documents of a row will attend to each other across their boundaries; add "
            f"--document-masking to keep each document to itself")


def _index_eos(path: str) -> int | None:
    """The EOS id the token set index beside `path` records, when it lists the file."""
    folder, name = os.path.split(os.path.realpath(path))
    try:
        index = read_index(folder)
    except TokenSetError:
        return None
    return index.eos_id if index is not None and name in index.files else None


def _holds_any(f: TokenFile, ids: tuple[int, ...]) -> bool:
    """Whether the file holds any of `ids`: read SCAN_TOKENS at a time, stopping at the first."""
    buf = np.empty(min(len(f), SCAN_TOKENS), dtype="<i4")
    for start in range(0, len(f), SCAN_TOKENS):
        chunk = f.read_into(start, buf[:min(SCAN_TOKENS, len(f) - start)])
        if np.isin(chunk, ids).any():
            return True
    return False


def file_documents(f: TokenFile, eos_ids: Sequence[int] = ()) -> FileDocuments:
    """The file's documents (the module docstring's rules); `eos_ids`: the model's EOS id(s), used when the file
    records no boundaries and is no `qtrain tokenize` output. A DataError naming the file when it has neither
    boundaries nor an EOS to split at, or when its documents section is corrupt."""
    starts = f.document_starts()
    if starts is not None:
        return FileDocuments(f.path, starts)
    recorded = _index_eos(f.path)
    eos = (recorded,) if recorded is not None else tuple(int(i) for i in eos_ids)
    where = f"{shorten(f.path)}: --document-masking: the file records no document boundaries (qtrain tokenize " \
            f"--pack-to writes them)"
    if not eos:
        raise DataError(f"{where} and no EOS id is known to split it at (it is no qtrain tokenize output and the "
                        f"model's config.json names no eos_token_id)")
    if not _holds_any(f, eos):
        source = "its token set's index" if recorded is not None else "the model's eos_token_id"
        raise DataError(f"{where} and holds no EOS token (id {', '.join(map(str, eos))}, {source}) to split it at")
    return FileDocuments(f.path, None, eos)
