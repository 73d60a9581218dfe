"""--rope-scaling: extending a model's context past its config's positions, as a fine-tune for long context does.

A checkpoint made for N positions (Qwen2.5-7B: 32,768) trains at a longer --seq-len only with its RoPE frequencies
scaled; the Qwen model cards ask users to add a `rope_scaling` entry to config.json by hand, and LLaMA-Factory's
`rope_scaling` option writes one for the run. `--rope-scaling TYPE[:FACTOR]` does it here without touching the
model's files: the run's config gains {"rope_type": TYPE, "factor": FACTOR, ...} (the keys each type needs,
kernels/rope_scaling.py `SCALING_KEYS`: the original context for yarn and llama3, Llama 3.1's frequency factors
1 and 4 for llama3), computed exactly as transformers computes that config, and the export writes it, so the
exported model loads in transformers at the new length. FACTOR defaults to --seq-len over the model's positions,
rounded up to a whole number (LLaMA-Factory's rule). `max_position_embeddings` stays the model's (the original
context that yarn, llama3 and dynamic scale from; Qwen's own YaRN entry keeps it too): the extended context is
`ModelConfig.context_length`.

A model whose config already has other RoPE scaling is refused (scaling it twice is not what any checkpoint means);
one that has exactly the scaling asked for is taken as it is (the export of such a run, or the base a LoRA run's
merge is pointed at after its config.json was given the scaling). An unknown type or a factor below 1 is refused.
"""
from __future__ import annotations

import json
import math
import re

from qtrain.kernels.rope_scaling import SCALING_KEYS
from qtrain.model.config import ModelConfig, check_rope_scaling

__all__ = ["LLAMA3_FREQ_FACTORS", "ContextExtensionError", "adapter_note", "extend_context", "parse_rope_scaling"]

LLAMA3_FREQ_FACTORS = (1.0, 4.0)  # low_freq_factor, high_freq_factor of Llama 3.1's config (and LLaMA-Factory's)
_NUMBER = re.compile(r"[0-9]+(\.[0-9]*)?")  # a factor as --rope-scaling takes it: digits, an optional fraction


class ContextExtensionError(ValueError):
    """A --rope-scaling value or a model it cannot extend; the message names the option."""


def parse_rope_scaling(text: str) -> tuple[str, float | None]:
    """'TYPE' or 'TYPE:FACTOR' -> (type, factor or None); ContextExtensionError naming the part that is wrong."""
    kind, sep, factor = text.partition(":")
    if kind not in SCALING_KEYS:
        raise ContextExtensionError(f"--rope-scaling {text!r}: the type must be one of {', '.join(SCALING_KEYS)}")
    if not sep:
        return kind, None
    value = float(factor) if _NUMBER.fullmatch(factor) else math.nan  # no blanks, signs or '_' (float() takes them)
    if not (math.isfinite(value) and value >= 1):
        raise ContextExtensionError(f"--rope-scaling {text!r}: the factor must be a number >= 1 (e.g. {kind}:4)")
    return kind, value


def extend_context(cfg: ModelConfig, text: str, seq_len: int) -> ModelConfig:
    """`cfg` with the RoPE scaling --rope-scaling `text` asks for at --seq-len `seq_len` ('' : `cfg` itself)."""
    if not text:
        return cfg
    kind, factor = parse_rope_scaling(text)
    if cfg.rope_scaling:
        have = {k: v for k, v in cfg.rope_scaling.items() if v is not None}
        if have == _scaling(text, kind, factor, seq_len, cfg.max_position_embeddings, check_length=False):
            return cfg
        raise ContextExtensionError(
            f"--rope-scaling {text}: the model's config already has other RoPE scaling ({have}, context "
            f"{cfg.context_length}); drop the option")
    return cfg.replace(rope_scaling=_scaling(text, kind, factor, seq_len, cfg.max_position_embeddings))


def _scaling(text: str, kind: str, factor: float | None, seq_len: int, original: int, *, check_length: bool = True
             ) -> dict:
    """The rope_scaling dict of --rope-scaling `text` for a model of `original` positions at `seq_len`."""
    if factor is None:
        if seq_len <= original and check_length:
            raise ContextExtensionError(
                f"--rope-scaling {text}: --seq-len {seq_len} is within the model's {original} positions; give the "
                f"factor to extend it anyway (e.g. {kind}:2)")
        factor = float(max(1, math.ceil(seq_len / original)))
    scaling: dict = {"rope_type": kind, "factor": factor}
    if kind in ("yarn", "llama3"):
        scaling["original_max_position_embeddings"] = original
    if kind == "llama3":
        scaling["low_freq_factor"], scaling["high_freq_factor"] = LLAMA3_FREQ_FACTORS
    check_rope_scaling(scaling)
    return scaling


def adapter_note(option: str, cfg: ModelConfig) -> str | None:
    """What a PEFT adapter export of a run with --rope-scaling `option` must tell: the adapter holds no config, so its
    base must be given the run's scaling to run as the run trained (None without the option)."""
    if not option:
        return None
    return (f"the run extended its base's context (--rope-scaling {option}): the PEFT adapter holds only the adapters; "
            f"load its base with \"rope_parameters\" (or \"rope_scaling\" where its config.json has no "
            f"\"rope_parameters\") set to {json.dumps(cfg.rope_scaling)} plus its rope_theta, or export with --lora-merge, "
            f"whose config.json carries it")
