"""`qtrain tokenize` for chat / SFT data (`qtrain.data.sft`): the loss masks land on the right *targets*.

The check goes through the whole path a training run takes: JSONL -> `qtrain tokenize` (CLI) -> token files
with masks -> `TokenLoader` (which reads a mask bit at the target position) -> the targets that are not -100
decode to exactly the responses (+ EOS), and every trained target's input is the token before it in the
example (so the first response token is trained, predicted from the last prompt token).
"""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from qtrain.cli.main import main
from qtrain.data.loader import TokenLoader
from qtrain.data.sft import SFTError, SFTFormat, encode_example
from qtrain.data.token_files import IGNORE_INDEX, read_token_file, read_token_file_header
from qtrain.data.tokenizers import get_tokenizer

EXAMPLES = [{"question": f"What is {i} plus {i}?", "answer": f" It is {2 * i}, because {i} + {i} = {2 * i}."}
            for i in range(12)]


def write_jsonl(path, records) -> str:
    """JSON Lines (a .jsonl file), or for a .json file one indented array of the records."""
    if path.suffix == ".json":
        path.write_text(json.dumps(records, indent=1))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


CHATS = [{"messages": [{"role": "system", "content": "Be brief."},
                       {"role": "user", "content": f"Count to {i}."},
                       {"role": "assistant", "content": " ".join(str(k) for k in range(1, i + 1))},
                       {"role": "user", "content": "Thanks!"},
                       {"role": "assistant", "content": "You are welcome."}]} for i in range(1, 6)]


def trained_targets(files, seq_len: int, tok) -> list[str]:
    """Per sequence of the loader: the decoded targets that are trained (not -100)."""
    out = []
    for x, y in TokenLoader(files, seq_len, shuffle=False).iterate_eval_batches(1):
        out.append(tok.decode(y[y != IGNORE_INDEX].tolist()))
    return out


@pytest.mark.parametrize("name", ["gpt2", "qwen2"])
def test_prompt_response_masks_only_train_the_responses(tmp_path, name, capsys):
    src = write_jsonl(tmp_path / "qa.jsonl", EXAMPLES)
    rc = main(["tokenize", src, "--out-dir", str(tmp_path / "out"), "--tokenizer", name, "--prompt-field", "question",
               "--response-field", "answer", "--eval-fraction", "0", "--no-progress", "--workers", "1"])
    assert rc == 0 and "loss masks" in capsys.readouterr().out
    tok = get_tokenizer(name)
    tokens, masks = read_token_file(tmp_path / "out" / "train.bin")
    assert read_token_file_header(tmp_path / "out" / "train.bin").tokenizer == name
    # all examples packed: the kept tokens, in order, are exactly the responses with their EOS
    assert tok.decode(tokens[masks].tolist()) == "".join(e["answer"] + tok.decode([tok.eos_id]) for e in EXAMPLES)
    assert tok.decode(tokens[~masks].tolist()) == "".join(e["question"] for e in EXAMPLES)
    # through the loader (mask read at the target position): whole file as one long sequence
    n = len(tokens) - 1
    loader = TokenLoader(str(tmp_path / "out" / "train.bin"), n, shuffle=False)
    (x, y), = list(loader.iterate_eval_batches(1))
    trained = (y[0] != IGNORE_INDEX).numpy()
    assert np.array_equal(trained, masks[1:])  # target j = token j+1 is trained iff its own mask bit is set
    first = tok.encode(EXAMPLES[0]["question"])
    j = len(first) - 1  # the input is the prompt's last token, the target the response's first
    assert int(x[0, j]) == first[-1] and trained[j] and not trained[j - 1]


def test_pad_to_makes_each_sequence_one_whole_example(tmp_path):
    src = write_jsonl(tmp_path / "qa.jsonl", EXAMPLES)
    T = 32
    assert main(["tokenize", src, "--out-dir", str(tmp_path / "out"), "--tokenizer", "gpt2", "--prompt-field",
                 "question", "--response-field", "answer", "--pad-to", str(T), "--eval-fraction", "0",
                 "--no-progress", "--workers", "1"]) == 0
    tok = get_tokenizer("gpt2")
    eos = tok.decode([tok.eos_id])
    got = trained_targets(str(tmp_path / "out" / "train.bin"), T, tok)
    assert got == [e["answer"] + eos for e in EXAMPLES]  # every example, the last one included, one per sequence
    x, _ = next(TokenLoader(str(tmp_path / "out" / "train.bin"), T, shuffle=False).iterate_eval_batches(1))
    assert tok.decode(x[0].tolist()).startswith(EXAMPLES[0]["question"])  # each sequence starts at its prompt


def test_pad_to_cuts_long_examples_keeping_eos(tmp_path):
    """A cut example keeps its EOS as its last token (the boundary) but not as a target: it did not end there. Cut
    inside the prompt, nothing of it is a target (the EOS after the cut prompt was, teaching the model to stop
    there); cut inside the response, the response's kept tokens are."""
    tok = get_tokenizer("gpt2")
    rec = {"q": "word " * 40, "a": " answer " * 40}
    tokens, mask = encode_example(tok, rec, SFTFormat(prompt_field="q", response_field="a", pad_to=16))
    assert tokens.size == 16 and tokens[-1] == tok.eos_id and not mask.any()
    tokens, mask = encode_example(tok, {"q": "hi", "a": " answer" * 40},
                                  SFTFormat(prompt_field="q", response_field="a", pad_to=16))
    assert tokens.size == 16 and tokens[-1] == tok.eos_id and not mask[-1] and mask[1:15].all() and not mask[0]
    tokens, mask = encode_example(tok, {"q": "hi", "a": " yo"}, SFTFormat(prompt_field="q", response_field="a",
                                                                          pad_to=16))
    assert tokens.size == 16 and not mask[4:].any() and (tokens[4:] == tok.eos_id).all()  # hi, yo, EOS, then pads


