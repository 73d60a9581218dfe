"""What `--continue` compares: the run a checkpoint records (every option, the training files) against the
command that resumes it, before anything is built.

Refused (one line naming each option with its old -> new value), because the saved state would then mean
something else:

* the data position (a chunk index into the shuffled files, `TokenLoader.state_dict`): another --seq-len (the
  chunks are cut anew: 16 -> 8 re-serves every token trained so far), another --train-seed (another order), a
  training file replaced, appended to, truncated or rewritten, or a glob that gained or lost a file. `--new-data`
  accepts them: the data position restarts at the start of the (new) data.
* the schedule and the optimizer's batch: another --lr-schedule, --warmup, --cooldown, --final-lr-fraction, or
  global batch (batch x grad-accumulation x ranks; another split of the same global batch is fine, as is another
  number of ranks with it). `--override-schedule` takes them from the command line (Megatron-LM's
  --override-opt_param-scheduler).
* a run shorter than the checkpoint (--steps or --epochs giving fewer steps than it has done): no flag.
* a LoRA run whose base weights (--model's files) are not those its adapters trained on (`lora_base_change`): no
  flag; the checkpoint holds the adapters only.

Every other changed option is accepted and reported, one line each (`Change`), in the console and the run log.
So is a change of the block linears --fp8-policy auto puts in FP8 (it decides by the micro-batch, which another
split of the same global batch changes: `fp8_change`).

Kept as the checkpoint's run made them, where the command leaves them as its command did (`Review.pinned`): the
automatic choices that change the numbers (PINNED_ON_RESUME) and what --fit-memory chose of them for the checkpoint's
device (`plan/fit.CHANGES_NUMBERS`: the LM head chunks, the MLP slices), so that a resume on another device continues
bit for bit.
The fit on this device changes such an option only where nothing fits with it, and what it changes otherwise
(recomputation, the residual offload: the same numbers) follows this device; either is reported, one line each
(`memory_differences`).

A checkpoint of an older qtrain (format 1) records five options and no files: what it lacks cannot be checked,
and the resume says so. A run whose checkpoint is at its last step and whose export is complete has nothing to
do (`Review.finished`).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from qtrain.data.fingerprint import describe_change, fingerprint, same_content
from qtrain.data.loader import position_error
from qtrain.data.token_files import expand_files, read_token_file_header
from qtrain.fsio import shorten
from qtrain.model.config import ModelConfig
from qtrain.model.hf_io import export_manifest, manifest_files
from qtrain.model.lora.peft_io import CONFIG_FILE as ADAPTER_CONFIG
from qtrain.model.resolve import resolve_model
from qtrain.options import Options, OptionsError
from qtrain.plan.fit import CHANGES_NUMBERS, FIT_OPTIONS
from qtrain.train.checkpoint_meta import (LORA_BASE_META, MEMORY_META, MUST_MATCH, lora_base_change, meant_value,
                                          memory_record, scratch_base_change)

# how this command resumes and what it prints, not what the run is: never compared
INVOCATION = ("continue_from", "new_data", "start_over", "override_schedule", "eval_at_start", "verbose", "quiet")
DATA_OPTIONS = ("seq_len", "train_seed")  # the saved data position means something else with another value
SCHEDULE_OPTIONS = ("lr_schedule", "warmup", "cooldown", "final_lr_fraction")
_LISTED = 3  # files named in a message before "and N more"


class ResumeError(ValueError):
    """A --continue whose command changes what the checkpoint's state means; the message names each change."""


@dataclass
class Change:
    """One accepted option change: `--lr 0.001 -> 0.0005`; `why`, where the command did not make it itself."""
    option: str
    old: Any
    new: Any
    why: str = ""

    def text(self, step: int) -> str:
        return (f"--continue: {_flag(self.option)} {_show(self.old)} -> {_show(self.new)} (checkpoint step {step})"
                + (f": {self.why}" if self.why else ""))


@dataclass
class Review:
    step: int  # the checkpoint's
    changes: list[Change] = field(default_factory=list)  # accepted, reported one line each
    notes: list[str] = field(default_factory=list)  # what else the resume should say (unchecked records, --new-data)
    finished: str | None = None  # "run X finished at step N; its export is in DIR; nothing to do"
    pinned: dict[str, Any] = field(default_factory=dict)  # automatic choices taken from the checkpoint's run
    memory: dict[str, Any] = field(default_factory=dict)  # how it held its activations (`ran_memory`)

    def report(self, log: Any) -> None:
        """Into the run log (a `RunLogger`) and onto the console: the notes, then one line per accepted change."""
        for note in self.notes:
            log.message(note, level="warning")
        for c in self.changes:
            log.message(c.text(self.step), level="warning", step=self.step, option=c.option, old=c.old, new=c.new)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _show(v: Any) -> str:
    return "''" if v == "" else shorten(v) if isinstance(v, str) else str(v)


