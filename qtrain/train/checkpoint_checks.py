"""What a checkpoint's shard files must hold, and the checks that refuse a state training cannot continue from.

A shard file of kind `weights`, `adam.m` or `adam.v` written by `world` ranks holds one 1-D tensor per group of
`FlatLayout(cfg, world)` (the group's shard: `shard_size(world)` elements) in the dtype its options record: the
master dtype for weights, --opt-m-dtype / --opt-v-dtype for the moments, and with an e4m3 m also the fp32 block scales
under `<group>.scales`. Anything else (a missing file or tensor, an extra tensor, another dtype or shape, a
header naming another file, a header or a tokenizer file that is not the one whose digest checkpoint.json
records) is refused before a byte of tensor data is read (`check_files`, `header_problem`). This is the one
check of a checkpoint's files against its layout: the preflight of `--continue` and `qtrain export` run it,
and so does the load itself (`checkpointing.restore_state`), for the files each rank reads.

The values (`value_problem`): weights and moments are finite (a non-finite step is skipped, never applied, so a
checkpoint never holds a NaN or inf that training put there), and Adam's v and the e4m3 scales are never
negative (v is a running mean of squares). A checkpoint that breaks one of these would train on nothing but
skipped steps (`norm nan`) or export a broken model.

Each check returns a one-line problem naming the file and the tensor (None when all is well); `verify` runs
them all over a checkpoint directory. They take a meta that passed `checkpoint_meta.validate` (the schema). The
callers (`checkpointing`, `export`) decide what to refuse and say what to do instead.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

from qtrain.data.tokenizers import TOKENIZER_JSON_MAX_BYTES
from qtrain.fsio import InputError, read_bounded, shorten
from qtrain.model.config import ModelConfig
from qtrain.model.hf_io import TOKENIZER_FILES
from qtrain.model.lora.checks import spec_from_record
from qtrain.model.lora.spec import LoraSpec
from qtrain.parallel.layout import FlatLayout
from qtrain.parallel.optimizer import DTYPES, SCALES_SUFFIX, group_m_scales
from qtrain.train import checkpoint_io as cio
from qtrain.train import checkpoint_meta
from qtrain.train.checkpoint_io import CheckpointError

STATE_KINDS = ("weights", "adam.m", "adam.v")

Expected = dict[str, tuple[torch.dtype | None, tuple[int, ...]]]  # tensor name -> (dtype or None: any, shape)
_CHECK_CHUNK = 1 << 24  # elements checked at a time (value_problem)
KIND_DTYPES = {"weights": ("fp32", "bf16"), "adam.m": ("fp32", "bf16", "e4m3"), "adam.v": ("fp32", "bf16")}


LORA_META = "lora"  # checkpoint.json: a LoRA run's adapter settings (`LoraSpec.record`)


def lora_of(meta: dict) -> LoraSpec | None:
    """The LoRA settings a checkpoint records (None: a full fine-tune), which decide its layout."""
    try:
        return spec_from_record(meta.get(LORA_META))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint.json: {LORA_META} is not a LoRA record ({type(e).__name__})") from None


def shard_stem(kind: str, rank: int, world: int) -> str:
    """The name (without .safetensors) of rank `rank`'s shard file of `kind` in a checkpoint of `world` ranks."""
    return f"{kind}.shard_{rank:03d}_of_{world:03d}"


def checkpoint_layout(cfg: ModelConfig, meta: dict[str, Any]) -> FlatLayout:
    """The layout the checkpoint's shards were cut from: its world, its LoRA adapters (a LoRA run's files hold its
    trainable groups only) and the experts per rank of the --expert-parallel its options record (parallel/experts.py)."""
    return FlatLayout(cfg, meta["distributed"]["world"], lora=lora_of(meta), expert_parallel=expert_parallel_of(meta))


def expert_parallel_of(meta: dict[str, Any]) -> int:
    """The --expert-parallel a checkpoint was written with (1 before the option existed)."""
    ep = meta.get("options", {}).get("expert_parallel", 1)
    return ep if isinstance(ep, int) and ep >= 1 else 1


def expected_tensors(cfg: ModelConfig, world: int, kind: str, dtype: str | None, lora: LoraSpec | None = None,
                     expert_parallel: int = 1) -> Expected:
    """The tensors every rank's shard file of `kind` holds (the same names and shapes on every rank).
    `dtype` None: not known (the options record none a shard of `kind` can hold); any dtype `kind` can have is
    accepted then, and an e4m3 m's scales are expected when the file holds them."""
    layout = FlatLayout(cfg, world, lora=lora, expert_parallel=expert_parallel)  # LoRA: the adapters only
    dt = DTYPES[dtype] if dtype is not None else None
    out: Expected = {g.key: (dt, (g.shard_size(world),)) for g in layout.trainable_groups()}
    if kind == "adam.m" and dtype in ("e4m3", None):
        for g in layout.trainable_groups():
            out[g.key + SCALES_SUFFIX] = (torch.float32, (group_m_scales(g, world),))
    return out


