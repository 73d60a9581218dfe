"""llm.q's run log (`src/training/logging.cpp`, reference/llmq.md §2.2) read as qtrain's log objects, so
`qtrain plot` and `qtrain export-wandb` take logs of either tool.

llm.q writes one JSON *array*, kept valid by seeking back over the closing bracket for every object, so the
file reads `[`, one object per line (each but the last followed by a comma), `]`. A run killed mid-write can
leave the array unclosed or its last line cut; then the objects are read line by line and a cut last line is
dropped, as qtrain's own reader does.

What changes on the way in (everything else passes through unchanged, field names included):
* the per-option `option` objects (`name`, `value`) become one `options` object, names with '_' for '-'
  (llm.q's `grad-accumulation` is qtrain's `grad_accumulation`);
* `step` objects gain `tokens_per_s` (= step_tokens / duration), which qtrain logs and llm.q leaves to readers.
`cmd` objects stay, so the restarts of a resumed llm.q run are merged as qtrain's are (`qtrain.observe.history`).

(The other direction, llm.q's plot script reading qtrain's JSON Lines, is up to llm.q: its scripts parse one
JSON document.)
"""
from __future__ import annotations

import json
from typing import Any

__all__ = ["is_llmq_log", "parse_llmq_log"]


def is_llmq_log(text: str) -> bool:
    """llm.q's logs are a JSON array; qtrain's are JSON Lines of objects."""
    return text.lstrip()[:1] == "["


def _objects(text: str, path: str) -> list[Any]:
    try:
        data = json.loads(text)
        if isinstance(data, list):
            return data
    except json.JSONDecodeError:
        pass
    # an unclosed array (killed run): one object per line
    lines = [ln.strip() for ln in text.splitlines()]
    body = [ln for ln in lines if ln not in ("", "[", "]")]
    out: list[Any] = []
    for i, ln in enumerate(body):
        try:
            out.append(json.loads(ln.rstrip(",")))
        except json.JSONDecodeError as e:
            if i == len(body) - 1:
                break  # cut last line
            raise ValueError(f"{path}: line {lines.index(ln) + 1} of the llm.q log is not a JSON object ({e})") from None
    return out


def parse_llmq_log(text: str, path: str = "log") -> list[dict[str, Any]]:
    """An llm.q log's text -> qtrain log objects (see the module docstring)."""
    events: list[dict[str, Any]] = []
    options: dict[str, Any] | None = None
    for obj in _objects(text, path):
        if not isinstance(obj, dict):
            raise ValueError(f"{path}: llm.q log entry is not an object: {obj!r:.80}")
        kind = obj.get("log")
        if kind == "option":
            if options is None:
                options = {}
                events.append({"log": "options", "time": obj.get("time"), "step": obj.get("step", 0),
                               "options": options})
            options[str(obj.get("name", "")).replace("-", "_")] = obj.get("value")
            continue
        if kind == "cmd":
            options = None  # a restart logs its options again
        if kind == "step" and "tokens_per_s" not in obj:
            ms, tokens = obj.get("duration_ms"), obj.get("step_tokens")
            ok = isinstance(ms, (int, float)) and isinstance(tokens, (int, float)) and ms > 0
            obj = {**obj, "tokens_per_s": tokens * 1000.0 / ms if ok else None}
        events.append(obj)
    return events
