"""Token files (llm.q's ``.bin`` format) and the training/eval data loader.

File format (byte-compatible with llm.q, ``reference/llmq.md`` §2.1), little-endian throughout::

    header   1024 bytes = 256 x int32
             [0:2] magic b"BIN.TOK\\n"   [2] version (1 or 2; we write 2)   [3] bytes per token (4)
             [4] number of tokens N      [5] vocab size (v2 only)          [6] has-masks flag
    tokens   N x int32
    masks    ceil(N/8) bytes, present iff has-masks; bit i (LSB-first in each byte) = 1 keeps token i
             as a training target.

Loader semantics follow llm.q (non-overlapping chunks of ``seq_len`` tokens, targets shifted by one,
no document-boundary handling, strided rank shares, state = (seed, epoch, file, chunk)) with two
deliberate differences, both documented where they happen:

* the mask bit is read at the *target* position (llm.q reads it at the input position, an off-by-one
  that trains on the token after EOS and never on the first response token);
* shuffling uses numpy's PCG64 seeded from ``(seed, epoch, ...)`` instead of libstdc++'s
  ``std::shuffle``: deterministic and platform independent, but not llm.q's exact order.
"""

from __future__ import annotations

import glob as _glob
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np

if TYPE_CHECKING:  # torch is imported where batches are made, so tokenizer workers start fast
    import torch

MAGIC = b"BIN.TOK\n"
HEADER_BYTES = 1024
HEADER_INTS = HEADER_BYTES // 4
WRITE_VERSION = 2
BYTES_PER_TOKEN = 4
MAX_TOKENS_PER_FILE = 2**31 - 1  # N is stored as int32
IGNORE_INDEX = -100  # target value that the loss skips (torch's cross_entropy default)

# Domain-separation tags for the shuffling RNG streams (arbitrary constants, like llm.q's 0x73653753).
_FILE_ORDER_TAG = 0x73653753
_CHUNK_ORDER_TAG = 0x636E6B73

PathLike = str | os.PathLike[str]


class DataError(ValueError):
    """A token file (or a set of them) cannot be used; the message names the file."""


@dataclass(frozen=True)
class TokenFileHeader:
    """Decoded header of one token file; ``vocab_size`` is None for version-1 files (not recorded)."""

    path: str
    version: int
    bytes_per_token: int
    num_tokens: int
    vocab_size: int | None
    has_masks: bool

    @property
    def mask_bytes(self) -> int:
        return (self.num_tokens + 7) // 8 if self.has_masks else 0

    @property
    def file_size(self) -> int:
        """Exact size a well-formed file with this header must have."""
        return HEADER_BYTES + self.num_tokens * self.bytes_per_token + self.mask_bytes


# ----------------------------------------------------------------------------------------------
# Writing


def _header_bytes(num_tokens: int, vocab_size: int, has_masks: bool) -> bytes:
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0:2] = np.frombuffer(MAGIC, dtype="<i4")
    header[2] = WRITE_VERSION
    header[3] = BYTES_PER_TOKEN
    header[4] = num_tokens
    header[5] = vocab_size
    header[6] = int(has_masks)
    return header.tobytes()


class TokenFileWriter:
    """Streams tokens (and optional masks) into a token file, atomically.

    Tokens go straight to ``<path>.tmp.<pid>`` so a file of 100M tokens never has to be held as a
    Python list; mask bits (N/8 bytes) are kept in memory because they follow all tokens. ``close()``
    writes the header and renames onto ``path`` (a crash leaves no half-written ``.bin`` behind);
    ``abort()`` removes the temporary file. Use as a context manager to get exactly that.
    """

    def __init__(self, path: PathLike, *, vocab_size: int, with_masks: bool = False) -> None:
        if vocab_size <= 0 or vocab_size > MAX_TOKENS_PER_FILE:
            raise DataError(f"{path}: invalid vocab_size {vocab_size}")
        self.path = str(path)
        self.vocab_size = int(vocab_size)
        self.with_masks = with_masks
        self.num_tokens = 0
        self._masks: list[np.ndarray] = []
        self._tmp = f"{self.path}.tmp.{os.getpid()}"
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self._tmp, "wb")
        self._f.write(b"\0" * HEADER_BYTES)  # placeholder until N is known

    def write(self, tokens: Sequence[int] | np.ndarray, masks: Sequence[bool] | np.ndarray | None = None) -> None:
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
        self._f.write(arr.astype("<i4", copy=False).tobytes())
        self.num_tokens += arr.size

    def close(self) -> str:
        if self.with_masks:
            bits = np.concatenate(self._masks) if self._masks else np.zeros(0, dtype=bool)
            self._f.write(np.packbits(bits, bitorder="little").tobytes())
        self._f.seek(0)
        self._f.write(_header_bytes(self.num_tokens, self.vocab_size, self.with_masks))
        self._f.close()
        os.replace(self._tmp, self.path)
        return self.path

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
        if os.path.exists(self._tmp):
            os.remove(self._tmp)

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
) -> str:
    """Write one token file (version 2) atomically; ``masks[i]`` true keeps token i as a target."""
    with TokenFileWriter(path, vocab_size=vocab_size, with_masks=masks is not None) as w:
        w.write(tokens, masks)
    return str(path)


