"""Options by name, as people and llm.q write them: llm.q's spellings and aliases (`--batch`, `lr`, '-' or '_'),
config-file values made the fields' types, and the run name an --out-dir implies. `Options.from_mapping` and
`qtrain.options.normalize_mapping` go through here."""
from __future__ import annotations

import os
import re
from typing import Any

from qtrain.fsio import shorten
from qtrain.options_values import OptionsError, closest


ALIASES = {"batch": "batch_size", "seq_length": "seq_len", "lr": "learning_rate", "continue": "continue_from",
           "use_all_to_all_reduce": "all_to_all_reduce", "offload_grads": "offload_gradients"}


def coerce(key: str, typ: Any, value: Any, source: str, spelled: str = "") -> Any:
    """A config-file value -> the field's type. Config files are loosely typed (PyYAML reads `3e-4` as a
    string, a TOML seed may be written "0x83b45442"), so parse strings for numeric fields and reject what
    does not fit, naming the file and key, instead of failing later with a TypeError."""
    def bad(what: str) -> OptionsError:
        return OptionsError(f"{source}: option {spelled or key!r} must be {what}, got {shorten(repr(value))}")
    if key == "continue_from":  # `continue = true` (latest), a step number, or a path
        if value is None or value is False:
            return None
        if value is True:
            return "latest"
        if isinstance(value, (int, str)):
            return str(value)
        raise bad("true, a step number or a path")
    if typ is bool:
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if typ == bool | None:  # unset = auto
        if value is None or value == "auto":
            return None
        if not isinstance(value, bool):
            raise bad('true, false or "auto"')
        return value
    if typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value.strip(), 0)
            except ValueError:
                pass
        raise bad("an integer")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise bad("a number")
    if not isinstance(value, str):
        raise bad("a string")
    return value


def map_names(d: dict[str, Any], types: dict[str, Any], *, source: str = "options") -> dict[str, Any]:
    """Option names (llm.q spellings, '-' or '_', aliases) -> field names of `types` (field -> type), values ->
    those types. Raises OptionsError naming `source` and the key for unknown, duplicated or ill-typed options."""
    names = set(types)
    norm: dict[str, Any] = {}
    unknown: list[str] = []
    for k, v in d.items():
        key = str(k).replace("-", "_")
        key = ALIASES.get(key, key)
        if key not in names:
            unknown.append(str(k))
            continue
        if key in norm:
            raise OptionsError(f"{source}: option {key!r} given twice (as {k!r} and another spelling)")
        norm[key] = coerce(key, types[key], v, source, spelled=str(k))
    if unknown:
        spelled = sorted(names | {a for a in ALIASES})
        hints = [f"{shorten(repr(u), 60)} -> {m!r}" for u in sorted(unknown)[:5]
                 if (m := closest(u.replace("-", "_"), spelled)) is not None]
        raise OptionsError(f"{source}: unknown option(s) {shorten(repr(sorted(unknown)))}"
                           + (f" (did you mean {', '.join(hints)}?)" if hints else ""))
    return norm


def with_derived_name(given: dict[str, Any]) -> dict[str, Any]:
    """Option values as given (flags over config file) with `name` derived from `out_dir` when only the out-dir
    was given: its last component, made a valid run name. Without that, every run into its own --out-dir would
    share the default name's checkpoint-dir and log, and a second one would be refused as the first's."""
    if "name" in given or "%n" in str(given.get("out_dir", "%n")):
        return given
    last = os.path.basename(os.path.normpath(str(given["out_dir"])))
    name = re.sub(r"\.{2,}", ".", re.sub(r"[^A-Za-z0-9._+-]+", "_", last))  # as check_run_name's suggestion
    name = re.sub(r"^[^A-Za-z0-9]+", "", name)[:128].rstrip("._-")
    return {**given, "name": name} if name else given
