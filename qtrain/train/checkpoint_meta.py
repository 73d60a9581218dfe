"""The shape of a checkpoint's `checkpoint.json`, in one place: what each field holds, its type and range, and
how the fields must agree. `validate` checks a meta against it before anything is built (the preflight of
`--continue`, the start of `qtrain export`, `checkpointing.load`), so an edited or damaged meta is one line
naming the file and the field, never a traceback half-way through loading.

    {
      "version": 2,                      # FORMAT_VERSION; 1 = before the records marked (2) below
      "step": 4,                         # optimizer steps done: the step of the step_NNNNNNNN directory holding it
      "run": {"id": "<hex>", "name": "run"},
      "nonfinite_streak": 0,             # non-finite steps in a row before it (stop.py); 0 = a finite checkpoint
      "data_loader": {"seed", "epoch", "file_index", "chunk_index", "world"}   # TokenLoader.state_dict; {} when the
                                         # run fed batches itself (the Python API): no position to restore
      "logger": {"loss_outliers": {"window", "threshold", "values"}, "norm_outliers": {...}},   # optional
      "options": {...},                  # the run's resolved Options (2; version 1: the five MUST_MATCH ones)
      "memory"?: {"lmhead_chunks": 2, "recompute_block": false, ...}   # the options --fit-memory may change, as
                                         # the run ran them (`memory_record`; absent: written before it was recorded)
      "data": {"files": [{"path", "size", "mtime_ns", "inode", "digest", "tokens"}]} | null   # (2) training files
      "model": {...},                    # the model's config.json
      "tokenizer": "gpt2" | "tokenizer" | null,   # a built-in, or the checkpoint's own tokenizer/ folder (2; version
                                         # 1 recorded an absolute path to a tokenizer.json or a model directory)
      "distributed": {"world": W, "replicas"?: R, "ranks"?: [...], "host"?: "..."},
      "fp8_scale_hints"?: [[[e, e], ...] | null, ...],   # per global rank (checkpointing.py)
      "lora_base"?: {"files": [{"path", "size", "mtime_ns", "inode", "digest"}]}   # a LoRA run's base weight files
                                         # (its checkpoints hold the adapters only: `lora_base_change`)
      "digests"?: {"<kind>.shard_RRR_of_WWW.safetensors": "sha256-tree:<hex>",   # every file but this one
                   "tokenizer/<file>": "sha256:<hex>"}
    }

`digests` (64 lower-case hex digits each) are computed while the files are written and verified where they are read
(`checkpoint_checks`): a shard file's is the SHA-256 of its header, which holds the SHA-256 of each of its tensors
(`tensor_file`); a file of the tokenizer copy's is the SHA-256 of its bytes. A checkpoint without `digests` was
written before qtrain recorded them (format 1, or an early format 2): it loads unverified, with a warning.

Keys this module does not know are left alone (a later qtrain may add some).
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
import shutil
import typing
from pathlib import Path
from typing import Any, Mapping

from qtrain.data.fingerprint import describe_change, fingerprint, same_content
from qtrain.data.loader import position_error
from qtrain.data.tokenizers import BUILTIN_TOKENIZERS
from qtrain.fsio import fsync_path, shorten
from qtrain.model.config import ConfigError, ModelConfig
from qtrain.model.registry import config_from_hf_dict
from qtrain.model.hf_io import TOKENIZER_FILES, checkpoint_files
from qtrain.options import CHOICES, EMPTY_MEANS_DEFAULT, Options, meant
from qtrain.plan.fit import CHANGES_NUMBERS, FIT_OPTIONS
from qtrain.train import tensor_file
from qtrain.train.checkpoint_io import DIGESTS, META_FILE, CheckpointError, checkpoint_step

FORMAT_VERSION = 2
KNOWN_VERSIONS = (1, 2)
HINTS_META = "fp8_scale_hints"
LORA_BASE_META = "lora_base"
MEMORY_META = "memory"
TOKENIZER_DIR = "tokenizer"  # the tokenizer files a run exports with, copied into each of its checkpoints (version 2)
# options that must match for a resume to continue the same run (every version records them)
MUST_MATCH = ("model_dtype", "master_dtype", "opt_m_dtype", "opt_v_dtype", "seed")

_MAX_INT = 2 ** 62  # larger counts are no run's
_MAX_WORLD = 1 << 20
_RUN_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_POSITION = ("seed", "epoch", "file_index", "chunk_index", "world")
_OPTION_TYPES = typing.get_type_hints(Options)


class MetaError(CheckpointError):
    """A checkpoint.json that does not have the shape qtrain writes; the message names the file and the field."""


def meant_value(options: Mapping[str, Any], key: str) -> Any:
    """What option `key` means in a run's options (a recorded dict or a command's): --master-dtype '' is the model
    dtype, so a run resumed with it given holds the same state and changes nothing (`options.meant`)."""
    return meant(options.get, key)


# ---------------------------------------------------------------------------------------------- writing


def options_record(opts: Options, run: Any = None) -> dict[str, Any]:
    """Every resolved option of the run (what `--continue` compares a later command with). `run`: its
    `RunResolution`, whose automatic choices that change the numbers are recorded as made (the FP8 head backward and
    the one-pass FP8 SwiGLU, unset = auto: a resume on another GPU, or one whose --fit-memory splits the MLP, must not
    turn them on or off mid-run; `resume_checks.pinned_choices`). --swiglu-epilogue stays as given: auto decides again
    on resume (it changes bf16 rounding only, and a pinned `on` would refuse a resume on a machine without quack)."""
    record = opts.to_dict()
    if run is not None:
        record["fp8_head_backward"] = bool(run.fp8_head_backward)
        record["fp8_swiglu_onepass"] = bool(run.fp8_swiglu_onepass)
    return record


def memory_record(opts: Options, run: Any) -> dict[str, Any]:
    """The options --fit-memory may change (`plan/fit.FIT_OPTIONS`) as the run ran them: its command's (`opts`) with
    the fit's changes (`run.memory_changes`), and those that change the numbers (`plan/fit.CHANGES_NUMBERS`: the LM
    head chunks, the MLP slices) as its model runs them (a resumed run's may be its checkpoint's:
    `resume_checks.review`). `--continue` keeps those and reports the others' changes."""
    ran = dataclasses.replace(opts, **dict(run.memory_changes))
    return {**{k: getattr(ran, k) for k in FIT_OPTIONS}, **{k: getattr(run, k) for k in CHANGES_NUMBERS}}


