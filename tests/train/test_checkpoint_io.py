"""Checkpoint files: bit-exact round trip, atomicity under failures, --continue lookup, cleanup."""
import json

import pytest
import torch

from qtrain.train import checkpoint_io as cio
from qtrain.train.checkpoint_io import (begin, checkpoint_path, checkpoint_step, clean_old_checkpoints, commit,
                                        find_checkpoint, list_checkpoints, read_checkpoint, remove_stale,
                                        write_checkpoint, write_files)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view, so NaN payloads and -0.0 compare bit for bit."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def sample_files():
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(64, generator=g)  # two views into one buffer, as an offloaded shard would be
    w32 = torch.randn(5, 7, generator=g)
    w32[0, 0], w32[0, 1], w32[0, 2] = float("nan"), float("-inf"), -0.0
    return {
        "weights.shard_000_of_002": {
            "model.embed_tokens.weight": torch.randn(11, 3, generator=g).to(torch.bfloat16),
            "model.layers.0.mlp.up.weight": w32,
            "model.norm.weight": flat[:16].view(4, 4),
            "model.layers.0.self_attn.qkv.bias": flat[16:40],
        },
        "adam.m.shard_000_of_002": {"m": torch.randn(3, 5, generator=g).to(torch.float8_e4m3fn),
                                    "scalar": torch.tensor(2.5)},
        "rng": {"state": torch.arange(-3, 10, dtype=torch.int64) * (2**40), "empty": torch.zeros(0, 4)},
    }


META = {"version": 1, "run": {"step": 100, "rng": [1, 2, 255], "past_losses": {"values": [3.25, 0.1], "index": 1}},
        "data-loader": {"seed": 0x83B45442, "file_name": "train-0.bin"}, "lr": 3e-4, "note": "ünïcode"}


def test_round_trip_bit_exact(tmp_path):
    files = sample_files()
    path = write_checkpoint(tmp_path / "ckpt", 100, files, META)
    assert path == tmp_path / "ckpt" / "step_00000100" and checkpoint_step(path) == 100
    assert sorted(p.name for p in path.iterdir()) == sorted([f"{n}.safetensors" for n in files] + ["checkpoint.json"])
    meta, loader = read_checkpoint(path)
    assert meta == {**META, "digests": meta["digests"]}  # the meta as given, plus every file's digest
    assert sorted(meta["digests"]) == sorted(f"{n}.safetensors" for n in files) and loader.verified
    assert loader.names == sorted(files) and "rng" in loader and "nope" not in loader
    for name, tensors in files.items():
        assert sorted(loader.keys(name)) == sorted(tensors)
        loaded = loader(name)
        for k, t in tensors.items():
            assert loaded[k].dtype == t.dtype and loaded[k].shape == t.shape, k
            assert torch.equal(bits(loaded[k]), bits(t.contiguous())), k
    assert torch.equal(loader.get("rng", "state"), files["rng"]["state"])
    with pytest.raises(cio.CheckpointError, match="adam.v"):
        loader.load("adam.v.shard_000_of_002")