# ----------------------------------------------------------------------------------------------
# Reading


def read_token_file_header(path: PathLike) -> TokenFileHeader:
    """Read and validate a header, including that the file size matches N and the mask flag."""
    path = str(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except OSError as e:
        raise DataError(f"{path}: cannot read token file ({e.strerror or e})") from e
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
    )
    if size != header.file_size:
        what = "truncated" if size < header.file_size else "oversized"
        raise DataError(
            f"{path}: {what} token file: {size} bytes, but the header's {n} tokens"
            f"{' + masks' if header.has_masks else ''} need {header.file_size}"
        )
    return header


class TokenFile:
    """A memory-mapped token file: ``tokens`` (int32, length N) and ``masks`` (packed bits or None)."""

    def __init__(self, path: PathLike) -> None:
        self.header = read_token_file_header(path)
        n = self.header.num_tokens
        self.path = self.header.path
        # np.memmap refuses zero-length maps; an empty file is still a valid (useless) file.
        self.tokens: np.ndarray = (
            np.memmap(self.path, dtype="<i4", mode="r", offset=HEADER_BYTES, shape=(n,))
            if n
            else np.zeros(0, dtype="<i4")
        )
        self.masks: np.ndarray | None = None
        if self.header.has_masks and n:
            self.masks = np.memmap(
                self.path, dtype=np.uint8, mode="r", offset=HEADER_BYTES + 4 * n, shape=(self.header.mask_bytes,)
            )

    def __len__(self) -> int:
        return self.header.num_tokens

    def mask_bits(self, start: int, stop: int) -> np.ndarray:
        """Unpacked keep-bits for tokens [start, stop) (all ones when the file has no masks)."""
        if self.masks is None:
            return np.ones(stop - start, dtype=bool)
        first, last = start // 8, (stop + 7) // 8
        bits = np.unpackbits(np.asarray(self.masks[first:last]), bitorder="little")
        return bits[start - 8 * first : stop - 8 * first].astype(bool)


def read_token_file(path: PathLike) -> tuple[np.ndarray, np.ndarray | None]:
    """Whole file as (tokens int32, keep-mask bool or None) in memory; for tests and small files."""
    f = TokenFile(path)
    masks = f.mask_bits(0, len(f)) if f.header.has_masks else None
    return np.array(f.tokens, dtype=np.int32), masks


def expand_files(pattern_or_files: PathLike | Sequence[PathLike]) -> list[str]:
    """Glob pattern(s) -> sorted list of files; llm.q also expands the pattern inside the program."""
    patterns = [pattern_or_files] if isinstance(pattern_or_files, (str, os.PathLike)) else list(pattern_or_files)
    files: list[str] = []
    for p in patterns:
        p = str(p)
        hits = sorted(_glob.glob(p)) if _glob.has_magic(p) else ([p] if os.path.exists(p) else [])
        if not hits:
            raise DataError(f"{p}: no token files match")
        files.extend(h for h in hits if h not in files)
    return files


# ----------------------------------------------------------------------------------------------
# Loader


