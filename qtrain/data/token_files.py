"""Token files: llm.q's ``.bin`` format, read (memory-mapped) and written.

File format (byte-compatible with llm.q, ``reference/llmq.md`` §2.1), little-endian throughout::

    header   1024 bytes = 256 x int32
             [0:2] magic b"BIN.TOK\\n"   [2] version (1 or 2; we write 2)   [3] bytes per token (4)
             [4] number of tokens N      [5] vocab size (v2 only)          [6] has-masks flag
             bytes 128.. (`qtrain tokenize --pack-to` only): b"documents=" D b"\0" (decimal ASCII): the file has a
             documents section of D entries
             bytes 256.. (`qtrain tokenize` only): b"tokenset=" ID " " SPLIT " " I " " N b"\0": shard I of the N
             of SPLIT (train / eval) in the token set ID, whose index lists them all (`token_sets.py`)
             bytes 512.. (qtrain's writer only): b"tokenizer=" NAME b"\0", the tokenizer that made the file
             (llm.q leaves bytes 28..1023 unused, so its reader ignores all three, and files without them read as
             before)
    tokens   N x int32
    masks    ceil(N/8) bytes, present iff has-masks; bit i (LSB-first in each byte) = 1 keeps token i
             as a training target.
    documents  D x int32, present iff the header's documents tag says D: the offsets of the documents' first tokens,
             strictly increasing, the first 0, all below N (document i is tokens [start i, start i+1), the last one
             runs to N). `qtrain tokenize --pack-to` writes it; --document-masking reads it (`data/documents.py`).
             llm.q's reader never looks past the masks (it reads header ints 0..6 and the tokens and masks at their
             offsets, and does not check the file's size), so it reads these files as packed rows without boundaries.
             qtrain checks the section's order and range when --document-masking reads it (`TokenFile.document_starts`).

Files are read with `os.pread`, not memory-mapped: a file truncated under a running reader gives a short read,
which `TokenFile.read` turns into a DataChangedError naming the file and offset, where a map would kill the
process with SIGBUS.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from qtrain.fsio import InputError, check_regular_file, expand_glob, shorten, temp_path

MAGIC = b"BIN.TOK\n"
HEADER_BYTES = 1024
HEADER_INTS = HEADER_BYTES // 4
WRITE_VERSION = 2
BYTES_PER_TOKEN = 4
MAX_TOKENS_PER_FILE = 2**31 - 1  # N is stored as int32
IGNORE_INDEX = -100  # target value that the loss skips (torch's cross_entropy default)
TOKENIZER_TAG, TOKENIZER_TAG_OFFSET = b"tokenizer=", 512  # see the format above
MAX_TOKENIZER_NAME = HEADER_BYTES - TOKENIZER_TAG_OFFSET - len(TOKENIZER_TAG) - 1
TOKEN_SET_TAG, TOKEN_SET_TAG_OFFSET = b"tokenset=", 256  # see the format above
DOCUMENTS_TAG, DOCUMENTS_TAG_OFFSET = b"documents=", 128  # see the format above
_DOCUMENTS_COUNT = re.compile(rb"^\d{1,10}$")
_TOKEN_SET_FIELDS = re.compile(r"^(?P<id>[0-9a-f]{8,64}) (?P<split>[a-z]{1,16}) (?P<index>\d{1,9}) (?P<count>\d{1,9})$")

# The vocab field of one tokenizer's files differs between writers: llm.q stores HF's `tokenizer.vocab_size`,
# which leaves out the added special tokens (151643 for Qwen2), qtrain one past the largest id the tokenizer
# can produce (151665 with Qwen2.5's specials; 151646 with Qwen2's three). Files whose fields fall in one
# family were made by the same tokenizer and mix; any other difference is a real mismatch.
VOCAB_FAMILIES = {"qwen2": (151643, 151646, 151665), "gpt2": (50257,), "llama3": (128000, 128256)}

PathLike = str | os.PathLike[str]


class DataError(ValueError):
    """A token file (or a set of them) cannot be used; the message names the file."""


class DataChangedError(DataError):
    """A token file changed under a running reader (cut short, or ids written out of range in place); the message
    names the file and the token offset. The training loop stops on it as on a signal (`train/stop.py`)."""


@dataclass(frozen=True)
class TokenSetTag:
    """What a `qtrain tokenize` shard says of itself in its header: shard `index` of the `count` of `split` in set
    `set_id` (`token_sets.py` checks a selection of shards against the set's index)."""

    set_id: str
    split: str
    index: int
    count: int

    def encode(self) -> bytes:
        return TOKEN_SET_TAG + f"{self.set_id} {self.split} {self.index} {self.count}".encode("ascii") + b"\0"

    def __str__(self) -> str:
        return f"{self.split} shard {self.index + 1} of {self.count} of token set {self.set_id}"


@dataclass(frozen=True)
class TokenFileHeader:
    """Decoded header of one token file; ``vocab_size`` is None for version-1 files (not recorded)."""

    path: str
    version: int
    bytes_per_token: int
    num_tokens: int
    vocab_size: int | None
    has_masks: bool
    tokenizer: str | None = None  # the tokenizer that wrote it, when recorded (qtrain's writer)
    token_set: TokenSetTag | None = None  # the `qtrain tokenize` set it belongs to, when it is one's shard
    documents: int = 0  # entries of the documents section (0: none; `qtrain tokenize --pack-to` writes one)

    @property
    def mask_bytes(self) -> int:
        return (self.num_tokens + 7) // 8 if self.has_masks else 0

    @property
    def documents_offset(self) -> int:
        """Byte offset of the documents section (right after the masks, or the tokens)."""
        return HEADER_BYTES + self.num_tokens * self.bytes_per_token + self.mask_bytes

    @property
    def file_size(self) -> int:
        """Exact size a well-formed file with this header must have."""
        return self.documents_offset + 4 * self.documents


# ----------------------------------------------------------------------------------------------
# Writing


def _header_bytes(num_tokens: int, vocab_size: int, has_masks: bool, tokenizer: str | None = None,
                  documents: int = 0) -> bytes:
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0:2] = np.frombuffer(MAGIC, dtype="<i4")
    header[2] = WRITE_VERSION
    header[3] = BYTES_PER_TOKEN
    header[4] = num_tokens
    header[5] = vocab_size
    header[6] = int(has_masks)
    raw = bytearray(header.tobytes())
    if documents:
        tag = DOCUMENTS_TAG + str(documents).encode("ascii") + b"\0"
        raw[DOCUMENTS_TAG_OFFSET:DOCUMENTS_TAG_OFFSET + len(tag)] = tag
    if tokenizer:
        tag = TOKENIZER_TAG + tokenizer.encode("utf-8") + b"\0"
        raw[TOKENIZER_TAG_OFFSET:TOKENIZER_TAG_OFFSET + len(tag)] = tag
    return bytes(raw)


