"""The memory plan: what a run will hold on the device and on the host, computed before anything large is
allocated (llm.q prints the same table at startup, reference/llmq.md §4).

    plan = plan_memory(cfg, opts, world=8, gpu_memory=parse_bytes("80GiB"))   # plan/resolution.py
    print(plan.format())                      # device | host table in GiB
    plan.to_dict()                            # the `memory-plan` event of the JSON log
    for changes, plan in propose(cfg, opts, parse_bytes("80GiB"), world=8): ...   # plan/propose.py

The plan decides nothing: `build_plan` takes the run's automatic choices as `plan/resolution.py` made them
(`resolve_run`, whose record carries the plan; `plan_memory` there is the plan of options alone). It re-derives
nothing either: each row is the memory statement of the component that allocates it, evaluated
for the options without building the component (docs/memory.md has the details):
  - weights: `weights.replicated.replicated_footprint` (+ `CastWeights`' compute copy under fp32 master weights) or `ShardedWeights.footprint_of` (shards, gather
    buffers, persistent e4m3 shards); Adam m / v and the staging slots: `ShardedAdamW.footprint_of`; gradients:
    `gradients.gradient_footprint`. Exact: tests/plan/test_components.py checks each row, byte for byte,
    against the storages real components hold, for every configuration the plan tests cover.
  - activations and workspace: `model.activations` (what autograd keeps per layer and token: the sum of the
    statements the family's block makes beside its steps, eager and compiled; the transient phases of a
    micro-step, the LM head's from `kernels.cross_entropy`). Activations are exact on CPU; workspace is an upper
    bound of the measured peak. Frozen groups (`parallel.layout`) have no gradient or optimizer rows.
  - with --use-cuda-graphs, the evaluation's LM head beside the graphs' private pool (train/cuda_graphs.py), when the
    run evaluates.
  - with --document-masking, what the document attention adds (`plan/documents.py`: nothing but offsets on the
    default varlen path); with --context-parallel, what its attention adds in its mode (`plan/context.py`).
  - a reserve (CUDA context, libraries) and 5% of activations + workspace for allocator fragmentation.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from qtrain.kernels.delta_rule import op_pairs_on
from qtrain.model.family import DTYPE_BYTES
from qtrain.model.lora import LoraAdapter
from qtrain.model.lora.checks import spec_from_options
from qtrain.model.lora.spec import LoraSpec
from qtrain.model.moe import max_received_rows
from qtrain.model.activations import activation_memory, workspace_phases
from qtrain.model.config import ModelConfig
from qtrain.model.recompute import block_steps, recompute_label, resolve_flags
from qtrain.model.registry import family_of
from qtrain.model.weights import num_params
from qtrain.plan.context import context_parallel_bytes
from qtrain.plan.documents import document_masking_bytes
from qtrain.options import Options
from qtrain.parallel.footprint import Footprint
from qtrain.parallel.gradients import gradient_footprint
from qtrain.parallel.layout import FlatLayout
from qtrain.parallel.optimizer import DTYPES, ShardedAdamW
from qtrain.parallel.staging import STAGING_SLOTS
from qtrain.parallel.weights.cast import CastWeights
from qtrain.parallel.weights.e4m3_base import E4m3BaseWeights
from qtrain.parallel.weights.quantized import QuantizedWeights
from qtrain.parallel.weights.replicated import replicated_footprint
from qtrain.parallel.weights.sharded import ShardedWeights

GiB = 1 << 30
MiB = 1 << 20

# fixed device reserve on CUDA (context, cuBLAS/cuDNN workspaces, NCCL buffers) + allocator slack
CUDA_RESERVE_BYTES = 1 * GiB
FRAGMENTATION = 0.05  # of activations + workspace: caching-allocator fragmentation


@dataclass
class Item:
    """One row of the plan: bytes on the device and on the host; `parts` names the buffers (for the
    gradients and weights: the keys of the managers' `memory()`)."""
    name: str
    device: int = 0
    host: int = 0
    detail: str = ""
    kind: str = "state"  # state | activations | workspace | reserve
    parts: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "device": self.device, "host": self.host, "detail": self.detail, "kind": self.kind,
                "parts": dict(self.parts)}