@pytest.mark.parametrize("spec", ["qwen2", "tokenizer.json"])
def test_chat_messages_train_the_assistant_turns(tmp_path, spec):
    """The built-in qwen2 tokenizer (tiktoken) and a tokenizer.json (the `tokenizers` library's added tokens, the
    path Qwen3.5's and any HF model's own tokenizer takes: `HFTokenizer.special_id`; here the built-in's own
    export) render the chat the same, its ChatML markers as special tokens."""
    src = write_jsonl(tmp_path / "chat.jsonl", CHATS)
    if spec == "tokenizer.json":
        from qtrain.data.hf_tokenizer import builtin_tokenizer_json
        (tmp_path / spec).write_text(builtin_tokenizer_json("qwen2"))
        spec = str(tmp_path / spec)
    assert main(["tokenize", src, "--out-dir", str(tmp_path / "out"), "--tokenizer", spec, "--messages-field",
                 "messages", "--eval-fraction", "0", "--no-progress", "--workers", "1"]) == 0
    tok = get_tokenizer(spec)
    assert type(tok).__name__ == ("TiktokenTokenizer" if spec == "qwen2" else "HFTokenizer")
    tokens, masks = read_token_file(tmp_path / "out" / "train.bin")
    assert tok.decode(tokens[masks].tolist()) == "".join(
        f"{' '.join(str(k) for k in range(1, i + 1))}<|im_end|>You are welcome.<|im_end|>" for i in range(1, 6))
    text = tok.decode(tokens.tolist())
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCount to 1.<|im_end|>\n"
                           "<|im_start|>assistant\n1<|im_end|>\n")
    assert tokens[0] == tok.special_id("<|im_start|>")  # a special token, not its text


@pytest.mark.parametrize("records,argv", [
    (EXAMPLES, ["--tokenizer", "gpt2", "--prompt-field", "question", "--response-field", "answer", "--pad-to", "32"]),
    (CHATS, ["--tokenizer", "qwen2", "--messages-field", "messages", "--pack-to", "64"]),
])
def test_a_json_array_gives_the_jsonl_files(tmp_path, records, argv):
    """SFT / chat records from one .json array: the same tokens and masks as from a .jsonl file."""
    out = {}
    for name in ("recs.jsonl", "recs.json"):
        src = write_jsonl(tmp_path / name, records)
        assert main(["tokenize", src, "--out-dir", str(tmp_path / name.replace(".", "-")), *argv, "--eval-fraction",
                     "0", "--no-progress", "--workers", "1"]) == 0
        out[name] = (tmp_path / name.replace(".", "-") / "train.bin").read_bytes()
    assert (tmp_path / "recs.json").read_text().startswith("[")
    assert out["recs.json"] == out["recs.jsonl"]
    tokens, masks = read_token_file(tmp_path / "recs-json" / "train.bin")
    assert masks is not None and masks.any() and not masks.all()


def test_chat_needs_chatml_tokens(tmp_path):
    tok = get_tokenizer("gpt2")
    with pytest.raises(SFTError, match="ChatML"):
        encode_example(tok, {"m": [{"role": "user", "content": "hi"}], "_where": "x.jsonl:1"},
                       SFTFormat(messages_field="m"))


@pytest.mark.parametrize("name,record,match", [
    ("qa.jsonl", {"question": "q"}, r"qa.jsonl:2: no field 'answer'"),
    ("qa.jsonl", {"question": "q", "answer": 3}, r"qa.jsonl:2: field 'answer' is int, not a string"),
    ("qa.json", {"question": "q"}, r"qa.json:\[1\]: no field 'answer'"),  # an array's element, counted from 0
    ("qa.json", {"question": "q", "answer": 3}, r"qa.json:\[1\]: field 'answer' is int, not a string"),
    ("qa.json", ["q", "a"], r"qa.json:\[1\]: a record must be a JSON object, got list"),
])
def test_bad_records_name_file_and_line(tmp_path, name, record, match, capsys):
    src = write_jsonl(tmp_path / name, [EXAMPLES[0], record])
    assert main(["tokenize", src, "--out-dir", str(tmp_path / "out"), "--tokenizer", "gpt2", "--prompt-field",
                 "question", "--response-field", "answer", "--no-progress", "--workers", "1"]) == 2
    assert re.search(match, capsys.readouterr().err)
    assert not list((tmp_path / "out").glob("*.bin"))  # nothing half-written


@pytest.mark.parametrize("argv,match", [
    (["--prompt-field", "q"], "go together"),
    (["--messages-field", "m", "--prompt-field", "q", "--response-field", "a"], "either"),
    (["--prompt-field", "q", "--response-field", "a", "--pad-to", "1"], "--pad-to"),
])
def test_bad_sft_flags_exit_2(tmp_path, argv, match, capsys):
    src = write_jsonl(tmp_path / "qa.jsonl", EXAMPLES)
    assert main(["tokenize", src, "--out-dir", str(tmp_path / "out"), "--tokenizer", "gpt2", *argv]) == 2
    assert match in capsys.readouterr().err
