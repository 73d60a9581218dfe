"""`qtrain export`: a training checkpoint (sharded or not) -> a Hugging Face model directory.

No process group is needed: the weight shards of every rank are concatenated in rank order, which
restores each group's flat buffer (see parallel/layout.py), and the tensors are views into those.

Nothing is exported from a checkpoint that does not verify (`checkpoint_checks`: its meta's schema, every file's
header against the layout and its digest before any tensor is read, then each tensor's digest and values: finite
weights and moments, v >= 0; the Adam files too when there, though the export does not carry them: they are the
same training state); the refusal names the newest checkpoint that does.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch

from qtrain.data.hf_tokenizer import TokenizerExportError, export_files, export_tokenizer, transformers_caveat
from qtrain.locks import Target, hold
from qtrain.model.config import ModelConfig
from qtrain.model.context_extension import adapter_note
from qtrain.model.hf_io import export_manifest, save_hf_model
from qtrain.parallel.experts import whole_experts
from qtrain.train import checkpoint_io as cio
from qtrain.train import checkpoint_meta, run_dir
from qtrain.train.checkpoint_io import CheckpointError
from qtrain.train.checkpoint_meta import LORA_BASE_META, lora_base_change, meant_value
from qtrain.fsio import shorten
from qtrain.model.lora.peft_io import save_adapter
from qtrain.model.resolve import ModelSource, resolve_model
from qtrain.train.checkpoint_checks import check_files, checkpoint_layout, load_checked, lora_of, verify
from qtrain.train.lora_export import base_params, export_lora
from qtrain.train.checkpoint_checks import shard_stem as _stem
from qtrain.train.checkpointing import newest_verifying, refusal, unverified_note

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ADAM_KINDS = ("adam.m", "adam.v")  # not exported; checked when there (the same training state as the weights)


def checked_meta(path: str) -> tuple[dict, ModelConfig, cio.CheckpointFiles]:
    """(meta, model config, files) of a checkpoint whose meta has the schema's shape and whose files' headers match
    its layout and their recorded digests (every rank's weights must be there; Adam files, if there, must fit too:
    `checkpoint_checks.check_files`); CheckpointError otherwise, naming the newest checkpoint beside it that
    verifies when the files are at fault. Reads no tensor."""
    meta, files = cio.read_checkpoint(path)
    cfg = checkpoint_meta.validate(path, meta)
    world = meta["distributed"]["world"]
    if problem := check_files(path, meta, files, cfg, ranks=list(range(world)), optional=ADAM_KINDS):
        raise refusal(problem, newest_verifying(path, _problem), _export_hint)
    return meta, cfg, files


def _problem(path: str) -> str | None:
    """Why the checkpoint at `path` cannot be exported (its weights and Adam files read whole), or None."""
    try:
        meta, _ = cio.read_checkpoint(path)
        checkpoint_meta.validate(path, meta)
    except CheckpointError as e:
        return str(e)
    return verify(path, ranks=list(range(meta["distributed"]["world"])), optional=ADAM_KINDS)


def checkpoint_params(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor], str]:
    """(model config, full parameters by internal name (a LoRA checkpoint's: its adapters), master dtype name) from a
    checkpoint directory, which must verify (CheckpointError naming the file and tensor, and the newest checkpoint beside it that does)."""
    meta, cfg, files = checked_meta(path)
    world = int(meta["distributed"]["world"])
    layout = checkpoint_layout(cfg, meta)  # a LoRA checkpoint: the adapters only
    # the Adam files first (each read whole, then dropped), then the weights: verified in the read that loads them
    try:
        for kind in ADAM_KINDS:
            for r in range(world):
                if _stem(kind, r, world) in files:
                    load_checked(files, kind, r, layout)
        shards = [load_checked(files, "weights", r, layout) for r in range(world)]
    except CheckpointError as e:
        raise refusal(str(e), newest_verifying(path, _problem), _export_hint) from None
    params = {}
    for g in layout.trainable_groups():
        parts = [s[g.key] for s in shards]
        if any(p.numel() != g.shard_size(world) for p in parts):
            raise CheckpointError(f"{path}: weight shard of {g.key} has the wrong size for world {world}")
        if g.ep > 1:  # --expert-parallel: each rank's experts, reassembled
            params.update(whole_experts(g, parts, world))
            continue
        buf = torch.cat(parts)
        params.update({s.name: buf[s.start:s.start + s.numel].view(s.shape) for s in g.segments})
    opts = meta["options"]
    return cfg, params, meant_value(opts, "master_dtype")


def _export_hint(path: str, step: int | None) -> str:
    return f"export it with --step {step}" if step is not None else f"export it with --checkpoint-dir {path}"


class ExportResult(NamedTuple):
    checkpoint: str  # the checkpoint directory exported
    out_dir: str
    tokenizer: str | None  # the tokenizer written beside the weights (None: the run recorded none that exists)
    caveat: str | None = None  # how transformers may load it differently (`transformers_caveat`, `adapter_note`)
    unverified: str | None = None  # the checkpoint records no digests (`checkpointing.unverified_note`)


def export_checkpoint(ckpt_dir: str, out_dir: str, *, step: int | None = None, tokenizer: str = "",
                      overwrite: bool = False, lora_merge: bool = False, base_model: str = "") -> ExportResult:
    """Write the checkpoint of `step` (default: the newest) in `ckpt_dir` as a HF model directory in `out_dir`,
    with the tokenizer the run recorded in it (or `tokenizer`: qwen2 | gpt2 | tokenizer.json | directory) and a
    generation_config.json. An export of another run already there is replaced only with `overwrite`; files no
    qtrain export wrote never are. A LoRA checkpoint is written as its PEFT adapter, or with `lora_merge` as the
    merged model: its adapters folded into the run's base (`base_model`: where that base is now, default the run's
    --model; its config must be the checkpoint's)."""
    # `ckpt_dir` as a path: a run's checkpoint directory (its newest), or one step_N itself (--help)
    path = cio.find_checkpoint(ckpt_dir, step if step is not None else ckpt_dir)
    if path is None:
        have = [s for s, _ in cio.list_checkpoints(ckpt_dir)]
        raise CheckpointError(f"--checkpoint-dir {ckpt_dir}: no checkpoint" + (f" of step {step}" if step is not None
                              else "") + (f" (it has steps {', '.join(map(str, have[-8:]))})" if have else ""))
    meta, ckpt_cfg, files = checked_meta(str(path))  # before anything is read or written
    run_dir.check_export_place(out_dir)
    lora = lora_of(meta)
    if (lora_merge or base_model) and lora is None:
        raise CheckpointError(f"--checkpoint-dir {ckpt_dir}: {'--lora-merge' if lora_merge else '--base-model'} "
                              f"needs a LoRA run's checkpoint; {path} is a full fine-tune's (export it without it)")
    if base_model and not lora_merge:
        raise CheckpointError("--base-model needs --lora-merge (the adapter export names the base, it holds none)")
    base = _merge_base(meta, ckpt_cfg, base_model) if lora_merge else None  # checked before anything is written
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
                 "checkpoint": str(path), "lora_merge": True if base is not None else None,
                 "base_model": os.path.abspath(base_model) if base is not None and base_model else None}
        owner = {k: v for k, v in owner.items() if v is not None}
        if base is not None:  # the adapters merged into the run's base (train/lora_export.py)
            opts = meta["options"]
            source, seed, zero = base
            base_w = base_params(source.cfg, source.weights_dir, dtype=DTYPES[opts["model_dtype"]], seed=seed,
                                 init_proj_to_zero=zero)
            export_lora(out_dir, cfg, lora, {**base_w, **params}, merge=True, base="", dtype=DTYPES[dtype],
                        tokenizer=spec, owner=owner)
        elif lora is not None:  # the PEFT adapter of the run's base model (--model, as the run recorded it)
            save_adapter(out_dir, cfg, lora, params, base=meta["options"].get("model") or "", dtype=DTYPES[dtype],
                         owner=owner, extra_files=export_files(spec, cfg))
        else:
            save_hf_model(out_dir, cfg, params, dtype=DTYPES[dtype], extra_files=export_files(spec, cfg), owner=owner)
    adapter = adapter_note(meta["options"].get("rope_scaling") or "", cfg) if lora is not None and base is None else None
    caveat = "; ".join(n for n in (transformers_caveat(spec, cfg), adapter) if n) or None
    return ExportResult(str(path), str(out_dir), spec, caveat, None if files.verified else unverified_note(str(path)))


def _merge_base(meta: dict, cfg: ModelConfig, base_model: str) -> tuple[ModelSource, int, bool]:
    """(the base's source, the run's seed, its --init-proj-to-zero) for a merged export: `base_model` or the run's
    --model, resolved as the run resolved it; CheckpointError when it is gone or is not the checkpoint's model."""
    opts = meta["options"]
    model = base_model or opts.get("model") or ""
    what = "--base-model" if base_model else "the run's --model"
    try:
        source = resolve_model(model, from_scratch=bool(opts.get("from_scratch")) and not base_model,
                               rope_scaling=opts.get("rope_scaling") or "", seq_len=int(opts.get("seq_len") or 0))
    except (ValueError, OSError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{what} {shorten(model)}: {shorten(first)} (pass --base-model DIR: the base model "
                              f"the run trained on)") from None
    if source.cfg.to_hf_dict() != cfg.to_hf_dict():
        raise CheckpointError(f"{what} {shorten(model)}: its config.json is not the checkpoint's model (another base "
                              f"model?); pass --base-model DIR: the base model the run trained on")
    if opts.get("from_scratch") and source.weights_dir is not None:
        raise CheckpointError(f"{what} {shorten(model)}: the run made its LoRA base from scratch (--seed "
                              f"{opts.get('seed')}): its adapters trained on that base, not on these weights; drop "
                              f"--base-model (the merge makes the run's base again)")
    if why := lora_base_change(meta.get(LORA_BASE_META), source.weights_dir):
        raise CheckpointError(f"{what} {shorten(model)}: {why}; pass --base-model DIR: the base model the run trained "
                              f"on")
    return source, int(opts.get("seed") or 0), bool(opts.get("init_proj_to_zero"))


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
