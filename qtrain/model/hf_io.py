"""Load and save Hugging Face checkpoints (config.json + safetensors) as qtrain's flat parameter dict.

Loading checks every tensor's presence, shape and dtype from the safetensors headers alone
(`check_hf_weights`, which the training preflight runs before the model is built), so a wrong or broken
checkpoint fails in a second with a message naming the file and the tensor rather than after minutes of
loading (or, worse, silently); NaN / inf values are refused as each tensor is read.

Saving writes the HF layout (`transformers.from_pretrained` reads it) into the output directory and touches
nothing else there: each file is written under a temp name first, and only when all are written are they
renamed into place. `qtrain-export.json` lists the files an export wrote (and for which run); a later
export replaces exactly those, removes the ones it no longer writes, and refuses to overwrite a file that no
qtrain export wrote (a user's model, say). From before the first rename over the previous export's files until
after the last of them is removed, the manifest says `"complete": false`, and every reader here refuses such a
directory (`check_export_complete`): a reader sees the previous export or the new one, never a mix of both,
whenever the export was killed. A directory without a manifest (any HF model) is read as it is.

Every JSON file read here is bounded in size and nesting and must be a regular file (`qtrain.fsio`), so a
hostile or broken model directory is one line of error, never a hang, a gigabyte read or a RecursionError.
"""
from __future__ import annotations

import json
import math
import os
import re
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Iterator, Mapping

import safetensors.torch as st
import torch
from safetensors import SafetensorError, safe_open

from qtrain import console
from qtrain.fsio import (CONFIG_MAX_BYTES, FileSystemError, atomic_write_json, check_regular_file, default_file_mode,
                         describe_write_error, ensure_free_space, fault_point, fsync_path, read_json, read_json_input,
                         shorten, sweep_temp_files, temp_path)
from qtrain.model import weights
from qtrain.model.config import ConfigError, ModelConfig
from qtrain.model.family import HfLayout
from qtrain.model.registry import config_from_json_file, family_of

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG = "generation_config.json"
# the files of a HF model directory that belong to its tokenizer and its generation defaults
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", GENERATION_CONFIG, "tokenizer.model")
MANIFEST = "qtrain-export.json"
# names an export may write: what a later export may replace (if a manifest lists it) or must not (if none does)
_EXPORT_NAME = re.compile(r"^(config\.json|model\.safetensors|model\.safetensors\.index\.json|"
                          r"model-\d{5}-of-\d{5}\.safetensors|adapter_config\.json|adapter_model\.safetensors)$")
# safetensors dtypes that hold weights; integer / bool tensors would be cast silently into nonsense
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# a safetensors index names each tensor's shard: ~100 bytes per tensor, so megabytes for the largest models.
# (A safetensors header itself is bounded by the safetensors library: 100 MB.)
INDEX_MAX_BYTES = 64 << 20


class WeightsError(ValueError):
    """A checkpoint whose tensors do not match the config, or a file that cannot be read."""


class IncompleteExportError(WeightsError):
    """A qtrain export that was interrupted (its manifest says incomplete): its files may mix two exports."""


def load_model_config(model_dir: str | os.PathLike) -> ModelConfig:
    """The config.json of a model directory, as its family's config (model/registry.py); an interrupted qtrain
    export there is refused first."""
    check_export_complete(model_dir)
    d = Path(model_dir)
    if not os.path.lexists(d / "config.json") and os.path.lexists(d / "adapter_config.json"):
        raise ConfigError(f"{shorten(str(d))}: a PEFT adapter (adapter_config.json), not a model: give a whole model "
                          f"(a LoRA run exports its adapters merged into the base with --lora-merge, also `qtrain "
                          f"export --lora-merge` from its checkpoint)")
    return config_from_json_file(d / "config.json")


def export_command(man: Mapping[str, Any], out_dir: str) -> str:
    """The `qtrain export` command that writes the export a manifest of `qtrain export` describes (its checkpoint,
    and for a merged LoRA model --lora-merge and the --base-model it was given) into `out_dir`."""
    merge = " --lora-merge" if man.get("lora_merge") is True else ""
    base = f" --base-model {shorten(str(man['base_model']))}" if merge and man.get("base_model") else ""
    return f"qtrain export --checkpoint-dir {shorten(str(man['checkpoint']))}{merge}{base} --out-dir {out_dir}"


