"""Load and save Hugging Face checkpoints (config.json + safetensors) as qtrain's flat parameter dict.

Loading checks every tensor's presence and shape from the safetensors headers alone, before reading or
allocating anything large, so a wrong or broken checkpoint fails in a second with a message naming the
file and the tensor rather than after minutes of loading (or, worse, silently). Saving writes the HF
layout (`transformers.from_pretrained` reads it) into a temporary sibling directory and renames it into
place, so a crash never leaves a half-written model where a good one was.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Iterable, Mapping

import safetensors.torch as st
import torch
from safetensors import SafetensorError, safe_open

from qtrain.fsio import fsync_path
from qtrain.model import weights
from qtrain.model.config import ModelConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG = "generation_config.json"
# the files of a HF model directory that belong to its tokenizer and its generation defaults
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", GENERATION_CONFIG, "tokenizer.model")


class WeightsError(ValueError):
    """A checkpoint whose tensors do not match the config, or a file that cannot be read."""


def load_model_config(model_dir: str | os.PathLike) -> ModelConfig:
    return ModelConfig.from_json_file(Path(model_dir) / "config.json")


def expected_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for every tensor a checkpoint of `cfg` must hold."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in weights.param_shapes(cfg).items():
        for hf, rows in weights.hf_parts(cfg, name):
            out[hf] = (rows, *shape[1:])
    return out


def _ignored_extra(cfg: ModelConfig, hf_name: str) -> bool:
    """Tensors HF checkpoints sometimes carry that do not belong to the model's parameters."""
    return (hf_name == "lm_head.weight" and cfg.tie_word_embeddings) or hf_name.endswith(".rotary_emb.inv_freq")


# ---------------------------------------------------------------- loading

def checkpoint_files(model_dir: str | os.PathLike) -> list[Path]:
    """The safetensors file(s) of a checkpoint: the shards an index names, else model.safetensors."""
    d = Path(model_dir)
    index = d / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise WeightsError(f"{index}: not a valid safetensors index ({type(e).__name__}: {e})") from None
        for s in shards:
            if not (d / s).is_file():
                raise WeightsError(f"{d / s}: shard named by {index} does not exist")
        return [d / s for s in shards]
    if (d / SINGLE_FILE).is_file():
        return [d / SINGLE_FILE]
    raise WeightsError(f"{d}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors checkpoints are supported)")


def _open(path: Path, stack: ExitStack):
    try:
        return stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
    except (SafetensorError, OSError) as e:
        raise WeightsError(f"{path}: not a readable safetensors file (corrupt or truncated?): {e}") from None