def _tokenizer_tag(raw: bytes) -> str | None:
    field = raw[TOKENIZER_TAG_OFFSET:]
    if not field.startswith(TOKENIZER_TAG) or b"\0" not in field:
        return None
    return field[len(TOKENIZER_TAG):field.index(b"\0")].decode("utf-8", errors="replace") or None


def _documents_tag(raw: bytes, path: str) -> int:
    """The documents section's entry count the header records (0 when it has no tag); a DataError for a tag whose
    count is no number."""
    field = raw[DOCUMENTS_TAG_OFFSET:TOKEN_SET_TAG_OFFSET]
    if not field.startswith(DOCUMENTS_TAG):
        return 0
    count = field[len(DOCUMENTS_TAG):field.index(b"\0")] if b"\0" in field else b""
    if not _DOCUMENTS_COUNT.match(count):
        raise DataError(f"{path}: corrupt documents tag in the header at byte {DOCUMENTS_TAG_OFFSET} "
                        f"({shorten(repr(field[:40]), 60)}): not a count")
    return int(count)


def _token_set_tag(raw: bytes) -> TokenSetTag | None:
    field = raw[TOKEN_SET_TAG_OFFSET:TOKENIZER_TAG_OFFSET]
    if not field.startswith(TOKEN_SET_TAG) or b"\0" not in field:
        return None
    m = _TOKEN_SET_FIELDS.match(field[len(TOKEN_SET_TAG):field.index(b"\0")].decode("ascii", errors="replace"))
    if m is None or int(m["index"]) >= int(m["count"]):
        return None
    return TokenSetTag(m["id"], m["split"], int(m["index"]), int(m["count"]))


