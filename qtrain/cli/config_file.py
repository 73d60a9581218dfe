"""`--config FILE`: a TOML or YAML file of training options, read into a flat mapping that
`qtrain.options.normalize_mapping` checks and types."""
from __future__ import annotations

import os
from typing import Any

from qtrain.options import OptionsError


def load_config_file(path: str) -> dict[str, Any]:
    """Read a TOML or YAML options file into a flat mapping (option name -> value)."""
    if not os.path.isfile(path):
        raise OptionsError(f"--config {path}: file not found")
    with open(path, "rb") as f:
        raw = f.read()
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
        import tomllib
        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise OptionsError(f"--config {path}: invalid TOML ({e})") from None
    if not isinstance(data, dict):
        raise OptionsError(f"--config {path}: expected a table of options")
    return data