@dataclass
class MemoryPlan:
    model: str
    world: int
    batch_size: int
    seq_len: int
    settings: dict[str, Any]
    items: list[Item]
    activation_breakdown: list[dict[str, Any]] = field(default_factory=list)
    budget: int | None = None  # device bytes available (None: unknown)
    phases: dict[str, int] = field(default_factory=dict)  # transient peaks: lm_head, block_backward, ...
    fp8_matrices: tuple[str, ...] = ()  # the family's block matrices that may run in FP8 (--fp8-policy keeps some)

    # ---- totals ----
    @property
    def device_total(self) -> int:
        return sum(i.device for i in self.items)

    @property
    def host_total(self) -> int:
        return sum(i.host for i in self.items)

    @property
    def fits(self) -> bool:
        return self.budget is None or self.device_total <= self.budget

    @property
    def headroom(self) -> int | None:
        return None if self.budget is None else self.budget - self.device_total

    def item(self, name: str) -> Item:
        """The row whose name is `name` or starts with `name + ' ('` (e.g. 'gradients', 'adam m')."""
        for i in self.items:
            if i.name == name or i.name.startswith(name + " ("):
                return i
        raise KeyError(f"no plan item {name!r}; have {[i.name for i in self.items]}")

    def summary(self) -> str:
        s = (f"{self.model} B={self.batch_size} T={self.seq_len} world {self.world}: "
             f"{_gib(self.device_total)} device, {_gib(self.host_total)} host")
        if self.budget is not None:
            s += f" of {_gib(self.budget)} ({'fits' if self.fits else 'does not fit'})"
        return s

    # ---- output ----
    def format(self) -> str:
        """The startup table: one row per buffer kind, device | host (GiB, or MiB for small runs)."""
        s = self.settings
        master = s.get("master_dtype", s["model_dtype"])
        dtypes = s["model_dtype"] + (f" on {master} master" if master != s["model_dtype"] else "")
        matmul = s["matmul_dtype"]
        if matmul == "e4m3" and len(s.get("fp8_linears", self.fp8_matrices)) < len(self.fp8_matrices):  # auto
            matmul += f" for {'/'.join(s['fp8_linears']) or 'none'}"
        head = (f"[Memory plan] {self.model} | {dtypes}, matmul {matmul} | B={self.batch_size} "
                f"T={self.seq_len} | world {self.world}"
                f"{' (expert parallel %d)' % s['expert_parallel'] if s.get('expert_parallel', 1) > 1 else ''} | "
                f"grads {s['gradients']} | recompute {s['recompute']}"
                f"{' | compiled blocks' if s['compiled'] else ''}"
                f"{' | SwiGLU in GEMM epilogues' if s.get('swiglu_epilogue') else ''}")
        unit, scale = ("GiB", GiB) if max(self.device_total, self.host_total, self.budget or 0) >= GiB else ("MiB", MiB)

        def col(n: int, dash: bool = True) -> str:
            if n == 0 and dash:
                return "-"
            v = n / scale
            return f"{v:.3f}" if v < 10 else f"{v:.2f}" if v < 1000 else f"{v:.1f}"

        w = max(30, *(len(i.name) + 2 for i in self.items))
        lines = [head, f"  {'':<{w}} {'device':>9} {'host':>9}   ({unit})"]
        for i in self.items:
            detail = f"   {i.detail}" if i.detail else ""
            lines.append(f"  {i.name:<{w}} {col(i.device):>9} {col(i.host):>9}{detail}")
        lines.append(f"  {'-' * (w + 20)}")
        lines.append(f"  {'total':<{w}} {col(self.device_total, False):>9} {col(self.host_total, False):>9}")
        if self.budget is not None:
            verdict = "fits" if self.fits else "DOES NOT FIT"
            lines.append(f"  {'device memory':<{w}} {col(self.budget, False):>9} {'':>9}   "
                         f"{verdict}: {_gib(abs(self.headroom))} {'free' if self.fits else 'over'}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "world": self.world, "batch_size": self.batch_size, "seq_len": self.seq_len,
                "settings": dict(self.settings), "items": [i.to_dict() for i in self.items],
                "phases": dict(self.phases), "activations_per_layer": list(self.activation_breakdown),
                "device_total": self.device_total, "host_total": self.host_total, "budget": self.budget,
                "fits": self.fits}


def _gib(n: int | float) -> str:
    return f"{n / GiB:.2f} GiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _mib(n: int | float) -> str:
    return f"{n / MiB:.1f} MiB" if n < GiB else _gib(n)


def _row(name: str, fp: Footprint, detail: str = "") -> Item:
    """A state row from a component's footprint (`parts` keep the component's own names)."""
    return Item(name, device=fp.device, host=fp.host, detail=detail, parts=dict(fp.parts))