def data_record(loader: Any) -> dict[str, Any] | None:
    """The training files of a TokenLoader, each with its identity (`qtrain.data.fingerprint`) and token count;
    None for a loader without files (batches fed through the API)."""
    files = getattr(loader, "files", None)
    if not files:
        return None
    return {"files": [{**fingerprint(f.path), "tokens": len(f)} for f in files]}


def lora_base_record(weights_dir: str | None) -> dict[str, Any] | None:
    """The identity of a LoRA run's base weight files (`qtrain.data.fingerprint`; None for a base made from the seed,
    which MUST_MATCH pins): its checkpoints hold only the adapters, so `--continue` and `qtrain export --lora-merge`
    read the base again from --model, and `lora_base_change` tells whether it is still the one they trained on."""
    if weights_dir is None:
        return None
    return {"files": [fingerprint(p) for p in checkpoint_files(weights_dir)]}


def lora_base_change(record: Mapping[str, Any] | None, weights_dir: str | None) -> str | None:
    """Why the base weights in `weights_dir` (None: from scratch) are not those a checkpoint's adapters trained on
    (`record`, its `lora_base`), or None: the same files by name with the same size and sampled content (moved,
    copied or touched is the same base)."""
    if not record:
        return None
    old = {Path(f["path"]).name: f for f in record["files"]}
    where = shorten(os.path.dirname(record["files"][0]["path"])) if record["files"] else "?"
    if weights_dir is None:
        return f"the LoRA base of the checkpoint's run is the weights in {where}, this run makes its base from scratch"
    new = {p.name: fingerprint(p) for p in checkpoint_files(weights_dir)}
    for name in sorted(old.keys() | new.keys()):
        if name not in new or name not in old:
            gone = f"{where}/{name} is not among its weight files" if name not in new else \
                f"{shorten(new[name]['path'])} was not among the weight files of {where}"
            return f"the LoRA base changed since the checkpoint: {gone} (another revision of the model?)"
        if not same_content(old[name], new[name]):
            return (f"the LoRA base {shorten(new[name]['path'])} was {describe_change(old[name], new[name])} since "
                    f"the checkpoint (the adapters trained on the weights as they were)")
    return None


