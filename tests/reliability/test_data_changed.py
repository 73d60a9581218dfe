"""A token file changed under a running run (issue 41, item 11): cut short in place, or ids written out of range
in place (with its mtime put back, too). A real `qtrain train` subprocess is changed under after its first
logged step; it must stop like a signal: a checkpoint of the last good step, one line naming the file and the
token offset, exit code 5, no traceback (before: SIGBUS from the memory map; an IndexError naming nothing).
In-process: the loader's own refusal, and the id-scan cache that must not outlive an edit whose mtime was
restored (before: keyed on size, mtime and inode only, so the edit passed the preflight and crashed at step 0).
"""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest

from qtrain.data import token_scan as ts
from qtrain.data.loader import TokenLoader
from qtrain.data.token_files import HEADER_BYTES, DataChangedError, DataError, write_token_file
from qtrain.observe.log import read_log
from qtrain.train import checkpoint_io as cio
from qtrain.train.stop import DATA_CHANGED_EXIT
from tests.run_utils import CFG, make_run_root, qtrain_popen, train_argv

V = CFG.vocab_size
TOKENS = 4000


def _poke_all(path: Path, value: int) -> None:
    """Every token id of `path` set to `value`, in place (same inode, same size)."""
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES)
        f.write(np.full(TOKENS, value, dtype="<i4").tobytes())


def _truncate(path: Path) -> None:
    os.truncate(path, HEADER_BYTES + 4 * 20)  # 20 of 4000 tokens left: almost every chunk lies past the end


def _poke_keep_mtime(path: Path) -> None:
    st = os.stat(path)
    _poke_all(path, V + 7)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


CHANGES = {"truncated": _truncate, "ids-poked": lambda p: _poke_all(p, V + 7), "ids-poked-mtime-kept": _poke_keep_mtime}


@pytest.mark.parametrize("change", list(CHANGES))
def test_change_under_a_live_run_stops_it_with_a_checkpoint(tmp_path: Path, change: str) -> None:
    root = make_run_root(tmp_path, tokens=TOKENS)
    argv = train_argv(root, steps=100_000, ckpt_interval=100_000)  # slow enough: it runs until the file changes
    p = qtrain_popen(argv, cwd=root)
    log = root / "logs" / "run.jsonl"
    try:
        deadline = time.monotonic() + 300
        while p.poll() is None and time.monotonic() < deadline:
            if log.exists() and any(e["log"] == "step" for e in read_log(log)):
                break
            time.sleep(0.05)
        assert p.poll() is None, p.communicate()[1][-3000:]
        CHANGES[change](root / "train.bin")
        out, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == DATA_CHANGED_EXIT, (p.returncode, err[-3000:])
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("qtrain: ")]
    assert len(lines) == 1, err[-3000:]
    m = re.match(r"qtrain: stopped: at step (\d+): (.*)", lines[0])
    assert m, lines[0]
    step, msg = int(m[1]), m[2]
    assert str(root / "train.bin") in msg and "token offset" in msg, msg
    if change != "truncated":
        assert f"token id {V + 7} at token offset" in msg, msg
    # the checkpoint of the last good step: `step` updates done, every logged step before it, the loader at its start
    ckpt = cio.find_checkpoint(root / "ckpt" / "run")
    assert ckpt is not None and cio.checkpoint_step(ckpt) == step and f"checkpoint {ckpt}" in msg, (ckpt, msg)
    meta, files = cio.read_checkpoint(ckpt)
    assert meta["step"] == step and sorted(files.names)
    logged = [e["step"] for e in read_log(log) if e["log"] == "step"]
    assert logged and max(logged) == step - 1
    pos = meta["data_loader"]  # at the start of `step` (batch 2, one file: 2 sequences a step; 124 steps an epoch)
    assert step < 124 and (pos["epoch"], pos["file_index"], pos["chunk_index"]) == (0, 0, 2 * step), pos


def test_loader_refuses_a_file_cut_short_and_ids_out_of_range(tmp_path: Path) -> None:
    p = write_token_file(tmp_path / "a.bin", np.arange(1000) % 50, vocab_size=V)
    loader = TokenLoader(p, 16, model_vocab_size=V, seed=3)
    first = loader.next_batch(4)
    assert first[0].shape == (4, 16)
    state = loader.state_dict()
    os.truncate(p, HEADER_BYTES + 4 * 10)
    with pytest.raises(DataChangedError, match=rf"{re.escape(p)}: changed while being read: token offset \d+ "):
        loader.next_batches(4, 3)
    assert loader.state_dict() == state  # all or nothing: the step's batches are fetched again on resume
    p2 = write_token_file(tmp_path / "b.bin", np.arange(1000) % 50, vocab_size=V)
    loader = TokenLoader(p2, 16, model_vocab_size=V, shuffle=False)
    _poke_at(Path(p2), 40, V)  # chunk 2 (tokens 32..48) holds it; the first batch (chunks 0, 1) does not
    loader.next_batch(2)
    with pytest.raises(DataChangedError, match=rf"token id {V} at token offset 40 is outside the vocabulary"):
        loader.next_batch(2)
    with pytest.raises(DataChangedError, match="token offset 40"):
        list(loader.iterate_eval_batches(4))


def _poke_at(path: Path, offset: int, value: int) -> None:
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 4 * offset)
        f.write(np.int32(value).tobytes())


def test_id_scan_cache_does_not_outlive_an_edit_with_its_mtime_restored(tmp_path: Path) -> None:
    p = Path(write_token_file(tmp_path / "a.bin", np.arange(5000) % V, vocab_size=V))
    ts.check_token_ids(p, V)  # scanned, and cached
    cache, ident = ts._scan_key(p)
    assert json.loads(cache.read_text())["max"] == V - 1
    st = os.stat(p)
    _poke_at(p, 2345, V + 3)  # not at a sampled block: only the ctime tells
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (os.stat(p).st_size, os.stat(p).st_mtime_ns, os.stat(p).st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)
    with pytest.raises(DataError, match=rf"token id {V + 3} at token offset 2345 "):
        ts.check_token_ids(p, V)
    # the same from the CLI's preflight: the edit is refused before the model is built
    with pytest.raises(DataError, match=rf"token id {V + 3} at token offset 2345 "):
        TokenLoader(str(p), 16, model_vocab_size=V)


def test_sampled_digest_sees_an_edit_at_a_sampled_block_and_fingerprint_keys(tmp_path: Path) -> None:
    p = Path(write_token_file(tmp_path / "a.bin", np.arange(100_000) % V, vocab_size=V))
    fp = ts.file_fingerprint(p)
    assert set(fp) == {"size", "mtime_ns", "ctime_ns", "ino", "dev", "digest"} and fp["size"] == p.stat().st_size
    size = fp["size"]
    with open(p, "r+b") as f:  # the 4th interior sample starts at 4/9 of the size
        f.seek(4 * size // 9 + 8)
        f.write(b"\x01\x02\x03\x04")
    assert ts.file_fingerprint(p)["digest"] != fp["digest"]
    copy = tmp_path / "copy.bin"
    copy.write_bytes(p.read_bytes())
    assert ts.file_fingerprint(copy)["digest"] == ts.file_fingerprint(p)["digest"]  # content, not identity
