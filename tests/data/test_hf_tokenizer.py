"""The tokenizer files an export carries (`qtrain.data.hf_tokenizer`):

- the built-in tiktoken tokenizers written as a HF tokenizer.json encode real text to exactly the built-in's
  ids (the Python docs, stdlib source, and a multilingual / whitespace / emoji sample), and decode it back;
- `transformers.AutoTokenizer` loads the generated files and agrees (ids, EOS, no BOS added, pad token);
- which tokenizer an export picks: --tokenizer > the model directory's files > the token files' header tag >
  the built-in their vocab field implies (llm.q files) > none;
- a model directory's files are copied byte for byte; bad specs are errors naming them.
"""
from __future__ import annotations

import glob
import json
import sys

import numpy as np
import pytest

from qtrain.data.hf_tokenizer import (TokenizerExportError, builtin_tokenizer_json, export_files, export_tokenizer,
                                      recorded_tokenizer, tokenizer_files, transformers_caveat)
from qtrain.data.token_files import read_token_file_header, write_token_file
from qtrain.data.tokenizers import get_tokenizer
from qtrain.model.llama import LlamaConfig
from tests.data.test_token_files import write_raw

tokenizers = pytest.importorskip("tokenizers")


def real_text() -> str:
    import pydoc_data.topics as topics
    text = "\n".join(list(topics.topics.values())[:40])  # ~200k characters of prose, code and markup
    for f in sorted(glob.glob(f"{sys.prefix}/lib/python3.*/[a-c]*.py"))[:4]:
        text += open(f, encoding="utf-8", errors="replace").read()
    return text + ("\nHéllo wörld — 日本語のテキスト 😀 Ünïcödé ﬁ Ａ 한국어 текст العربية \r\n\t  x   y\n\n\n 123456789 "
                   "don't WE'LL they've <|endoftext|> <|im_start|>")


@pytest.mark.parametrize("name", ["gpt2", "qwen2"])
def test_builtin_as_tokenizer_json_encodes_exactly_like_the_builtin(name):
    tok = get_tokenizer(name)
    hf = tokenizers.Tokenizer.from_str(builtin_tokenizer_json(name))
    hf.encode_special_tokens = True  # the built-ins treat special-token strings in text as plain text
    text = real_text()
    ours, theirs = tok.encode(text), hf.encode(text, add_special_tokens=False).ids
    assert len(ours) > 20_000
    if ours != theirs:
        i = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
        pytest.fail(f"first difference at token {i}: built-in {ours[i - 3:i + 4]} vs tokenizer.json {theirs[i - 3:i + 4]}")
    assert hf.decode(theirs, skip_special_tokens=False) == (text if name == "gpt2" else tok.decode(ours))
    for special, i in tok.encoding._special_tokens.items():
        assert hf.token_to_id(special) == i
    assert hf.get_vocab_size(with_added_tokens=True) == tok.vocab_size


@pytest.mark.parametrize("name", ["gpt2", "qwen2"])
def test_transformers_autotokenizer_loads_the_generated_files(name, tmp_path):
    transformers = pytest.importorskip("transformers")
    for fname, data in tokenizer_files(name, model_max_length=1024).items():
        (tmp_path / fname).write_bytes(data)
    at = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    tok = get_tokenizer(name)
    text = "The quick brown fox jumps over the lazy dog.\n  def f(x):\n\treturn x ** 2  # 日本語"
    assert at(text)["input_ids"] == tok.encode(text)  # no BOS added, same ids
    assert at.eos_token_id == tok.eos_id and at.pad_token_id == tok.eos_id
    assert at.decode(tok.encode(text)) == text
    assert at.model_max_length == 1024


def test_export_files_generation_config_uses_the_tokenizers_eos():
    cfg = LlamaConfig(vocab_size=151936, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, bos_token_id=151643, eos_token_id=151643)
    files = export_files("gpt2", cfg)  # a Qwen-shaped config trained on GPT-2 tokens: generation stops at 50256
    gen = json.loads(files["generation_config.json"])
    assert gen["eos_token_id"] == 50256 and gen["pad_token_id"] == 50256
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= files.keys()
    gen = json.loads(export_files(None, cfg)["generation_config.json"])  # no tokenizer: the config's ids
    assert gen == {"bos_token_id": 151643, "eos_token_id": 151643}


