"""`qtrain export`: a training checkpoint (sharded or not) -> a Hugging Face model directory.

No process group is needed: the weight shards of every rank are concatenated in rank order, which
restores each group's flat buffer (see parallel/layout.py), and the tensors are views into those.
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from qtrain.data.hf_tokenizer import TokenizerExportError, export_files, export_tokenizer, transformers_caveat
from qtrain.locks import Target, hold
from qtrain.model.config import ModelConfig
from qtrain.model.hf_io import export_manifest, save_hf_model
from qtrain.parallel.layout import FlatLayout
from qtrain.train import checkpoint_io as cio
from qtrain.train import checkpoint_meta
from qtrain.train.checkpoint_io import CheckpointError
from qtrain.train.checkpointing import _stem, check_shard_files

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def checked_meta(path: str) -> tuple[dict, ModelConfig]:
    """(meta, model config) of a checkpoint whose meta has the schema's shape and whose shard files' headers match
    its layout (the weights must be there; Adam files, if there, must fit too); CheckpointError otherwise. Reads no
    tensor."""
    meta, _ = cio.read_checkpoint(path)
    cfg = checkpoint_meta.validate(path, meta)
    check_shard_files(path, meta, cfg, optional=("adam.m", "adam.v"))
    return meta, cfg


def checkpoint_params(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor], str]:
    """(model config, full parameters by internal name, master dtype name) from a checkpoint directory."""
    meta, cfg = checked_meta(path)
    files = cio.CheckpointFiles(Path(path))
    world = int(meta["distributed"]["world"])
    layout = FlatLayout(cfg, world)
    shards = [files.load(_stem("weights", r, world)) for r in range(world)]
    buffers = {}
    for g in layout.groups:
        parts = [s[g.key] for s in shards]
        if any(p.numel() != g.shard_size(world) for p in parts):
            raise CheckpointError(f"{path}: weight shard of {g.key} has the wrong size for world {world}")
        buffers[g.key] = torch.cat(parts)
    opts = meta["options"]
    return cfg, layout.views(buffers), opts["master_dtype"] or opts["model_dtype"]


class ExportResult(NamedTuple):
    checkpoint: str  # the checkpoint directory exported
    out_dir: str
    tokenizer: str | None  # the tokenizer written beside the weights (None: the run recorded none that exists)
    caveat: str | None = None  # how transformers may load that tokenizer differently (`transformers_caveat`)


def export_checkpoint(ckpt_dir: str, out_dir: str, *, step: int | None = None, tokenizer: str = "",
                      overwrite: bool = False) -> ExportResult:
    """Write the checkpoint of `step` (default: the newest) in `ckpt_dir` as a HF model directory in `out_dir`,
    with the tokenizer the run recorded in it (or `tokenizer`: qwen2 | gpt2 | tokenizer.json | directory) and a
    generation_config.json. An export of another run already there is replaced only with `overwrite`; files no
    qtrain export wrote never are."""
    path = cio.find_checkpoint(ckpt_dir, step)
    if path is None:
        have = [s for s, _ in cio.list_checkpoints(ckpt_dir)]
        raise CheckpointError(f"--checkpoint-dir {ckpt_dir}: no checkpoint" + (f" of step {step}" if step is not None
                              else "") + (f" (it has steps {', '.join(map(str, have[-8:]))})" if have else ""))
    meta, _ = checked_meta(str(path))  # before anything is read or written
    run_id = (meta.get("run") or {}).get("id")
    # the out-dir is this process's from the check of its manifest to the export's last rename: another export
    # or a run writing there is refused, naming it (a run holds its own out-dir for its whole life)
    with hold([Target(out_dir, "--out-dir")]):
        man = export_manifest(out_dir)
        theirs = (man or {}).get("run_id")
        if theirs and theirs != run_id and not overwrite:
            what = "the export" if man.get("complete") is True else "an interrupted export"  # hf_io's readers refuse it
            raise CheckpointError(f"--out-dir {out_dir}: holds {what} of another run ({str(theirs)[:8]}, step "
                                  f"{man.get('step')}); choose another --out-dir, or pass --overwrite to replace it")
        cfg, params, dtype = checkpoint_params(str(path))
        spec = export_tokenizer(explicit=tokenizer or (checkpoint_tokenizer(str(path)) or ""))
        owner = {"run_id": run_id, "name": (meta.get("run") or {}).get("name"), "step": meta.get("step"),
                 "checkpoint": str(path)}
        save_hf_model(out_dir, cfg, params, dtype=DTYPES[dtype], extra_files=export_files(spec, cfg),
                      owner={k: v for k, v in owner.items() if v is not None})
    return ExportResult(str(path), str(out_dir), spec, transformers_caveat(spec, cfg))


def checkpoint_tokenizer(path: str) -> str | None:
    """The tokenizer a run recorded in its checkpoint, if it still exists (a built-in name or a path)."""
    meta, _ = cio.read_checkpoint(path)
    checkpoint_meta.validate(path, meta)
    spec = checkpoint_meta.resolve_tokenizer(path, meta)
    if not spec:
        return None
    try:
        return export_tokenizer(explicit=spec)
    except TokenizerExportError:
        return None  # recorded path gone: export without a tokenizer rather than fail the conversion