# ---------------------------------------------------------------------------------------------------------
# the rows of persistent state: each component's own statement
def _weight_rows(cfg: ModelConfig, opts: Options, layout: FlatLayout, quants: tuple[str, ...]) -> list[Item]:
    """The trainer's replicated buffers (+ `QuantizedWeights`' e4m3 copies), or `ShardedWeights` (+ its persistent
    e4m3 shards); the e4m3 weights (of the block matrices `quants`) are a row of their own."""
    persistent_quants = bool(quants)
    dtype, world, L = DTYPES[opts.model_dtype], layout.world, cfg.num_hidden_layers
    if not opts.weights_sharded and opts.separate_master:  # --master-dtype fp32: master + the model's copy
        master = opts.effective_master_dtype
        rows = [_row(f"weights ({master}, master)", replicated_footprint(layout, DTYPES[master], dtype),
                     f"{_count(num_params(cfg))} parameters; what the optimizer updates"),
                _row(f"weights ({opts.model_dtype}, compute copy)", CastWeights.footprint_of(layout, dtype),
                     "what the model computes with; cast from the master once per step")]
    elif not opts.weights_sharded and layout.lora is not None and layout.lora.base_dtype == "e4m3":
        on_host = "; on the host, 2 layers on the device" if opts.offload_quants else ""
        rows = [_row(f"weights ({opts.model_dtype}, e4m3 base)",
                     E4m3BaseWeights.footprint_of(layout, dtype, offload=opts.offload_quants),
                     f"{_count(num_params(cfg))} parameters; the frozen base's block matrices as e4m3 + a scale "
                     f"each (1 byte per parameter{on_host}), the rest in {opts.model_dtype}")]
        return rows
    elif not opts.weights_sharded:
        rows = [_row(f"weights ({opts.model_dtype})", replicated_footprint(layout, dtype),
                     f"{_count(num_params(cfg))} parameters; also the master (no separate copy)")]
    if not opts.weights_sharded:
        if persistent_quants:
            rows.append(_row("fp8 weights (e4m3, cached)", QuantizedWeights.footprint_of(cfg, quants),
                             "e4m3 copies of every block matrix and their transposes, made once per step"))
        return rows
    fp = ShardedWeights.footprint_of(layout, dtype=DTYPES[opts.effective_master_dtype], offload=opts.offload_master,
                                     quantized=quants, offload_quants=opts.offload_quants, compute_dtype=dtype)
    on_host = " on host" if opts.offload_master else ""
    master = f"{opts.effective_master_dtype} master shards, {opts.model_dtype} gathers" if opts.separate_master \
        else opts.model_dtype
    rows = [_row(f"weights ({master}, sharded)",
                 fp.select("shards", "block_buffers", "small_index", "non_block_buffers"),
                 f"shards 1/{world}{on_host} (= master) + {min(2, L)} gathered blocks"
                 f"{' (small tensors)' if persistent_quants else ''} + non-block groups")]
    if persistent_quants:  # e4m3 block matrices kept across micro-steps (--persistent-quants, llm.q §4.3)
        rows.append(_row("fp8 weights (e4m3, persistent)", fp.select("quant_shards", "quant_buffers", "quant_scales"),
                         f"block matrix shards 1/{world}{' on host' if opts.offload_quants else ''}, made once per "
                         f"step, + {min(2, L)} gathered e4m3 blocks"))
    return rows


def _optimizer_rows(opts: Options, layout: FlatLayout, *, grads_staged: bool) -> list[Item]:
    """Adam m and v (this rank's shards) and the device slots offloaded state streams through."""
    dtype = DTYPES[opts.effective_master_dtype]  # the weights it updates and the gradients it reads
    fp = ShardedAdamW.footprint_of(layout, param_dtype=dtype, m_dtype=opts.opt_m_dtype, v_dtype=opts.opt_v_dtype,
                                   offload_params=opts.offload_master and opts.weights_sharded,
                                   offload_m=opts.offload_opt_m, offload_v=opts.offload_opt_v,
                                   zero_copy=opts.use_zero_copy,
                                   grad_dtype=DTYPES[opts.effective_grad_accum_dtype] if grads_staged else None)
    moments = (("m", opts.opt_m_dtype, opts.offload_opt_m), ("v", opts.opt_v_dtype, opts.offload_opt_v))
    rows = [_row(f"adam {w} ({dt}, 1/{layout.world})", fp.select(f"adam.{w}"), "offloaded" if off else "")
            for w, dt, off in moments]
    if fp.parts["staging"]:
        rows.append(_row("optimizer staging", fp.select("staging"),
                         f"{STAGING_SLOTS} device slots streaming offloaded state through the update"))
    return rows


