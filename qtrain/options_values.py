"""The values options take and the error a bad one raises, without torch (`qtrain --help` and every command import
them): the fixed choices of each such field, which fields take '' to mean "follow another", and the closest-name
hint for a mistyped one."""
from __future__ import annotations

from typing import Any, Callable, Iterable

from qtrain.model.choices import (CONTEXT_PARALLEL_MODES, DELTA_RULE_PRECISION_OPTIONS, DOCUMENT_ATTENTION,
                                  FP8_POLICIES, SDPA_BACKENDS)

DTYPES = ("fp32", "bf16")
MATMUL_DTYPES = ("fp32", "bf16", "e4m3")
GRADIENT_DTYPES = ("e4m3", "e5m2")
OPT_M_DTYPES = ("fp32", "bf16", "e4m3")
OPT_V_DTYPES = ("fp32", "bf16")
SCHEDULES = ("cosine", "linear", "wsd")
DEFAULT_MODEL = "qtrain-tiny"  # the embedded default: a small model trained on the embedded corpus


# fields with a fixed set of values (validate() checks them; the CLI lists them in --help)
CHOICES: dict[str, tuple[str, ...]] = {
    "model_dtype": DTYPES, "master_dtype": DTYPES, "grad_accum_dtype": DTYPES, "fp8_policy": FP8_POLICIES,
    "matmul_dtype": MATMUL_DTYPES, "gradient_dtype": GRADIENT_DTYPES, "opt_m_dtype": OPT_M_DTYPES,
    "opt_v_dtype": OPT_V_DTYPES, "lr_schedule": SCHEDULES, "device": ("auto", "cpu", "cuda"),
    "compile": ("auto", "on", "off"), "sdpa_backend": SDPA_BACKENDS, "lora_base_dtype": ("e4m3",),
    "document_attention": DOCUMENT_ATTENTION, "context_parallel_mode": CONTEXT_PARALLEL_MODES,
    "delta_rule_precision": DELTA_RULE_PRECISION_OPTIONS, "swiglu_epilogue": ("auto", "on", "off"),
}
# '' = follow the model / matmul dtype
EMPTY_MEANS_DEFAULT = ("matmul_dtype", "gradient_dtype", "master_dtype", "grad_accum_dtype", "lora_base_dtype")


def meant(get: Callable[[str], Any], name: str) -> Any:
    """What option `name` means, read through `get` (an Options' getattr or a recorded options dict's get): '' of an
    EMPTY_MEANS_DEFAULT option is the value it follows (the model dtype; --grad-accum-dtype the master's;
    --gradient-dtype e4m3, its FP8 default), so an explicit default and '' name the same run."""
    value = get(name)
    if value or name not in EMPTY_MEANS_DEFAULT:
        return value
    if name == "gradient_dtype":
        return "e4m3"
    if name == "grad_accum_dtype":
        return meant(get, "master_dtype")
    return get("model_dtype")


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate most like a mistyped `name`, for "did you mean ...?" hints. The similarity cut-off (difflib
    ratio 0.7) takes typos (--stesp: 0.86) and cut-off names (--grad-accum: 0.77), not unrelated words
    (--frobnicate vs --from-scratch: 0.62)."""
    import difflib
    found = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.7)
    return found[0] if found else None


class OptionsError(ValueError):
    """A bad option or combination of options; the message names the option(s) and the fix."""
