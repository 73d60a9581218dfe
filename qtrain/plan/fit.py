"""What long sequences take to fit a device, as option changes: the LM head in chunks, recomputation, the block inputs
on the host, and the MLP in token slices. One home for the rules `qtrain plan`'s proposals (`plan/propose.py`) and a
run's start (`plan/resolution.py`, when the given options would not fit) both follow, and for which of them change the
numbers (CHANGES_NUMBERS: what a resumed run keeps as its checkpoint ran it, `train/resume_checks.py`).

Activations and the LM head's transient grow with the tokens of a micro-batch (B x T); the weights, gradients and
optimizer state do not. At Qwen2.5-7B and T = 131072 one unchunked LM head holds the bf16 logits of every token:
131072 x 152064 x 2 bytes = 37 GiB, where chunks of HEAD_CHUNK_TOKENS tokens hold 4.6 GiB each.

    chunks = head_chunks(B * T, at_least=opts.lmhead_chunks)
    changes, plan = fit_activations(opts, plan_of)   # ({}, plan) when the options fit as given
    changes, plan = fit_activations(opts, plan_of, keep=frozenset({"lmhead_chunks"}))   # a resume's: chunks as given
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from qtrain.options import Options, OptionsError
from qtrain.options_checks import MLP_SLICE_ROWS
from qtrain.plan.memory import MemoryPlan

# Tokens per LM head chunk beyond which the head is split. qtrain's H200 rates at 1.5B-14B with 32-64k tokens per
# micro-batch were measured with the head in chunks of 8-16k tokens (--lmhead-chunks 4): GEMMs of 16k x C x V are
# large enough. Whether fewer, larger chunks run faster at long sequences is not measured; they cost memory.
HEAD_CHUNK_TOKENS = 16384

PlanOf = Callable[[Options], "MemoryPlan | None"]  # the plan of a run of these options; None: not a run to make

# The activation-side switches, least intrusive first (each adds to the previous): what recomputes only element-wise
# steps, then the MLP's GEMMs, then the whole block, then the block inputs moved to pinned host memory.
ACTIVATION_RUNGS: tuple[tuple[str, dict[str, bool]], ...] = (
    ("recompute swiglu+norm", {"recompute_swiglu": True, "recompute_norm": True}),
    ("recompute ffn", {"recompute_ffn": True}),
    ("recompute block", {"recompute_block": True}),
    ("offload residual", {"offload_residual": True}),
)
MLP_RUNG = "mlp chunks"  # after them all: one more MLP forward a step (`mlp_chunks`), for long micro-batches only
# Every option the fit may change.
FIT_OPTIONS: tuple[str, ...] = ("lmhead_chunks",
                                *dict.fromkeys(k for _label, flags in ACTIVATION_RUNGS for k in flags), "mlp_chunks")
# Those of them that change the numbers: the LM head's chunks regroup its sums (the loss's and, accumulated chunk by
# chunk, d(W_head)'s; tests/model/test_recompute.py compares each variant with a plain run of its own chunks), and the
# MLP's slices regroup the block weights' gradient sums (and in e4m3 scale each slice's FP8 operands).
# Recomputation and the residual offload replay the same operations on the same inputs: bit for bit the same
# (eager, and through AOTAutograd's partitioner without inductor's code: tests/model/test_recompute.py). The automatic
# choice the MLP-splitting switches turn off, the one-pass FP8 SwiGLU, does change them: a resume pins it
# (`train/resume_checks.PINNED_ON_RESUME`).
CHANGES_NUMBERS: tuple[str, ...] = ("lmhead_chunks", "mlp_chunks")


def head_chunks(tokens: int, at_least: int = 1, rows: int = 1) -> int:
    """LM head chunks for a micro-batch of `tokens`: `at_least`, doubled while a chunk holds more than
    HEAD_CHUNK_TOKENS tokens and the doubled count still divides the tokens (--lmhead-chunks must) into chunks of a
    multiple of `rows` tokens."""
    n = max(1, at_least)
    while -(-tokens // n) > HEAD_CHUNK_TOKENS and tokens % (2 * n * rows) == 0:
        n *= 2
    return n


def mlp_chunks(tokens: int) -> int:
    """--mlp-chunks for a micro-batch of `tokens` (a rank's): the LM head's rule (GEMMs of 16k rows run near their
    peak), each slice a multiple of MLP_SLICE_ROWS tokens; 1 where one slice holds them all."""
    return head_chunks(tokens, rows=MLP_SLICE_ROWS)


def activation_rungs(opts: Options) -> tuple[tuple[str, dict[str, Any]], ...]:
    """ACTIVATION_RUNGS, then the MLP in slices where the micro-batch is long enough to slice (a plan that refuses
    them, a family without slices, returns None there)."""
    n = mlp_chunks(opts.batch_size * opts.seq_len // max(1, opts.context_parallel))
    return ACTIVATION_RUNGS + (((MLP_RUNG, {"mlp_chunks": n}),) if n > opts.mlp_chunks else ())


def _plan(opts: Options, changes: dict[str, Any], plan_of: PlanOf) -> MemoryPlan | None:
    try:
        o = dataclasses.replace(opts, **changes).validate()
    except OptionsError:
        return None
    return plan_of(o)


def fit_activations(opts: Options, plan_of: PlanOf, plan: MemoryPlan | None = None, *,
                    keep: frozenset[str] = frozenset()) -> tuple[dict[str, Any], MemoryPlan | None]:
    """The fewest activation-side changes with which `plan_of(options)` fits its budget: none where the options
    fit as given (`plan`: their plan, when made already); else the LM head in chunks of HEAD_CHUNK_TOKENS tokens,
    then each of `activation_rungs` in turn, the switches the options have already kept. ({}, the given plan) where
    nothing fits: what the user asked for stays, and the plan says it does not fit. `plan_of` returns None for
    options the caller cannot run. `keep`: options of FIT_OPTIONS to leave as given (a resumed run's, whose
    checkpoint ran them so)."""
    given = plan if plan is not None else plan_of(opts)
    if given is None or given.fits:
        return {}, given
    changes: dict[str, Any] = {}
    chunks = head_chunks(opts.batch_size * opts.seq_len, at_least=opts.lmhead_chunks)
    if chunks != opts.lmhead_chunks and "lmhead_chunks" not in keep:
        changes["lmhead_chunks"] = chunks
        p = _plan(opts, changes, plan_of)
        if p is not None and p.fits:
            return changes, p
    for _label, flags in activation_rungs(opts):
        changes.update({k: v for k, v in flags.items() if getattr(opts, k) != v and k not in keep})
        p = _plan(opts, changes, plan_of)
        if p is not None and p.fits:
            return _prune(opts, changes, p, keep=set(flags), plan_of=plan_of)
    return {}, given


def _prune(opts: Options, changes: dict[str, Any], plan: MemoryPlan, *, keep: set[str],
           plan_of: PlanOf) -> tuple[dict[str, Any], MemoryPlan]:
    """Drop the earlier rungs' switches the fitting changes do not need (those --recompute-block implies), latest
    first; the last rung's (`keep`) and the LM head chunks stay."""
    for k in reversed([k for k in changes if k not in keep and k != "lmhead_chunks"]):
        trial = {kk: vv for kk, vv in changes.items() if kk != k}
        p = _plan(opts, trial, plan_of)
        if p is not None and p.fits:
            changes, plan = trial, p
    return changes, plan