def stamp_token_set(path: PathLike, tag: TokenSetTag) -> None:
    """Write a set's tag into the header of a finished (not yet published) token file, and fsync it: a shard's
    count is known only once the whole set is written."""
    fd = os.open(path, os.O_RDWR)
    try:
        field = tag.encode()
        os.pwrite(fd, field + b"\0" * (TOKENIZER_TAG_OFFSET - TOKEN_SET_TAG_OFFSET - len(field)), TOKEN_SET_TAG_OFFSET)
        os.fsync(fd)
    finally:
        os.close(fd)


def tokenizer_family(vocab_size: int | None) -> str | None:
    """The VOCAB_FAMILIES name a file's vocab field belongs to, if any."""
    return next((name for name, sizes in VOCAB_FAMILIES.items() if vocab_size in sizes), None)


def common_vocab_size(headers: Sequence["TokenFileHeader"]) -> int | None:
    """The vocab size that files meant to be read together need from the model (None: no file records one).
    Equal fields, or fields of one tokenizer family (VOCAB_FAMILIES: then the family's largest, since the
    files may hold any of its ids), are fine; anything else raises DataError naming every file."""
    sizes = {h.vocab_size for h in headers if h.vocab_size is not None}
    if len(sizes) <= 1:
        return sizes.pop() if sizes else None
    families = {tokenizer_family(v) for v in sizes}
    if len(families) == 1 and None not in families:
        return max(VOCAB_FAMILIES[families.pop()])
    desc = ", ".join(f"{h.path} ({h.vocab_size})" for h in headers)
    raise DataError(f"token files have different vocab sizes, so different tokenizers made them: {desc}")


