"""What a checkpoint's shard files must hold, and the checks that refuse a state training cannot continue from.

A shard file of kind `weights`, `adam.m` or `adam.v` written by `world` ranks holds one 1-D tensor per group of
`FlatLayout(cfg, world)` (the group's shard: `shard_size(world)` elements) in the run's dtype: the master dtype
for weights, --opt-m-dtype / --opt-v-dtype for the moments, and with an e4m3 m also the fp32 block scales
under `<group>.scales`. Anything else (a missing or extra tensor, another dtype or shape, a header naming
another file) is refused before a byte of tensor data is read (`header_problem`).

The values (`value_problem`): weights and moments are finite (a non-finite step is skipped, never applied, so a
checkpoint never holds a NaN or inf that training put there), and Adam's v and the e4m3 scales are never
negative (v is a running mean of squares). A checkpoint that breaks one of these would train on nothing but
skipped steps (`norm nan`) or export a broken model.

Each check returns a one-line problem naming the file and the tensor (None when all is well); the callers
(`checkpointing`, `export`) decide what to refuse and say what to do instead.
"""
from __future__ import annotations

from pathlib import Path

import torch

from qtrain.model.config import ModelConfig
from qtrain.parallel.layout import FlatLayout
from qtrain.parallel.optimizer import DTYPES, SCALES_SUFFIX, group_m_scales

Expected = dict[str, tuple[torch.dtype | None, tuple[int, ...]]]  # tensor name -> (dtype or None: any, shape)
KIND_DTYPES = {"weights": ("fp32", "bf16"), "adam.m": ("fp32", "bf16", "e4m3"), "adam.v": ("fp32", "bf16")}


def expected_tensors(cfg: ModelConfig, world: int, kind: str, dtype: str | None) -> Expected:
    """The tensors every rank's shard file of `kind` holds (the same names and shapes on every rank).
    `dtype` None: not known (a meta without options); any dtype `kind` can have is accepted then, and an
    e4m3 m's scales are expected when the file holds them."""
    layout = FlatLayout(cfg, world)
    dt = DTYPES[dtype] if dtype is not None else None
    out: Expected = {g.key: (dt, (g.shard_size(world),)) for g in layout.groups}
    if kind == "adam.m" and dtype in ("e4m3", None):
        for g in layout.groups:
            out[g.key + SCALES_SUFFIX] = (torch.float32, (group_m_scales(g, world),))
    return out


def header_problem(file: Path, kind: str, expected: Expected, found: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                   name_in_file: str | None = None) -> str | None:
    """Why the tensors `found` in `file` (its header: name -> (dtype, shape)) are not what a shard of `kind`
    holds (`expected`), or None. `name_in_file`: the file name its writer recorded in the header."""
    stem = file.name.removesuffix(".safetensors")
    if name_in_file is not None and name_in_file != stem:
        return (f"{file}: holds the shard written as {name_in_file[:80]}.safetensors (files swapped or renamed: "
                f"each rank's shard must keep its own name)")
    optional = {k for k in expected if k.endswith(SCALES_SUFFIX) and expected[k.removesuffix(SCALES_SUFFIX)][0] is None}
    missing = sorted(set(expected) - set(found) - optional)
    extra = sorted(set(found) - set(expected))
    if missing or extra:
        what = (f"has no tensor {', '.join(missing[:3])}" if missing else "") + ("; " if missing and extra else "") + (
            f"has unexpected tensor(s) {', '.join(k[:80] for k in extra[:3])}" if extra else "")
        return f"{file}: {what} (a shard of {kind} holds one tensor per parameter group)"
    allowed = {DTYPES[d] for d in KIND_DTYPES[kind]}
    for key, (dtype, shape) in found.items():
        want_dtype, want_shape = expected[key]
        if key.endswith(SCALES_SUFFIX):
            allowed_here = {torch.float32}
        else:
            allowed_here = {want_dtype} if want_dtype is not None else allowed
        if dtype not in allowed_here:
            return (f"{file}: tensor {key} is {_dtype_name(dtype)}, this run keeps {kind} in "
                    f"{' or '.join(sorted(_dtype_name(d) for d in allowed_here))}")
        if tuple(shape) != want_shape:
            return f"{file}: tensor {key} has shape {list(shape)}, a shard of {kind} has {list(want_shape)} here"
    codes = {d for k, (d, _) in found.items() if not k.endswith(SCALES_SUFFIX)}
    if len(codes) > 1:
        return f"{file}: its tensors mix dtypes {', '.join(sorted(map(_dtype_name, codes)))}"
    if kind == "adam.m" and (torch.float8_e4m3fn in codes) != any(k.endswith(SCALES_SUFFIX) for k in found):
        return f"{file}: an e4m3 m needs its block scales (<group>{SCALES_SUFFIX}), and only an e4m3 m has them"
    return None


def value_problem(file: Path, kind: str, key: str, t: torch.Tensor, layout: FlatLayout | None = None,
                  rank: int = 0) -> str | None:
    """Why tensor `key` of `file` (a shard of `kind`, on whatever device it lives) is a state training cannot
    continue from, or None: a NaN or inf anywhere; a negative Adam v or e4m3 scale. With the `layout` the file
    was written for (and the shard's `rank`), the first bad element is named by its parameter."""
    bad = t.isnan() if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else ~torch.isfinite(t)
    what = "NaN/inf value(s)"
    n = int(bad.sum())
    if not n and (kind == "adam.v" or key.endswith(SCALES_SUFFIX)):
        bad = t < 0
        what = "negative value(s) (" + ("Adam's v is a running mean of squares" if kind == "adam.v"
                                         else "a block scale") + ")"
        n = int(bad.sum())
    if not n:
        return None
    first = int(bad.reshape(-1).nonzero()[0, 0])
    where = _element(layout, key, rank, first) if layout is not None and not key.endswith(SCALES_SUFFIX) else ""
    return f"{file}: tensor {key} holds {n} {what}, the first at element {first}{where}"


def _element(layout: FlatLayout, key: str, rank: int, index: int) -> str:
    """' (parameter NAME, element i)' for element `index` of rank `rank`'s shard of group `key`."""
    g = layout.by_key.get(key)
    if g is None:
        return ""
    at = g.shard_range(rank, layout.world)[0] + index
    for s in g.segments:
        if s.start <= at < s.start + s.numel:
            return f" (parameter {s.name}, element {at - s.start})"
    return " (group padding)"


def _dtype_name(d: torch.dtype | None) -> str:
    return str(d).removeprefix("torch.")
