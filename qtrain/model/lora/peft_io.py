"""PEFT's adapter format, written and read: `adapter_config.json` + `adapter_model.safetensors`, the directory
`peft.PeftModel.from_pretrained(base, DIR)` loads.

Keys are peft's (`base_model.model.model.layers.{l}.self_attn.q_proj.lora_A.weight`, ...: the adapter tensors'
HF parts, `tensors.py`). Written through the export's machinery (`hf_io.write_export`: staged files, a manifest,
never over a file no qtrain export wrote). Read (--lora-init-from) only after every check passed: no interrupted
qtrain export (`hf_io.check_export_complete`: its files may mix two exports), the config's fields that change the
math are the run's (rank, targets, alpha; no DoRA, rsLoRA, bias or per-layer patterns), and the safetensors header
has exactly the run's keys with their shapes, before any tensor is read; values must be finite.

Adapters of an MoE model's experts (tensors.py) are peft's `target_parameters` (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`), with gate_up's rank and alpha doubled by `rank_pattern`/`alpha_pattern` ('.*\\.gate_up_proj',
as peft's own conversion of target_modules gate_proj + up_proj writes them). peft's ParamWrapper refuses any
lora_dropout, so such an adapter is written with lora_dropout 0 (dropout changes training only, not what the adapter
computes). peft >= 0.22 keeps a transformers-4 name it converted (gate_proj, up_proj, down_proj) in target_modules
where a linear of that name exists too (a dense layer's MLP, a shared expert) and adapts that linear as well: the
name is accepted beside the expert parameters it names, the adapter's tensors of those linears are refused with a
message that says why (qtrain adapts only the routed experts of an MoE model's MLPs).
"""
from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import SafetensorError, safe_open

from qtrain.fsio import CONFIG_MAX_BYTES, InputError, check_regular_file, read_json_input, shorten
from qtrain.model.config import ModelConfig
from qtrain.model.hf_io import FLOAT_DTYPES, IncompleteExportError, check_export_complete, write_export
from qtrain.model.lora.spec import LoraError, LoraSpec
from qtrain.model.lora.tensors import (EXPERT_MATRICES, adapter_specs, base_module_names, base_parameter_names,
                                       peft_v4_expert_modules)
from qtrain.model.weights import to_hf

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# fields of adapter_config.json that change what the adapter computes, and the only value qtrain implements
_PLAIN = {"use_dora": False, "use_rslora": False, "bias": "none", "fan_in_fan_out": False,
          "layers_to_transform": None, "modules_to_save": None}
# the adapter key of a dense MLP's or a shared expert's projection (peft >= 0.22 adapts those in an MoE model too)
_DENSE_MLP_ADAPTER = re.compile(r"\.mlp\.(shared_expert\.)?(gate|up|down)_proj\.lora_[AB]\.weight$")
GATE_UP_PATTERN = r".*\.gate_up_proj"  # peft's rank_pattern / alpha_pattern key of the experts' fused gate_up_proj


def _number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def _patterns(cfg: ModelConfig, spec: LoraSpec, alpha: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """peft's rank_pattern and alpha_pattern of this adapter: gate_up_proj's doubled rank and alpha (module
    docstring), or none."""
    ug = EXPERT_MATRICES["experts_up_gate"][0]
    if not any(p.endswith(ug) for p in base_parameter_names(cfg, spec)):
        return {}, {}
    return {GATE_UP_PATTERN: 2 * spec.rank}, {GATE_UP_PATTERN: _number(2 * alpha)}


def adapter_config(cfg: ModelConfig, spec: LoraSpec, base: str) -> dict[str, Any]:
    """The adapter_config.json peft writes for this adapter (`base`: the base model's name or path)."""
    params = base_parameter_names(cfg, spec)
    ranks, alphas = _patterns(cfg, spec, spec.alpha)
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": spec.rank,
            "lora_alpha": _number(spec.alpha), "lora_dropout": 0.0 if params else spec.dropout,
            "target_modules": base_module_names(cfg, spec), "target_parameters": params or None,
            "init_lora_weights": True, "inference_mode": True, "layers_pattern": None, "revision": None, **_PLAIN,
            "rank_pattern": ranks, "alpha_pattern": alphas}


def save_adapter(out_dir: str | os.PathLike, cfg: ModelConfig, spec: LoraSpec, adapters: Mapping[str, torch.Tensor],
                 *, base: str, dtype: torch.dtype, owner: Mapping[str, Any] | None = None,
                 extra_files: Mapping[str, bytes] | None = None) -> Path:
    """Write the adapter tensors `adapters` (internal name -> tensor, every adapter of `spec`) in PEFT's format, with
    `extra_files` (the tokenizer files an export carries) beside them."""
    specs = adapter_specs(cfg, spec)
    if set(adapters) != set(specs):
        raise LoraError(f"save_adapter: got {sorted(set(adapters) ^ set(specs))[:3]} beyond or short of the adapters")
    hf = {key: part for name, t in adapters.items() for key, part in to_hf(specs[name], t).items()}
    nbytes = sum(t.numel() for t in hf.values()) * dtype.itemsize
    files = {CONFIG_FILE: adapter_config(cfg, spec, base), WEIGHTS_FILE: hf, **dict(extra_files or {})}
    return write_export(out_dir, files, dtype=dtype, nbytes=nbytes, owner=owner)


