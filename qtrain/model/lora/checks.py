"""A run's LoRA settings resolved against its model: the option values (a mapping of Options' field names, so
this layer needs no options import) -> a checked `LoraSpec`, or the one-line LoraError naming the option or file.

What is checked here, before the model is built (the preflight calls `spec_from_options(..., check_adapter=True)`):
the targets are the model's (`tensors.known_targets`), the rank fits every targeted matrix (r <= min(out, in): a
larger rank adds nothing a full-rank update would not, and peft refuses nothing there), and a --lora-init-from
adapter's config and tensor header are the run's (`peft_io.read_adapter(load=False)`), and an e4m3 base
(`--lora-base-dtype e4m3`) is one the family can hold only as e4m3 (`e4m3_base_error`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from qtrain.fsio import CONFIG_MAX_BYTES, InputError, read_json_input
from qtrain.model.config import ModelConfig
from qtrain.model.registry import family_of
from qtrain.model.lora.peft_io import CONFIG_FILE, read_adapter, read_config
from qtrain.model.lora.spec import DEFAULT_TARGETS, LoraError, LoraSpec, default_alpha, parse_targets
from qtrain.model.lora.tensors import (EXPERT_MATRICES, adapted_experts, expert_targets, known_targets, layer_targets,
                                       peft_v4_expert_modules)
from qtrain.model.weights import statements


def check_dims(cfg: ModelConfig, spec: LoraSpec) -> None:
    """LoraError when the rank exceeds a targeted matrix's smaller dimension (in any layer)."""
    for layer in range(cfg.num_hidden_layers):
        for t in layer_targets(cfg, layer).values():
            if t.name in spec.targets and spec.rank > min(t.rows, t.cols):
                raise LoraError(f"--lora-rank {spec.rank} is larger than target {t.name}'s dimensions ({t.rows} x "
                                f"{t.cols}); choose a rank <= {min(t.rows, t.cols)} or drop {t.name} from "
                                f"--lora-targets")
        for t in expert_targets(cfg, layer).values():  # each expert's gate, up (F x C) and down (C x F)
            rows = t.rows // len(t.names)
            if set(t.names) & set(spec.targets) and spec.rank > min(rows, t.cols):
                raise LoraError(f"--lora-rank {spec.rank} is larger than the experts' {'/'.join(t.names)} dimensions "
                                f"({rows} x {t.cols} per expert); choose a rank <= {min(rows, t.cols)} or drop "
                                f"{','.join(t.names)} from --lora-targets")
        for t in expert_targets(cfg, layer).values():
            named = [n for n in t.names if n in spec.targets]
            if named and len(named) < len(t.names):
                raise LoraError(f"--lora-targets: {named[0]} without {(set(t.names) - set(named)).pop()}: an MoE "
                                f"model's experts hold gate and up as one matrix (transformers' gate_up_proj, one "
                                f"adapter for both, as peft); name both or neither")


def e4m3_base_error(cfg: ModelConfig) -> str | None:
    """Why `--lora-base-dtype e4m3` cannot hold this model's frozen base only as e4m3, or None. The e4m3 base is the
    block matrices that run through the block's linear (the family's `fp8_matrices`: the frozen e4m3 linear replaces
    it); a matrix the block multiplies itself (an MoE's experts and router, Qwen3.5-MoE's shared expert) has no e4m3
    path and would stay in the model dtype, so such a model is refused, naming its family and those matrices."""
    family = family_of(cfg)
    own = {s.name: None for block in statements(cfg).blocks for s in block
           if (s.experts or len(s.shape) == 2) and s.name not in family.fp8_matrices}
    if not own:
        return None
    return (f"--lora-base-dtype e4m3 is not supported for model type {cfg.model_type!r} (the {family.name} family): "
            f"the block multiplies its {', '.join(own)} itself, with no e4m3 path (they would stay in the model "
            f"dtype); drop --lora-base-dtype")


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
    why_not = {n: "an MoE model's MLP matrix (peft maps it onto the experts, which qtrain does not adapt; the "
                  "attention's linears are targets)" for n in ("gate", "up", "down")
               if n not in known and getattr(cfg, "router", None)}
    moe = any(n in known for n in ("gate", "up", "down")) and getattr(cfg, "router", None)
    why_not.update({n: "not a target name: the experts' projections are gate, up (together: gate_up_proj) and down"
                    if moe else "an MoE model's experts (this model has no routed layer to adapt)"
                    for n in ("experts", "gate_up")})
    targets = parse_targets(text or ",".join(t for t in DEFAULT_TARGETS if t in known) or ",".join(known), known,
                            why_not)
    spec = LoraSpec(rank, float(v.get("lora_alpha") or 0.0) or 1.0, float(v.get("lora_dropout") or 0.0), targets,
                    v.get("lora_base_dtype") or "")
    check_dims(cfg, spec)
    ep = int(v.get("expert_parallel") or 1)
    if ep > 1 and any(adapted_experts(cfg, spec, layer) for layer in range(cfg.num_hidden_layers)):
        mlp = ",".join(t for t in targets if t in ("gate", "up", "down"))
        raise LoraError(f"--lora-rank with --expert-parallel {ep}: targets {mlp} adapt the experts, which expert "
                        "parallelism spreads over ranks: not built yet (adapt the attention, e.g. --lora-targets "
                        "q,k,v,o, or drop --expert-parallel)")
    why = e4m3_base_error(cfg) if spec.base_dtype == "e4m3" else None
    if why:
        raise LoraError(why)
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
    params = d.get("target_parameters") if isinstance(d, dict) else None
    params = [params] if isinstance(params, str) else params if isinstance(params, list) else []
    experts = {param: names for param, names in EXPERT_MATRICES.values()}  # 'gate_up_proj' -> ('gate', 'up')
    v4 = peft_v4_expert_modules(params)  # peft >= 0.22's names of the expert parameters: named by those below
    leaves = [str(m).rsplit(".", 1)[-1] for m in modules]
    return [m for m in leaves if m not in v4] + [
        n for p in params for n in experts.get(str(p).rsplit(".", 1)[-1], ())]


def spec_from_record(d: Any) -> LoraSpec | None:
    """The spec a checkpoint records (`LoraSpec.record`; None: a full fine-tune)."""
    if not d:
        return None
    return LoraSpec(int(d["rank"]), float(d["alpha"]), float(d["dropout"]), tuple(d["targets"]),
                    str(d.get("base_dtype") or ""))