def check_export_complete(model_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The manifest of the qtrain export in `model_dir` (None: no qtrain export there, a plain HF directory);
    IncompleteExportError when it says the export is incomplete, with how to finish it."""
    man = export_manifest(model_dir)
    if man is None or man.get("complete") is True:
        return man
    d = shorten(str(model_dir))
    if man.get("checkpoint"):
        how = f"run `{export_command(man, d)}` again"
    elif man.get("name"):
        how = f"resume run {shorten(str(man['name']), 60)} (`qtrain train ... --continue`) or re-export it"
    else:
        how = "export it again (`qtrain export`) or resume its run with --continue"
    raise IncompleteExportError(f"{d}: an interrupted export ({MANIFEST} says it is incomplete; its files may mix "
                                f"two exports), so qtrain does not read it; to finish it, {how}")


def expected_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for every tensor a checkpoint of `cfg` must hold."""
    return {hf: shape for spec in weights.tensor_specs(cfg).values() for hf, shape in spec.hf}


def _ignored_extra(cfg: ModelConfig, hf_name: str) -> bool:
    """Tensors HF checkpoints sometimes carry that do not belong to the model's parameters (and the parts of a
    multimodal checkpoint outside the text model, `ModelFamily.ignored_hf_tensor`, which `skipped_notes` reports)."""
    return (hf_name == "lm_head.weight" and cfg.tie_word_embeddings) or hf_name.endswith(".rotary_emb.inv_freq") \
        or family_of(cfg).ignored_hf_tensor(cfg, hf_name) is not None


def skipped_notes(model_dir: str | os.PathLike, cfg: ModelConfig, names: list[str]) -> list[str]:
    """One line per part of the checkpoint that loading skips (the family's `ignored_hf_tensor`: a vision tower, an
    MTP head), with how many tensors it holds."""
    counts: dict[str, int] = {}
    for n in names:
        what = family_of(cfg).ignored_hf_tensor(cfg, n)
        if what is not None:
            counts[what] = counts.get(what, 0) + 1
    return [f"{shorten(str(model_dir))}: ignoring {n} tensor(s) of {what} (not part of the text model; not in an "
            f"export)" for what, n in counts.items()]


# ---------------------------------------------------------------- loading

def checkpoint_files(model_dir: str | os.PathLike) -> list[Path]:
    """The safetensors file(s) of a checkpoint: the shards an index names, else model.safetensors."""
    d = Path(model_dir)
    index = d / INDEX_FILE
    if os.path.lexists(index):
        index_json = read_json_input(index, "", INDEX_MAX_BYTES)
        try:
            weight_map = index_json["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise WeightsError(f"{index}: not a valid safetensors index ({type(e).__name__}: {shorten(str(e))})"
                               ) from None
        for s in shards:
            if not isinstance(s, str) or Path(s).name != s or s in (".", "..") or "\\" in s:
                raise WeightsError(f"{index}: shard name {shorten(repr(s))} is not a file name in the model "
                                   f"directory; an index may only name files beside it")
            if not os.path.lexists(d / s):
                raise WeightsError(f"{d / s}: shard named by {index} does not exist")
            check_regular_file(d / s, "")
        return [d / s for s in shards]
    if os.path.lexists(d / SINGLE_FILE):
        return [check_regular_file(d / SINGLE_FILE, "")]
    raise WeightsError(f"{d}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors checkpoints are supported)")


def _open(path: Path, stack: ExitStack):
    try:
        return stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
    except (SafetensorError, OSError) as e:
        raise WeightsError(f"{path}: not a readable safetensors file (corrupt or truncated?): {shorten(str(e))}"
                           ) from None


def _index(files: list[Path], cfg: ModelConfig, stack: ExitStack
           ) -> tuple[dict[str, tuple[Path, Any]], dict[str, HfLayout]]:
    """Where each tensor lives, validated against `cfg` from the headers alone: presence, shape, dtype; and the
    alternative layout (`TensorSpec.hf_alternatives`) of each tensor the checkpoint holds in one (internal name ->
    layout; a tensor whose HF tensors are all there is read as `TensorSpec.hf` says)."""
    where: dict[str, tuple[Path, Any]] = {}
    for path in files:
        f = _open(path, stack)
        for k in f.keys():
            if k in where:
                raise WeightsError(f"tensor {k!r} appears in both {where[k][0]} and {path}")
            where[k] = (path, f)
    layouts: dict[str, HfLayout] = {}
    expected: dict[str, tuple[int, ...]] = {}
    for name, spec in weights.tensor_specs(cfg).items():
        parts = spec.hf
        if not all(hf in where for hf, _ in parts):
            alt = next((a for a in spec.hf_alternatives if all(hf in where for hf, _ in a.hf)), None)
            if alt is not None:
                layouts[name], parts = alt, alt.hf
        expected.update(parts)
    searched = ", ".join(str(p) for p in files)
    for hf, shape in expected.items():
        if hf not in where:
            raise WeightsError(f"tensor {hf!r} missing; searched {searched}")
        path, f = where[hf]
        try:
            sl = f.get_slice(hf)
            found, dtype = tuple(sl.get_shape()), sl.get_dtype()
        except SafetensorError as e:
            raise WeightsError(f"{path}: cannot read the header of tensor {hf!r}: {e}") from None
        if found != shape:
            raise WeightsError(f"{path}: tensor {hf!r} has shape {list(found)}, expected {list(shape)} "
                               f"for this config")
        if dtype not in FLOAT_DTYPES:
            raise WeightsError(f"{path}: tensor {hf!r} has dtype {dtype}; weights must be floating point "
                               f"({', '.join(FLOAT_DTYPES)})")
    extra = sorted(k for k in where if k not in expected and not _ignored_extra(cfg, k))
    if extra:
        raise WeightsError(f"unexpected tensor(s) {extra[:5]}{' ...' if len(extra) > 5 else ''} in "
                           f"{where[extra[0]][0]}; the checkpoint does not match config.json")
    return where, layouts


def check_hf_weights(model_dir: str | os.PathLike, cfg: ModelConfig) -> list[Path]:
    """Validate a HF checkpoint against `cfg` from its headers (files, index, names, shapes, dtypes) without
    reading any tensor data; returns its files. What `load_hf_weights` checks first, for the preflight."""
    check_export_complete(model_dir)
    files = checkpoint_files(model_dir)
    with ExitStack() as stack:
        where, _ = _index(files, cfg, stack)
    for line in skipped_notes(model_dir, cfg, list(where)):
        console.write(f"qtrain: note: {line}\n", sys.stderr)
    return files


def load_hf_weights(model_dir: str | os.PathLike, cfg: ModelConfig, *, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Read a HF checkpoint into internal names (fused qkv / up), cast to `dtype` on `device`. Headers are
    validated before any data is read; a tensor holding NaN or inf is refused by name. An interrupted qtrain
    export is refused, and so is one that an export replaced while its files were being opened."""
    return dict(stream_hf_weights(model_dir, cfg, dtype=dtype, device=device))


def stream_hf_weights(model_dir: str | os.PathLike, cfg: ModelConfig, *, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """`load_hf_weights` one internal tensor at a time (name, tensor), so that a loader that converts each one (LoRA's
    e4m3 base) never holds the whole model in `dtype`; the same checks, made before the first tensor is read."""
    manifest = check_export_complete(model_dir)
    files = checkpoint_files(model_dir)
    with ExitStack() as stack:
        where, layouts = _index(files, cfg, stack)
        # the files are open now: what they hold no longer changes, even when an export renames new ones in
        if export_manifest(model_dir) != manifest:
            raise WeightsError(f"{model_dir}: an export was written into it while qtrain opened its files; run "
                               f"this again once the export has finished")

        # stream tensors one by one. get_tensor returns a view of a private mmap of the file: copy it,
        # so the params never change (or SIGBUS) when someone later rewrites or truncates the file in place.
        def get(hf: str) -> torch.Tensor:
            path, f = where[hf]
            try:
                t = f.get_tensor(hf)
            except SafetensorError as e:
                raise WeightsError(f"{path}: cannot read tensor {hf!r}: {e}") from None
            bad = t.numel() - int(torch.isfinite(t).sum())
            if bad:
                raise WeightsError(f"{path}: tensor {hf!r} holds {bad} NaN/inf value(s) of {t.numel()}; refusing to "
                                   f"train from non-finite weights")
            return t.to(device=device, dtype=dtype, copy=True)

        yield from weights.hf_to_internal(cfg, get, layouts)


# ---------------------------------------------------------------- saving

def _check_params(cfg: ModelConfig, params: Mapping[str, torch.Tensor]) -> None:
    shapes = weights.param_shapes(cfg)
    missing = [n for n in shapes if n not in params]
    extra = [n for n in params if n not in shapes]
    if missing or extra:
        raise WeightsError(f"params do not match the config: missing {missing[:5]}, unexpected {extra[:5]}")
    for n, s in shapes.items():
        if tuple(params[n].shape) != s:
            raise WeightsError(f"param {n!r} has shape {list(params[n].shape)}, expected {list(s)}")


def plan_shards(sizes: Mapping[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Greedy split of tensors (in the given order) into shards of at most max_shard_bytes each
    (a single larger tensor gets a shard of its own), as transformers does."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, n in sizes.items():
        if shards[-1] and used + n > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += n
    return shards



def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def export_manifest(out_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The manifest of the qtrain export in `out_dir` (which files it wrote, for which run), or None."""
    man = read_json(Path(out_dir) / MANIFEST)
    return man if isinstance(man, dict) and isinstance(man.get("files"), list) else None


def is_export_name(name: str) -> bool:
    return bool(_EXPORT_NAME.match(name)) or name in TOKENIZER_FILES


def manifest_files(man: dict[str, Any] | None) -> set[str]:
    """The files a manifest lists, restricted to names an export writes (a hand-edited manifest can never
    make qtrain delete anything else)."""
    return {n for n in (man or {}).get("files", []) if isinstance(n, str) and is_export_name(n)}


def foreign_export_files(out_dir: str | os.PathLike) -> list[str]:
    """Files in `out_dir` an export would overwrite but no qtrain export wrote (absent from the manifest)."""
    out = Path(out_dir)
    if not out.is_dir():
        return []
    ours = manifest_files(export_manifest(out))
    return sorted(p.name for p in out.iterdir() if is_export_name(p.name) and p.name not in ours)


def save_hf_model(out_dir: str | os.PathLike, cfg: ModelConfig, params: Mapping[str, torch.Tensor], *,
                  dtype: torch.dtype = torch.bfloat16, max_shard_bytes: int = 5 * 2**30,
                  tokenizer_src: str | os.PathLike | None = None, extra_files: Mapping[str, bytes] | None = None,
                  owner: Mapping[str, Any] | None = None) -> Path:
    """Write a HF checkpoint into `out_dir` (created if needed), touching only its own files (see the module
    docstring). All files are written under temp names first; on an error before they are renamed in,
    nothing in `out_dir` has changed. `tokenizer_src`: a directory whose tokenizer files are copied;
    `extra_files`: {file name: bytes} written alongside (the tokenizer and generation config an export
    carries, `qtrain.data.hf_tokenizer.export_files`); `owner` (e.g. the run id and step) goes into the manifest."""
    _check_params(cfg, params)
    hf = weights.internal_to_hf(cfg, {n: params[n] for n in weights.param_shapes(cfg)})  # views, canonical order
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = {k: math.prod(t.shape) * itemsize for k, t in hf.items()}
    shards = plan_shards(sizes, max_shard_bytes)
    files: dict[str, Any] = {"config.json": cfg.to_hf_dict(dtype=str(dtype).removeprefix("torch."))}
    names = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for fname, keys in zip(names, shards):
        files[fname] = {k: hf[k] for k in keys}
    if len(shards) > 1:
        weight_map = {k: fname for fname, keys in zip(names, shards) for k in keys}
        files[INDEX_FILE] = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": dict(sorted(weight_map.items()))}
    if tokenizer_src is not None:
        for fname in TOKENIZER_FILES:
            src = Path(tokenizer_src) / fname
            if src.is_file():
                files[fname] = src.read_bytes()
    for fname, data in (extra_files or {}).items():
        if fname not in TOKENIZER_FILES:
            raise WeightsError(f"{fname!r}: not a file name an export may add (one of {', '.join(TOKENIZER_FILES)})")
        files[fname] = data
    return write_export(out_dir, files, dtype=dtype, nbytes=sum(sizes.values()), owner=owner)


def write_export(out_dir: str | os.PathLike, files: Mapping[str, Any], *, dtype: torch.dtype, nbytes: int,
                 owner: Mapping[str, Any] | None = None) -> Path:
    """Write an export's `files` (name -> a dict of tensors: safetensors in `dtype`; another dict: JSON; bytes)
    into `out_dir` as the module docstring says: refused if a file it would replace is none of qtrain's, every
    file staged under a temp name, then all renamed in between an incomplete and a complete manifest."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise WeightsError(f"{out}: exists and is not a directory")
    foreign = foreign_export_files(out)
    if foreign:
        raise WeightsError(f"{out}: {', '.join(foreign[:4])}{' ...' if len(foreign) > 4 else ''} exist(s) and no "
                           f"qtrain export wrote them; qtrain does not overwrite them: choose another output "
                           f"directory (or move them away)")
    ensure_free_space(out, nbytes + (1 << 20), f"the export to {out}")
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    sweep_temp_files(out)
    temps: dict[str, Path] = {}
    try:
        for fname, content in files.items():
            temps[fname] = path = temp_path(out / fname)
            if isinstance(content, bytes):
                path.write_bytes(content)
            elif fname.endswith(".safetensors"):
                # contiguous copies, one file at a time: split views share storage, which safetensors refuses
                tensors = {k: t.detach().to(device="cpu", dtype=dtype, copy=True).contiguous()
                           for k, t in content.items()}
                st.save_file(tensors, str(path), metadata={"format": "pt"})
                del tensors
                fault_point("export.write")
            else:
                _write_json(path, content)
        mode = default_file_mode()
        for tmp in temps.values():
            os.chmod(tmp, mode)  # all alike, as any file the user makes (safetensors writes its files 0600)
            fsync_path(tmp)
        fault_point("export.staged")
        _publish(out, temps, dict(owner or {}))
    except BaseException as e:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)
        if created:
            try:
                out.rmdir()  # only if still empty: the directory this call made
            except OSError:
                pass
        if isinstance(e, (OSError, SafetensorError)):
            raise FileSystemError(f"writing the export to {out} failed: {describe_write_error(e)}") from e
        raise
    return out


def _publish(out: Path, temps: Mapping[str, Path], owner: dict[str, Any]) -> None:
    """Rename the staged files in and remove the previous export's files that this one no longer has (an old
    index would otherwise still name the old shards), all between a manifest that says the export is incomplete
    (listing old and new files, so an interrupted export's files are all known) and one that says it is
    complete: killed anywhere in between, the directory is refused by every reader (`check_export_complete`)."""
    old = manifest_files(export_manifest(out))
    new = sorted(temps)
    head = {"format": 1, "writer": "qtrain", **owner}
    atomic_write_json(out / MANIFEST, {**head, "complete": False, "files": sorted(old | set(new))},
                      point="export.manifest")
    for name in new:
        os.replace(temps[name], out / name)
        fault_point("export.rename")
    for name in sorted(old - set(new)):
        (out / name).unlink(missing_ok=True)
        fault_point("export.unlink")
    fsync_path(out)
    atomic_write_json(out / MANIFEST, {**head, "complete": True, "files": new}, point="export.manifest")


def stop_token_ids(model_dir: str | os.PathLike, cfg: ModelConfig) -> list[int]:
    """The ids that end generation: generation_config.json's `eos_token_id` (an id or a list), else config.json's."""
    path = Path(model_dir) / GENERATION_CONFIG
    eos: Any = None
    if os.path.lexists(path):
        d = read_json_input(path, "", CONFIG_MAX_BYTES)
        if not isinstance(d, dict):
            raise WeightsError(f"{path}: not a valid generation config (not a JSON object)")
        eos = d.get("eos_token_id")
    if eos is None:
        eos = cfg.eos_token_id
    ids = eos if isinstance(eos, list) else [eos]
    return [int(i) for i in ids if isinstance(i, int)]