def scratch_base_change(old: Mapping[str, Any], weights_dir: str | None, init_proj_to_zero: bool) -> str | None:
    """Why this run's LoRA base (`weights_dir`, None: made from scratch with `init_proj_to_zero`) is not the one a
    checkpoint's run made from scratch (`old`: its options; the seed is MUST_MATCH's), or None. Such a run records
    no `lora_base` (there are no files): its base is the seed's init, made again on `--continue`."""
    if not old.get("from_scratch"):
        return None
    made = "the LoRA base of the checkpoint's run was made from scratch"
    if weights_dir is not None:
        return f"{made} (--seed {old.get('seed')}), this run reads the weights in {shorten(weights_dir)}"
    if bool(old.get("init_proj_to_zero")) != init_proj_to_zero:
        def flag(on: bool) -> str:
            return "--init-proj-to-zero" if on else "--no-init-proj-to-zero"
        was = bool(old.get("init_proj_to_zero"))
        return f"{made} with {flag(was)}, this run makes it with {flag(init_proj_to_zero)}"
    return None


def tokenizer_record(spec: str | None) -> str | None:
    """What `tokenizer` says for an export tokenizer spec: a built-in's name, else the checkpoint's own copy."""
    if spec is None or spec in BUILTIN_TOKENIZERS:
        return spec
    return TOKENIZER_DIR


def tokenizer_files(spec: str | None) -> dict[str, Path]:
    """{name in TOKENIZER_DIR: source file} to copy into a checkpoint for `spec` (a model directory's tokenizer
    files, or a tokenizer.json with the tokenizer_config.json beside it); {} for a built-in or none."""
    if spec is None or spec in BUILTIN_TOKENIZERS:
        return {}
    src = Path(spec)
    if src.is_dir():
        return {n: src / n for n in TOKENIZER_FILES if (src / n).is_file()}
    out = {"tokenizer.json": src}
    if (src.parent / "tokenizer_config.json").is_file():
        out["tokenizer_config.json"] = src.parent / "tokenizer_config.json"
    return out


def write_tokenizer(spec: str | None, checkpoint_tmp: str | os.PathLike) -> dict[str, str] | None:
    """Copy the files of `spec` into `<checkpoint_tmp>/TOKENIZER_DIR` (the checkpoint's temp directory); returns
    their `digests` entries ({} for a built-in or none). None when `spec` names files that are gone (nothing is
    copied then); an error writing the copy raises."""
    files = tokenizer_files(spec)
    if not files:
        return {} if spec is None or spec in BUILTIN_TOKENIZERS else None
    dest = Path(checkpoint_tmp) / TOKENIZER_DIR
    dest.mkdir(exist_ok=True)
    digests = {}
    for name, src in files.items():
        try:
            data = src.read_bytes()
        except OSError:
            shutil.rmtree(dest, ignore_errors=True)
            return None
        (dest / name).write_bytes(data)
        fsync_path(dest / name)
        digests[f"{TOKENIZER_DIR}/{name}"] = copy_digest(data)
    fsync_path(dest)
    return digests


def copy_digest(data: bytes) -> str:
    """The `digests` entry of a file of the tokenizer copy with these bytes."""
    return f"{tensor_file.ALGORITHM}:{hashlib.new(tensor_file.ALGORITHM, data).hexdigest()}"


def resolve_tokenizer(path: str | os.PathLike, meta: Mapping[str, Any]) -> str | None:
    """The tokenizer spec an export of the checkpoint at `path` carries (meta validated): a built-in's name, the
    checkpoint's own tokenizer folder, or (version 1) the recorded path if it still exists."""
    spec = meta.get("tokenizer")
    if spec is None or spec in BUILTIN_TOKENIZERS:
        return spec
    if spec == TOKENIZER_DIR and meta.get("version", 1) >= 2:
        return str(Path(path) / TOKENIZER_DIR)
    return spec if Path(spec).exists() else None