def header_problem(file: Path, kind: str, expected: Expected, found: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                   name_in_file: str | None = None) -> str | None:
    """Why the tensors `found` in `file` (its header: name -> (dtype, shape)) are not what a shard of `kind`
    holds (`expected`), or None. `name_in_file`: the file name its writer recorded in the header."""
    stem = file.name.removesuffix(".safetensors")
    if name_in_file is not None and name_in_file != stem:
        return (f"{file}: holds the shard written as {shorten(name_in_file)}.safetensors (files swapped or renamed: "
                f"each rank's shard must keep its own name)")
    optional = {k for k in expected if k.endswith(SCALES_SUFFIX) and expected[k.removesuffix(SCALES_SUFFIX)][0] is None}
    missing = sorted(set(expected) - set(found) - optional)
    extra = sorted(set(found) - set(expected))
    if missing or extra:
        what = (f"has no tensor {', '.join(missing[:3])}" if missing else "") + ("; " if missing and extra else "") + (
            f"has unexpected tensor(s) {', '.join(shorten(k) for k in extra[:3])}" if extra else "")
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
    was written for (and the shard's `rank`), the first bad element is named by its parameter. The common
    case, nothing wrong, costs one reduction (`aminmax`: NaN propagates, inf shows as a bound; ~2.2 GB/s on one
    core of the CI machine, 10x `isfinite().sum()`); only a tensor that fails it is searched element by element."""
    nonneg = kind == "adam.v" or key.endswith(SCALES_SUFFIX)
    if t.numel() == 0 or not _suspect(t, nonneg):
        return None
    n, first = _count(t, _float8_nan if t.dtype in _FLOAT8 else lambda x: ~torch.isfinite(x))
    what = "NaN/inf value(s)"
    if not n and nonneg:
        n, first = _count(t, lambda x: x < 0)
        what = "negative value(s) (" + ("Adam's v is a running mean of squares" if kind == "adam.v"
                                         else "a block scale") + ")"
    if not n:
        return None
    where = _element(layout, key, rank, first) if layout is not None and not key.endswith(SCALES_SUFFIX) else ""
    return f"{file}: tensor {key} holds {n} {what}, the first at element {first}{where}"


_FLOAT8 = {torch.float8_e4m3fn: 0x7F, torch.float8_e5m2: 0x7C}  # the bits that are all ones in a NaN (or inf) code


def _float8_nan(x: torch.Tensor) -> torch.Tensor:
    """NaN (e5m2: also inf) codes of a float8 tensor, from its bits: integer ops every device has."""
    mask = _FLOAT8[x.dtype]
    return (x.view(torch.uint8) & mask) == mask


def _suspect(t: torch.Tensor, nonneg: bool) -> bool:
    """Whether `t` may hold a NaN or inf (or, with `nonneg`, a negative value): one pass, one sync."""
    if t.dtype in _FLOAT8:  # no min/max for float8: its NaN codes, a chunk at a time
        return _count(t, _float8_nan)[0] > 0
    lo, hi = torch.stack(list(torch.aminmax(t.reshape(-1)))).float().tolist()
    return not (math.isfinite(lo) and math.isfinite(hi)) or (nonneg and lo < 0)


def _count(t: torch.Tensor, is_bad) -> tuple[int, int]:
    """(how many elements of `t` are bad, the index of the first), a chunk at a time: the check's transient
    memory (a bool per element) stays at `_CHECK_CHUNK` bytes however large the shard, on whatever device."""
    flat, n, first = t.reshape(-1), 0, -1
    for i in range(0, flat.numel(), _CHECK_CHUNK):
        bad = is_bad(flat[i:i + _CHECK_CHUNK])
        if c := int(bad.sum()):
            first = first if first >= 0 else i + int(bad.nonzero()[0, 0])
            n += c
    return n, first


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


# ---- a checkpoint directory ----

def recorded_dtypes(meta: dict[str, Any]) -> dict[str, str | None]:
    """The dtype the checkpoint's options keep each state kind in (what its files must hold; None where it is none
    a shard can hold: any is accepted then). A resume's options equal them (`checkpointing.check_compatible`)."""
    o = meta["options"]
    given = {"weights": checkpoint_meta.meant_value(o, "master_dtype"), "adam.m": o["opt_m_dtype"],
             "adam.v": o["opt_v_dtype"]}
    return {k: v if v in KIND_DTYPES[k] else None for k, v in given.items()}


def held_ranks(meta: dict[str, Any]) -> list[int]:
    """The ranks whose shards the directory holds (all, unless written into per-node directories)."""
    dist = meta["distributed"]
    return dist.get("ranks") or list(range(dist["world"]))