class TokenLoader:
    """Serves (inputs, targets) batches of ``seq_len`` tokens from one or more token files.

    Chunk c of a file is inputs = tokens[cT : cT+T], targets = tokens[cT+1 : cT+T+1]; a file yields
    (N-1)//T chunks. Per epoch, the file order and each file's chunk order are shuffled with numpy
    generators seeded from (seed, epoch, tag) and (seed, epoch, file index, tag), so any position can be
    reconstructed from (seed, epoch, file position, chunk position) alone: that is the whole resumable
    state. Rank r of W takes the shuffled chunks r, r+W, r+2W, ... of every file and the last
    ``C mod W`` chunks of a file are dropped, so all ranks see the same number of chunks and stay in
    lockstep. A batch may span a file boundary; a trailing partial batch at the end of an epoch is
    dropped, and ``next_batch`` moves on to the next epoch by itself when the current one is exhausted.
    """

    def __init__(
        self,
        pattern_or_files: PathLike | Sequence[PathLike],
        seq_len: int,
        *,
        rank: int = 0,
        world: int = 1,
        seed: int = 0,
        model_vocab_size: int | None = None,
        shuffle: bool = True,
    ) -> None:
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside world of size {world}")
        self.seq_len = seq_len
        self.rank, self.world = rank, world
        self.seed = int(seed)
        self.shuffle = shuffle
        self.files = [TokenFile(p) for p in expand_files(pattern_or_files)]

        vocabs = {f.header.vocab_size for f in self.files if f.header.vocab_size is not None}
        if len(vocabs) > 1:
            desc = ", ".join(f"{f.path} ({f.header.vocab_size})" for f in self.files)
            raise DataError(f"token files have different vocab sizes: {desc}")
        self.vocab_size: int | None = vocabs.pop() if vocabs else None
        if model_vocab_size is not None and self.vocab_size is not None and self.vocab_size > model_vocab_size:
            bad = next(f for f in self.files if f.header.vocab_size == self.vocab_size)
            raise DataError(
                f"{bad.path}: token file vocab size {self.vocab_size} exceeds the model's vocab size {model_vocab_size}"
            )
        for f in self.files:
            if len(f) < seq_len + 1:
                raise DataError(
                    f"{f.path}: {len(f)} tokens are too few for one sequence of seq_len={seq_len} "
                    f"(need seq_len + 1 = {seq_len + 1})"
                )
        # Chunks per rank for each file (same on every rank).
        self._per_rank = [((len(f) - 1) // seq_len) // world for f in self.files]
        if sum(self._per_rank) == 0:
            raise DataError(f"{self.files[0].path}: too few chunks of {seq_len} tokens to give one to each of {world} ranks")
        self.epoch = 0
        self._file_pos = 0  # position in this epoch's file order
        self._chunk_pos = 0  # position in this rank's share of the current file
        self._order_cache: dict[tuple[int, int], np.ndarray] = {}

    # -- sizes ----------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        """Tokens in all files together (before chunking and rank split)."""
        return sum(len(f) for f in self.files)

    @property
    def chunks_per_epoch(self) -> int:
        """Sequences this rank sees per epoch."""
        return sum(self._per_rank)

    @property
    def progress(self) -> float:
        """Fraction of this epoch's sequences already served (0 at the start of an epoch)."""
        order = self._file_order(self.epoch)
        done = sum(self._per_rank[i] for i in order[: self._file_pos]) + self._chunk_pos
        return done / self.chunks_per_epoch

    # -- ordering -------------------------------------------------------------------------------
    def _rng(self, *key: int) -> np.random.Generator:
        return np.random.default_rng([self.seed % 2**64, *key])

    def _file_order(self, epoch: int) -> np.ndarray:
        n = len(self.files)
        if not self.shuffle:
            return np.arange(n)
        return self._rng(epoch, _FILE_ORDER_TAG).permutation(n)

    def _rank_chunks(self, epoch: int, file_index: int) -> np.ndarray:
        """This rank's chunk indices of one file in this epoch, in serving order (cached per file)."""
        key = (epoch, file_index)
        cached = self._order_cache.get(key)
        if cached is None:
            total = (len(self.files[file_index]) - 1) // self.seq_len
            order = (
                self._rng(epoch, file_index, _CHUNK_ORDER_TAG).permutation(total) if self.shuffle else np.arange(total)
            )
            cached = order[self.rank :: self.world][: self._per_rank[file_index]]
            self._order_cache = {key: cached}  # only the current file's order is ever needed again
        return cached

    def _chunk(self, file_index: int, chunk: int) -> tuple[np.ndarray, np.ndarray]:
        f, T = self.files[file_index], self.seq_len
        start = chunk * T
        window = np.asarray(f.tokens[start : start + T + 1], dtype=np.int64)
        inputs, targets = window[:-1], window[1:].copy()
        if f.masks is not None:
            # Mask bit at the *target* position: bit (cT+j+1) decides whether target j is trained.
            # (llm.q reads bit cT+j, an off-by-one; see reference/llmq.md §2.1 [quirk].)
            targets[~f.mask_bits(start + 1, start + T + 1)] = IGNORE_INDEX
        return inputs, targets

    # -- iteration ------------------------------------------------------------------------------
    def _remaining(self) -> int:
        order = self._file_order(self.epoch)
        return sum(self._per_rank[i] for i in order[self._file_pos :]) - self._chunk_pos

    def has_next(self, batch_size: int) -> bool:
        """Whether this epoch still holds a full batch of ``batch_size`` sequences."""
        return self._remaining() >= batch_size

    def advance_epoch(self) -> None:
        """Start the next epoch (new shuffle); anything left of the current one is skipped."""
        self.epoch += 1
        self._file_pos = 0
        self._chunk_pos = 0

    def next_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Next ``(inputs, targets)``, int64 CPU tensors of shape [batch_size, seq_len]."""
        import torch

        if batch_size > self.chunks_per_epoch:
            raise DataError(
                f"{self.files[0].path}: batch of {batch_size} sequences is larger than the "
                f"{self.chunks_per_epoch} sequences per epoch this rank gets"
            )
        if not self.has_next(batch_size):
            self.advance_epoch()
        inputs = np.empty((batch_size, self.seq_len), dtype=np.int64)
        targets = np.empty((batch_size, self.seq_len), dtype=np.int64)
        order = self._file_order(self.epoch)
        for b in range(batch_size):
            while self._chunk_pos >= self._per_rank[order[self._file_pos]]:
                self._file_pos += 1
                self._chunk_pos = 0
            fi = int(order[self._file_pos])
            inputs[b], targets[b] = self._chunk(fi, int(self._rank_chunks(self.epoch, fi)[self._chunk_pos]))
            self._chunk_pos += 1
        return torch.from_numpy(inputs), torch.from_numpy(targets)

    def iterate_eval_batches(
        self, batch_size: int, max_batches: int | None = None, *, drop_last: bool = False
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One pass over the files in order, unshuffled (rank r takes chunks r, r+W, ... of each file).

        Independent of the training position (it does not touch the loader's state). The last batch
        may be smaller than ``batch_size`` unless ``drop_last``; its size is the same on every rank.
        """
        import torch

        pending: list[tuple[np.ndarray, np.ndarray]] = []
        produced = 0

        def emit() -> tuple[torch.Tensor, torch.Tensor]:
            x = torch.from_numpy(np.stack([p[0] for p in pending]))
            y = torch.from_numpy(np.stack([p[1] for p in pending]))
            pending.clear()
            return x, y

        for fi, count in enumerate(self._per_rank):
            for k in range(count):
                if max_batches is not None and produced >= max_batches:
                    return
                pending.append(self._chunk(fi, self.rank + k * self.world))
                if len(pending) == batch_size:
                    produced += 1
                    yield emit()
        if pending and not drop_last and (max_batches is None or produced < max_batches):
            yield emit()

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, int]:
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "file_index": self._file_pos,
            "chunk_index": self._chunk_pos,
            "world": self.world,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore a position; the seed comes from the state (as in llm.q), the world size must match."""
        if int(state.get("world", self.world)) != self.world:
            raise DataError(
                f"{self.files[0].path}: loader state was saved with world size {state['world']}, "
                f"cannot resume with {self.world}"
            )
        file_pos, chunk_pos = int(state["file_index"]), int(state["chunk_index"])
        if not 0 <= file_pos <= len(self.files):
            raise DataError(f"{self.files[0].path}: loader state file_index {file_pos} out of range")
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self._file_pos, self._chunk_pos = file_pos, chunk_pos
        self._order_cache = {}
