"""resolve_model_dir against a fake local HF cache: found where huggingface_hub would put it, never
downloaded, and a not-found message that lists every place searched."""
from __future__ import annotations

import pytest

from qtrain.model.resolve import ModelNotFoundError, resolve_model_dir


@pytest.fixture
def caches(tmp_path, monkeypatch):
    """HF_HOME, XDG_CACHE_HOME and HOME all pointing into tmp_path; returns their hub folders."""
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return {"hf": tmp_path / "hf" / "hub", "xdg": tmp_path / "xdg" / "huggingface" / "hub",
            "home": tmp_path / "home" / ".cache" / "huggingface" / "hub"}


def _snapshot(hub, repo, rev):
    d = hub / f"models--{repo.replace('/', '--')}" / "snapshots" / rev
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    return d


def test_existing_directory(tmp_path):
    assert resolve_model_dir(str(tmp_path)) == tmp_path


def test_found_in_hf_home(caches):
    snap = _snapshot(caches["hf"], "Qwen/Qwen2.5-0.5B", "abc123")
    _snapshot(caches["home"], "Qwen/Qwen2.5-0.5B", "zzz")  # HF_HOME wins over ~/.cache
    assert resolve_model_dir("Qwen/Qwen2.5-0.5B") == snap


@pytest.mark.parametrize("where", ["xdg", "home"])
def test_found_in_fallback_caches(caches, where):
    snap = _snapshot(caches[where], "org/name", "abc")
    assert resolve_model_dir("org/name") == snap


def test_refs_main_picks_among_snapshots(caches):
    _snapshot(caches["hf"], "org/name", "old")
    new = _snapshot(caches["hf"], "org/name", "new")
    (caches["hf"] / "models--org--name" / "refs").mkdir()
    (caches["hf"] / "models--org--name" / "refs" / "main").write_text("new\n")
    assert resolve_model_dir("org/name") == new
    (caches["hf"] / "models--org--name" / "refs" / "main").unlink()
    with pytest.raises(ModelNotFoundError, match="2 snapshots.*refs/main"):
        resolve_model_dir("org/name")


def test_not_found_lists_every_place(caches):
    with pytest.raises(ValueError) as e:  # ModelNotFoundError is a ValueError
        resolve_model_dir("org/missing")
    assert isinstance(e.value, ModelNotFoundError)
    msg = str(e.value)
    assert "'org/missing'" in msg and "never downloads" in msg
    for hub in caches.values():
        assert str(hub / "models--org--missing") in msg
    # an empty repo folder (interrupted download) is not a hit either
    (caches["hf"] / "models--org--missing" / "snapshots").mkdir(parents=True)
    with pytest.raises(ModelNotFoundError):
        resolve_model_dir("org/missing")


def test_hf_hub_cache_searched_first(caches, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hubcache"))
    snap = _snapshot(tmp_path / "hubcache", "org/name", "abc")
    _snapshot(caches["hf"], "org/name", "def")
    assert resolve_model_dir("org/name") == snap


def test_plain_missing_path(caches, tmp_path):
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model_dir(str(tmp_path / "nope"))
    assert str(tmp_path / "nope") in str(e.value) and "models--" not in str(e.value)


def test_preset_name_without_from_scratch_gets_a_hint(caches):
    from qtrain.model.resolve import resolve_model
    for spec in ("Qwen2.5-7B", "Qwen/Qwen2.5-7B", "llama-3.2-1b"):
        with pytest.raises(ModelNotFoundError, match="add --from-scratch") as ei:
            resolve_model(spec)
        assert "not found" in str(ei.value)  # the search is still listed
        assert resolve_model(spec, from_scratch=True).weights_dir is None  # and with the flag it is the preset
    with pytest.raises(ModelNotFoundError) as ei:
        resolve_model("Qwen2.5-8B")  # not a preset: no hint
    assert "--from-scratch" not in str(ei.value)


def test_tiny_presets_have_each_built_in_tokenizers_vocabulary():
    """tiny-gpt2 / tiny-qwen2: the embedded default's shape, the vocabulary of `qtrain tokenize --tokenizer gpt2 /
    qwen2` padded to a multiple of 64; from scratch with or without --from-scratch (no weights exist), whatever a
    directory of that name holds."""
    import dataclasses

    from qtrain.model.resolve import TINY, TINY_MODELS, is_tiny, resolve_model
    pytest.importorskip("tiktoken")
    from qtrain.data.tokenize import get_tokenizer
    for name, tokenizer in (("tiny-gpt2", "gpt2"), ("tiny-qwen2", "qwen2")):
        cfg = TINY_MODELS[name]
        vocab = get_tokenizer(tokenizer).vocab_size
        assert cfg.vocab_size % 64 == 0 and 0 <= cfg.vocab_size - vocab < 64, (name, vocab)
        shape = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in (
            "model_type", "vocab_size", "attention_bias", "bos_token_id", "eos_token_id")}
        assert shape == {k: v for k, v in dataclasses.asdict(TINY).items() if k in shape}
        for spec, scratch in ((name, False), (name.upper(), False), (name, True)):
            source = resolve_model(spec, from_scratch=scratch)
            assert source.cfg == cfg and source.weights_dir is None and source.tokenizer_dir is None
    assert TINY_MODELS["tiny-qwen2"].model_type == "qwen2" and TINY_MODELS["tiny-gpt2"] == TINY
    assert is_tiny("") and is_tiny("qtrain-tiny") and not is_tiny("Qwen2.5-0.5B")
