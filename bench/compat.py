"""What differs between the qtrain layouts a benchmark may run against: before the restructure (dac8680:
qtrain.train.options / memory_plan / metrics / data) and after it (qtrain.options, qtrain.plan.memory,
qtrain.observe.metrics, qtrain.data.token_files). The kinds import through here, so a baseline checkout of
either layout runs the same benchmark code. Imports happen when called: the harness chooses the checkout
whose qtrain a case imports before any kind is loaded (bench/case.py)."""
from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

LAYOUTS = {  # what -> (module after the restructure, module before it), attribute
    "Options": (("qtrain.options", "qtrain.train.options"), "Options"),
    "Trainer": (("qtrain.train.trainer",), "Trainer"),
    "plan_for_trainer": (("qtrain.plan.resolution", "qtrain.plan.memory", "qtrain.train.memory_plan"),
                         "plan_for_trainer"),
    "mfu_bf16": (("qtrain.observe.metrics", "qtrain.train.metrics"), "mfu_bf16"),
    "model_flops_per_token": (("qtrain.observe.metrics", "qtrain.train.metrics"), "model_flops_per_token"),
    "peak_tflops": (("qtrain.observe.metrics", "qtrain.train.metrics"), "peak_tflops"),
    "write_token_file": (("qtrain.data.token_files", "qtrain.train.data"), "write_token_file"),
    # the model families' registry (issue 42) holds the presets; before it, model/config.py did
    "preset": (("qtrain.model.registry", "qtrain.model.config"), "preset"),
}


def has_module(name: str) -> bool:
    """Whether the imported qtrain's own tree has module `name`. Asked of the files, not of the import
    system: an editable install of another checkout would supply modules this one lacks."""
    import qtrain as q

    p = Path(q.__file__).parent.joinpath(*name.split(".")[1:])
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def qtrain(what: str) -> Any:
    """The object `what` (a key of LAYOUTS) from whichever layout the imported qtrain has."""
    modules, attr = LAYOUTS[what]
    for name in modules:
        if has_module(name):
            return getattr(importlib.import_module(name), attr)
    raise ImportError(f"qtrain has none of {', '.join(modules)} (for {what}); is this a qtrain checkout?")


def preset(name: str) -> Any:
    """The model config of a built-in preset, from either layout."""
    return qtrain("preset")(name)


def model_config(model: str):
    """The model config of a preset name or of a directory holding config.json."""
    if not os.path.isdir(model):
        return preset(model)
    path = os.path.join(model, "config.json")
    if has_module("qtrain.model.registry"):
        from qtrain.model.registry import config_from_json_file
        return config_from_json_file(path)
    from qtrain.model.config import ModelConfig  # before the model families' registry
    return ModelConfig.from_json_file(path)
