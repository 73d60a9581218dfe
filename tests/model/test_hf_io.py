"""HF checkpoint load/save against real transformers and real safetensors files: bit-exact round trips
(single file and sharded), interop both ways, every broken-input error, and atomic replacement."""
from __future__ import annotations

import json
import os

import pytest
import safetensors.torch as st
import torch
from safetensors import safe_open

from tests.hf_fixtures import TINY_KINDS, tiny_hf_model
from qtrain.model import hf_io, weights
from qtrain.model.registry import preset
from qtrain.model.hf_io import WeightsError, load_hf_weights, load_model_config, save_hf_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """kind -> (dir written by transformers' save_pretrained, that model's state dict)."""
    out = {}
    for kind in TINY_KINDS:
        model = tiny_hf_model(kind, seed=len(out))
        d = tmp_path_factory.mktemp(kind)
        model.save_pretrained(d)
        out[kind] = (d, {k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


def _load(d, **kw):
    cfg = load_model_config(d)
    return cfg, load_hf_weights(d, cfg, **kw)


def _assert_equal(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _file_tensors(d) -> dict[str, torch.Tensor]:
    out = {}
    for p in sorted(d.glob("*.safetensors")):
        out.update(st.load_file(p))
    return out


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_loads_transformers_checkpoint(kind, hf_dirs):
    d, sd = hf_dirs[kind]
    cfg, params = _load(d)
    assert {k: tuple(v.shape) for k, v in params.items()} == weights.param_shapes(cfg)
    # the fused layout, spelled out independently of weights.hf_parts
    a = "model.layers.1.self_attn."
    assert torch.equal(params["layers.1.qkv"], torch.cat([sd[a + "q_proj.weight"], sd[a + "k_proj.weight"],
                                                          sd[a + "v_proj.weight"]]))
    assert torch.equal(params["layers.1.up"], torch.cat([sd["model.layers.1.mlp.up_proj.weight"],
                                                         sd["model.layers.1.mlp.gate_proj.weight"]]))
    if cfg.attention_bias:
        assert torch.equal(params["layers.1.qkv_bias"], torch.cat([sd[a + "q_proj.bias"], sd[a + "k_proj.bias"],
                                                                   sd[a + "v_proj.bias"]]))
    for hf, t in weights.internal_to_hf(cfg, params).items():
        assert torch.equal(t, sd[hf]), hf
    assert ("lm_head" in params) != cfg.tie_word_embeddings


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("kind", TINY_KINDS)
def test_round_trip_bit_exact_and_transformers_reads_it(kind, sharded, hf_dirs, tmp_path):
    cfg, params = _load(hf_dirs[kind][0])
    out = tmp_path / "out"
    save_hf_model(out, cfg, params, dtype=torch.float32, max_shard_bytes=40_000 if sharded else 5 * 2**30)
    assert (out / hf_io.INDEX_FILE).is_file() == sharded
    cfg2, params2 = _load(out)
    assert cfg2 == cfg
    _assert_equal(params2, params)

    files = _file_tensors(out)
    assert ("lm_head.weight" in files) != cfg.tie_word_embeddings
    for p in out.glob("*.safetensors"):
        with safe_open(p, "pt") as f:
            assert f.metadata() == {"format": "pt"}
    if sharded:
        shards = sorted(p.name for p in out.glob("*.safetensors"))
        assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
        index = json.loads((out / hf_io.INDEX_FILE).read_text())
        assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in files.values())
        assert set(index["weight_map"]) == set(files) and set(index["weight_map"].values()) == set(shards)

    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    sd = model.state_dict()
    for hf, t in weights.internal_to_hf(cfg, params).items():
        assert torch.equal(sd[hf], t), hf
    if cfg.tie_word_embeddings:
        assert torch.equal(sd["lm_head.weight"], params["embed"])


def test_loaded_params_own_their_memory(qwen2_copy):
    """safetensors hands out mmap views; params must not follow later in-place writes to the file."""
    d, cfg, _ = qwen2_copy
    params = load_hf_weights(d, cfg)
    before = {k: v.clone() for k, v in params.items()}
    path = d / "model.safetensors"
    with open(path, "r+b") as f:  # zero the data in place (same inode, same mapping)
        f.seek(-4096 * 4, os.SEEK_END)
        f.write(bytes(4096 * 4))
    _assert_equal(params, before)


def test_bf16_round_trip_and_cast(hf_dirs, tmp_path):
    d = hf_dirs["qwen3"][0]
    cfg, p32 = _load(d)
    cfg, p16 = _load(d, dtype=torch.bfloat16)
    _assert_equal(p16, {k: v.to(torch.bfloat16) for k, v in p32.items()})
    save_hf_model(tmp_path / "out", cfg, p16)  # default dtype bf16
    _assert_equal(_load(tmp_path / "out", dtype=torch.bfloat16)[1], p16)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in _file_tensors(tmp_path / "out").values())
    # fp32 params saved as bf16: the file holds the rounded values
    save_hf_model(tmp_path / "out2", cfg, p32)
    _assert_equal(_load(tmp_path / "out2", dtype=torch.bfloat16)[1], p16)


def test_tokenizer_files_copied(hf_dirs, tmp_path):
    src = hf_dirs["qwen2"][0]  # save_pretrained wrote generation_config.json
    (src / "tokenizer.json").write_text('{"fake": true}')
    (src / "merges.txt").write_text("a b\n")
    cfg, params = _load(src)
    out = save_hf_model(tmp_path / "out", cfg, params, tokenizer_src=src)
    for name in ("tokenizer.json", "merges.txt", "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert not (out / "vocab.json").exists() and not (out / "tokenizer.model").exists()


# ---------------------------------------------------------------- broken checkpoints

@pytest.fixture
def qwen2_copy(hf_dirs, tmp_path):
    """A writable single-file qwen2 checkpoint: (dir, cfg, HF tensors in the file)."""
    cfg, params = _load(hf_dirs["qwen2"][0])
    d = save_hf_model(tmp_path / "ckpt", cfg, params, dtype=torch.float32)
    return d, cfg, _file_tensors(d)


def _rewrite(d, tensors):
    st.save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor(qwen2_copy):
    d, cfg, tensors = qwen2_copy
    name = "model.layers.1.self_attn.k_proj.bias"
    del tensors[name]
    _rewrite(d, tensors)
    with pytest.raises(WeightsError, match="missing") as e:
        load_hf_weights(d, cfg)
    assert name in str(e.value) and str(d / "model.safetensors") in str(e.value)


def test_wrong_shape(qwen2_copy):
    d, cfg, tensors = qwen2_copy
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = torch.zeros(64, 95)
    _rewrite(d, tensors)
    with pytest.raises(WeightsError) as e:
        load_hf_weights(d, cfg)
    msg = str(e.value)
    assert name in msg and str(d / "model.safetensors") in msg and "[64, 95]" in msg and "[64, 96]" in msg
    # a config that does not match the checkpoint fails the same way, before reading data
    with pytest.raises(WeightsError, match="model.embed_tokens.weight.*expected \\[256, 64\\]"):
        load_hf_weights(d, cfg.replace(vocab_size=256))


def test_unexpected_tensor(qwen2_copy):
    d, cfg, tensors = qwen2_copy
    _rewrite(d, {**tensors, "model.layers.0.mlp.extra_proj.weight": torch.zeros(2)})
    with pytest.raises(WeightsError, match="unexpected.*model.layers.0.mlp.extra_proj.weight"):
        load_hf_weights(d, cfg)


def test_ignored_extras(hf_dirs, tmp_path):
    """A tied checkpoint may still store lm_head.weight; old ones store rotary inv_freq buffers."""
    cfg, params = _load(hf_dirs["qwen2-tied"][0])
    d = save_hf_model(tmp_path / "ckpt", cfg, params, dtype=torch.float32)
    tensors = _file_tensors(d)
    _rewrite(d, {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"].clone(),
                 "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})
    _assert_equal(load_hf_weights(d, cfg), params)
    untied = cfg.replace(tie_word_embeddings=False)  # but an untied config needs lm_head, and gets it
    assert torch.equal(load_hf_weights(d, untied)["lm_head"], params["embed"])


def test_corrupt_file(qwen2_copy):
    d, cfg, _ = qwen2_copy
    path = d / "model.safetensors"
    data = path.read_bytes()
    for cut in (len(data) - 100, 20, 3):
        path.write_bytes(data[:cut])
        with pytest.raises(WeightsError, match="corrupt or truncated") as e:
            load_hf_weights(d, cfg)
        assert str(path) in str(e.value)


@pytest.fixture
def sharded_copy(hf_dirs, tmp_path):
    cfg, params = _load(hf_dirs["llama"][0])
    return save_hf_model(tmp_path / "ckpt", cfg, params, dtype=torch.float32, max_shard_bytes=40_000), cfg


def test_missing_shard(sharded_copy):
    d, cfg = sharded_copy
    shard = sorted(d.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(WeightsError) as e:
        load_hf_weights(d, cfg)
    assert str(shard) in str(e.value) and str(d / hf_io.INDEX_FILE) in str(e.value)


def test_corrupt_shard_and_index(sharded_copy):
    d, cfg = sharded_copy
    shard = sorted(d.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-8])
    with pytest.raises(WeightsError, match="corrupt or truncated") as e:
        load_hf_weights(d, cfg)
    assert str(shard) in str(e.value)
    (d / hf_io.INDEX_FILE).write_text('{"metadata": {}}')
    with pytest.raises(WeightsError, match="not a valid safetensors index") as e:
        load_hf_weights(d, cfg)
    assert str(d / hf_io.INDEX_FILE) in str(e.value)


def test_no_weights(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(WeightsError, match="no model.safetensors") as e:
        load_hf_weights(tmp_path, preset("Qwen2.5-0.5B"))
    assert str(tmp_path) in str(e.value)


def test_save_rejects_wrong_params(hf_dirs, tmp_path):
    cfg, params = _load(hf_dirs["qwen2"][0])
    bad = dict(params)
    del bad["layers.0.o"]
    with pytest.raises(WeightsError, match="layers.0.o"):
        save_hf_model(tmp_path / "out", cfg, bad)
    with pytest.raises(WeightsError, match="'norm' has shape \\[63\\]"):
        save_hf_model(tmp_path / "out", cfg, {**params, "norm": torch.zeros(63)})
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- atomic save

def _snapshot(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_failed_save_leaves_old_dir_intact(hf_dirs, tmp_path, monkeypatch):
    cfg, params = _load(hf_dirs["qwen2"][0])
    out = save_hf_model(tmp_path / "out", cfg, params, dtype=torch.float32)
    (out / "marker.txt").write_text("old")
    before = _snapshot(out)

    real_save, calls = st.save_file, []

    def flaky_save(*args, **kwargs):  # the second shard fails after the first one was written
        calls.append(args[1])
        if len(calls) == 2:
            raise OSError("disk full")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(st, "save_file", flaky_save)
    zeros = {k: torch.zeros_like(v) for k, v in params.items()}
    with pytest.raises(hf_io.FileSystemError, match="writing the export to .* failed: disk full"):
        save_hf_model(out, cfg, zeros, dtype=torch.float32, max_shard_bytes=40_000)
    assert len(calls) == 2
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp dir left behind
    with pytest.raises(hf_io.FileSystemError, match="disk full"):
        calls.clear()
        save_hf_model(tmp_path / "fresh", cfg, zeros, dtype=torch.float32, max_shard_bytes=40_000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_save_replaces_its_own_files_only(hf_dirs, tmp_path):
    cfg, params = _load(hf_dirs["qwen2"][0])
    out = save_hf_model(tmp_path / "out", cfg, params, dtype=torch.float32, max_shard_bytes=40_000)
    assert json.loads((out / hf_io.MANIFEST).read_text())["complete"] is True
    (out / "marker.txt").write_text("the user's")
    (out / "notes").mkdir()
    (out / "notes" / "a.txt").write_text("also the user's")
    zeros = {k: torch.zeros_like(v) for k, v in params.items()}
    save_hf_model(out, cfg, zeros, dtype=torch.float32)  # single file now: stale shards must not survive
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "marker.txt", "model.safetensors", "notes",
                                                    hf_io.MANIFEST]
    assert (out / "marker.txt").read_text() == "the user's" and (out / "notes" / "a.txt").read_text() == "also the user's"
    man = json.loads((out / hf_io.MANIFEST).read_text())
    assert man["complete"] is True and man["files"] == ["config.json", "model.safetensors"]
    _assert_equal(_load(out)[1], zeros)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert oct(os.stat(out).st_mode & 0o777) == oct(0o755)


def test_save_refuses_files_it_did_not_write(hf_dirs, tmp_path):
    """A model directory of the user (written by transformers, no manifest) is never overwritten."""
    src = hf_dirs["llama"][0]
    cfg, params = _load(src)
    before = _snapshot(src)
    with pytest.raises(WeightsError, match="no qtrain export wrote them"):
        save_hf_model(src, cfg, params)
    assert _snapshot(src) == before


def test_index_entries_stay_inside_the_model_dir(sharded_copy, tmp_path):
    d, cfg = sharded_copy
    (tmp_path / "outside.safetensors").write_bytes(sorted(d.glob("model-*.safetensors"))[0].read_bytes())
    index = json.loads((d / hf_io.INDEX_FILE).read_text())
    first = next(iter(index["weight_map"]))
    for bad in ("../outside.safetensors", str(tmp_path / "outside.safetensors"), "sub/x.safetensors"):
        index["weight_map"][first] = bad
        (d / hf_io.INDEX_FILE).write_text(json.dumps(index))
        with pytest.raises(WeightsError, match="not a file name in the model directory"):
            load_hf_weights(d, cfg)


def test_integer_and_non_finite_weights_are_refused(qwen2_copy):
    d, cfg, tensors = qwen2_copy
    name = "model.layers.0.mlp.down_proj.weight"
    _rewrite(d, {**tensors, name: tensors[name].to(torch.int32)})
    with pytest.raises(WeightsError, match=f"{name}.*dtype I32"):
        hf_io.check_hf_weights(d, cfg)
    for bad in (float("nan"), float("inf")):
        t = tensors[name].clone()
        t[0, 3] = bad
        _rewrite(d, {**tensors, name: t})
        hf_io.check_hf_weights(d, cfg)  # headers are fine
        with pytest.raises(WeightsError, match=f"{name}.*1 NaN/inf"):
            load_hf_weights(d, cfg)
