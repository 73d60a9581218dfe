"""`qtrain export`: a training checkpoint (sharded or not) -> a Hugging Face model directory.

No process group is needed: the weight shards of every rank are concatenated in rank order, which
restores each group's flat buffer (see parallel/layout.py), and the tensors are views into those.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from qtrain.data.hf_tokenizer import TokenizerExportError, export_files, export_tokenizer, transformers_caveat
from qtrain.model.config import ModelConfig
from qtrain.model.hf_io import export_manifest, save_hf_model
from qtrain.model.registry import config_from_hf_dict
from qtrain.parallel.layout import FlatLayout
from qtrain.train import checkpoint_io as cio
from qtrain.train.checkpoint_io import CheckpointError
from qtrain.train.checkpointing import _stem

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def checkpoint_params(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor], str]:
    """(model config, full parameters by internal name, master dtype name) from a checkpoint directory."""
    meta, files = cio.read_checkpoint(path)
    cfg = config_from_hf_dict(meta["model"], source=f"{path}/checkpoint.json")
    world = int(meta["distributed"]["world"])
    layout = FlatLayout(cfg, world)
    shards = [files.load(_stem("weights", r, world)) for r in range(world)]
    buffers = {}
    for g in layout.groups:
        parts = [s[g.key] for s in shards]
        if any(p.numel() != g.shard_size(world) for p in parts):
            raise CheckpointError(f"{path}: weight shard of {g.key} has the wrong size for world {world}")
        buffers[g.key] = torch.cat(parts)
    opts = meta.get("options", {})
    return cfg, layout.views(buffers), opts.get("master_dtype") or opts.get("model_dtype", "bf16")


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
    meta, _ = cio.read_checkpoint(path)
    run_id = (meta.get("run") or {}).get("id")
    man = export_manifest(out_dir)
    theirs = (man or {}).get("run_id")
    if theirs and theirs != run_id and not overwrite:
        raise CheckpointError(f"--out-dir {out_dir}: holds the export of another run ({theirs[:8]}, step "
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
    spec = meta.get("tokenizer")
    if not spec:
        return None
    try:
        return export_tokenizer(explicit=spec)
    except TokenizerExportError:
        return None  # recorded path gone: export without a tokenizer rather than fail the conversion