def check_files(path: str, meta: dict[str, Any], files: cio.CheckpointFiles, cfg: ModelConfig, *,
                ranks: list[int] | None = None, optional: tuple[str, ...] = ()) -> str | None:
    """The problem with the checkpoint's files, found without reading tensor data, or None: a shard file of
    `ranks` (default: every rank the directory holds) missing (a kind in `optional` may be absent for every rank:
    an export needs only the weights), unreadable, without a recorded digest (when the meta records digests),
    renamed or swapped, holding other tensors, dtypes or shapes than the layout of `cfg`, or whose header is not
    the one written; a file of the tokenizer copy that is not the one written (`copy_problem`)."""
    dist = meta["distributed"]
    world, dtypes = dist["world"], recorded_dtypes(meta)
    ranks = held_ranks(meta) if ranks is None else ranks
    for kind in STATE_KINDS:
        stems = [shard_stem(kind, r, world) for r in ranks]
        missing = [s for s in stems if s not in files]
        if kind in optional and len(missing) == len(stems):
            continue
        if missing:
            listed = " it lists in distributed.ranks" if "ranks" in dist else ""
            return (f"{path}: {missing[0]}.safetensors is missing (a checkpoint of {world} rank(s) holds a {kind} "
                    f"file per rank{listed})")
        expected = expected_tensors(cfg, world, kind, dtypes[kind], lora_of(meta), expert_parallel_of(meta))
        for stem in stems:
            try:
                files.digest(stem)
                header = files.header(stem, verify=False)
                problem = header_problem(files.path / f"{stem}.safetensors", kind, expected, header.dtypes_shapes(),
                                         header.metadata.get("name"))
                if problem:
                    return problem
                files.header(stem)  # its digest (the tensors' are checked as they are read)
            except CheckpointError as e:
                return str(e)
    return copy_problem(path, meta)


def copy_problem(path: str, meta: dict[str, Any]) -> str | None:
    """Why the checkpoint's tokenizer copy is not the one written (a file changed, added or removed since), or
    None. Its files are small (read whole). A checkpoint without digests: not checked."""
    digests = meta.get(cio.DIGESTS)
    if digests is None:
        return None
    folder, prefix = Path(path) / checkpoint_meta.TOKENIZER_DIR, checkpoint_meta.TOKENIZER_DIR + "/"
    recorded = {k[len(prefix):]: v for k, v in digests.items() if k.startswith(prefix)}
    there = {n for n in TOKENIZER_FILES if os.path.lexists(folder / n)}
    for name in sorted(there | recorded.keys()):
        f = folder / name
        if name not in recorded:
            return f"{f}: not a file of the checkpoint's tokenizer copy ({cio.DIGESTS} records none by that name)"
        if name not in there:
            return f"{f}: missing from the checkpoint's tokenizer copy ({cio.DIGESTS} records its digest)"
        try:
            data = read_bounded(f, "", TOKENIZER_JSON_MAX_BYTES)
        except InputError as e:
            return str(e)
        if checkpoint_meta.copy_digest(data) != recorded[name]:
            return f"{f}: differs from the file copied into the checkpoint when it was written (changed since)"
    return None


def load_checked(files: cio.CheckpointFiles, kind: str, rank: int, layout: FlatLayout) -> dict[str, torch.Tensor]:
    """The tensors of rank `rank`'s shard file of `kind`, its digest verified in the read that loads it and its
    values checked (on the CPU); CheckpointError naming the file and tensor otherwise. Headers are checked first
    (`check_files`)."""
    stem = shard_stem(kind, rank, layout.world)
    tensors = files.load(stem)
    for key, t in tensors.items():
        if problem := value_problem(files.path / f"{stem}.safetensors", kind, key, t, layout, rank):
            raise CheckpointError(problem)
    return tensors


def verify(path: str, *, ranks: list[int] | None = None, optional: tuple[str, ...] = (),
           load: tuple[str, ...] = STATE_KINDS) -> str | None:
    """Why the checkpoint at `path` does not verify, or None: its meta (the schema), every file `check_files`
    checks (`ranks`, `optional` as there), and for the kinds in `load` that are there every file's digest and
    values. Reads the files whole: for export and for finding a checkpoint to name instead of a refused one."""
    try:
        meta, files = cio.read_checkpoint(path)
        cfg = checkpoint_meta.validate(path, meta)
        ranks = held_ranks(meta) if ranks is None else ranks
        if problem := check_files(path, meta, files, cfg, ranks=ranks, optional=optional):
            return problem
        layout = checkpoint_layout(cfg, meta)
        for kind in load:
            for r in ranks:
                if shard_stem(kind, r, layout.world) in files:
                    load_checked(files, kind, r, layout)
        return None
    except CheckpointError as e:
        return str(e)
