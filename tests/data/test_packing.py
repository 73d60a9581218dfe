"""`qtrain tokenize --pack-to N` (data/packing.py) and the documents the loader serves with document masking
(data/documents.py): rows of exactly N tokens holding whole examples with their masks, the padding a document of its
own under mask 0, the boundaries recorded in a section llm.q's reader does not see, and per loader chunk the
positions and the targets that cross a boundary (recorded, or after each EOS; a row starts a new document)."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest

from qtrain.cli.main import main
from qtrain.data.documents import FileDocuments
from qtrain.data.loader import TokenLoader
from qtrain.data.packing import first_fit_decreasing
from qtrain.data.token_files import (HEADER_BYTES, IGNORE_INDEX, TokenFile, read_token_file, read_token_file_header,
                                     write_token_file)
from qtrain.data.tokenizers import get_tokenizer


def naive_ffd(lengths, capacity):
    bins, room = [], []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        b = next((k for k, r in enumerate(room) if r >= lengths[i]), None)
        if b is None:
            bins.append([]), room.append(capacity)
            b = len(bins) - 1
        bins[b].append(i)
        room[b] -= lengths[i]
    return bins


@pytest.mark.parametrize("seed", range(4))
def test_first_fit_decreasing_is_first_fit_decreasing(seed):
    rng = random.Random(seed)
    capacity = 64
    lengths = [rng.choice([rng.randint(1, 10), rng.randint(20, 64)]) for _ in range(rng.randint(1, 300))]
    bins = first_fit_decreasing(lengths, capacity)
    assert bins == naive_ffd(lengths, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
    assert first_fit_decreasing([], 8) == []


def write_examples(path, n=60, seed=0, long=()):
    """Prompt/response records of spread lengths; `long`: indices made far longer than any row."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            words = rng.choice([rng.randint(1, 6), rng.randint(6, 30)])
            q = "Q" + str(i) + " " + " ".join(str(rng.randint(0, 999)) for _ in range(rng.randint(1, words)))
            words = 200 if i in long else words
            a = " A" + str(i) + " " + " ".join(str(rng.randint(0, 999)) for _ in range(rng.randint(words, 2 * words)))
            f.write(json.dumps({"q": q, "a": a}) + "\n")
    return str(path)


def test_pack_to_rows_hold_whole_examples_and_record_them(tmp_path, capsys):
    src = write_examples(tmp_path / "qa.jsonl", long=(7,))
    N = 96
    assert main(["tokenize", src, "--out-dir", str(tmp_path / "out"), "--tokenizer", "gpt2", "--prompt-field", "q",
                 "--response-field", "a", "--pack-to", str(N), "--eval-fraction", "0", "--no-progress",
                 "--workers", "1"]) == 0
    out = capsys.readouterr().out
    tok = get_tokenizer("gpt2")
    path = tmp_path / "out" / "train.bin"
    tokens, masks = read_token_file(path)
    f = TokenFile(path)
    starts = f.document_starts()
    rows = (len(tokens) - 1) // N
    assert len(tokens) == rows * N + 1 and starts[-1] == rows * N  # whole rows, then the tail: a document
    assert json.loads((tmp_path / "out" / "qtrain-tokenize.json").read_text())["pack_to"] == N
    # every document is one example (prompt + response + EOS, masks on the response), or a row's padding
    examples = {json.loads(line)["q"]: json.loads(line) for line in open(src)}
    seen, padding = set(), 0
    bounds = list(starts) + [len(tokens)]
    for s, e in zip(bounds[:-2], bounds[1:-1]):
        assert s // N == (e - 1) // N, "a document crosses a row"
        doc, keep = tokens[s:e], masks[s:e]
        if not keep.any():  # padding: EOS only, ends its row
            assert (doc == tok.eos_id).all() and e % N == 0
            padding += e - s
            continue
        text = tok.decode(doc.tolist())
        q = text[:text.index(" A")]
        ex = examples[q]
        seen.add(q)
        if len(doc) == N and q.startswith("Q7 "):
            assert doc[-1] == tok.eos_id and not text.endswith(ex["a"] + "<|endoftext|>")  # cut, EOS kept
        else:
            assert text == ex["q"] + ex["a"] + "<|endoftext|>"
            assert tok.decode(doc[keep].tolist()) == ex["a"] + "<|endoftext|>"
    assert seen == set(examples)
    assert (f"packed 60 examples into {rows} rows of {N} tokens: {padding} padding tokens" in out
            and "1 example(s) longer than 96 cut to it" in out)
    # FFD: the rows are nearly full (whole examples only)
    assert padding < 0.2 * rows * N
    # the loader (chunks in order): row c's positions restart at its recorded starts; a document's last token
    # predicts nothing; the other targets are those the masks keep
    loader = TokenLoader(str(path), N, shuffle=False, document_masking=True)
    x, y, p = (np.concatenate(parts) for parts in zip(*loader.iterate_eval_batches(4)))
    assert len(x) == rows
    for c in range(rows):
        first = starts[(starts >= c * N) & (starts < c * N + N)] - c * N
        assert np.flatnonzero(p[c] == 0).tolist() == first.tolist()
        ends = np.r_[first[1:] - 1, N - 1]
        assert (y[c, ends] == IGNORE_INDEX).all()
        inner = np.setdiff1d(np.arange(N), ends)
        kept = masks[c * N + 1:c * N + N + 1][inner]
        assert ((y[c, inner] != IGNORE_INDEX) == kept).all()


