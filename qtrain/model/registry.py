"""The model families qtrain supports, and how a config finds its family: by the HF `model_type` of its
config.json (each family states the model types it reads and the `architectures` entry it writes for each; a
config.json without `model_type` is refused, as transformers' AutoConfig refuses it).

Adding a family is a folder `qtrain/model/<family>/` with a `family.ModelFamily` object and one line in
`FAMILIES` below (docs/architecture.md, "Adding a model family").
"""
from __future__ import annotations

import os
from typing import Any, Callable

from qtrain.fsio import CONFIG_MAX_BYTES, InputError, read_json_input, shorten
from qtrain.model.config import ConfigError, ModelConfig
from qtrain.model.family import ModelFamily
from qtrain.model.llama import LLAMA
from qtrain.model.mixtral import MIXTRAL
from qtrain.model.olmoe import OLMOE
from qtrain.model.qwen3_5 import QWEN3_5
from qtrain.model.qwen3_moe import QWEN3_MOE

FAMILIES: tuple[ModelFamily, ...] = (
    LLAMA,  # llama, qwen2, qwen3
    QWEN3_MOE,  # qwen3_moe
    OLMOE,  # olmoe
    MIXTRAL,  # mixtral
    QWEN3_5,  # qwen3_5_text, qwen3_5_moe_text (and the multimodal qwen3_5, qwen3_5_moe read as their text model)
)

_BY_MODEL_TYPE: dict[str, ModelFamily] = {mt: f for f in FAMILIES for mt in f.architectures}
MODEL_TYPES: tuple[str, ...] = tuple(_BY_MODEL_TYPE)


def _unsupported(model_type: Any) -> str:
    return f"unknown model_type {shorten(repr(model_type), 64)}; supported: {', '.join(MODEL_TYPES)}"


def family_for(model_type: str) -> ModelFamily:
    """The family that reads `model_type`; a ConfigError listing the supported ones if none does."""
    try:
        return _BY_MODEL_TYPE[model_type]
    except (KeyError, TypeError):
        raise ConfigError(_unsupported(model_type)) from None


def family_of(cfg: ModelConfig) -> ModelFamily:
    """The family of a config (by its model_type)."""
    return family_for(cfg.model_type)


def delta_rule_layers(cfg: ModelConfig) -> int:
    """How many of `cfg`'s layers run the gated delta rule (the family's optional `delta_rule_layers`; 0 without)."""
    count = getattr(family_of(cfg), "delta_rule_layers", None)
    return count(cfg) if count is not None else 0


def config_from_hf_dict(d: Any, *, source: str = "config.json") -> ModelConfig:
    """A parsed config.json as its family's config; `source` names the file in error messages."""
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: expected a JSON object")
    mt = d.get("model_type")
    if mt is None:
        raise ConfigError(f"{source}: missing key 'model_type'")
    if not isinstance(mt, str) or mt not in _BY_MODEL_TYPE:
        raise ConfigError(f"{source}: {_unsupported(mt)}")
    return _BY_MODEL_TYPE[mt].config_from_hf(d, source=source)


def config_from_json_file(path: str | os.PathLike) -> ModelConfig:
    """A config.json file as its family's config; errors name the file."""
    path = os.fspath(path)
    if not os.path.lexists(path):
        raise ConfigError(f"{shorten(path)}: file not found")
    try:  # bounded, nesting checked: a pipe, a huge or a deeply nested file is refused before parsing
        d = read_json_input(path, "", CONFIG_MAX_BYTES)
    except InputError as e:
        raise ConfigError(str(e)) from None
    return config_from_hf_dict(d, source=path)


PRESETS: dict[str, Callable[[], ModelConfig]] = {name: make for f in FAMILIES for name, make in f.presets.items()}


def preset(name: str) -> ModelConfig:
    """Look a preset up by name, case-insensitively, with or without an `org/` prefix."""
    key = name.rsplit("/", 1)[-1].lower()
    for k, make in PRESETS.items():
        if k.lower() == key:
            return make()
    raise ConfigError(f"unknown model preset {shorten(repr(name))}; known presets: {', '.join(PRESETS)}")