class TokenFileWriter:
    """Streams tokens (and optional masks) into a token file, atomically.

    With ``with_documents``, each ``write`` may say where documents start in the tokens it writes (``starts``, offsets
    into them); the file's first token must start one. They are kept in memory (D x 8 bytes) and follow the masks.

    Tokens go straight to a hidden temp name (`fsio.temp_path`: `.NAME.tmp-HOST-PID`, swept once its writer is
    dead) so a file of 100M tokens never has to be held as a Python list; mask bits (N/8 bytes) are kept in memory
    because they follow all tokens. ``close()`` writes the header, fsyncs and renames onto ``path`` (a crash leaves
    no half-written ``.bin`` behind); ``finish()`` does the same but leaves the file under its temp name
    (``temp``), for a caller that publishes several files together (`token_sets.py`); ``abort()`` removes it. Use as
    a context manager to get exactly that. ``sha256`` is the digest of the bytes after the header (tokens, masks).
    """

    def __init__(self, path: PathLike, *, vocab_size: int, with_masks: bool = False,
                 tokenizer: str | None = None, with_documents: bool = False) -> None:
        if vocab_size <= 0 or vocab_size > MAX_TOKENS_PER_FILE:
            raise DataError(f"{path}: invalid vocab_size {vocab_size}")
        if tokenizer is not None and (len(tokenizer.encode("utf-8")) > MAX_TOKENIZER_NAME or "\0" in tokenizer):
            tokenizer = None  # a path too long for the header: the file stays valid, just unlabelled
        self.tokenizer = tokenizer
        self.path = str(path)
        self.vocab_size = int(vocab_size)
        self.with_masks = with_masks
        self.with_documents = with_documents
        self.num_tokens = 0
        self._masks: list[np.ndarray] = []
        self._starts: list[np.ndarray] = []
        self._body = hashlib.sha256()
        self.temp = str(temp_path(self.path))
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.temp, "wb")
        self._f.write(b"\0" * HEADER_BYTES)  # placeholder until N is known

    def write(self, tokens: Sequence[int] | np.ndarray, masks: Sequence[bool] | np.ndarray | None = None,
              starts: Sequence[int] | np.ndarray | None = None) -> None:
        """Append tokens (and their masks; and, with_documents, the offsets among them where documents start)."""
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise DataError(f"{self.path}: tokens must be 1-D, got shape {arr.shape}")
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise DataError(
                f"{self.path}: token ids must lie in [0, {self.vocab_size}), got [{arr.min()}, {arr.max()}]"
            )
        if self.num_tokens + arr.size > MAX_TOKENS_PER_FILE:
            raise DataError(f"{self.path}: more than {MAX_TOKENS_PER_FILE} tokens do not fit one file")
        if self.with_masks:
            if masks is None or len(masks) != arr.size:
                raise DataError(f"{self.path}: masks must be given with the same length as tokens")
            self._masks.append(np.asarray(masks, dtype=bool))
        elif masks is not None:
            raise DataError(f"{self.path}: masks given to a writer created with with_masks=False")
        if starts is not None:
            at = np.asarray(starts, dtype=np.int64)
            if not self.with_documents:
                raise DataError(f"{self.path}: document starts given to a writer created with with_documents=False")
            if at.size and (at[0] < 0 or at[-1] >= arr.size or (np.diff(at) <= 0).any()):
                raise DataError(f"{self.path}: document starts must increase within [0, {arr.size})")
            if self.num_tokens == 0 and arr.size and (not at.size or at[0] != 0):
                raise DataError(f"{self.path}: the file's first token must start a document")
            self._starts.append(at + self.num_tokens)
        data = arr.astype("<i4", copy=False).tobytes()
        self._f.write(data)
        self._body.update(data)
        self.num_tokens += arr.size

    @property
    def sha256(self) -> str:
        return self._body.hexdigest()

    def finish(self) -> str:
        """Write the masks and the header, fsync and close; the file stays under its temp name, which is returned."""
        if self.with_masks:
            bits = np.concatenate(self._masks) if self._masks else np.zeros(0, dtype=bool)
            data = np.packbits(bits, bitorder="little").tobytes()
            self._f.write(data)
            self._body.update(data)
        documents = 0
        if self.with_documents:
            starts = np.concatenate(self._starts) if self._starts else np.zeros(0, dtype=np.int64)
            if self.num_tokens and (not starts.size or starts[0] != 0):
                raise DataError(f"{self.path}: the file's first token must start a document")
            data = starts.astype("<i4").tobytes()
            self._f.write(data)
            self._body.update(data)
            documents = starts.size
        self._f.seek(0)
        self._f.write(_header_bytes(self.num_tokens, self.vocab_size, self.with_masks, self.tokenizer, documents))
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        return self.temp

    def close(self) -> str:
        os.replace(self.finish(), self.path)
        return self.path

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
        if os.path.exists(self.temp):
            os.remove(self.temp)

    def __enter__(self) -> "TokenFileWriter":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_token_file(
    path: PathLike,
    tokens: Sequence[int] | np.ndarray,
    *,
    vocab_size: int,
    masks: Sequence[bool] | np.ndarray | None = None,
    tokenizer: str | None = None,
    starts: Sequence[int] | np.ndarray | None = None,
) -> str:
    """Write one token file (version 2) atomically; ``masks[i]`` true keeps token i as a target; ``tokenizer``
    (a name or path) is recorded in the header; ``starts``: the offsets where documents start (a documents
    section)."""
    with TokenFileWriter(path, vocab_size=vocab_size, with_masks=masks is not None, tokenizer=tokenizer,
                         with_documents=starts is not None) as w:
        w.write(tokens, masks, starts)
    return str(path)