def test_model_directory_files_are_copied_byte_for_byte(tmp_path):
    src = tmp_path / "model"
    src.mkdir()
    files = tokenizer_files("gpt2")
    for fname, data in files.items():
        (src / fname).write_bytes(data)
    (src / "generation_config.json").write_text('{"eos_token_id": [1, 2], "temperature": 0.7}\n')
    (src / "README.md").write_text("not a tokenizer file")
    got = tokenizer_files(str(src))
    assert got == {**files, "generation_config.json": (src / "generation_config.json").read_bytes()}
    cfg = LlamaConfig(vocab_size=50304, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    assert export_files(str(src), cfg)["generation_config.json"] == (src / "generation_config.json").read_bytes()


def test_bare_tokenizer_json_gets_a_generated_config(tmp_path):
    path = tmp_path / "tok" / "tokenizer.json"
    path.parent.mkdir()
    path.write_text(builtin_tokenizer_json("gpt2"))
    files = tokenizer_files(str(path))
    cfg = json.loads(files["tokenizer_config.json"])
    assert cfg["eos_token"] == "<|endoftext|>" and cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert cfg["added_tokens_decoder"]["50256"]["content"] == "<|endoftext|>"


@pytest.mark.parametrize("spec", ["gpt3", "/no/such/tokenizer.json"])
def test_unknown_tokenizer_spec_is_an_error_naming_it(spec):
    with pytest.raises(TokenizerExportError, match=spec.replace(".", r"\.")):
        export_tokenizer(explicit=spec)
    with pytest.raises(TokenizerExportError, match=spec.replace(".", r"\.")):
        tokenizer_files(spec)


def test_directory_without_tokenizer_files_is_an_error(tmp_path):
    with pytest.raises(TokenizerExportError, match="no tokenizer files"):
        tokenizer_files(str(tmp_path))


def test_export_tokenizer_priority(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    tagged = write_token_file(tmp_path / "q.bin", np.arange(10), vocab_size=151665, tokenizer="qwen2")
    write_raw(tmp_path / "l.bin", np.arange(100), vocab=50257, filler=b"*")  # as llm.q writes it: no tag
    h_tagged, h_llmq = read_token_file_header(tagged), read_token_file_header(tmp_path / "l.bin")
    assert (h_tagged.tokenizer, h_llmq.tokenizer) == ("qwen2", None)

    # no files anywhere: nothing; a directory without tokenizer files does not count
    assert export_tokenizer(model_dir=str(model)) is None
    assert export_tokenizer(model_dir=str(model), token_files=[h_tagged]) == "qwen2"  # the header's tag
    assert export_tokenizer(token_files=[h_llmq]) == "gpt2"  # llm.q's file: its vocab field implies GPT-2
    (model / "tokenizer.json").write_text(builtin_tokenizer_json("gpt2"))
    assert export_tokenizer(model_dir=str(model), token_files=[h_tagged]) == str(model)  # the model's own
    assert export_tokenizer(explicit="gpt2", model_dir=str(model), token_files=[h_tagged]) == "gpt2"  # explicit wins


def test_recorded_tokenizer_needs_agreement_and_existence(tmp_path):
    a = read_token_file_header(write_token_file(tmp_path / "a.bin", [1], vocab_size=50257, tokenizer="gpt2"))
    gone = read_token_file_header(write_token_file(tmp_path / "b.bin", [1], vocab_size=50257,
                                                   tokenizer=str(tmp_path / "deleted-model")))
    odd = read_token_file_header(write_token_file(tmp_path / "c.bin", [1], vocab_size=32000, tokenizer=None))
    assert recorded_tokenizer([a]) == "gpt2"
    assert recorded_tokenizer([gone]) == "gpt2"  # the recorded path is gone: the vocab field still says GPT-2
    assert recorded_tokenizer([odd]) is None  # 32000: no built-in to fall back on
    (tmp_path / "deleted-model").mkdir()
    assert recorded_tokenizer([gone]) == str(tmp_path / "deleted-model")


def test_transformers_caveat_for_qwen2_models_with_another_tokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    qwen = LlamaConfig(model_type="qwen2", vocab_size=50304, hidden_size=64, intermediate_size=96,
                       num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    llama = LlamaConfig(model_type="llama", vocab_size=50304, hidden_size=64, intermediate_size=96,
                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    assert "Qwen2Tokenizer" in transformers_caveat("gpt2", qwen)
    assert transformers_caveat("qwen2", qwen) is None and transformers_caveat("gpt2", llama) is None
    assert transformers_caveat(None, qwen) is None
    for fname, data in tokenizer_files("gpt2").items():
        (tmp_path / fname).write_bytes(data)
    assert transformers_caveat(str(tmp_path), qwen) is not None
    # what the caveat recommends loads the exact tokenizer whatever the model type
    (tmp_path / "config.json").write_text(json.dumps(qwen.to_hf_dict()))
    exact = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    text = "In the late 1980s they'd built 12345 machines."
    assert exact(text)["input_ids"] == get_tokenizer("gpt2").encode(text)
