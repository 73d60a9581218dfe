"""The training/eval data loader: (inputs, targets) batches from token files (`token_files.py`).

Loader semantics follow llm.q (non-overlapping chunks of ``seq_len`` tokens, targets shifted by one,
no document-boundary handling (but see document masking below), strided rank shares, state = (seed, epoch, file,
chunk)) with two deliberate differences, both documented where they happen:

* the mask bit is read at the *target* position (llm.q reads it at the input position, an off-by-one
  that trains on the token after EOS and never on the first response token);
* shuffling uses numpy's PCG64 seeded from ``(seed, epoch, ...)`` instead of libstdc++'s
  ``std::shuffle``: deterministic and platform independent, but not llm.q's exact order.

With ``document_masking`` every batch also carries position ids (B, T): each token's position in its document
(documents recorded in the files, or split after each EOS; a row starts a new document), and targets that cross
into the next document are ignored (`qtrain.data.documents` says how, exactly).

The files were checked before the run (headers, sizes, every id; `qtrain tokenize` sets against their index:
`token_sets.py`), but they may change under it: every batch is read with `pread` (a file cut short is a short
read, not a SIGBUS) and its ids are checked against the vocabulary with one min/max over the batch. Either fault is
a DataChangedError naming the file and the token offset, which the training loop stops on like a signal.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import numpy as np

from qtrain.data.documents import file_documents
from qtrain.data.token_files import (IGNORE_INDEX, DataChangedError, DataError, PathLike, TokenFile, common_vocab_size,
                                      expand_files)
from qtrain.data.token_scan import check_token_ids
from qtrain.data.token_sets import check_token_sets

if TYPE_CHECKING:  # torch is imported where batches are made, so tokenizer workers start fast
    import torch

    # (inputs, targets) int64 (B, T); with document masking (inputs, targets, positions)
    Batch = tuple[torch.Tensor, ...]

# Domain-separation tags for the shuffling RNG streams (arbitrary constants, like llm.q's 0x73653753).
_FILE_ORDER_TAG = 0x73653753
_CHUNK_ORDER_TAG = 0x636E6B73


def file_order(seed: int, epoch: int, num_files: int, *, shuffle: bool = True) -> np.ndarray:
    """The order an epoch serves the files in: a permutation seeded from (seed, epoch), or as given."""
    if not shuffle:
        return np.arange(num_files)
    return np.random.default_rng([int(seed) % 2**64, int(epoch), _FILE_ORDER_TAG]).permutation(num_files)


def position_error(state: Mapping[str, Any], file_tokens: Sequence[int], seq_len: int, *,
                   shuffle: bool = True) -> str | None:
    """Why a saved position (`TokenLoader.state_dict`) is no position in files of these token counts cut into
    `seq_len` chunks, or None. `chunk_index` counts the sequences of the current file each of the saved `world`
    ranks consumed: at most that file's chunks per rank (it equals them once the file is done and the next batch
    has not started the next file yet)."""
    n, fi, ci, world = len(file_tokens), int(state["file_index"]), int(state["chunk_index"]), int(state["world"])
    if fi > n or (fi == n and ci):
        return f"file_index {fi} is past the {n} training file(s)"
    if fi == n:
        return None
    f = int(file_order(state["seed"], state["epoch"], n, shuffle=shuffle)[fi])
    per_rank = max(file_tokens[f] - 1, 0) // seq_len // world
    if ci > per_rank:
        return (f"chunk_index {ci} is past the {per_rank} sequence(s) of {seq_len} tokens each of {world} rank(s) "
                f"takes from training file {f}")
    return None


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
        document_masking: bool = False,
        eos_ids: Sequence[int] = (),
    ) -> None:
        """`document_masking`: batches carry position ids of the files' documents (module docstring); `eos_ids`: the
        model's EOS id(s), where a file neither records its documents nor says its own EOS (`data/documents.py`)."""
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside world of size {world}")
        self.seq_len = seq_len
        self.rank, self.world = rank, world
        self.seed = int(seed)
        self.shuffle = shuffle
        self.files = [TokenFile(p) for p in check_token_sets(expand_files(pattern_or_files))]

        # files of one tokenizer may label their vocab differently (llm.q vs qtrain): see VOCAB_FAMILIES
        self.vocab_size: int | None = common_vocab_size([f.header for f in self.files])
        if model_vocab_size is not None and self.vocab_size is not None and self.vocab_size > model_vocab_size:
            bad = max(self.files, key=lambda f: f.header.vocab_size or 0)
            raise DataError(
                f"{bad.path}: token file vocab size {self.vocab_size} exceeds the model's vocab size {model_vocab_size}"
            )
        if model_vocab_size is not None:  # every id must index the embedding (scan cached per file)
            for f in self.files:
                check_token_ids(f.path, model_vocab_size)
        self._id_limit = model_vocab_size  # what each batch's ids are checked against (negative ones always)
        self.documents = [file_documents(f, eos_ids) for f in self.files] if document_masking else None
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
        return file_order(self.seed, epoch, len(self.files), shuffle=self.shuffle)

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

    def _windows(self, chunks: Sequence[tuple[int, int]]) -> tuple[np.ndarray, ...]:
        """(inputs, targets[, positions]) int64 [len(chunks), T] of (file index, chunk) pairs. Chunk c of a file is
        the window tokens[cT : cT+T+1]: inputs its first T, targets its last T. The windows' ids are checked with one
        min/max against the vocabulary (the files changed since the preflight's scan otherwise). With document
        masking, the positions, and the targets that cross a document boundary ignored (`data/documents.py`)."""
        T = self.seq_len
        windows = np.empty((len(chunks), T + 1), dtype="<i4")
        for row, (fi, chunk) in enumerate(chunks):
            self.files[fi].read_into(chunk * T, windows[row])
        if windows.size and (windows.min() < 0 or (self._id_limit is not None and windows.max() >= self._id_limit)):
            self._bad_id(windows, chunks)
        inputs, targets = windows[:, :-1].astype(np.int64), windows[:, 1:].astype(np.int64)
        for row, (fi, chunk) in enumerate(chunks):
            f = self.files[fi]
            if f.header.has_masks:
                # Mask bit at the *target* position: bit (cT+j+1) decides whether target j is trained.
                # (llm.q reads bit cT+j, an off-by-one; see reference/llmq.md §2.1 [quirk].)
                targets[row, ~f.mask_bits(chunk * T + 1, chunk * T + T + 1)] = IGNORE_INDEX
        if self.documents is None:
            return inputs, targets
        positions = np.empty_like(inputs)
        for row, (fi, chunk) in enumerate(chunks):
            positions[row], crossing = self.documents[fi].chunk(chunk * T, windows[row])
            targets[row, crossing] = IGNORE_INDEX
        return inputs, targets, positions

    def _bad_id(self, windows: np.ndarray, chunks: Sequence[tuple[int, int]]) -> None:
        limit = self._id_limit
        bad = (windows < 0) | (windows >= limit) if limit is not None else windows < 0
        row, col = (int(i) for i in np.argwhere(bad)[0])
        fi, chunk = chunks[row]
        offset = chunk * self.seq_len + col
        raise DataChangedError(f"{self.files[fi].path}: token id {int(windows[row, col])} at token offset {offset} "
                               f"is outside the vocabulary [0, {limit}): the file changed after the run checked it")

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

    def next_batch(self, batch_size: int) -> Batch:
        """Next ``(inputs, targets)`` (with document masking ``(inputs, targets, positions)``), int64 CPU tensors of
        shape [batch_size, seq_len]."""
        import torch

        if batch_size > self.chunks_per_epoch:
            raise DataError(
                f"{self.files[0].path}: batch of {batch_size} sequences is larger than the "
                f"{self.chunks_per_epoch} sequences per epoch this rank gets"
            )
        if not self.has_next(batch_size):
            self.advance_epoch()
        order = self._file_order(self.epoch)
        chunks = []
        for _ in range(batch_size):
            while self._chunk_pos >= self._per_rank[order[self._file_pos]]:
                self._file_pos += 1
                self._chunk_pos = 0
            fi = int(order[self._file_pos])
            chunks.append((fi, int(self._rank_chunks(self.epoch, fi)[self._chunk_pos])))
            self._chunk_pos += 1
        return tuple(torch.from_numpy(a) for a in self._windows(chunks))

    def next_batches(self, batch_size: int, count: int) -> list[Batch]:
        """`count` batches (one step's micro-batches), all or none: on a DataChangedError the position is back
        where it was, so a checkpoint written then resumes at this step's first batch."""
        start = self.state_dict()
        try:
            return [self.next_batch(batch_size) for _ in range(count)]
        except DataChangedError:
            self.load_state_dict(start)
            raise

    def iterate_eval_batches(
        self, batch_size: int, max_batches: int | None = None, *, drop_last: bool = False
    ) -> Iterator[Batch]:
        """One pass over the files in order, unshuffled (rank r takes chunks r, r+W, ... of each file).

        Independent of the training position (it does not touch the loader's state). The last batch
        may be smaller than ``batch_size`` unless ``drop_last``; its size is the same on every rank.
        """
        import torch

        pending: list[tuple[int, int]] = []
        produced = 0

        def emit() -> Batch:
            arrays = self._windows(pending)
            pending.clear()
            return tuple(torch.from_numpy(a) for a in arrays)

        for fi, count in enumerate(self._per_rank):
            for k in range(count):
                if max_batches is not None and produced >= max_batches:
                    return
                pending.append((fi, self.rank + k * self.world))
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

    def load_state_dict(self, state: dict[str, int]) -> int:
        """Restore a position; the seed comes from the state (as in llm.q). Returns the sequences skipped.

        Across world sizes (a checkpoint of N ranks resumed on M) the position carried over is the *global*
        one: (epoch, file position, sequences of the current file consumed by all ranks together = chunk
        index x N). Rank r of W serves the file's shuffled chunks r, r+W, ..., so the first k*W chunks of the
        shuffled order are exactly what W ranks consumed after k each, whatever W: resuming at chunk index
        k*N/M on M ranks continues with the same global batches (the same sequences, spread over other
        ranks). When k*N is not a multiple of M (a batch that ended inside a file boundary), the position is
        rounded up to the next multiple and the few sequences in between (< M) are skipped: the count is
        returned. What stays world-dependent is only the tail each file drops so ranks stay in step (its
        last C mod W chunks): from the next file on, the M-rank run drops C mod M instead of C mod N.
        """
        file_pos, chunk_pos = int(state["file_index"]), int(state["chunk_index"])
        if not 0 <= file_pos <= len(self.files):
            raise DataError(f"{self.files[0].path}: loader state file_index {file_pos} out of range")
        if chunk_pos < 0:
            raise DataError(f"{self.files[0].path}: loader state chunk_index {chunk_pos} is negative")
        saved_world = int(state.get("world", self.world))
        if saved_world < 1:
            raise DataError(f"{self.files[0].path}: loader state world {saved_world} is not a world size")
        if why := position_error({**state, "world": saved_world}, [len(f) for f in self.files], self.seq_len,
                                  shuffle=self.shuffle):
            raise DataError(f"{self.files[0].path}: loader state {why}")
        consumed = chunk_pos * saved_world  # sequences of the current file all ranks consumed
        chunk_pos = -(-consumed // self.world)
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self._file_pos, self._chunk_pos = file_pos, chunk_pos
        self._order_cache = {}
        return chunk_pos * self.world - consumed