# ----------------------------------------------------------------------------------------------
# Reading


def _open_token_file(path: str) -> int:
    """A read-only descriptor of a token file; anything but a regular file is refused first (a FIFO would block
    the read forever, a device never end it)."""
    try:
        check_regular_file(path, "token file")
        return os.open(path, os.O_RDONLY)
    except InputError as e:  # its wording after the path: "no such file", "is a directory", ...
        raise DataError(f"{shorten(path)}: cannot read token file ({str(e).rsplit(': ', 1)[-1]})") from None
    except OSError as e:
        raise DataError(f"{shorten(path)}: cannot read token file ({e.strerror or e})") from None


def _pread_into(fd: int, buf: np.ndarray, offset: int) -> int:
    """Fill `buf` from byte `offset` of `fd`; returns the bytes read (fewer only at the end of the file)."""
    view, got = memoryview(buf).cast("B"), 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


def _header_of(fd: int, path: str) -> TokenFileHeader:
    """Read and validate the header of an open token file, including that the file size matches N and the mask flag."""
    size = os.fstat(fd).st_size
    raw_arr = np.zeros(HEADER_BYTES, dtype=np.uint8)
    got = _pread_into(fd, raw_arr, 0)
    raw = raw_arr.tobytes()[:got]
    if len(raw) < HEADER_BYTES:
        raise DataError(f"{path}: truncated token file ({size} bytes, the header alone is {HEADER_BYTES})")
    if raw[:8] != MAGIC:
        raise DataError(f"{path}: not a token file (magic {raw[:8]!r}, expected {MAGIC!r})")
    h = np.frombuffer(raw, dtype="<i4")
    version, bpt, n = int(h[2]), int(h[3]), int(h[4])
    if version not in (1, 2):
        raise DataError(f"{path}: unsupported token file version {version} (supported: 1, 2)")
    if bpt != BYTES_PER_TOKEN:
        raise DataError(f"{path}: unsupported bytes per token {bpt} (supported: {BYTES_PER_TOKEN})")
    if n < 0:
        raise DataError(f"{path}: negative token count {n} in header")
    # v1 headers have no vocab field; llm.q's v1 writer still stored the mask flag at int 6.
    header = TokenFileHeader(
        path=path,
        version=version,
        bytes_per_token=bpt,
        num_tokens=n,
        vocab_size=int(h[5]) if version >= 2 else None,
        has_masks=bool(h[6]),
        tokenizer=_tokenizer_tag(raw),
        token_set=_token_set_tag(raw),
        documents=_documents_tag(raw, path),
    )
    if header.documents > n:
        raise DataError(f"{path}: corrupt documents tag: {header.documents} documents in {n} tokens")
    if size != header.file_size:
        what = "truncated" if size < header.file_size else "oversized"
        raise DataError(
            f"{path}: {what} token file: {size} bytes, but the header's {n} tokens"
            f"{' + masks' if header.has_masks else ''}"
            f"{f' + {header.documents} document starts' if header.documents else ''} need {header.file_size}"
        )
    return header


def read_token_file_header(path: PathLike) -> TokenFileHeader:
    """Read and validate a header, including that the file size matches N and the mask flag."""
    path = str(path)
    fd = _open_token_file(path)
    try:
        return _header_of(fd, path)
    finally:
        os.close(fd)