def test_failure_midway_leaves_nothing(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, 100, {"w": {"a": torch.ones(2)}}, {"step": 100})
    calls = []
    real_write = cio.tensor_file.write

    def failing_write(path, tensors, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        return real_write(path, tensors, metadata)

    monkeypatch.setattr(cio.tensor_file, "write", failing_write)
    with pytest.raises(OSError, match="disk full"):
        write_checkpoint(ckpt, 200, sample_files(), META)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000100"]  # temp dir removed too
    assert find_checkpoint(ckpt) == checkpoint_path(ckpt, 100)
    assert find_checkpoint(ckpt, 200) is None


def test_crash_before_commit_is_invisible(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    # a process that dies after writing its shards (no cleanup runs): only a temp dir remains
    tmp = begin(ckpt, 300, tag=1234)
    write_files(tmp, {"weights.shard_000_of_001": {"a": torch.ones(3)}})
    assert tmp.name == "step_00000300.tmp-1234"
    assert list_checkpoints(ckpt) == [] and find_checkpoint(ckpt) is None and find_checkpoint(ckpt, 300) is None
    # dying while writing the meta: still nothing
    monkeypatch.setattr(cio.json, "dump", lambda *a, **k: (_ for _ in ()).throw(OSError("killed")))
    with pytest.raises(OSError):
        commit(tmp, checkpoint_path(ckpt, 300), META)
    monkeypatch.undo()
    assert find_checkpoint(ckpt) is None
    # a directory with the right name but no checkpoint.json (foreign crash) is not a checkpoint either
    (ckpt / "step_00000400").mkdir()
    assert find_checkpoint(ckpt) is None and find_checkpoint(ckpt / "step_00000400") is None
    with pytest.raises(cio.CheckpointError, match="checkpoint.json"):
        read_checkpoint(ckpt / "step_00000400")
    assert remove_stale(ckpt) == [tmp] and not tmp.exists()


def test_multi_rank_protocol(tmp_path):
    ckpt, world = tmp_path / "ckpt", 2
    tmps = [begin(ckpt, 50, tag="777") for _ in range(world)]  # same tag from rank 0 -> one directory
    assert tmps[0] == tmps[1]
    for rank in range(world):  # each rank writes only its own shards
        write_files(tmps[rank], {f"weights.shard_{rank:03d}_of_{world:03d}": {"w": torch.full((2,), float(rank))},
                                 f"adam.m.shard_{rank:03d}_of_{world:03d}": {"w": torch.zeros(2)}})
    assert find_checkpoint(ckpt) is None  # before rank 0 commits, nothing is visible
    final = commit(tmps[0], checkpoint_path(ckpt, 50), {"distributed": {"world": world}})
    meta, loader = read_checkpoint(final)
    assert meta["distributed"]["world"] == 2
    assert loader.names == ["adam.m.shard_000_of_002", "adam.m.shard_001_of_002",
                            "weights.shard_000_of_002", "weights.shard_001_of_002"]
    assert loader.get("weights.shard_001_of_002", "w").tolist() == [1.0, 1.0]
    assert [p.name for p in ckpt.iterdir()] == ["step_00000050"]


def test_rewrite_same_step_replaces(tmp_path):
    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, 10, {"w": {"a": torch.zeros(1)}, "old": {"a": torch.zeros(1)}}, {"v": 1})
    write_checkpoint(ckpt, 10, {"w": {"a": torch.ones(1)}}, {"v": 2})
    meta, loader = read_checkpoint(checkpoint_path(ckpt, 10))
    assert meta == {"v": 2, "digests": meta["digests"]} and loader.names == ["w"] and loader.get("w", "a").item() == 1.0
    assert [p.name for p in ckpt.iterdir()] == ["step_00000010"]


def test_bad_file_name(tmp_path):
    with pytest.raises(ValueError, match="file name"):
        write_checkpoint(tmp_path, 1, {"../evil": {"a": torch.ones(1)}}, {})
    assert list(tmp_path.iterdir()) == []


def _make(ckpt, steps):
    for s in steps:
        tmp = begin(ckpt, s)
        commit(tmp, checkpoint_path(ckpt, s), {"step": s})


def test_find_semantics(tmp_path):
    ckpt = tmp_path / "ckpt"
    other = tmp_path / "elsewhere"
    assert find_checkpoint(ckpt) is None  # directory does not exist
    _make(ckpt, [0, 100, 2000, 300])
    _make(other, [5, 7])
    assert list_checkpoints(ckpt) == [(s, checkpoint_path(ckpt, s)) for s in (0, 100, 300, 2000)]
    assert find_checkpoint(ckpt) == checkpoint_path(ckpt, 2000)  # bare --continue: latest (numerically)
    assert find_checkpoint(ckpt, True) == checkpoint_path(ckpt, 2000)
    assert find_checkpoint(ckpt, "") == checkpoint_path(ckpt, 2000)
    assert find_checkpoint(ckpt, False) is None
    assert find_checkpoint(ckpt, 300) == checkpoint_path(ckpt, 300)  # --continue 300
    assert find_checkpoint(ckpt, "100") == checkpoint_path(ckpt, 100)
    assert find_checkpoint(ckpt, 0) == checkpoint_path(ckpt, 0)
    assert find_checkpoint(ckpt, 400) is None  # missing step: caller warns, starts fresh
    assert find_checkpoint(ckpt, str(other / "step_00000005")) == other / "step_00000005"  # explicit ckpt
    assert find_checkpoint(ckpt, other / "step_00000006") is None
    assert find_checkpoint(ckpt, str(other)) == other / "step_00000007"  # other dir: latest inside
    assert find_checkpoint(ckpt, tmp_path / "missing") is None
    only_zero = tmp_path / "zero"
    _make(only_zero, [0])
    assert find_checkpoint(only_zero) is None  # like llm.q, step 0 is never "latest"


@pytest.mark.parametrize("keep_n,major,left", [
    (2, 500, [500, 800, 900, 1000]),  # majors (500, 1000) never deleted and not counted
    (2, -1, [900, 1000]),
    (0, 500, [500, 1000]),
    (0, -1, []),
    (-1, -1, list(range(100, 1001, 100))),  # -1 keeps all
    (-1, 500, list(range(100, 1001, 100))),
    (20, 300, list(range(100, 1001, 100))),
    (1, 300, [300, 600, 900, 1000]),
])
def test_clean_old_checkpoints(tmp_path, keep_n, major, left):
    ckpt = tmp_path / "ckpt"
    steps = list(range(100, 1001, 100))
    _make(ckpt, steps)
    (ckpt / "step_00000050.tmp-1").mkdir()  # temp dirs are not touched by cleanup
    deleted = clean_old_checkpoints(ckpt, keep_n, major)
    assert [s for s, _ in list_checkpoints(ckpt)] == left
    assert sorted(checkpoint_step(p) for p in deleted) == sorted(set(steps) - set(left))
    assert sorted(p.name for p in ckpt.iterdir()) == sorted([f"step_{s:08d}" for s in left] + ["step_00000050.tmp-1"])
    for s in left:  # survivors are untouched
        assert json.loads((checkpoint_path(ckpt, s) / "checkpoint.json").read_text()) == {"step": s}