def _names(paths: list[str]) -> str:
    shown = ", ".join(shorten(p) for p in paths[:_LISTED])
    return shown + (f" and {len(paths) - _LISTED} more" if len(paths) > _LISTED else "")


def current_data(train_pattern: str) -> list[dict[str, Any]]:
    """Fingerprints of the files `train_pattern` names now (in the loader's order)."""
    return [fingerprint(p) for p in expand_files(train_pattern)]


def _by_place(files: list[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """Files by their path below the folder they share: the same data moved elsewhere pairs up file by file."""
    root = os.path.commonpath([os.path.dirname(f["path"]) for f in files])
    return {os.path.relpath(f["path"], root): f for f in files}


def data_change(old: list[Mapping[str, Any]], new: list[Mapping[str, Any]]) -> tuple[str | None, str | None]:
    """(what changed in the training data that moves the data position, or None; a note on what changed that
    does not: the same bytes at other paths, files touched)."""
    if [(f["size"], f["digest"]) for f in old] == [(f["size"], f["digest"]) for f in new]:
        moved = [f"{shorten(a['path'])} -> {shorten(b['path'])}" for a, b in zip(old, new) if a["path"] != b["path"]]
        touched = [b["path"] for a, b in zip(old, new) if a["path"] == b["path"] and describe_change(a, b)]
        notes = ([f"the training files are at other paths with the same content ({', '.join(moved[:_LISTED])}"
                  f"{' ...' if len(moved) > _LISTED else ''})"] if moved else []) + (
            [f"{_names(touched)}: touched or copied since the checkpoint (same size and sampled content)"]
            if touched else [])
        return None, "; ".join(notes) or None
    old_by, new_by = _by_place(old), _by_place(new)
    parts = [f"{shorten(new_by[k]['path'])} was {describe_change(old_by[k], new_by[k])}"
             for k in sorted(old_by.keys() & new_by.keys()) if not same_content(old_by[k], new_by[k])]
    parts = parts[:_LISTED] + ([f"{len(parts) - _LISTED} more changed"] if len(parts) > _LISTED else [])
    if gained := sorted(new_by[k]["path"] for k in new_by.keys() - old_by.keys()):
        parts.append(f"the training files now include {_names(gained)}")
    if lost := sorted(old_by[k]["path"] for k in old_by.keys() - new_by.keys()):
        parts.append(f"{_names(lost)} {'is' if len(lost) == 1 else 'are'} no longer among the training files")
    return "the training data changed since the checkpoint: " + "; ".join(parts or ["the files are reordered"]), None


def _position_problem(state: Mapping[str, Any], train_pattern: str, seq_len: int) -> list[str]:
    """[why the saved data position cannot be restored in the training files there are now] or []."""
    if not state:
        return ["the checkpoint records no data position (written without a data loader): pass --new-data to start "
                "at the beginning of the training data"]
    why = position_error(state, [read_token_file_header(p).num_tokens for p in expand_files(train_pattern)], seq_len)
    return [f"its data_loader is no position in the training files there are now ({why}): pass --new-data to "
            f"restart at the start of the training data"] if why else []


def _global_batch(o: Mapping[str, Any], world: int) -> int:
    return int(o["batch_size"]) * int(o["grad_accumulation"]) * world


def _finished(meta: Mapping[str, Any], out_dir: str, lora_merge: bool = False) -> tuple[bool, str]:
    """(whether the export in `out_dir` is this run's, of the checkpoint's step, complete, and for a LoRA run the
    kind this command asks for -- the adapter, or with `lora_merge` the merged model; why not)."""
    from qtrain.train.checkpoint_checks import LORA_META  # here: at the top it closes an import cycle
    man = export_manifest(out_dir)
    run_id = (meta.get("run") or {}).get("id")
    if man is None:
        return False, "missing"
    if man.get("run_id") != run_id:
        return False, "of another run"
    if man.get("step") != meta["step"]:
        return False, f"of step {shorten(man.get('step'))}"
    if man.get("complete") is not True or not all((Path(out_dir) / n).is_file() for n in manifest_files(man)):
        return False, "incomplete"
    if meta.get(LORA_META) and (ADAPTER_CONFIG not in manifest_files(man)) != lora_merge:
        return False, ("the merged model, not the adapter this command asks for" if not lora_merge else
                       "the adapter, not the merged model --lora-merge asks for")
    return True, ""


def _data_problems(meta: Mapping[str, Any], opts: Options, train_pattern: str) -> tuple[list[str], list[str]]:
    """(changes that move the data position, notes on changes that do not)."""
    old, state, data = meta["options"], meta["data_loader"], meta.get("data")
    problems, notes = [], []
    old_seed = state.get("seed", old.get("train_seed"))  # the seed the saved position was shuffled with
    if old_seed is not None and old_seed != opts.train_seed:
        problems.append(f"--train-seed {old_seed:#x} -> {opts.train_seed:#x}")
    if "seq_len" in old and old["seq_len"] != opts.seq_len:
        problems.append(f"--seq-len {old['seq_len']} -> {opts.seq_len}")
    if data is not None:
        problem, note = data_change(data["files"], current_data(train_pattern))
        problems += [problem] if problem else []
        notes += [note] if note else []
    return problems, notes


def _schedule_problems(meta: Mapping[str, Any], opts: Options, world: int) -> list[str]:
    """Changes of the learning-rate schedule or of the global batch (another split of it, or the same global batch
    on another number of ranks, is none)."""
    old, state, dist = meta["options"], meta["data_loader"], meta["distributed"]
    problems = []
    if {"batch_size", "grad_accumulation"} <= old.keys():
        # the ranks that read their own sequences: the loader's world (a --context-parallel group shares its own)
        old_world = state.get("world") or dist["world"] * dist.get("replicas", 1)
        readers = world // max(1, opts.context_parallel)
        before, now = _global_batch(old, old_world), _global_batch(vars(opts), readers)
        if before != now:
            problems.append(f"global batch {before} -> {now} sequences per step (--batch-size {old['batch_size']} -> "
                            f"{opts.batch_size}, --grad-accumulation {old['grad_accumulation']} -> "
                            f"{opts.grad_accumulation}, {old_world} -> {readers} rank(s)"
                            f"{' reading their own sequences' if readers != world else ''})")
    return problems + [f"{_flag(k)} {_show(old[k])} -> {_show(getattr(opts, k))}" for k in SCHEDULE_OPTIONS
                       if k in old and old[k] != getattr(opts, k)]


def _lora_base_problem(meta: Mapping[str, Any], opts: Options) -> str | None:
    """Why this command's LoRA base is not the one the checkpoint's adapters trained on (weights it recorded, or the
    base its run made from scratch), or None (also for a run without adapters)."""
    from qtrain.train.checkpoint_checks import LORA_META  # here: at the top it closes an import cycle
    if not meta.get(LORA_META):
        return None
    weights_dir = resolve_model(opts.model, from_scratch=opts.from_scratch).weights_dir
    return (lora_base_change(meta.get(LORA_BASE_META), weights_dir)
            or scratch_base_change(meta["options"], weights_dir, opts.init_proj_to_zero))


def later_checkpoints(path: str, step: int) -> str | None:
    """The line naming the checkpoints beside `path` of later steps than its `step` (a resume from an earlier one),
    or None: the run writes those of the steps it reaches anew, and the newest stays what a plain --continue takes."""
    from qtrain.train.checkpoint_io import list_checkpoints  # here: at the top it closes an import cycle
    later = [p.name for s, p in list_checkpoints(Path(path).parent) if s > step]
    if not later:
        return None
    return (f"--continue: the checkpoint directory holds later checkpoints of the run than step {step} "
            f"({_names(later)}): this run replaces those of the steps it reaches, and a plain --continue resumes the "
            f"newest of them (remove those you do not want resumed)")


# what `resolution.fp8_choice` chooses the FP8 block linears by (--fp8-policy auto: the micro-batch's tokens)
FP8_CHOICE_OPTIONS = ("model_dtype", "matmul_dtype", "batch_size", "seq_len", "fp8_policy", "fp8_min_size",
                      "fp8_min_block_gflop")


def fp8_change(old: Mapping[str, Any], opts: Options, cfg: ModelConfig, step: int) -> str | None:
    """The line saying that this run puts other block linears in FP8 than the checkpoint's run did (--fp8-policy
    auto decides by the micro-batch, which another split of the same global batch changes), or None."""
    from qtrain.plan.resolution import fp8_choice  # here: at the top it closes an import cycle
    try:
        was = fp8_choice(cfg, dataclasses.replace(opts, **{k: old[k] for k in FP8_CHOICE_OPTIONS if k in old}))
    except (ValueError, TypeError):  # a record this qtrain cannot choose from: its options lines say what changed
        return None
    now = fp8_choice(cfg, opts)
    before, after = (tuple(c.fp8) if c is not None else () for c in (was, now))
    if before == after or was is None or now is None:  # none, or --matmul-dtype's own change line says it
        return None
    return (f"--continue: the block linears in FP8 (--fp8-policy {opts.fp8_policy}) {', '.join(before) or 'none'} -> "
            f"{', '.join(after) or 'none'}: micro-batches of {was.tokens} -> {now.tokens} tokens (checkpoint step "
            f"{step}); the run's precision changes here (keep --batch-size {old.get('batch_size')} or pass "
            f"--fp8-policy all to keep them)")


# automatic choices that change the numbers: left unset on `--continue`, each is taken as the checkpoint's run made it
# (a checkpoint written before the FP8 head backward became auto records it off, then the default; the one-pass FP8
# SwiGLU, which --fit-memory's --recompute-swiglu / --recompute-ffn turn off, is recorded as made since they are)
PINNED_ON_RESUME = ("fp8_head_backward", "fp8_swiglu_onepass")


def pinned_choices(old: Mapping[str, Any], opts: Options) -> dict[str, Any]:
    """The options of PINNED_ON_RESUME that this command leaves unset, with the values the checkpoint's run used;
    none where the command runs another matmul dtype (FP8 choices, made anew: its change is reported)."""
    if "matmul_dtype" in old and meant_value(old, "matmul_dtype") != meant_value(opts.to_dict(), "matmul_dtype"):
        return {}
    return {k: old[k] for k in PINNED_ON_RESUME if getattr(opts, k) is None and isinstance(old.get(k), bool)}


def ran_memory(meta: Mapping[str, Any], opts: Options) -> dict[str, Any]:
    """The checkpoint's `memory` record (the options --fit-memory may change, as its run ran them) for those this
    command gives as the checkpoint's command did (a command's other value is its own change, reported as one); {}
    for a checkpoint written before the record."""
    ran, old = meta.get(MEMORY_META) or {}, meta["options"]
    return {k: ran[k] for k in FIT_OPTIONS if k in ran and k in old and old[k] == getattr(opts, k)}


def _runnable(opts: Options, pins: Mapping[str, Any]) -> dict[str, Any]:
    """The pins this command's options take, in order: one they refuse (the LM head chunks of another micro-batch,
    the one-pass SwiGLU with a recompute switch the command adds) stays the command's to decide."""
    out: dict[str, Any] = {}
    for k, v in pins.items():
        try:
            dataclasses.replace(opts, **out, **{k: v}).validate()
        except OptionsError:
            continue
        out[k] = v
    return out


def memory_differences(rv: Review, opts: Options, run: Any) -> list[Change]:
    """One line for each option of the checkpoint's `memory` record (`Review.memory`) that this run (`opts`, resolved
    as `run`) holds otherwise: one that changes the numbers where the fit on this device could not keep it (or this
    command's options refuse it), one that does not where this device's plan differs."""
    now = memory_record(opts, run)
    budget = f"{run.plan.budget / 2**30:.1f} GiB" if run.plan.budget is not None else "this device"
    lost = "so the numbers do not continue bit for bit from here"

    def why(k: str) -> str:
        if k not in CHANGES_NUMBERS and k not in PINNED_ON_RESUME:
            return "how this run holds its activations on this device (--fit-memory); the numbers stay the same"
        if k in rv.pinned:
            return f"with the checkpoint's value the plan does not fit {budget} (--fit-memory), {lost} " \
                   f"(--no-fit-memory keeps it)"
        return f"this command's options do not take the checkpoint's value, {lost}"
    lost_pins = [Change(k, was, getattr(run, k), why(k)) for k, was in rv.pinned.items()
                 if k in PINNED_ON_RESUME and getattr(run, k) != was]  # the FP8 choices (always number-changing)
    # kept where the command says otherwise (its value is the checkpoint's command's, e.g. the default): said, since
    # options cannot tell a value given from one left as it was
    kept = [Change(k, getattr(opts, k), was, "kept as the checkpoint's run ran it (its --fit-memory chose it), so the "
                   "numbers continue bit for bit; another value on this command changes it")
            for k, was in rv.memory.items() if k in CHANGES_NUMBERS and now[k] == was != getattr(opts, k)]
    return [Change(k, was, now[k], why(k)) for k, was in rv.memory.items() if now[k] != was] + lost_pins + kept


def review(path: str, meta: Mapping[str, Any], opts: Options, *, world: int, train_pattern: str, total_steps: int,
           out_dir: str, cfg: ModelConfig | None = None) -> Review:
    """Compare this command (`opts` on `world` ranks, its resolved training files and step count; `cfg`, the model,
    for the automatic choices it reports) with the checkpoint at `path` (its meta, validated); ResumeError for a
    change the module docstring refuses."""
    step, old, state, version = meta["step"], meta["options"], meta["data_loader"], meta["version"]
    if total_steps < step:
        how = f"--steps {opts.steps}" if opts.steps > 0 else f"--epochs {opts.epochs} ({total_steps} steps)"
        raise ResumeError(f"--continue {path}: {how} ends before the checkpoint's step {step}: its weights have "
                          f"trained {step} steps. Resume it with --steps {step} or more, resume an earlier checkpoint "
                          f"(--continue STEP), or export it with `qtrain export`")
    if (why := _lora_base_problem(meta, opts)) is not None:
        raise ResumeError(f"--continue {path}: {why}; resume with that base, or export the adapters (`qtrain export`) "
                          f"and start a new run on this base with --lora-init-from")
    data_problems, notes = _data_problems(meta, opts, train_pattern)
    schedule_problems = _schedule_problems(meta, opts, world)
    refused = []
    if data_problems and not opts.new_data:
        refused.append(f"{', '.join(data_problems)}: the saved data position would serve other sequences than the "
                       f"run's next ones (pass --new-data to restart it at the start of the training data)")
    if schedule_problems and not opts.override_schedule:
        refused.append(f"{', '.join(schedule_problems)}: the learning-rate schedule or the batch the optimizer "
                       f"steps with would change mid-run (pass --override-schedule to take them from this command)")
    tail = "; or resume with the checkpoint's values" if refused else ""
    if not opts.new_data and not data_problems:
        refused += _position_problem(state, train_pattern, opts.seq_len)
    if refused:
        raise ResumeError(f"--continue {path} (step {step}): {'; '.join(refused)}{tail}")

    rv = Review(step=step, notes=notes)
    if version < 2:
        rv.notes.append(f"checkpoint {path} has format {version}: it records {len(old)} options and not the training "
                        f"files, so changes to the other options or to the data cannot be checked (checkpoints "
                        f"written from now on record them)")
    elif meta.get("data") is None:
        rv.notes.append(f"checkpoint {path} records no training files (written without a data loader): changes to "
                        f"the data cannot be checked")
    if opts.new_data:
        where = (f"epoch {state['epoch']}, file {state['file_index']}, sequence {state['chunk_index']}" if state
                 else "no position")
        rv.notes.append(f"--new-data: the data position restarts at the start of the training data (the checkpoint "
                        f"was at {where})" + (f"; {', '.join(data_problems)}" if data_problems else ""))
    rv.memory = ran_memory(meta, opts)
    rv.pinned = _runnable(opts, {**pinned_choices(old, opts),
                                 **{k: v for k, v in rv.memory.items() if k in CHANGES_NUMBERS}})
    if line := later_checkpoints(path, step):
        rv.notes.append(line)
    if cfg is not None and (line := fp8_change(old, opts, cfg, step)):
        rv.notes.append(line)
    skip = set(INVOCATION) | set(MUST_MATCH) | set(rv.pinned)
    now = opts.to_dict()  # compared by meaning: an explicit default where the checkpoint has '' is no change
    rv.changes = sorted((Change(k, old[k], now[k]) for k in Options.field_names() & old.keys()
                         if k not in skip and meant_value(old, k) != meant_value(now, k)), key=lambda c: c.option)
    if total_steps == step:
        done, why = _finished(meta, out_dir, opts.lora_merge)
        run = meta.get("run") or {}
        who = f"run {run.get('name') or '?'} ({str(run.get('id') or '?')[:8]})"
        if done:
            rv.finished = f"{who} finished at step {step}; its export is in {out_dir}; nothing to do"
        else:
            rv.notes.append(f"{who} finished at step {step}, but its export in {out_dir} is {why}: evaluating and "
                            f"exporting it")
    return rv
