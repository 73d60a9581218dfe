"""`qtrain plan`'s proposals: for each micro-batch, the least intrusive recompute / offload / sharding
settings that fit a device, and the fastest of them by the step-time model (`step_cost.py`).

    for changes, plan in propose(cfg, opts, parse_bytes("80GiB"), world=8): ...
    best, costs = recommend(cfg, opts, proposals)
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from qtrain.model.config import ModelConfig
from qtrain.options import Options, OptionsError
from qtrain.plan.fit import MLP_RUNG, head_chunks, mlp_chunks
from qtrain.plan.memory import MemoryPlan, run_layout
from qtrain.plan.resolution import mlp_chunks_refusal, plan_memory, sharded_weights_refusal
from qtrain.plan.step_cost import StepCost, fp8_weight_params, step_cost

MIN_CHUNK_ROWS = 1024  # propose() splits the LM head into chunks of at least this many tokens (GEMM efficiency)


def _ladder(base: Options, world: int, *, offload_first: bool = False, shardable: bool = True,
            sliceable: bool = True) -> list[tuple[str, dict[str, Any]]]:
    """Cumulative option changes, least intrusive first: recompute (cheap element-wise steps first), then
    host offload of optimizer state, then sharding (world > 1) and offload of weights and gradients, then
    the block inputs. `offload_first`: the optimizer-state offload before the recomputation of GEMMs (ffn,
    block), which is cheaper when an optimizer step has many micro-steps (see `step_cost`). `shardable` False: the
    run cannot shard its weights (`resolution.sharded_weights_refusal`), so neither they nor the master's offload
    are proposed; an e4m3 LoRA base (`--lora-base-dtype e4m3`) is offered on the host instead (`--offload-quants`).
    `sliceable`: the model's MLP can run in token slices (`resolution.mlp_chunks_refusal`), a rung where the
    micro-batch is long (`fit.mlp_chunks`; the batch is the proposal's, so `_fit_batch` sets the count): after the
    block's recomputation, or with `offload_first` after every offload (the step model picks between the two)."""
    steps: list[tuple[str, dict[str, Any]]] = [("none", {})]

    def add(label: str, **flags: Any) -> None:
        steps.append((label, flags))
    add("recompute swiglu+norm", recompute_swiglu=True, recompute_norm=True)
    if offload_first:
        add("offload opt m", offload_opt_m=True)
        add("offload opt v", offload_opt_v=True)
    add("recompute ffn", recompute_ffn=True)
    add("recompute block", recompute_block=True)
    if sliceable and not offload_first:  # 0: `_fit_batch` sets the count for its micro-batch
        add(MLP_RUNG, mlp_chunks=0)
    if not offload_first:
        add("offload opt m", offload_opt_m=True)
        add("offload opt v", offload_opt_v=True)
    unsharded = base.gradient_manager_kind == "unsharded"
    if world > 1 and unsharded:
        add("shard gradients", shard_gradients=True)
    if shardable and base.zero_level < 2:  # --zero-level and --shard-weights are exclusive; level 3 already shards
        add("shard weights", shard_weights=True)
    if shardable:
        add("offload master", offload_master=True)
    elif base.lora_rank and base.lora_base_dtype:  # an e4m3 base: its codes on the host (after recompute block)
        add("offload base", offload_quants=True)
    add("offload gradients", offload_gradients=True, **({"shard_gradients": True} if unsharded and base.zero_level < 2
                                                         else {}))
    add("offload residual", offload_residual=True)
    if sliceable and offload_first:
        add(MLP_RUNG, mlp_chunks=0)
    out, acc = [], {}
    for label, flags in steps:
        acc = {**acc, **flags}
        out.append((label, dict(acc)))
    return out


def _try(cfg: ModelConfig, opts: Options, changes: dict[str, Any], **kw: Any) -> MemoryPlan | None:
    """The plan of `opts` with `changes`, or None where the changed options are refused: by their own checks or by
    the run's resolution inside the plan (e.g. persistent quants whose matrices sharding cannot split on the FP8
    alignment: a rung the user never asked for must not end the whole proposal)."""
    try:
        o = dataclasses.replace(opts, **changes).validate()
        return plan_memory(cfg, o, **kw)
    except (OptionsError, TypeError):
        return None


def propose(cfg: ModelConfig, base_options: Options, gpu_bytes: int, world: int = 1, *, max_batch: int = 64,
            device: str = "cuda", compiled: bool | None = None, reserve: int | None = None,
            model_name: str | None = None) -> list[tuple[dict[str, Any], MemoryPlan]]:
    """Configurations that fit `gpu_bytes` per device, largest micro-batch first: the largest power-of-two
    micro-batch (<= max_batch) that fits, with the least intrusive changes that make it fit; then each
    smaller batch with its own least changes. Each entry: (option changes relative to `base_options`, plan);
    empty if nothing fits. `recommend` picks the one the step model says is fastest.

    For each batch two ladders are climbed (`_ladder`: none -> recompute swiglu+norm -> ffn -> block ->
    [a long micro-batch: mlp chunks] -> offload opt m -> v -> [world > 1: shard gradients] -> shard weights ->
    offload master -> offload gradients -> offload residual; and the same with the optimizer-state offload before
    recompute ffn and the MLP's slices last);
    at each rung `--lmhead-chunks` starts where a chunk holds at most `fit.HEAD_CHUNK_TOKENS` tokens and is doubled
    first (cheap, as long as a chunk keeps MIN_CHUNK_ROWS tokens).
    Each first fit is pruned of earlier switches it does not need, and of the two the one `step_cost`
    finds cheaper at the base options' sequences per optimizer step is kept. When the micro-batch changes,
    `--grad-accumulation` changes with it so that the sequences per step stay the same (at least one
    micro-step). With FP8 linears and several micro-steps, `--persistent-quants` is added where it still fits
    and the step model finds it faster (`_with_persistent_quants`)."""
    layout = run_layout(cfg, base_options, world)  # the run's own: LoRA's frozen base, expert parallelism
    kw = dict(world=world, gpu_memory=gpu_bytes, device=device, compiled=compiled, reserve=reserve, layout=layout,
              model_name=model_name)
    shardable = sharded_weights_refusal(cfg, base_options) is None
    sliceable = mlp_chunks_refusal(cfg) is None
    ladders = [_ladder(base_options, world, shardable=shardable, sliceable=sliceable),
               _ladder(base_options, world, offload_first=True, shardable=shardable, sliceable=sliceable)]
    seqs = _sequences(base_options, {})
    out: list[tuple[dict[str, Any], MemoryPlan]] = []
    batches = [1 << i for i in range(int(math.log2(max(1, max_batch))) + 1)]
    for B in batches:
        found = [f for f in (_fit_batch(cfg, base_options, B, ladder, kw) for ladder in ladders) if f is not None]
        if not found:
            break  # more memory per step never fits better at a larger batch
        accum = max(1, -(-seqs // B))
        if accum != base_options.grad_accumulation:  # re-planned, so the plan's settings say it too
            found = [({**c, "grad_accumulation": accum}, _try(cfg, base_options, {**c, "grad_accumulation": accum},
                                                              **kw)) for c, _ in found]
        best = min(found, key=lambda f: _cost(cfg, base_options, f).seconds_per_token)
        out.append(_with_persistent_quants(cfg, base_options, best, kw) or best)
    out.reverse()
    return out


def _with_persistent_quants(cfg: ModelConfig, base: Options, proposal: tuple[dict[str, Any], MemoryPlan],
                            kw) -> tuple[dict[str, Any], MemoryPlan] | None:
    """`proposal` with --persistent-quants where it pays: FP8 linears, several micro-steps per optimizer step
    and replicated weights (the e4m3 weights and their transposes made once per step instead of in every
    micro-step: +2.1% at Qwen2.5-7B 8 x 8 on an H200), if the plan with the copies still fits and
    the step model finds it cheaper; else None. Sharded weights are left alone: there the option changes what the
    gathers move, and on one GPU it measured no faster. Nor with --use-cuda-graphs asked for (the
    graphs cannot capture the per-step cache) or --debug-log-abs-max (it bypasses the cache)."""
    changes, _ = proposal
    o = dataclasses.replace(base, **changes)
    if (o.persistent_quants or o.weights_sharded or o.use_cuda_graphs or o.debug_log_abs_max or o.grad_accumulation < 2
            or not fp8_weight_params(cfg, o)):
        return None
    trial = {**changes, "persistent_quants": True}
    plan = _try(cfg, base, trial, **kw)
    if plan is None or not plan.fits:
        return None
    faster = _cost(cfg, base, (trial, plan)).seconds_per_token < _cost(cfg, base, proposal).seconds_per_token
    return (trial, plan) if faster else None


def _cost(cfg: ModelConfig, base: Options, proposal: tuple[dict[str, Any], MemoryPlan]) -> StepCost:
    """`step_cost` of a proposal at its own sequences per step (batch x accumulation)."""
    changes, plan = proposal
    return step_cost(cfg, dataclasses.replace(base, **changes), plan)


def _sequences(base: Options, changes: dict[str, Any]) -> int:
    return changes.get("batch_size", base.batch_size) * changes.get("grad_accumulation", base.grad_accumulation)


def recommend(cfg: ModelConfig, base_options: Options,
              proposals: list[tuple[dict[str, Any], MemoryPlan]]) -> tuple[int | None, list[StepCost]]:
    """Index of the proposal with the least estimated time per token (`step_cost`) among those that keep the
    base options' sequences per optimizer step (all of them when none does: a per-step cost spread over
    more sequences must not win by that alone), and every proposal's estimate. None when nothing fits."""
    seqs = _sequences(base_options, {})
    costs = [_cost(cfg, base_options, p) for p in proposals]
    same = [i for i, (c, _) in enumerate(proposals) if _sequences(base_options, c) == seqs]
    pool = same or list(range(len(costs)))
    best = min(pool, key=lambda i: costs[i].seconds_per_token) if costs else None
    return best, costs


def _mlp_slices(base: Options, B: int) -> int | None:
    """The MLP rung's --mlp-chunks at micro-batch B (`fit.mlp_chunks`), None where there is nothing to slice: the
    micro-batch is short, the options slice it already as much, or they refuse slices (--lora-dropout, ...)."""
    n = mlp_chunks(B * base.seq_len // max(1, base.context_parallel))
    if n <= base.mlp_chunks:
        return None
    try:
        dataclasses.replace(base, batch_size=B, mlp_chunks=n).validate()
    except OptionsError:
        return None
    return n


def _fit_batch(cfg: ModelConfig, base: Options, B: int, ladder, kw) -> tuple[dict[str, Any], MemoryPlan] | None:
    T = base.seq_len
    first = head_chunks(B * T, at_least=base.lmhead_chunks)  # long micro-batches: chunks of HEAD_CHUNK_TOKENS
    prev_dev = None
    prev_flags: dict[str, Any] = {}
    slices = _mlp_slices(base, B)
    for label, flags in ladder:
        if "mlp_chunks" in flags:  # the MLP rung, and every later rung carries it
            if slices is None:  # nothing to slice: skip the rung, the later ones go on without it
                if label == MLP_RUNG:
                    continue
                flags = {k: v for k, v in flags.items() if k != "mlp_chunks"}
            else:
                flags = {**flags, "mlp_chunks": slices}
        chunks = first
        while chunks == first or B * T // chunks >= MIN_CHUNK_ROWS:
            changes = {"batch_size": B, **flags}
            if chunks != base.lmhead_chunks:
                changes["lmhead_chunks"] = chunks
            plan = _try(cfg, base, changes, **kw)
            if plan is not None:
                if plan.fits:
                    return _minimize(cfg, base, changes, plan, keep=set(flags) - set(prev_flags), kw=kw)
                if prev_dev is not None and chunks > first and plan.device_total >= prev_dev:
                    break  # more chunks no longer helps
                prev_dev = plan.device_total
            chunks *= 2
        prev_dev = None
        prev_flags = flags
    return None


def _minimize(cfg: ModelConfig, base: Options, changes: dict[str, Any], plan: MemoryPlan, *, keep: set[str],
              kw) -> tuple[dict[str, Any], MemoryPlan]:
    """Drop flags of earlier ladder rungs that the fitting configuration does not need (e.g. an offload
    that sharding made unnecessary, or switches implied by --recompute-block), latest first."""
    for k in reversed([k for k in changes if k not in keep and k not in ("batch_size", "lmhead_chunks")]):
        trial = {kk: vv for kk, vv in changes.items() if kk != k}
        p = _try(cfg, base, trial, **kw)
        if p is not None and p.fits:
            changes, plan = trial, p
    return {k: v for k, v in changes.items() if getattr(base, k, None) != v}, plan