# ---------------------------------------------------------------------------------------------- checking

class _Checker:
    """Field checks that name `<checkpoint.json>: <field>` in their error."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.file = f"{path}/{META_FILE}"

    def error(self, field: str, problem: str) -> MetaError:
        return MetaError(f"{self.file}: {field} {problem}")

    def get(self, d: Mapping[str, Any], key: str, field: str, *, required: bool = True) -> Any:
        if key not in d:
            if required:
                raise self.error(field, "is missing")
            return None
        return d[key]

    def dict(self, v: Any, field: str) -> dict:
        if not isinstance(v, dict):
            raise self.error(field, f"must be a JSON object, got {_kind(v)}")
        return v

    def int(self, v: Any, field: str, lo: int = 0, hi: int = _MAX_INT) -> int:
        if not (isinstance(v, int) and not isinstance(v, bool)):
            raise self.error(field, f"must be an integer, got {shorten(v)}")
        if not lo <= v <= hi:
            raise self.error(field, f"must be in [{lo}, {hi}], got {v}")
        return v

    def number(self, v: Any, field: str) -> float:
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)):
            raise self.error(field, f"must be a finite number, got {shorten(v)}")
        return float(v)

    def str(self, v: Any, field: str, max_len: int = 4096) -> str:
        if not isinstance(v, str) or not v or len(v) > max_len or "\0" in v:
            raise self.error(field, f"must be a non-empty string of at most {max_len} characters, got {shorten(v)}")
        return v


def _kind(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number" if isinstance(v, (int, float)) else type(v).__name__)


def validate(path: str | os.PathLike, meta: Any) -> ModelConfig:
    """Check a checkpoint's meta against the schema (module docstring); MetaError naming the file and the first
    field that is wrong. Returns the checkpoint's model config. Reads nothing but the meta and, for the tokenizer,
    whether the files it names are there."""
    c = _Checker(path)
    if not isinstance(meta, dict):
        raise MetaError(f"{c.file}: not a JSON object")
    version = c.get(meta, "version", "version")
    if not (isinstance(version, int) and not isinstance(version, bool)) or version not in KNOWN_VERSIONS:
        raise c.error("version", f"{shorten(version)} is not a checkpoint format this qtrain reads "
                                 f"({', '.join(map(str, KNOWN_VERSIONS))}); a newer qtrain wrote it?")
    step = c.int(c.get(meta, "step", "step"), "step")
    named = checkpoint_step(path)
    if named is not None and step != named:
        raise c.error("step", f"{step} differs from the step of its directory {Path(path).name}")
    run = c.get(meta, "run", "run", required=False)
    if run is not None:
        run = c.dict(run, "run")
        if "id" in run and not (isinstance(run["id"], str) and _RUN_ID.match(run["id"])):
            raise c.error("run.id", f"must be a run id (letters, digits, '_', '-'), got {shorten(run['id'])}")
        if "name" in run:
            c.str(run["name"], "run.name", 200)
    if "nonfinite_streak" in meta:
        c.int(meta["nonfinite_streak"], "nonfinite_streak")
    _check_position(c, c.dict(c.get(meta, "data_loader", "data_loader"), "data_loader"))
    if meta.get("logger") is not None:
        _check_logger(c, c.dict(meta["logger"], "logger"))
    options = _check_options(c, c.dict(c.get(meta, "options", "options"), "options"))
    try:
        cfg = config_from_hf_dict(c.dict(c.get(meta, "model", "model"), "model"), source=f"{c.file}: model")
    except ConfigError as e:
        raise MetaError(str(e)) from None
    _check_tokenizer(c, path, meta.get("tokenizer"), version)
    _check_distributed(c, c.dict(c.get(meta, "distributed", "distributed"), "distributed"))
    check_hints(path, meta.get(HINTS_META), cfg.num_hidden_layers)
    if meta.get(LORA_BASE_META) is not None:
        _check_files(c, c.dict(meta[LORA_BASE_META], LORA_BASE_META), LORA_BASE_META, ("size", "mtime_ns", "inode"))
    if meta.get(MEMORY_META) is not None:
        _check_memory(c, c.dict(meta[MEMORY_META], MEMORY_META))
    if meta.get(DIGESTS) is not None:
        _check_digests(c, c.dict(meta[DIGESTS], DIGESTS))
    data = c.get(meta, "data", "data", required=version >= 2)
    if data is not None:
        files = _check_data(c, c.dict(data, "data"))
        state = meta["data_loader"]
        if state and isinstance(options.get("seq_len"), int):
            if why := position_error(state, [f["tokens"] for f in files], options["seq_len"]):
                raise c.error("data_loader", f"is no position in the recorded training data: {why}")
    return cfg


def _check_position(c: _Checker, state: dict) -> None:
    if not state:
        return  # written without a loader (the Python API): nothing to restore
    for k in _POSITION:
        v = c.get(state, k, f"data_loader.{k}")
        c.int(v, f"data_loader.{k}", *((-_MAX_INT, _MAX_INT) if k == "seed" else (1, _MAX_WORLD) if k == "world"
                                       else (0, _MAX_INT)))


def _check_logger(c: _Checker, logger: dict) -> None:
    for name in ("loss_outliers", "norm_outliers"):
        d = c.dict(c.get(logger, name, f"logger.{name}"), f"logger.{name}")
        window = c.int(c.get(d, "window", f"logger.{name}.window"), f"logger.{name}.window", 1, 1 << 20)
        c.number(c.get(d, "threshold", f"logger.{name}.threshold"), f"logger.{name}.threshold")
        values = c.get(d, "values", f"logger.{name}.values")
        if not isinstance(values, list) or len(values) > window:
            raise c.error(f"logger.{name}.values", f"must be a list of at most window={window} numbers")
        for i, v in enumerate(values):
            c.number(v, f"logger.{name}.values[{i}]")


def _option_ok(name: str, v: Any) -> bool:
    typ = _OPTION_TYPES[name]
    ok = {bool: isinstance(v, bool), int: isinstance(v, int) and not isinstance(v, bool),
          float: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
          str: isinstance(v, str)}.get(typ)
    if ok is None:  # bool | None, str | None
        ok = v is None or isinstance(v, typing.get_args(typ)[0])
    if ok and name in CHOICES and not (v == "" and name in EMPTY_MEANS_DEFAULT):
        ok = v in CHOICES[name]
    return ok


def _check_options(c: _Checker, options: dict) -> dict:
    for k in MUST_MATCH:
        c.get(options, k, f"options.{k}")
    for k, v in options.items():
        if k in _OPTION_TYPES and not _option_ok(k, v):
            raise c.error(f"options.{k}", f"is not a value of --{k.replace('_', '-')}: {shorten(v)}")
    return options


def _check_memory(c: _Checker, record: dict) -> None:
    """`memory`: the values of the options of FIT_OPTIONS it holds (others, a later qtrain's, are left alone)."""
    for k in FIT_OPTIONS:
        if k in CHANGES_NUMBERS and k in record:  # chunk counts
            c.int(record[k], f"{MEMORY_META}.{k}", 1)
        elif k in record and not _option_ok(k, record[k]):
            raise c.error(f"{MEMORY_META}.{k}", f"is not a value of --{k.replace('_', '-')}: {shorten(record[k])}")


def _check_tokenizer(c: _Checker, path: str | os.PathLike, spec: Any, version: int) -> None:
    if spec is None or spec in BUILTIN_TOKENIZERS:
        return
    forms = f"null, a built-in ({', '.join(BUILTIN_TOKENIZERS)})"
    if version >= 2:
        if spec != TOKENIZER_DIR:
            raise c.error("tokenizer", f"must be {forms} or {TOKENIZER_DIR!r} (the checkpoint's own copy), got "
                                       f"{shorten(spec)}")
        own = Path(path) / TOKENIZER_DIR
        if own.is_symlink() or not own.is_dir() or not any((own / n).is_file() for n in TOKENIZER_FILES):
            raise c.error("tokenizer", f"names the checkpoint's {TOKENIZER_DIR}/ folder, which holds no tokenizer "
                                       f"files")
        if linked := [n for n in TOKENIZER_FILES if (own / n).is_symlink()]:  # a copy is never a link out of it
            raise c.error("tokenizer", f"names the checkpoint's {TOKENIZER_DIR}/ folder, whose {linked[0]} is a "
                                       f"symbolic link (qtrain copies the tokenizer's files there)")
        return
    # version 1 recorded where the tokenizer was: an absolute path to a tokenizer.json or a model directory
    if not isinstance(spec, str) or not os.path.isabs(spec) or len(spec) > 4096 or "\0" in spec:
        raise c.error("tokenizer", f"must be {forms} or the absolute path of a tokenizer, got {shorten(spec)}")
    p = Path(spec)
    if p.exists() and not (p.is_dir() or (p.is_file() and p.suffix == ".json")):
        raise c.error("tokenizer", f"{shorten(spec)} is neither a tokenizer.json nor a model directory")


def _check_digests(c: _Checker, digests: dict) -> None:
    for name, digest in digests.items():
        if name.endswith(".safetensors") and "/" not in name:
            label = tensor_file.FILE_DIGEST
        elif name.startswith(TOKENIZER_DIR + "/") and name[len(TOKENIZER_DIR) + 1:] in TOKENIZER_FILES:
            label = tensor_file.ALGORITHM
        else:
            raise c.error(DIGESTS, f"names {shorten(name)}, which is no file of a checkpoint")
        if not tensor_file.is_digest(digest, label):
            raise c.error(DIGESTS, f"must map file names to digest strings ({tensor_file.FILE_DIGEST}:<hex> for a "
                                   f"shard file, {tensor_file.ALGORITHM}:<hex> for a tokenizer file, 64 hex digits "
                                   f"each); {shorten(name)} has {shorten(digest)}")


def _check_distributed(c: _Checker, dist: dict) -> None:
    world = c.int(c.get(dist, "world", "distributed.world"), "distributed.world", 1, _MAX_WORLD)
    if "replicas" in dist:
        c.int(dist["replicas"], "distributed.replicas", 1, _MAX_WORLD)
    if "ranks" in dist:
        ranks = dist["ranks"]
        if not (isinstance(ranks, list) and ranks and all(isinstance(r, int) and not isinstance(r, bool)
                                                          and 0 <= r < world for r in ranks)
                and ranks == sorted(set(ranks))):
            raise c.error("distributed.ranks", f"must be the sorted ranks (0..{world - 1}) whose shards the directory "
                                               f"holds, got {shorten(ranks)}")
    if "host" in dist:
        c.str(dist["host"], "distributed.host", 255)


def _check_data(c: _Checker, data: dict) -> list[dict]:
    return _check_files(c, data, "data", ("size", "mtime_ns", "inode", "tokens"))


def _check_files(c: _Checker, record: dict, key: str, ints: tuple[str, ...]) -> list[dict]:
    """`key`.files: a non-empty list of file fingerprints (path, digest and the integers `ints`)."""
    files = c.get(record, "files", f"{key}.files")
    if not isinstance(files, list) or not files:
        raise c.error(f"{key}.files", "must be a non-empty list of files")
    for i, f in enumerate(files):
        f = c.dict(f, f"{key}.files[{i}]")
        c.str(c.get(f, "path", f"{key}.files[{i}].path"), f"{key}.files[{i}].path")
        c.str(c.get(f, "digest", f"{key}.files[{i}].digest"), f"{key}.files[{i}].digest", 200)
        for k in ints:
            c.int(c.get(f, k, f"{key}.files[{i}].{k}"), f"{key}.files[{i}].{k}", -_MAX_INT if k == "mtime_ns" else 0)
    return files


def check_hints(path: str | os.PathLike, hints: Any, layers: int) -> None:
    """`fp8_scale_hints`, when present: a list with one entry per rank, each null or `layers` integer pairs."""
    if hints is None:
        return
    where = f"{path}/{META_FILE}: {HINTS_META}"
    if not isinstance(hints, list):
        raise MetaError(f"{where} must be a list with one entry per rank, got {type(hints).__name__}")
    for r, h in enumerate(hints):
        ok = h is None or (isinstance(h, list) and len(h) == layers and all(
            isinstance(p, list) and len(p) == 2 and all(type(e) is int and abs(e) < 2 ** 31 for e in p) for p in h))
        if not ok:
            raise MetaError(f"{where}[{r}] must be null or {layers} pairs of integer exponents (one per layer)")
