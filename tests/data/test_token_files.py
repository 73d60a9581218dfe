"""Token file format and TokenLoader: round trips, hand-computed chunks, masks, shuffling, ranks, resume, errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from qtrain.data.token_files import HEADER_BYTES, IGNORE_INDEX, DataError, read_token_file, read_token_file_header, write_token_file
from qtrain.data.loader import TokenLoader


def raw_header(n: int, *, magic: bytes = b"BIN.TOK\n", version: int = 2, bpt: int = 4, vocab: int = 1000, masks: int = 0, filler: bytes = b"\0") -> bytes:
    """A header built by hand, independent of the writer (llm.q's writer pads with '*')."""
    fields = np.array([version, bpt, n, vocab, masks], dtype="<i4").tobytes()
    head = magic + fields
    return head + filler * (HEADER_BYTES - len(head))


def write_raw(path: Path, tokens: np.ndarray, **kw) -> Path:
    path.write_bytes(raw_header(len(tokens), **kw) + tokens.astype("<i4").tobytes())
    return path


# ------------------------------------------------------------------------------------------------
# format


def test_round_trip_plain(tmp_path: Path) -> None:
    toks = np.random.default_rng(0).integers(0, 50257, size=1001)
    p = write_token_file(tmp_path / "a.bin", toks, vocab_size=50257)
    h = read_token_file_header(p)
    assert (h.version, h.bytes_per_token, h.num_tokens, h.vocab_size, h.has_masks) == (2, 4, 1001, 50257, False)
    raw = Path(p).read_bytes()
    assert raw[:8] == b"BIN.TOK\n" and len(raw) == 1024 + 4 * 1001
    assert np.array_equal(np.frombuffer(raw[1024:], dtype="<i4"), toks)
    got, masks = read_token_file(p)
    assert np.array_equal(got, toks) and masks is None
    assert not list(tmp_path.glob("*.tmp*"))  # atomic write leaves nothing behind


def test_round_trip_masks_lsb_first(tmp_path: Path) -> None:
    toks = np.arange(13)
    masks = np.array([1, 0, 0, 1, 1, 1, 0, 1, 0, 1, 1, 0, 1], dtype=bool)
    p = write_token_file(tmp_path / "m.bin", toks, vocab_size=100, masks=masks)
    h = read_token_file_header(p)
    assert h.has_masks and h.file_size == 1024 + 13 * 4 + 2
    tail = Path(p).read_bytes()[1024 + 52 :]
    # bit i of byte i//8, LSB first: byte0 = 1+8+16+32+128, byte1 = 2+4+16
    assert tail == bytes([0b10111001, 0b00010110])
    got, got_masks = read_token_file(p)
    assert np.array_equal(got, toks) and np.array_equal(got_masks, masks)


def test_reads_v1_and_star_filled_headers(tmp_path: Path) -> None:
    toks = np.arange(50)
    v1 = write_raw(tmp_path / "v1.bin", toks, version=1, vocab=0)
    h = read_token_file_header(v1)
    assert h.version == 1 and h.vocab_size is None
    star = write_raw(tmp_path / "star.bin", toks, filler=b"*")
    assert read_token_file_header(star).vocab_size == 1000
    # v1 files (no vocab to disagree with) mix with v2 files
    loader = TokenLoader([v1, star], 7, model_vocab_size=1000, shuffle=False)
    assert loader.vocab_size == 1000
    x, y = loader.next_batch(1)
    assert x.tolist() == [list(range(7))] and y.tolist() == [list(range(1, 8))]


def test_writer_rejects_out_of_range_ids(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="bad.bin"):
        write_token_file(tmp_path / "bad.bin", [1, 2, 100], vocab_size=100)
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------------------------------------
# loader


def test_chunking_matches_hand_computation(tmp_path: Path) -> None:
    toks = np.arange(100, 123)  # N = 23, T = 5 -> (23-1)//5 = 4 chunks, tokens 121,122 only as last target/dropped
    p = write_token_file(tmp_path / "t.bin", toks, vocab_size=200)
    loader = TokenLoader(str(p), 5, shuffle=False)
    assert loader.chunks_per_epoch == 4 and loader.num_tokens == 23
    x, y = loader.next_batch(3)
    assert x.dtype == torch.int64 and y.dtype == torch.int64 and x.shape == (3, 5)
    assert x.tolist() == [[100, 101, 102, 103, 104], [105, 106, 107, 108, 109], [110, 111, 112, 113, 114]]
    assert y.tolist() == [[101, 102, 103, 104, 105], [106, 107, 108, 109, 110], [111, 112, 113, 114, 115]]
    assert loader.progress == pytest.approx(0.75)
    assert not loader.has_next(3)  # one chunk left: dropped, next call starts epoch 1
    x, _ = loader.next_batch(3)
    assert loader.epoch == 1 and x[0].tolist() == [100, 101, 102, 103, 104]


def test_shuffled_epoch_serves_every_chunk_once(tmp_path: Path) -> None:
    T = 4
    toks = np.arange(4 * 10 + 1)
    loader = TokenLoader(write_token_file(tmp_path / "t.bin", toks, vocab_size=100), T, seed=7)
    firsts = []
    for _ in range(5):
        x, y = loader.next_batch(2)
        for xi, yi in zip(x, y):
            c = int(xi[0]) // T
            assert xi.tolist() == list(range(c * T, c * T + T)) and yi.tolist() == list(range(c * T + 1, c * T + T + 1))
            firsts.append(c)
    assert sorted(firsts) == list(range(10)) and firsts != list(range(10))


def test_mask_applies_at_target_position(tmp_path: Path) -> None:
    toks = np.arange(17)
    keep = np.ones(17, dtype=bool)
    keep[[0, 3, 4, 9, 16]] = False
    loader = TokenLoader(write_token_file(tmp_path / "m.bin", toks, vocab_size=50, masks=keep), 4, shuffle=False)
    x, y = loader.next_batch(4)
    # target j of chunk c is token 4c+j+1; it is dropped iff that token's mask bit is 0
    expected = [[t if keep[t] else IGNORE_INDEX for t in range(4 * c + 1, 4 * c + 5)] for c in range(4)]
    assert y.tolist() == expected
    assert y.tolist()[0] == [1, 2, IGNORE_INDEX, IGNORE_INDEX]  # tokens 3, 4 masked; token 0 irrelevant
    assert x.tolist()[0] == [0, 1, 2, 3]  # inputs are never masked


def _epoch_batches(loader: TokenLoader, batch: int) -> list[list[list[int]]]:
    out = []
    start = loader.epoch
    while loader.has_next(batch) and loader.epoch == start:
        out.append(loader.next_batch(batch)[0].tolist())
    return out


def _files(tmp_path: Path, sizes: list[int], vocab: int = 10_000) -> list[str]:
    paths, base = [], 0
    for i, n in enumerate(sizes):
        paths.append(write_token_file(tmp_path / f"f{i}.bin", np.arange(base, base + n), vocab_size=vocab))
        base += n
    return paths


def test_shuffling_deterministic_per_seed(tmp_path: Path) -> None:
    files = _files(tmp_path, [81, 41, 121])
    pattern = str(tmp_path / "f*.bin")
    a = _epoch_batches(TokenLoader(pattern, 8, seed=1), 2)
    b = _epoch_batches(TokenLoader(pattern, 8, seed=1), 2)
    c = _epoch_batches(TokenLoader(pattern, 8, seed=2), 2)
    assert a == b and a != c
    loader = TokenLoader(files, 8, seed=1)
    e0 = _epoch_batches(loader, 2)
    loader.advance_epoch()
    assert _epoch_batches(loader, 2) != e0


def test_ranks_get_disjoint_strided_shares(tmp_path: Path) -> None:
    T, W = 4, 3
    files = _files(tmp_path, [4 * 11 + 1, 4 * 7 + 3, 4 * 3 + 1])  # 11, 7, 3 chunks: tails 2, 1, 0 dropped
    full = TokenLoader(files, T, seed=5)
    per_rank = []
    for r in range(W):
        loader = TokenLoader(files, T, rank=r, world=W, seed=5)
        assert loader.chunks_per_epoch == 3 + 2 + 1
        per_rank.append([int(row[0]) for b in _epoch_batches(loader, 1) for row in b])
    sets = [set(s) for s in per_rank]
    assert all(len(s) == 6 for s in sets) and not (sets[0] & sets[1]) and not (sets[1] & sets[2]) and not (sets[0] & sets[2])
    # The union is world=1's shuffled chunk order of each file minus its last (C mod W) entries.
    expected = set()
    for fi, (f, c) in enumerate(zip(full.files, [11, 7, 3])):
        order = full._rank_chunks(0, fi)
        expected |= {int(f.read(k * T, k * T + 1)[0]) for k in order[: c - c % W]}
    assert set().union(*sets) == expected
    # rank r takes positions r, r+W, ... of that order within each file
    r1 = TokenLoader(files, T, rank=1, world=W, seed=5)
    assert list(r1._rank_chunks(0, 0)) == list(full._rank_chunks(0, 0)[1::W][:3])


def test_state_dict_resume_gives_identical_batches(tmp_path: Path) -> None:
    files = _files(tmp_path, [81, 41, 121])
    ref = TokenLoader(files, 8, seed=3, rank=1, world=2)
    for _ in range(5):
        ref.next_batch(3)
    state, progress = ref.state_dict(), ref.progress
    expected = [ref.next_batch(3) for _ in range(12)]  # crosses files and an epoch boundary
    assert ref.epoch >= 1
    resumed = TokenLoader(files, 8, seed=999, rank=1, world=2)
    resumed.load_state_dict(dict(state))
    assert resumed.seed == 3 and resumed.progress == pytest.approx(progress) and 0 < progress < 1
    for ex, got in zip(expected, (resumed.next_batch(3) for _ in range(12))):
        assert torch.equal(ex[0], got[0]) and torch.equal(ex[1], got[1])
    with pytest.raises(DataError, match="chunk_index -1 is negative"):
        TokenLoader(files, 8, world=1).load_state_dict({**state, "chunk_index": -1})


def _global_batches(files: list[str], world: int, global_batch: int, steps: int, state: dict | None = None
                    ) -> tuple[list[set[int]], dict, int]:
    """The global batches (sets of chunk first tokens) that `world` ranks serve in `steps` steps, each rank
    taking global_batch / world sequences a step (from `state` if given); also rank 0's state after them and
    the sequences the resume skipped."""
    loaders = [TokenLoader(files, 8, seed=3, rank=r, world=world) for r in range(world)]
    skipped = {ld.load_state_dict(dict(state)) for ld in loaders} if state is not None else {0}
    out = []
    for _ in range(steps):
        out.append({int(x) for ld in loaders for x in ld.next_batch(global_batch // world)[0][:, 0]})
    return out, loaders[0].state_dict(), skipped.pop()


@pytest.mark.parametrize("old,new", [(2, 1), (1, 2), (2, 4), (4, 2)], ids=lambda x: str(x))
def test_position_carries_across_world_sizes_as_global_sequences(tmp_path: Path, old: int, new: int) -> None:
    """A state saved by `old` ranks resumed on `new`: the same global batches as the uninterrupted `old`-rank
    run until its current file ends (one big file here: 60 chunks, 12 steps of 4), and `skipped` is 0."""
    files = _files(tmp_path, [8 * 60 + 1])
    ref, _, _ = _global_batches(files, old, 4, 12)
    _, state, _ = _global_batches(files, old, 4, 5)
    assert state["world"] == old and state["chunk_index"] == 5 * 4 // old
    resumed, _, skipped = _global_batches(files, new, 4, 7, state)
    assert skipped == 0 and resumed == ref[5:]
    # and the batches are the shuffled order's next runs of 4 (not the same batch again, not a gap)
    assert len(set().union(*ref)) == 48


def test_position_not_on_the_new_world_grid_skips_fewer_than_world(tmp_path: Path) -> None:
    """3 ranks stopped after 1 sequence each of a file (3 consumed); 2 ranks resume at 4: one skipped."""
    files = _files(tmp_path, [8 * 30 + 1])
    loader = TokenLoader(files, 8, seed=3, rank=0, world=2)
    assert loader.load_state_dict({"seed": 3, "epoch": 0, "file_index": 0, "chunk_index": 1, "world": 3}) == 1
    assert loader.state_dict()["chunk_index"] == 2


def test_eval_iteration_in_order(tmp_path: Path) -> None:
    files = _files(tmp_path, [4 * 5 + 1, 4 * 2 + 1])  # 5 + 2 chunks
    loader = TokenLoader(files, 4, seed=1)
    loader.next_batch(2)
    before = loader.state_dict()
    batches = list(loader.iterate_eval_batches(3))
    assert [b[0].shape[0] for b in batches] == [3, 3, 1]
    firsts = [int(r[0]) for b in batches for r in b[0]]
    assert firsts == [0, 4, 8, 12, 16, 21, 25]
    assert len(list(loader.iterate_eval_batches(3, max_batches=2))) == 2
    assert len(list(loader.iterate_eval_batches(3, drop_last=True))) == 2
    assert loader.state_dict() == before
    r1 = TokenLoader(files, 4, rank=1, world=2)
    assert [int(r[0]) for b in r1.iterate_eval_batches(8) for r in b[0]] == [4, 12, 25]


# ------------------------------------------------------------------------------------------------
# errors: every one names the file


@pytest.mark.parametrize(
    "case",
    ["magic", "version", "bpt", "truncated", "truncated_masks", "oversized", "short_header", "vocab", "too_short"],
)
def test_bad_files_raise_data_error_naming_file(tmp_path: Path, case: str) -> None:
    p = tmp_path / f"bad_{case}.bin"
    toks = np.arange(64)
    if case == "magic":
        write_raw(p, toks, magic=b"BIN.TOX\n")
    elif case == "version":
        write_raw(p, toks, version=3)
    elif case == "bpt":
        write_raw(p, toks, bpt=2)
    elif case == "truncated":
        write_raw(p, toks)
        p.write_bytes(p.read_bytes()[:-5])
    elif case == "truncated_masks":
        p.write_bytes(raw_header(64, masks=1) + toks.astype("<i4").tobytes() + b"\xff" * 7)  # needs 8
    elif case == "oversized":
        write_raw(p, toks)
        p.write_bytes(p.read_bytes() + b"\0\0\0\0")
    elif case == "short_header":
        p.write_bytes(b"BIN.TOK\n" + b"\0" * 100)
    elif case == "vocab":
        write_raw(p, toks, vocab=50257)
    elif case == "too_short":
        write_raw(p, np.arange(16))  # 16 tokens < seq_len + 1 = 17
    with pytest.raises(DataError) as info:
        TokenLoader(str(p), 16, model_vocab_size=32000)
    assert str(p) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_no_matching_files_and_mixed_vocab(tmp_path: Path) -> None:
    pattern = str(tmp_path / "nothing-*.bin")
    with pytest.raises(DataError, match="nothing-"):
        TokenLoader(pattern, 8)
    a = write_token_file(tmp_path / "a.bin", np.arange(40), vocab_size=100)
    b = write_token_file(tmp_path / "b.bin", np.arange(40), vocab_size=200)
    with pytest.raises(DataError) as info:
        TokenLoader(str(tmp_path / "*.bin"), 8)
    assert a in str(info.value) and b in str(info.value)


def test_tokenizer_tag_round_trip_and_what_llmq_reads(tmp_path: Path) -> None:
    toks = np.arange(30)
    plain = write_token_file(tmp_path / "plain.bin", toks, vocab_size=151665)
    tagged = write_token_file(tmp_path / "tagged.bin", toks, vocab_size=151665, tokenizer="qwen2")
    assert read_token_file_header(tagged).tokenizer == "qwen2" and read_token_file_header(plain).tokenizer is None
    a, b = Path(plain).read_bytes(), Path(tagged).read_bytes()
    assert a[:512] == b[:512] and a[HEADER_BYTES:] == b[HEADER_BYTES:]  # llm.q reads ints 0..6 and the tokens only
    assert b[512:530] == b"tokenizer=qwen2\0\0\0"
    star = write_raw(tmp_path / "star.bin", toks, filler=b"*")  # llm.q's writer: '*' filler, no tag
    assert read_token_file_header(star).tokenizer is None
    long = write_token_file(tmp_path / "long.bin", toks, vocab_size=100, tokenizer="/x" * 400)
    assert read_token_file_header(long).tokenizer is None  # too long for the header: unlabelled, still valid
    assert read_token_file(long)[0].tolist() == toks.tolist()


def test_files_of_one_tokenizer_from_llmq_and_qtrain_mix(tmp_path: Path) -> None:
    # llm.q labels Qwen2 files 151643 (HF's tokenizer.vocab_size, without the specials), qtrain 151665; both hold
    # EOS = 151643
    llmq = write_raw(tmp_path / "train-llmq.bin", np.r_[np.arange(20), 151643, np.arange(20)], vocab=151643,
                     filler=b"*")
    ours = write_token_file(tmp_path / "train-qtrain.bin", np.r_[np.arange(100, 140), 151643], vocab_size=151665,
                            tokenizer="qwen2")
    loader = TokenLoader(str(tmp_path / "train-*.bin"), 8, model_vocab_size=151936, shuffle=False)
    assert loader.vocab_size == 151665  # the family's largest: any of its ids may occur
    x = torch.cat([b for b, _ in loader.iterate_eval_batches(4)])
    assert {int(v) for v in x.flatten()} >= {0, 100, 151643}  # batches from both files
    with pytest.raises(DataError, match="exceeds the model's vocab size 151000"):
        TokenLoader(str(tmp_path / "train-*.bin"), 8, model_vocab_size=151000)
    # a real mismatch (GPT-2 and Qwen2 files) is still refused, naming every file
    gpt2 = write_token_file(tmp_path / "train-zgpt2.bin", np.arange(40), vocab_size=50257)
    with pytest.raises(DataError, match="different vocab sizes") as info:
        TokenLoader(str(tmp_path / "train-*.bin"), 8)
    assert all(str(p) in str(info.value) for p in (llmq, ours, gpt2))


def test_glob_is_sorted(tmp_path: Path) -> None:
    for name, base in (("train-002.bin", 200), ("train-000.bin", 0), ("train-001.bin", 100)):
        write_token_file(tmp_path / name, np.arange(base, base + 9), vocab_size=1000)
    loader = TokenLoader(str(tmp_path / "train-*.bin"), 8, shuffle=False)
    assert [os.path.basename(f.path) for f in loader.files] == ["train-000.bin", "train-001.bin", "train-002.bin"]
    assert [int(r[0]) for r in loader.next_batch(3)[0]] == [0, 100, 200]


# ------------------------------------------------------------------------------------------------
# token id range check, memory-mapped and cached per file


@pytest.mark.parametrize("bad_id", [-1, 32000, 2**31 - 1])
def test_out_of_range_id_is_named_with_its_offset(tmp_path: Path, bad_id: int) -> None:
    from qtrain.data import token_scan as ts

    toks = np.arange(5000) % 32000
    toks[3217] = bad_id
    toks[4000] = bad_id
    p = write_raw(tmp_path / "ids.bin", toks, vocab=32000)  # the header looks fine: only the ids are wrong
    with pytest.raises(DataError) as info:
        TokenLoader(str(p), 16, model_vocab_size=32000)
    msg = str(info.value)
    assert str(p) in msg and f"token id {bad_id} at token offset 3217" in msg
    assert f"(byte {HEADER_BYTES + 4 * 3217})" in msg and "2 such id(s)" in msg
    assert ts.scan_token_ids(p) == (min(0, bad_id), max(4999, bad_id))  # the other ids are 0..4999


def test_scan_spans_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunked scan finds an id in a later chunk and reports its absolute offset."""
    from qtrain.data import token_scan as ts

    monkeypatch.setattr(ts, "SCAN_CHUNK_TOKENS", 1000)
    toks = np.zeros(4500, dtype=np.int64)
    toks[3999] = 77
    p = write_raw(tmp_path / "c.bin", toks, vocab=100)
    with pytest.raises(DataError, match="token id 77 at token offset 3999"):
        ts.check_token_ids(p, 50)
    ts.check_token_ids(p, 78)


def test_scan_result_is_cached_per_file_and_invalidated_by_changes(tmp_path: Path) -> None:
    from qtrain.data import token_scan as ts

    p = write_token_file(tmp_path / "a.bin", np.arange(100), vocab_size=1000)
    assert ts.scan_token_ids(p) == (0, 99)
    cache, ident = ts._scan_key(p)
    entry = json.loads(cache.read_text())
    assert entry["min"] == 0 and entry["max"] == 99 and entry["path"] == os.path.realpath(p)
    # the cached answer is used without reading the tokens: a doctored entry proves it
    cache.write_text(json.dumps({**entry, "max": 12345}))
    assert ts.scan_token_ids(p) == (0, 12345)
    # a rewritten file (new size / mtime / inode) is scanned again
    write_token_file(tmp_path / "a.bin", np.arange(7, 300), vocab_size=1000)
    assert ts.scan_token_ids(p) == (7, 299)
    assert json.loads(cache.read_text())["max"] == 299


def test_unwritable_cache_only_costs_a_rescan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from qtrain.data import token_scan as ts

    (tmp_path / "cache").write_text("a file where the cache dir should be")
    monkeypatch.setenv("QTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    p = write_token_file(tmp_path / "a.bin", np.arange(10), vocab_size=1000)
    assert ts.scan_token_ids(p) == (0, 9)
    ts.check_token_ids(p, 10)