def load_hf_weights(model_dir: str | os.PathLike, cfg: ModelConfig, *, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Read a HF checkpoint into internal names (fused qkv / up), cast to `dtype` on `device`."""
    files = checkpoint_files(model_dir)
    expected = expected_hf_shapes(cfg)
    with ExitStack() as stack:
        # 1) headers only: where each tensor lives and its shape
        where: dict[str, tuple[Path, Any]] = {}
        for path in files:
            f = _open(path, stack)
            for k in f.keys():
                if k in where:
                    raise WeightsError(f"tensor {k!r} appears in both {where[k][0]} and {path}")
                where[k] = (path, f)
        searched = ", ".join(str(p) for p in files)
        # 2) validate before reading any data
        for hf, shape in expected.items():
            if hf not in where:
                raise WeightsError(f"tensor {hf!r} missing; searched {searched}")
            path, f = where[hf]
            found = tuple(f.get_slice(hf).get_shape())
            if found != shape:
                raise WeightsError(f"{path}: tensor {hf!r} has shape {list(found)}, expected {list(shape)} "
                                   f"for this config")
        extra = sorted(k for k in where if k not in expected and not _ignored_extra(cfg, k))
        if extra:
            raise WeightsError(f"unexpected tensor(s) {extra[:5]}{' ...' if len(extra) > 5 else ''} in "
                               f"{where[extra[0]][0]}; the checkpoint does not match config.json")

        # 3) stream tensors one by one. get_tensor returns a view of a private mmap of the file: copy it,
        # so the params never change (or SIGBUS) when someone later rewrites or truncates the file in place.
        def get(hf: str) -> torch.Tensor:
            path, f = where[hf]
            try:
                t = f.get_tensor(hf)
            except SafetensorError as e:
                raise WeightsError(f"{path}: cannot read tensor {hf!r}: {e}") from None
            return t.to(device=device, dtype=dtype, copy=True)

        return dict(weights.hf_to_internal(cfg, get))


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


def save_hf_model(out_dir: str | os.PathLike, cfg: ModelConfig, params: Mapping[str, torch.Tensor], *,
                  dtype: torch.dtype = torch.bfloat16, max_shard_bytes: int = 5 * 2**30,
                  tokenizer_src: str | os.PathLike | None = None,
                  extra_files: Mapping[str, bytes] | None = None) -> Path:
    """Write a HF checkpoint directory atomically: all of it at `out_dir`, or (on any error) nothing new.
    An existing `out_dir` is replaced only after the new one is complete and synced. `tokenizer_src`: a
    directory whose tokenizer files are copied; `extra_files`: {file name: bytes} written alongside (the
    tokenizer and generation config an export carries, `qtrain.data.hf_tokenizer.export_files`)."""
    _check_params(cfg, params)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise WeightsError(f"{out}: exists and is not a directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    hf = weights.internal_to_hf(cfg, {n: params[n] for n in weights.param_shapes(cfg)})  # views, canonical order
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = {k: math.prod(t.shape) * itemsize for k, t in hf.items()}
    shards = plan_shards(sizes, max_shard_bytes)

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        os.chmod(tmp, 0o755)
        _write_json(tmp / "config.json", cfg.to_hf_dict(dtype=str(dtype).removeprefix("torch.")))
        names = [SINGLE_FILE] if len(shards) == 1 else [
            f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        for fname, keys in zip(names, shards):
            # contiguous copies, one shard at a time: split views share storage, which safetensors refuses
            tensors = {k: hf[k].detach().to(device="cpu", dtype=dtype, copy=True).contiguous() for k in keys}
            st.save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
            del tensors
        if len(shards) > 1:
            weight_map = {k: fname for fname, keys in zip(names, shards) for k in keys}
            _write_json(tmp / INDEX_FILE, {"metadata": {"total_size": sum(sizes.values())},
                                           "weight_map": dict(sorted(weight_map.items()))})
        if tokenizer_src is not None:
            copy_tokenizer_files(tokenizer_src, tmp)
        for fname, data in (extra_files or {}).items():
            if Path(fname).name != fname or fname in ("config.json", INDEX_FILE) or fname.endswith(".safetensors"):
                raise WeightsError(f"{fname!r}: not a file name an export may add")
            (tmp / fname).write_bytes(data)
        for p in tmp.iterdir():
            fsync_path(p)
        fsync_path(tmp)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _replace_dir(new: Path, out: Path) -> None:
    """Rename `new` to `out`; an existing `out` is moved aside first and deleted only once `new` is in."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(out, old)
    try:
        os.rename(new, out)
    except BaseException:
        if old is not None:
            os.rename(old, out)
        raise
    fsync_path(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def copy_tokenizer_files(src: str | os.PathLike, dst: str | os.PathLike,
                         names: Iterable[str] = TOKENIZER_FILES) -> list[str]:
    """Copy the tokenizer / generation files present in `src` into `dst`; returns the names copied."""
    copied = []
    for fname in names:
        s = Path(src) / fname
        if s.is_file():
            shutil.copyfile(s, Path(dst) / fname)
            copied.append(fname)
    return copied


def stop_token_ids(model_dir: str | os.PathLike, cfg: ModelConfig) -> list[int]:
    """The ids that end generation: generation_config.json's `eos_token_id` (an id or a list), else config.json's."""
    path = Path(model_dir) / GENERATION_CONFIG
    eos: Any = None
    if path.is_file():
        try:
            eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
        except (ValueError, AttributeError) as e:
            raise WeightsError(f"{path}: not a valid generation config ({e})") from None
    if eos is None:
        eos = cfg.eos_token_id
    ids = eos if isinstance(eos, list) else [eos]
    return [int(i) for i in ids if isinstance(i, int)]
