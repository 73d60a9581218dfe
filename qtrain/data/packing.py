"""`qtrain tokenize --pack-to N`: SFT / chat examples bin-packed into rows of exactly N tokens, with their loss masks
and their boundaries recorded (token_files.py's documents section), for training with --seq-len N and
--document-masking.

How: examples are gathered in windows of about PACK_WINDOW_TOKENS tokens (input order; the last window holds the
rest) and each window is packed by first-fit decreasing: longest example first, each into the first row it fits in
(a segment tree over the rows' free space finds it in log time), a new row when none has room. A row holds whole
examples only, longest first; the rest of a row that no example fits is padding: the EOS id under mask 0, recorded
as a document of its own, so it attends to nothing real and nothing attends to it (and it is never a target).
The padding is counted in the summary. An example longer than N is cut to its first N - 1 tokens and its last (the
EOS stays, no longer a target: `cut_to`), as --pad-to cuts, and counted; with --no-truncate it is refused
(`sft.encode_example`, naming its file and line or row). Rows come out in the order their first example was placed,
and the files end with one extra token (EOS, mask 0, a document of its own) so that a file of R rows is exactly R
loader chunks of N tokens (`tokenize.ShardedWriter`'s alignment, as with --pad-to). The output depends only on the
input and N.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

PACK_WINDOW_TOKENS = 1 << 24  # tokens of examples packed together: ~80 MB of tokens and masks in memory


class RowSink(Protocol):
    def write(self, tokens: np.ndarray, masks: np.ndarray | None = None, starts: np.ndarray | None = None) -> None: ...


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of first-fit decreasing: the items (indices into `lengths`, each <= capacity) longest first (ties in
    index order), each into the first bin with room, in the order each bin was opened."""
    n = len(lengths)
    size = 1
    while size < max(n, 1):
        size *= 2
    free = [capacity] * (2 * size)  # free[node]: the most room in a bin under node; leaves are bins, unopened full
    bins: list[list[int]] = []
    for i in sorted(range(n), key=lambda j: (-lengths[j], j)):
        need, node = lengths[i], 1
        while node < size:  # the leftmost leaf with room
            node = 2 * node if free[2 * node] >= need else 2 * node + 1
        b = node - size
        if b == len(bins):
            bins.append([])
        bins[b].append(i)
        free[node] -= need
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return bins


def cut_to(tokens: np.ndarray, mask: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """An example longer than n: its first n - 1 tokens and its last (the EOS stays, as the boundary to what follows),
    the EOS under mask 0: the example did not end where it was cut, so the model must not learn to stop there (with
    the cut inside a prompt, the EOS right after it was the example's only target). --pad-to cuts the same way."""
    keep = np.r_[0:n - 1, tokens.size - 1]
    cut_mask = mask[keep]
    cut_mask[-1] = False
    return tokens[keep], cut_mask


@dataclass
class PackStats:
    rows: int = 0
    examples: int = 0
    padding: int = 0  # tokens of padding in the rows
    truncated: int = 0  # examples cut to the row length

    def add(self, other: "PackStats") -> None:
        self.rows += other.rows
        self.examples += other.examples
        self.padding += other.padding
        self.truncated += other.truncated


@dataclass
class Packer:
    """Gathers one split's examples and writes them packed (module docstring) to `sink`, row by row; `flush()` at
    the end packs what is left."""
    sink: RowSink
    row_tokens: int
    pad_id: int
    window_tokens: int = PACK_WINDOW_TOKENS
    stats: PackStats = field(default_factory=PackStats)
    _examples: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    _held: int = 0

    def write(self, tokens: np.ndarray, mask: np.ndarray | None) -> None:
        if mask is None:
            raise ValueError("packing needs loss-masked examples")
        if tokens.size > self.row_tokens:
            tokens, mask = cut_to(tokens, mask, self.row_tokens)
            self.stats.truncated += 1
        if tokens.size == 0:
            return
        self._examples.append((tokens, mask))
        self._held += tokens.size
        if self._held >= self.window_tokens:
            self.flush()

    def flush(self) -> None:
        N = self.row_tokens
        for row in first_fit_decreasing([t.size for t, _ in self._examples], N):
            parts = [self._examples[i] for i in row]
            lengths = [t.size for t, _ in parts]
            pad = N - sum(lengths)
            starts = np.cumsum([0, *lengths])[:len(parts) + (pad > 0)]
            tokens = np.concatenate([t for t, _ in parts] + [np.full(pad, self.pad_id, dtype=np.int32)])
            masks = np.concatenate([m for _, m in parts] + [np.zeros(pad, dtype=bool)])
            self.sink.write(tokens, masks, starts)
            self.stats.rows += 1
            self.stats.examples += len(parts)
            self.stats.padding += pad
        self._examples, self._held = [], 0
