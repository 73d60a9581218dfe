"""A run's LoRA settings resolved against its model: the option values (a mapping of Options' field names, so
this layer needs no options import) -> a checked `LoraSpec`, or the one-line LoraError naming the option or file.

What is checked here, before the model is built (the preflight calls `spec_from_options(..., check_adapter=True)`):
the targets are the model's (`tensors.known_targets`), the rank fits every targeted matrix (r <= min(out, in): a
larger rank adds nothing a full-rank update would not, and peft refuses nothing there), and a --lora-init-from
adapter's config and tensor header are the run's (`peft_io.read_adapter(load=False)`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from qtrain.fsio import CONFIG_MAX_BYTES, InputError, read_json_input
from qtrain.model.config import ModelConfig
from qtrain.model.lora.peft_io import CONFIG_FILE, read_adapter, read_config
from qtrain.model.lora.spec import DEFAULT_TARGETS, LoraError, LoraSpec, default_alpha, parse_targets
from qtrain.model.lora.tensors import known_targets, layer_targets


def check_dims(cfg: ModelConfig, spec: LoraSpec) -> None:
    """LoraError when the rank exceeds a targeted matrix's smaller dimension (in any layer)."""
    for layer in range(cfg.num_hidden_layers):
        for t in layer_targets(cfg, layer).values():
            if t.name in spec.targets and spec.rank > min(t.rows, t.cols):
                raise LoraError(f"--lora-rank {spec.rank} is larger than target {t.name}'s dimensions ({t.rows} x "
                                f"{t.cols}); choose a rank <= {min(t.rows, t.cols)} or drop {t.name} from "
                                f"--lora-targets")


def spec_from_options(v: Mapping[str, Any], cfg: ModelConfig, *, check_adapter: bool = False) -> LoraSpec | None:
    """The run's LoRA settings (None without --lora-rank), checked against `cfg` (module docstring); `check_adapter`:
    also the --lora-init-from adapter's tensor header."""
    rank = int(v.get("lora_rank") or 0)
    if rank <= 0:
        return None
    known = known_targets(cfg)
    text = v.get("lora_targets") or ""
    init_from = v.get("lora_init_from") or ""
    if not text and init_from:  # the adapter's targets
        text = ",".join(_adapter_targets(init_from, cfg, rank))
    targets = parse_targets(text or ",".join(t for t in DEFAULT_TARGETS if t in known) or ",".join(known), known)
    spec = LoraSpec(rank, float(v.get("lora_alpha") or 0.0) or 1.0, float(v.get("lora_dropout") or 0.0), targets,
                    v.get("lora_base_dtype") or "")
    check_dims(cfg, spec)
    alpha = float(v.get("lora_alpha") or 0.0)
    if init_from:
        theirs = read_config(init_from, cfg, spec)
        if alpha and alpha != theirs:
            raise LoraError(f"--lora-init-from {init_from[:160]}: lora_alpha {theirs:g} differs from --lora-alpha "
                            f"{alpha:g} (drop --lora-alpha to keep the adapter's)")
        alpha = theirs
        if check_adapter:
            read_adapter(init_from, cfg, spec, load=False)
    return LoraSpec(rank, alpha or default_alpha(rank), spec.dropout, targets, spec.base_dtype)


def _adapter_targets(init_from: str, cfg: ModelConfig, rank: int) -> list[str]:
    """The target names an adapter's config lists (its target_modules, 'q_proj' -> 'q'); checked later in full."""
    try:
        d = read_json_input(Path(init_from) / CONFIG_FILE, "", CONFIG_MAX_BYTES)
    except (InputError, OSError):
        return []  # read_config names the problem
    modules = d.get("target_modules") if isinstance(d, dict) else None
    modules = [modules] if isinstance(modules, str) else modules if isinstance(modules, list) else []
    return [str(m).rsplit(".", 1)[-1] for m in modules]


def spec_from_record(d: Any) -> LoraSpec | None:
    """The spec a checkpoint records (`LoraSpec.record`; None: a full fine-tune)."""
    if not d:
        return None
    return LoraSpec(int(d["rank"]), float(d["alpha"]), float(d["dropout"]), tuple(d["targets"]),
                    str(d.get("base_dtype") or ""))
