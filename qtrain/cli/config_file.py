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
"""
from __future__ import annotations

import os
import sys
from typing import Any

from qtrain.options import OptionsError

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, as the `tomli` package (a dependency there, see pyproject.toml)
    import tomli as tomllib


def load_config_file(path: str) -> dict[str, Any]:
    """Read a TOML or YAML options file into a flat mapping (option name -> value)."""
    if not os.path.isfile(path):
        raise OptionsError(f"--config {path}: file not found")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise OptionsError(f"--config {path}: cannot read ({e.strerror or e})") from None
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml  # type: ignore[import-not-found]
        except ImportError:
            raise OptionsError(f"--config {path}: YAML needs PyYAML (pip install pyyaml), or use TOML") from None
        try:
            data = yaml.safe_load(raw) or {}
        except yaml.YAMLError as e:
            raise OptionsError(f"--config {path}: invalid YAML ({e})") from None
    else:
        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise OptionsError(f"--config {path}: invalid TOML ({e})") from None
    if not isinstance(data, dict):
        raise OptionsError(f"--config {path}: expected a table of options")
    return flatten_sections(data, source=f"--config {path}")


def flatten_sections(data: dict[str, Any], *, source: str) -> dict[str, Any]:
    """One level of sections -> one flat mapping. Keys are compared after '-' -> '_' (`seq-len` and `seq_len`
    are the same option), so a value given twice is caught here, wherever it was given."""
    flat: dict[str, Any] = {}
    where: dict[str, str] = {}  # normalized key -> where it was set, for the error message

    def put(key: Any, value: Any, place: str) -> None:
        norm = str(key).replace("-", "_")
        if norm in where:
            raise OptionsError(f"{source}: option {str(key)!r} is set twice ({where[norm]} and {place}); "
                               f"keep one")
        where[norm] = place
        flat[str(key)] = value

    for key, value in data.items():
        if isinstance(value, dict):
            for k, v in value.items():
                if isinstance(v, dict):
                    raise OptionsError(f"{source}: [{key}.{k}] is a table inside a section; sections are one "
                                       f"level deep (put {k!r}'s options directly under [{key}])")
                put(k, v, f"[{key}] {k}")
        else:
            put(key, value, f"top level {key}")
    return flat
