"""The recompute switches as names and set rules, without torch (the options and the CLI name them; `recompute.py`
holds the mechanism and its docstring the whole story).

- `IMPLIES`: --recompute-ffn => swiglu, --recompute-att => qkv, --recompute-block => att, ffn, norm.
- `STEPS`: the block steps each switch reruns in backward instead of keeping their results from forward.
- `MLP_STEPS`: the steps a block's one-function MLP covers; recomputing one of them splits it.
"""
from __future__ import annotations

from typing import Iterable

FLAGS = ("swiglu", "norm", "ffn", "qkv", "att", "block")
IMPLIES = {"ffn": ("swiglu",), "att": ("qkv",), "block": ("att", "ffn", "norm")}
STEPS = {"norm": ("ln1", "ln2"), "swiglu": ("swiglu",), "qkv": ("qkv",), "att": ("ln1", "attention"),
         "ffn": ("ln2", "up"), "block": ()}


def resolve_flags(flags: Iterable[str]) -> frozenset[str]:
    """The given recompute switches plus everything they imply (llm.q's post-parse logic)."""
    out: set[str] = set()
    todo = list(flags)
    while todo:
        f = todo.pop()
        if f not in FLAGS:
            raise ValueError(f"unknown recompute switch {f!r}; known: {', '.join(FLAGS)}")
        if f not in out:
            out.add(f)
            todo.extend(IMPLIES.get(f, ()))
    return frozenset(out)


def recompute_label(flags: Iterable[str]) -> str:
    """A short name of a recompute set for tables and logs: 'none', 'block', or e.g. 'norm+swiglu'."""
    flags = resolve_flags(flags)
    if "block" in flags:
        return "block"
    on = [f for f in ("norm", "qkv", "att", "swiglu", "ffn") if f in flags]
    return "+".join(on) if on else "none"


def block_steps(flags: Iterable[str]) -> frozenset[str]:
    """Steps recomputed inside one block call: none with `block` (the loop reruns the whole block)."""
    flags = resolve_flags(flags)
    if "block" in flags:
        return frozenset()
    return frozenset(s for f in flags for s in STEPS[f])


MLP_STEPS = frozenset({"up", "swiglu"})  # recomputing either runs the MLP as separate steps, not one function


def splits_mlp(flags: Iterable[str]) -> bool:
    """Whether these switches rerun the up projection or SwiGLU as steps of their own inside the block, so that
    the MLP cannot be one function (--recompute-swiglu, --recompute-ffn; not --recompute-block, which reruns the
    whole block, MLP function included)."""
    return bool(MLP_STEPS & block_steps(flags))