def _gradient_row(opts: Options, layout: FlatLayout, device: str, *, graphs: bool) -> Item:
    kind = opts.gradient_manager_kind
    off = opts.offload_gradients and kind != "unsharded"
    dtype = opts.effective_grad_accum_dtype  # fp32 sums of the bf16 gradients under fp32 master weights
    fp = gradient_footprint(kind, layout, dtype=DTYPES[dtype], device=device, offload=off,
                            key_table=graphs)  # CUDA graphs read the SR keys from a device table
    detail = ("full, replicated (ZeRO-1)" if kind == "unsharded" else
              f"non-block full, block shards 1/{layout.world}{' on host' if off else ''}, 2 staging blocks")
    return _row(f"gradients ({kind}, {dtype})", fp, detail)


def _lora_settings(cfg: ModelConfig, lora: LoraSpec | None) -> dict[str, Any]:
    """The activation settings of a LoRA run (`family.ActivationSettings`): a frozen base, whose linears keep their
    input only for an adapter that reads it (without dropout; with it the adapter keeps its own dropped copy, in the
    `lora adapters` row)."""
    if lora is None:
        return {}
    adapter = LoraAdapter(cfg, lora)
    reads = frozenset() if lora.dropout else frozenset(adapter.parts) | frozenset(adapter.experts)
    return {"frozen_base": True, "adapter_inputs": reads}


def run_layout(cfg: ModelConfig, opts: Options, world: int) -> FlatLayout:
    """The flat layout a run of `opts` holds on `world` ranks: with --lora-rank only the adapters train (no gradients
    or Adam state for the base), with --expert-parallel a rank holds E/ep experts."""
    return FlatLayout(cfg, world, lora=spec_from_options(vars(opts), cfg), expert_parallel=opts.expert_parallel)


def _balanced_experts(cfg: ModelConfig, opts: Options, tokens: int, rc: frozenset[str],
                      kw: dict[str, Any]) -> int | None:
    """With --expert-parallel the activations are planned for the most rows a rank's experts can receive (every token
    of the token group routed to them, `moe.max_received_rows`): the device bytes of balanced routing beside them
    (None without expert parallelism, where the two are the same: dropless routing)."""
    if opts.expert_parallel == 1 or cfg.router is None:
        return None
    return activation_memory(cfg, tokens, recompute=rc, offload_residual=opts.offload_residual,
                             **{**kw, "balanced_experts": True}).device