def read_config(adapter_dir: str, cfg: ModelConfig, spec: LoraSpec, *, option: str = "--lora-init-from") -> float:
    """Check `adapter_dir`'s adapter_config.json against the run (LoraError naming the file and field); returns its
    lora_alpha."""
    path = Path(adapter_dir) / CONFIG_FILE
    where = f"{option} {shorten(str(path))}"
    if not Path(adapter_dir).is_dir():
        raise LoraError(f"{option} {shorten(str(adapter_dir))}: not a directory (a PEFT adapter: {CONFIG_FILE} + "
                        f"{WEIGHTS_FILE})")
    try:  # an interrupted qtrain export: its config and weights may be of two exports
        check_export_complete(adapter_dir)
    except IncompleteExportError as e:
        raise LoraError(f"{option} {e}") from None
    if not os.path.lexists(path):
        raise LoraError(f"{where}: file not found")
    try:
        d = read_json_input(path, "", CONFIG_MAX_BYTES)
    except InputError as e:
        raise LoraError(f"{option} {e}") from None
    if not isinstance(d, dict):
        raise LoraError(f"{where}: not a JSON object")
    if d.get("peft_type") != "LORA":
        raise LoraError(f"{where}: peft_type {shorten(repr(d.get('peft_type')))} is not 'LORA'")
    for key, plain in _PLAIN.items():
        v = d.get(key, plain)
        if not (v == plain or (plain == {} and v is None)):
            raise LoraError(f"{where}: {key}={shorten(repr(d.get(key)))} is not supported (only {plain!r})")
    r = d.get("r")
    if r != spec.rank:
        raise LoraError(f"{where}: r={shorten(repr(r))}, this run's --lora-rank is {spec.rank}")
    params = d.get("target_parameters") or []
    params = [params] if isinstance(params, str) else params
    modules = d.get("target_modules")
    modules = [modules] if isinstance(modules, str) else modules
    want = base_module_names(cfg, spec)
    # peft >= 0.22 keeps the experts' transformers-4 names (gate_proj, ...) beside the target_parameters it made of them
    v4 = peft_v4_expert_modules(params) if isinstance(params, list) else set()
    if not isinstance(modules, list) or not set(want) <= set(map(str, modules)) <= set(want) | v4:
        raise LoraError(f"{where}: target_modules {shorten(repr(modules))} differ from this run's --lora-targets "
                        f"({', '.join(want)})")
    want = base_parameter_names(cfg, spec)
    if not isinstance(params, list) or sorted(str(p).rsplit(".", 1)[-1] for p in params) != sorted(
            p.rsplit(".", 1)[-1] for p in want):
        raise LoraError(f"{where}: target_parameters {shorten(repr(params))} differ from this run's --lora-targets "
                        f"({', '.join(want) or 'no expert parameters'})")
    alpha = d.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0 or not math.isfinite(alpha):
        raise LoraError(f"{where}: lora_alpha {shorten(repr(alpha))} is not a positive number")
    for key, plain in zip(("rank_pattern", "alpha_pattern"), _patterns(cfg, spec, float(alpha))):
        v = d.get(key) or {}
        if not (isinstance(v, dict) and v == plain):
            raise LoraError(f"{where}: {key}={shorten(repr(d.get(key)))} is not supported (only {plain!r}: "
                            f"{'gate_up_proj at twice r and lora_alpha' if plain else 'one r and lora_alpha'})")
    return float(alpha)


def read_adapter(adapter_dir: str, cfg: ModelConfig, spec: LoraSpec, *, option: str = "--lora-init-from",
                 load: bool = True) -> dict[str, torch.Tensor] | None:
    """The adapter's tensors by PEFT key (fp32), after `read_config` and a check of the safetensors header against
    the run's adapters (every key, its shape, a float dtype) and of the values (finite). `load` False: the checks
    that need no tensor data only (the preflight)."""
    read_config(adapter_dir, cfg, spec, option=option)
    path = Path(adapter_dir) / WEIGHTS_FILE
    where = f"{option} {shorten(str(path))}"
    if not os.path.lexists(path):
        raise LoraError(f"{where}: file not found")
    try:
        check_regular_file(path, "")
    except InputError as e:
        raise LoraError(f"{option} {e}") from None
    want = {k: shape for s in adapter_specs(cfg, spec).values() for k, shape in s.hf}
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            missing, extra = sorted(set(want) - keys), sorted(keys - set(want))
            if missing or extra:
                dense = [k for k in extra if getattr(cfg, "router", None) and _DENSE_MLP_ADAPTER.search(k)]
                if not missing and dense:
                    raise LoraError(f"{where}: has tensor {shorten(dense[0])}: an adapter of a dense MLP or shared "
                                    "expert in an MoE model (peft >= 0.22 adapts those for target_modules gate_proj/"
                                    "up_proj/down_proj); qtrain adapts only the routed experts of an MoE model's MLPs")
                what = f"has no tensor {missing[0]}" if missing else f"has unexpected tensor {shorten(extra[0])}"
                raise LoraError(f"{where}: {what} (an adapter of another base model, rank or targets?)")
            for k, shape in want.items():
                sl = f.get_slice(k)
                if sl.get_dtype() not in FLOAT_DTYPES or tuple(sl.get_shape()) != shape:
                    raise LoraError(f"{where}: tensor {k} is {sl.get_dtype()} {list(sl.get_shape())}, this base model "
                                    f"and rank need a float tensor of shape {list(shape)}")
            if not load:
                return None
            out = {}
            for k in want:
                t = f.get_tensor(k).float()
                if not torch.isfinite(t).all():
                    raise LoraError(f"{where}: tensor {k} has non-finite values")
                out[k] = t
            return out
    except SafetensorError as e:
        raise LoraError(f"{where}: not a readable safetensors file ({shorten(str(e))})") from None
    except OSError as e:
        raise LoraError(f"{where}: cannot be read ({e.strerror or e})") from None


__all__ = ["CONFIG_FILE", "WEIGHTS_FILE", "adapter_config", "read_adapter", "read_config", "save_adapter"]