def test_documents_section_leaves_llmq_layout_alone(tmp_path):
    """Tokens and masks sit at the offsets llm.q reads (1024 + 4i, then the mask bytes), whether or not a documents
    section follows; the header differs only in the documents tag (bytes 128..)."""
    rng = np.random.default_rng(0)
    toks, masks = rng.integers(0, 100, 50).astype(np.int32), rng.random(50) < 0.5
    a = write_token_file(tmp_path / "a.bin", toks, vocab_size=100, masks=masks)
    b = write_token_file(tmp_path / "b.bin", toks, vocab_size=100, masks=masks, starts=[0, 10, 31])
    ra, rb = open(a, "rb").read(), open(b, "rb").read()
    assert rb[:128] == ra[:128] and rb[256:len(ra)] == ra[256:] and rb[128:139] == b"documents=3"
    assert np.frombuffer(rb[len(ra):], "<i4").tolist() == [0, 10, 31]
    assert read_token_file_header(b).documents == 3 and read_token_file_header(a).documents == 0
    assert TokenFile(b).document_starts().tolist() == [0, 10, 31] and TokenFile(a).document_starts() is None
    assert np.array_equal(read_token_file(b)[0], toks) and np.array_equal(read_token_file(b)[1], masks)
    assert rb[HEADER_BYTES:HEADER_BYTES + 200] == toks.astype("<i4").tobytes()


def test_eos_documents_and_the_row_cut():
    """After each EOS (id 0): positions restart after it, the target after it is ignored; a row starts a new
    document; a document the row's end cuts keeps its last target."""
    docs = FileDocuments("f", None, (0,))
    window = np.array([5, 0, 7, 8, 0, 9, 9, 9, 4])  # T = 8: inputs window[:8], targets window[1:]
    pos, crossing = docs.chunk(16, window)
    assert pos.tolist() == [0, 1, 0, 1, 2, 0, 1, 2]
    assert crossing.tolist() == [False, True, False, False, True, False, False, False]
    recorded = FileDocuments("f", np.array([0, 5, 17, 20, 24, 30]))
    pos, crossing = recorded.chunk(16, window)  # tokens 16..24: starts 17, 20, 24 (the token after the row)
    assert pos.tolist() == [0, 0, 1, 2, 0, 1, 2, 3]
    assert crossing.tolist() == [True, False, False, True, False, False, False, True]


def test_loader_masks_crossing_targets_and_index_eos(tmp_path, capsys):
    """Plain text tokenized by qtrain (EOS after each document, recorded in the set's index): the loader needs no
    EOS id from the model; positions restart after every EOS."""
    (tmp_path / "t.txt").write_text("one two three\nfour five\nsix seven eight nine ten\n" * 4)
    assert main(["tokenize", str(tmp_path / "t.txt"), "--out-dir", str(tmp_path / "o"), "--tokenizer", "gpt2",
                 "--split-lines", "--eval-fraction", "0", "--no-progress", "--workers", "1"]) == 0
    eos = get_tokenizer("gpt2").eos_id
    loader = TokenLoader(str(tmp_path / "o" / "train.bin"), 8, shuffle=False, document_masking=True)
    for x, y, p in loader.iterate_eval_batches(2):
        x, y, p = x.numpy(), y.numpy(), p.numpy()
        after_eos = np.zeros_like(x, dtype=bool)
        after_eos[:, 1:] = x[:, :-1] == eos
        assert ((p == 0) == (after_eos | (np.arange(8) == 0))).all()
        assert (y[x == eos] == IGNORE_INDEX).all() and (y[x != eos] != IGNORE_INDEX).all()
    plain = TokenLoader(str(tmp_path / "o" / "train.bin"), 8, shuffle=False)
    assert all(len(b) == 2 for b in plain.iterate_eval_batches(2))