# ---------------------------------------------------------------------------------------------------------
def build_plan(cfg: ModelConfig, opts: Options, *, device: str, world: int, shards: int, compiled: bool,
               fp8_linears: tuple[str, ...], quants: tuple[str, ...], keep_transposes: bool, fp8_head_backward: bool,
               cuda_graphs: bool, recompute: frozenset[str], swiglu_epilogue: bool = False,
               gpu_memory: int | None = None, reserve: int | None = None, layout: FlatLayout | None = None,
               model_name: str | None = None) -> MemoryPlan:
    """Bytes per rank for `cfg` trained with `opts` on `world` ranks of `device` ('cuda' or 'cpu'), its state cut
    across `shards` ranks, with the run's automatic choices as `plan.resolution.resolve_run` made them (this
    function decides nothing): compiled blocks, the block linears in FP8 and their e4m3 weights made once per
    step (`quants`), the e4m3 input transposes kept, the LM head's FP8 backward, CUDA graphs, the recompute set, the
    MLP's SwiGLU in its GEMMs' epilogues.

    gpu_memory: the budget (None: unknown). reserve: fixed device reserve (None: 1 GiB on CUDA, 0 on CPU), plus
    5% of activations + workspace for allocator fragmentation."""
    layout = layout if layout is not None and layout.world == shards else run_layout(cfg, opts, shards)
    matmul = opts.effective_matmul_dtype
    B, T, L = opts.batch_size, opts.seq_len, cfg.num_hidden_layers
    N = B * T // opts.context_parallel  # a rank's tokens (--context-parallel: its part of each sequence)
    rc = resolve_flags(recompute)
    fp8 = fp8_linears  # --fp8-policy: the block linears in FP8 (model/fp8_policy.py); the others as in the model dtype
    persistent_quants = bool(quants)
    keep_t = bool(keep_transposes and compiled and fp8)  # the e4m3 input transposes kept (activations)

    grads = _gradient_row(opts, layout, device, graphs=cuda_graphs)
    grads_staged = grads.host > 0 and device != "cpu"  # host gradient shards stream through the update too
    items = [*_weight_rows(cfg, opts, layout, quants),
             *_optimizer_rows(opts, layout, grads_staged=grads_staged), grads]

    # ---- activations kept for backward, and the transient phases of a micro-step (model/activations.py) ----
    attn_chunks = max(1, opts.attn_bwd_chunks or 1)
    chunks = max(1, opts.lmhead_chunks)
    lora = layout.lora
    adapter = LoraAdapter(cfg, lora) if lora is not None else None  # what the adapters keep and draw
    e4m3_base = lora is not None and lora.base_dtype == "e4m3"  # the FP8 linears keep the held codes, not copies
    kw = dict(model_dtype=opts.model_dtype, matmul_dtype=matmul if fp8 or matmul != "e4m3" else "",
              compiled=compiled, attn_chunks=attn_chunks, mlp_chunks=opts.mlp_chunks,
              fp8_weight_copies=not (persistent_quants or e4m3_base),
              fp8_keep_transposes=keep_t, documents=opts.document_masking, seq_len=T // opts.context_parallel,
              fp8_experts=opts.fp8_experts, expert_parallel=opts.expert_parallel, swiglu_epilogue=swiglu_epilogue,
              delta_rule_kernels=op_pairs_on(device, getattr(cfg, "linear_key_head_dim", 128),
                                             getattr(cfg, "linear_value_head_dim", 128)),
              **_lora_settings(cfg, lora))
    acts = activation_memory(cfg, N, recompute=rc, offload_residual=opts.offload_residual, **kw)
    acts_kw = kw  # the settings of the activations planned (the larger of two, some linears in FP8)
    phases = workspace_phases(cfg, N, lmhead_chunks=chunks, cuda=device == "cuda", recompute=rc,
                              fp8_head_backward=fp8_head_backward, lora=lora, **kw)
    if 0 < len(fp8) < len(family_of(cfg).fp8_matrices):  # some linears in FP8, some not: the larger of the two
        kw_plain = {**kw, "matmul_dtype": ""}
        plain = activation_memory(cfg, N, recompute=rc, offload_residual=opts.offload_residual, **kw_plain)
        acts, acts_kw = max((acts, kw), (plain, kw_plain), key=lambda a: a[0].device)
        phases = {k: max(v, p) for (k, v), p in zip(phases.items(), workspace_phases(
            cfg, N, lmhead_chunks=chunks, cuda=device == "cuda", recompute=rc, fp8_head_backward=fp8_head_backward,
            lora=lora, **kw_plain).values())}
    if adapter is not None and opts.context_parallel > 1:  # dropout masks drawn for whole sequences (adapter._drop)
        drop = adapter.context_dropout_bytes(B, T, opts.context_parallel)
        if drop:
            phases["lora_dropout"] = drop
    balanced = _balanced_experts(cfg, opts, N, rc, acts_kw)
    experts = "" if balanced is None or balanced == acts.device else (
        f"; MoE layers at the worst case of the token exchange, "
        f"{max_received_rows(N, top_k=cfg.router.top_k, num_experts=cfg.router.experts, ep=opts.expert_parallel)} "
        f"rows a rank's experts receive (ep N min(k, E/ep)); balanced routing ({N * cfg.router.top_k} rows, N k): "
        f"{_mib(acts.device - balanced)} less")
    items.append(Item(f"activations ({L} layers)", device=acts.device, host=acts.host, kind="activations",
                      parts={"per_layer": acts.per_layer, "inputs": L * acts.input, "output": acts.input,
                             # what balanced routing would keep (not a buffer: the worst case's comparison)
                             **({} if balanced is None else {"balanced_routing": balanced})},
                      detail=f"{_mib(acts.per_layer + acts.input)} per layer; recompute {recompute_label(rc)}"
                             + ("; e4m3 input transposes kept" if keep_t and lora is None else "")
                             + ("; block inputs on host" if acts.offload_residual else "") + experts))
    # --document-masking: plan/documents.py; under --context-parallel its attention's own masks (plan/context.py)
    documents = document_masking_bytes(cfg, opts, device, rc) if opts.context_parallel == 1 else None
    if documents is not None:
        items.append(Item("document masks", device=documents[0], kind="activations", detail=documents[1]))
    context = context_parallel_bytes(cfg, opts, rc)
    if context is not None:
        items.append(Item(f"context parallel attention ({opts.context_parallel_mode})", device=context[0],
                          kind="activations", detail=context[1]))
    if adapter is not None and "block" not in rc:  # each target's A output (and dropout's input and mask)
        dtype_bytes = DTYPE_BYTES[opts.model_dtype]
        per_layer = N * adapter.saved_bytes_per_token(dtype_bytes, block_steps(rc)) + adapter.saved_bytes_per_layer(
            dtype_bytes, block_steps(rc))  # + the fused matrices' block-diagonal B, the experts' B as read
        items.append(Item(f"lora adapters ({L} layers)", device=int(L * per_layer), kind="activations",
                          detail=f"rank {layout.lora.rank}, targets {','.join(layout.lora.targets)}: what the "
                                 f"adapters keep for backward"))
    peak_phase = max(phases, key=phases.get)
    workspace = phases[peak_phase]
    items.append(Item("workspace", device=workspace, kind="workspace", parts=dict(phases),
                      detail=f"largest transient: {peak_phase.replace('_', ' ')} (lm-head {_mib(phases['lm_head'])}, "
                             f"{chunks} chunk{'s' if chunks > 1 else ''}"
                             f"{', FP8 backward' if fp8_head_backward else ''}; block backward "
                             f"{_mib(phases['block_backward'])}"
                             f"{f', MLP in {opts.mlp_chunks} slices' if opts.mlp_chunks > 1 else ''})"))

    if cuda_graphs and opts.eval_num_steps > 0:  # the graphs keep a private pool; evaluation allocates beside it
        items.append(Item("cuda graphs", device=phases["lm_head"], kind="workspace",
                          detail="the graphs' pool holds a micro-step's activations and workspace; evaluation "
                                 "allocates beside it (bound: the LM head's transient; none with --eval-num-steps 0)"))

    # ---- reserve ----
    if reserve is None:
        reserve = CUDA_RESERVE_BYTES if device == "cuda" else 0
    res = reserve + int(FRAGMENTATION * (acts.device + workspace))
    if res:
        items.append(Item("reserve", device=res, kind="reserve",
                          detail=(f"{_gib(reserve)} CUDA context/libraries + " if reserve else "")
                          + f"{int(100 * FRAGMENTATION)}% fragmentation"))

    settings = {"model_dtype": opts.model_dtype, "master_dtype": opts.effective_master_dtype, "matmul_dtype": matmul,
                "fp8_linears": list(fp8), "opt_m_dtype": opts.opt_m_dtype,
                "opt_v_dtype": opts.opt_v_dtype, "gradients": opts.gradient_manager_kind,
                "offload_gradients": opts.offload_gradients, "shard_weights": opts.weights_sharded,
                "recompute": recompute_label(rc), "offload_residual": acts.offload_residual,
                "offload_master": opts.offload_master, "offload_opt_m": opts.offload_opt_m,
                "offload_opt_v": opts.offload_opt_v, "lmhead_chunks": chunks, "attn_bwd_chunks": attn_chunks,
                "mlp_chunks": opts.mlp_chunks,
                "grad_accumulation": opts.grad_accumulation, "compiled": compiled, "device": device,
                "fp8_keep_transposes": keep_t, "fp8_head_backward": fp8_head_backward,
                "swiglu_epilogue": swiglu_epilogue,
                "expert_parallel": opts.expert_parallel}
    breakdown = [{"name": a.name, "bytes": a.nbytes(N), "kept": a.kept, "what": a.what} for a in acts.terms]
    name = model_name or opts.model or "qtrain-tiny"
    return MemoryPlan(model=name, world=world, batch_size=B, seq_len=T, settings=settings, items=items,
                      activation_breakdown=breakdown, budget=gpu_memory, phases=phases,
                      fp8_matrices=family_of(cfg).fp8_matrices)


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(s: str | int) -> int:
    """'80GiB', '80 GB', '141e9', '24g' -> bytes (G/GB are powers of ten, GiB powers of two).

    A number without a unit is bytes, so a small one (below 1 MiB, but not 0) is refused: '--gpu-memory 141' meant
    141 GiB or GB, and as 141 bytes it made every plan "not fit" without saying why."""
    if isinstance(s, int):
        return s
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", str(s))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a memory size: {s!r} (examples: 80GiB, 24GB, 141e9)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not m.group(2) and 0 < value < 1 << 20:
        raise ValueError(f"not a memory size: {s!r} has no unit, so it is {value:g} bytes; write {s.strip()}GiB or "
                         f"{s.strip()}GB")
    return int(value)
