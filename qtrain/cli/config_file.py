"""`--config FILE`: a TOML or YAML file of training options, read into a flat mapping that
`qtrain.options.normalize_mapping` checks and types.

Options may be grouped into sections, one level deep, as torchtitan-style configs do:

    [model]                       model:
    model = "Qwen2.5-0.5B"          model: Qwen2.5-0.5B
    from-scratch = true             from-scratch: true
    [optimizer]                   optimizer:
    lr = 3e-4                       lr: 3e-4

Section names are free (they only group); the keys inside are option names. A table inside a section, or
the same option set twice (in two sections, or at the top and in a section), is an error naming both places.

A config file is an input like any other: it must be a regular file of at most 256 KiB, nest at most 64 levels
(checked before PyYAML's or tomllib's recursive parts run), and YAML aliases may not expand it past a megabyte
(a "billion laughs" file of a kilobyte expands to 10^9 values). Values are never echoed whole.
"""
from __future__ import annotations

import os
import sys
from typing import Any

from qtrain.fsio import MAX_NESTING, data_nesting, read_bounded, shorten
from qtrain.options import OptionsError

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, as the `tomli` package (a dependency there, see pyproject.toml)
    import tomli as tomllib


CONFIG_FILE_MAX_BYTES = 256 << 10  # an options file is a few hundred bytes; PyYAML reads ~100 KiB a second
# characters + values once YAML aliases are expanded; an alias-free file stays below twice its size
YAML_MAX_EXPANDED = 1 << 20


def load_config_file(path: str) -> dict[str, Any]:
    """Read a TOML or YAML options file into a flat mapping (option name -> value)."""
    source = f"--config {shorten(path)}"
    if not os.path.lexists(path):
        raise OptionsError(f"{source}: file not found")
    raw = read_bounded(path, "--config", CONFIG_FILE_MAX_BYTES)
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml  # type: ignore[import-not-found]
        except ImportError:
            raise OptionsError(f"{source}: YAML needs PyYAML (pip install pyyaml), or use TOML") from None
        try:
            check_yaml_size(raw, source)
            data = yaml.safe_load(raw) or {}
        except yaml.YAMLError as e:
            if "maximum nesting depth" in str(e):  # PyYAML >= 6.0.4 refuses deep flow nesting while scanning
                raise _too_deep(source) from None
            raise OptionsError(f"{source}: invalid YAML ({shorten(str(e))})") from None
    else:
        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise OptionsError(f"{source}: invalid TOML ({shorten(str(e))})") from None
        except RecursionError:  # tomllib parses nested arrays and inline tables recursively
            raise _too_deep(source) from None
        if data_nesting(data) > MAX_NESTING:
            raise _too_deep(source)
    if not isinstance(data, dict):
        raise OptionsError(f"{source}: expected a table of options")
    return flatten_sections(data, source=source)


def _too_deep(source: str) -> OptionsError:
    return OptionsError(f"{source}: nested more than {MAX_NESTING} levels deep; options are values, lists or "
                        f"one level of sections")


def check_yaml_size(raw: bytes, source: str) -> None:
    """Walk the YAML event stream (PyYAML's parser keeps its own stack, it does not recurse) before anything
    is built from it: refuse nesting deeper than MAX_NESTING, and aliases that would expand the document past
    YAML_MAX_EXPANDED (each value counts 1 + its length in characters; an alias counts what its anchor does)."""
    import yaml  # type: ignore[import-not-found]

    anchored: dict[str, int] = {}  # anchor -> expanded size of the node it names
    open_nodes: list[list[Any]] = [[None, 0]]  # [anchor, expanded size so far] of each open collection
    for ev in yaml.parse(raw, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # libyaml's when built
        if isinstance(ev, yaml.CollectionStartEvent):
            open_nodes.append([ev.anchor, 1])
            if len(open_nodes) - 1 > MAX_NESTING:
                raise _too_deep(source)
            continue
        if isinstance(ev, yaml.CollectionEndEvent):
            anchor, size = open_nodes.pop()
        elif isinstance(ev, yaml.ScalarEvent):
            anchor, size = ev.anchor, 1 + len(ev.value)
        elif isinstance(ev, yaml.AliasEvent):
            anchor, size = None, anchored.get(ev.anchor, 1)
        else:
            continue
        if anchor is not None:
            anchored[anchor] = size
        open_nodes[-1][1] += size
        if open_nodes[-1][1] > YAML_MAX_EXPANDED:
            raise OptionsError(f"{source}: its aliases expand to more than {YAML_MAX_EXPANDED:,} characters "
                               f"(a YAML \"billion laughs\"?); an options file needs a few hundred")


def flatten_sections(data: dict[str, Any], *, source: str) -> dict[str, Any]:
    """One level of sections -> one flat mapping. Keys are compared after '-' -> '_' (`seq-len` and `seq_len`
    are the same option), so a value given twice is caught here, wherever it was given."""
    flat: dict[str, Any] = {}
    where: dict[str, str] = {}  # normalized key -> where it was set, for the error message

    def put(key: Any, value: Any, place: str) -> None:
        norm = str(key).replace("-", "_")
        if norm in where:
            raise OptionsError(f"{source}: option {shorten(repr(str(key)))} is set twice ({where[norm]} and "
                               f"{place}); keep one")
        where[norm] = place
        flat[str(key)] = value

    for key, value in data.items():
        if isinstance(value, dict):
            for k, v in value.items():
                if isinstance(v, dict):
                    section, inner = shorten(str(key), 60), shorten(str(k), 60)
                    raise OptionsError(f"{source}: [{section}.{inner}] is a table inside a section; sections are "
                                       f"one level deep (put its options directly under [{section}])")
                put(k, v, f"[{shorten(str(key), 60)}] {shorten(str(k), 60)}")
        else:
            put(key, value, f"top level {shorten(str(key), 60)}")
    return flat
