"""`qtrain export`: a training checkpoint (sharded or not) -> a Hugging Face model directory.

No process group is needed: the weight shards of every rank are concatenated in rank order, which
restores each group's flat buffer (see parallel/layout.py), and the tensors are views into those.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from qtrain.data.hf_tokenizer import TokenizerExportError, export_files, export_tokenizer, transformers_caveat
from qtrain.model.config import ModelConfig
from qtrain.model.hf_io import save_hf_model
from qtrain.parallel.layout import FlatLayout
from qtrain.train import checkpoint_io as cio
from qtrain.train.checkpointing import CheckpointError, _stem

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def checkpoint_params(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor], str]:
    """(model config, full parameters by internal name, model dtype name) from a checkpoint directory."""
    meta, files = cio.read_checkpoint(path)
    cfg = ModelConfig.from_hf_dict(meta["model"], source=f"{path}/checkpoint.json")
    world = int(meta["distributed"]["world"])
    layout = FlatLayout(cfg, world)
    shards = [files.load(_stem("weights", r, world)) for r in range(world)]
    buffers = {}
    for g in layout.groups:
        parts = [s[g.key] for s in shards]
        if any(p.numel() != g.shard_size(world) for p in parts):
            raise CheckpointError(f"{path}: weight shard of {g.key} has the wrong size for world {world}")
        buffers[g.key] = torch.cat(parts)
    return cfg, layout.views(buffers), meta.get("options", {}).get("model_dtype", "bf16")


class ExportResult(NamedTuple):
    checkpoint: str  # the checkpoint directory exported
    out_dir: str
    tokenizer: str | None  # the tokenizer written beside the weights (None: the run recorded none that exists)
    caveat: str | None = None  # how transformers may load that tokenizer differently (`transformers_caveat`)


def export_checkpoint(ckpt_dir: str, out_dir: str, *, step: int | None = None, tokenizer: str = "") -> ExportResult:
    """Write the checkpoint (latest, or `step`) as a HF model directory, with the tokenizer the run recorded
    in it (or `tokenizer`: qwen2 | gpt2 | tokenizer.json | directory) and a generation_config.json."""
    path = cio.find_checkpoint(ckpt_dir, step)
    if path is None:
        raise CheckpointError(f"--checkpoint-dir {ckpt_dir}: no checkpoint" + (f" for step {step}" if step else ""))
    cfg, params, dtype = checkpoint_params(str(path))
    spec = export_tokenizer(explicit=tokenizer or (checkpoint_tokenizer(str(path)) or ""))
    save_hf_model(out_dir, cfg, params, dtype=DTYPES[dtype], extra_files=export_files(spec, cfg))
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