class TokenFile:
    """An open token file: ``read(start, stop)`` gives tokens, ``mask_bits`` keep-bits (all ones without masks).

    Reads go through `os.pread` on a descriptor opened once (not a memory map: see the module docstring), so a
    file replaced by a rename goes on being read whole from its old inode, and one cut short in place gives a
    DataChangedError naming the file and the token offset instead of a SIGBUS."""

    def __init__(self, path: PathLike) -> None:
        path = str(path)
        self._fd = _open_token_file(path)
        try:
            self.header = _header_of(self._fd, path)
        except BaseException:
            os.close(self._fd)
            raise
        self.path = self.header.path

    def __len__(self) -> int:
        return self.header.num_tokens

    def close(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.close()

    def _read(self, buf: np.ndarray, offset: int, what: str) -> None:
        got = _pread_into(self._fd, buf, offset)
        if got < buf.nbytes:
            size = os.fstat(self._fd).st_size
            raise DataChangedError(f"{shorten(self.path)}: changed while being read: {what} ends at byte "
                                   f"{offset + got} of the {self.header.file_size} its header promises (the file "
                                   f"now has {size} bytes)")

    def read_into(self, start: int, out: np.ndarray) -> np.ndarray:
        """Tokens [start, start + len(out)) into `out` (an int32 array); a DataChangedError if the file ends first."""
        if start < 0 or start + len(out) > len(self):
            raise IndexError(f"{self.path}: tokens [{start}, {start + len(out)}) outside [0, {len(self)})")
        self._read(out, HEADER_BYTES + BYTES_PER_TOKEN * start, f"token offset {start}")
        return out

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) as a new int32 array."""
        return self.read_into(start, np.empty(max(stop - start, 0), dtype="<i4"))

    def mask_bits(self, start: int, stop: int) -> np.ndarray:
        """Unpacked keep-bits for tokens [start, stop) (all ones when the file has no masks)."""
        if not self.header.has_masks:
            return np.ones(stop - start, dtype=bool)
        first, last = start // 8, (stop + 7) // 8
        packed = np.empty(last - first, dtype=np.uint8)
        self._read(packed, HEADER_BYTES + BYTES_PER_TOKEN * len(self) + first, f"the mask of token offset {start}")
        bits = np.unpackbits(packed, bitorder="little")
        return bits[start - 8 * first : stop - 8 * first].astype(bool)

    def document_starts(self) -> np.ndarray | None:
        """The documents section (int64 offsets of the documents' first tokens), None when the file has none; read
        and checked once (strictly increasing, the first 0, all below the token count: a DataError naming the file
        and the first bad entry otherwise)."""
        if not self.header.documents:
            return None
        if getattr(self, "_document_starts", None) is None:
            raw = np.empty(self.header.documents, dtype="<i4")
            self._read(raw, self.header.documents_offset, "the documents section")
            starts = raw.astype(np.int64)
            bad = np.flatnonzero(np.diff(starts) <= 0)
            why = (f"its first entry is {starts[0]}, not 0" if starts[0] != 0 else
                   f"entry {bad[0] + 1} ({starts[bad[0] + 1]}) does not follow entry {bad[0]} ({starts[bad[0]]})"
                   if bad.size else
                   f"its last entry {starts[-1]} is beyond the {len(self)} tokens" if starts[-1] >= len(self) else "")
            if why:
                raise DataError(f"{shorten(self.path)}: corrupt documents section (byte "
                                f"{self.header.documents_offset}): {why}; write the file again (qtrain tokenize "
                                f"--pack-to)")
            self._document_starts = starts
        return self._document_starts


def read_token_file(path: PathLike) -> tuple[np.ndarray, np.ndarray | None]:
    """Whole file as (tokens int32, keep-mask bool or None) in memory; for tests and small files."""
    f = TokenFile(path)
    try:
        masks = f.mask_bits(0, len(f)) if f.header.has_masks else None
        return f.read(0, len(f)).astype(np.int32), masks
    finally:
        f.close()


def expand_files(pattern_or_files: PathLike | Sequence[PathLike]) -> list[str]:
    """Glob pattern(s) -> sorted list of files (a bounded matcher: `fsio.expand_glob`); llm.q also expands the
    pattern inside the program."""
    patterns = [pattern_or_files] if isinstance(pattern_or_files, (str, os.PathLike)) else list(pattern_or_files)
    files: list[str] = []
    for p in patterns:
        p = str(p)
        hits = expand_glob(p, "token file pattern")
        if not hits:
            raise DataError(f"{shorten(p)}: no token files match")
        files.extend(h for h in hits if h not in files)
    return files
