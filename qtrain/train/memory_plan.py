"""The memory plan: what a run will hold on the device and on the host, computed before anything large is
allocated, and a search for the largest micro-batch that fits a device (llm.q prints the same table at
startup, reference/llmq.md §4).

    plan = plan_memory(cfg, opts, world=8, gpu_memory=parse_bytes("80GiB"))
    print(plan.format())                      # device | host table in GiB
    plan.to_dict()                            # the `memory-plan` event of the JSON log
    for changes, plan in propose(cfg, opts, parse_bytes("80GiB"), world=8): ...

Where the numbers come from (docs/memory.md has the details):
  - Persistent state is exact: it is computed from the same `FlatLayout` the trainer allocates from
    (padded group buffers), so weights, Adam m / v and each gradient manager's buffers equal, byte for
    byte, what `Trainer` allocates (tests/test_memory_plan.py checks this).
  - Activations are what autograd saves for backward, per layer and token, term by term from the ops of
    `transformer.make_block_fn`. Two tables: eager (measured exactly on CPU with saved-tensor hooks) and
    torch.compile'd blocks (AOTAutograd's min-cut partitioner saves fewer tensors: it recomputes the
    cheap element-wise ops; measured with the same partitioner on CPU). `--recompute-*` drop terms as
    llm.q's flags do (§4.5); `--recompute-block` keeps only each block's input.
  - Workspace (LM head chunk logits -- on CUDA nothing more, the fused cross-entropy writes d(logits) in
    place; on CPU + fp32 temporaries --, d(hidden), d(W_head), one block's backward) and a reserve (CUDA
    context, allocator slack) are estimates, checked against a CPU allocation tracker and the H200's peaks.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable

from ..model.config import ModelConfig
from ..parallel.layout import FlatLayout
from ..parallel.optimizer import STAGING_SLOTS, group_m_scales, scale_slot_numel, staging_capacity
from .fp8_weights import FP8_MATRICES
from .options import Options, OptionsError
from .step_cost import StepCost, step_cost

GiB = 1 << 30
MiB = 1 << 20
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "e4m3": 1}

# fixed device reserve on CUDA (context, cuBLAS/cuDNN workspaces, NCCL buffers) + allocator slack
CUDA_RESERVE_BYTES = 1 * GiB
FRAGMENTATION = 0.05  # of activations + workspace: caching-allocator fragmentation
MIN_CHUNK_ROWS = 1024  # propose() splits the LM head into chunks of at least this many tokens (GEMM efficiency)

def _opt(opts: Any, name: str, default: Any = False) -> Any:
    """An option that may not exist (yet) in `Options`: absent means off."""
    return getattr(opts, name, default)


def has_option(name: str) -> bool:
    return name in Options.field_names()


# ---------------------------------------------------------------------------------------------------------
# recompute switches
@dataclass(frozen=True)
class Recompute:
    """llm.q's recompute switches after their implications (ffn => swiglu, att => qkv,
    block => att, ffn, norm), as `model/recompute.py` resolves them."""
    swiglu: bool = False
    norm: bool = False
    ffn: bool = False
    qkv: bool = False
    att: bool = False
    block: bool = False

    @classmethod
    def of(cls, *flags: str) -> "Recompute":
        from ..model.recompute import resolve_flags
        on = resolve_flags(flags)
        return cls(**{f: f in on for f in ("swiglu", "norm", "ffn", "qkv", "att", "block")})

    @classmethod
    def from_options(cls, opts: Any) -> "Recompute":
        return cls.of(*(f for f in ("swiglu", "norm", "ffn", "qkv", "att", "block") if _opt(opts, f"recompute_{f}")))

    def label(self) -> str:
        if self.block:
            return "block"
        on = [f for f in ("norm", "qkv", "att", "swiglu", "ffn") if getattr(self, f)]
        return "+".join(on) if on else "none"


# ---------------------------------------------------------------------------------------------------------
# activations
@dataclass(frozen=True)
class ActTerm:
    """Bytes one layer keeps for backward: `per_token` x (B*T) + `per_layer`; `kept` is False when the
    recompute switches drop it (it is rebuilt in backward instead)."""
    name: str
    per_token: float
    kept: bool = True
    what: str = ""
    per_layer: int = 0

    def nbytes(self, tokens: int) -> int:
        return int(round(self.per_token * tokens)) + self.per_layer


def activation_terms(cfg: ModelConfig, *, model_dtype: str = "bf16", matmul_dtype: str = "", compiled: bool = False,
                     recompute: Recompute = Recompute(), attn_chunks: int = 1,
                     fp8_weight_copies: bool = True) -> list[ActTerm]:
    """What autograd keeps per layer for backward, term by term, for the ops of `transformer.make_block_fn`
    and its recompute steps (ln1, qkv [+ qk-norm + RoPE], attention, ln2, up, swiglu).

    Eager (exact; tests measure it): RMSNorm keeps its fp32 upcast of a bf16 input, rstd and the
    normalized value, and the next linear keeps the gain product (its input); SDPA keeps q and k after
    RoPE, the fused QKV buffer (v is a view of it), its output and the log-sum-exp (B, nh, T) fp32; SwiGLU
    keeps the up/gate output, silu(gate), and the down linear keeps the product. A recomputed step drops
    what it saved and its result where later ops save it; its inputs stay (recompute.Recomputer).

    Compiled (torch.compile; measured with AOTAutograd's min-cut partitioner, the one inductor uses): the
    norm outputs + rstd, QKV, q/k after RoPE, attention output + LSE, the residual after attention, the
    up/gate and SwiGLU outputs -- llm.q's set (§4.5), except that RoPE is not in place. Recomputed steps are
    checkpoint regions whose inputs stay: LN1's output with --recompute-qkv/att, q and k after RoPE with
    --recompute-att, and --recompute-ffn keeps one more (B, T, C) tensor than its steps' inputs.

    FP8 (--matmul-dtype e4m3): each linear keeps an e4m3 copy of its input instead of the model-dtype one,
    and its e4m3 weight (per layer; rebuilt when the linear is inside a recomputed step) -- unless
    `fp8_weight_copies` is False (--persistent-quants): then the weight it keeps is a view of the gathered
    e4m3 block, which `ShardedWeights.saving()` keeps as a handle (the bytes are the plan's fp8 weights
    row). For compiled blocks this is an upper bound: where the quantization is traceable the partitioner
    recomputes the e4m3 copies of the norm and SwiGLU outputs instead (CPU measurement: ~12% less)."""
    E = DTYPE_BYTES[model_dtype]
    fp8 = (matmul_dtype or model_dtype) == "e4m3"
    rc = recompute
    if rc.block:  # only the block input stays; the whole block is rerun in backward
        rc = Recompute(swiglu=True, norm=True, ffn=True, qkv=True, att=True, block=True)
    up = 4 if E != 4 else 0  # fp32 copies that eager RMSNorm makes of a bf16 input (none for fp32)
    C, Fi, q, kv, qkv = cfg.hidden_size, cfg.intermediate_size, cfg.q_dim, cfg.kv_dim, cfg.qkv_dim
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    lin = 0 if fp8 else E  # bytes/element of a linear input the linear saves (fp8: an e4m3 copy instead)
    f8 = 1 if fp8 else 0
    chunked = attn_chunks > 1 and not fp8  # SDPA slices' outputs + their concatenation (the projection input)
    blk = not rc.block
    T = ActTerm
    t = [T("input", E * C, True, "block input (residual stream)")]
    if compiled:
        t += [T("ln1", 4, not (rc.norm or rc.att), "RMSNorm-1 rstd"),
              T("ln1_out", 0 if (fp8 and not rc.qkv) else E * C, blk and (rc.qkv or not rc.norm),
                "RMSNorm-1 output" + (" (input of the recomputed QKV step)" if rc.qkv else "")),
              T("qkv", E * qkv + f8 * C, not rc.qkv, "fused QKV output (v is a view)")]
        if cfg.qk_norm:
            t.append(T("qk_norm", 4 * (nh + nkv), not rc.qkv, "q/k RMSNorm rstd"))
        t.append(T("rope", E * (q + kv), blk and (rc.att or not rc.qkv), "q, k after RoPE (SDPA inputs)"))
    else:
        t += [T("ln1", up * C + 4 + E * C + lin * C, not (rc.norm or rc.att),
                "RMSNorm-1 fp32 copy, rstd, normalized, output"),
              T("qkv", E * qkv + f8 * C, not rc.qkv, "fused QKV output (v is a view)")]
        if cfg.qk_norm:
            t.append(T("qk_norm", up * (q + kv) + 4 * (nh + nkv) + E * (q + kv), not rc.qkv, "q/k RMSNorm state"))
        t.append(T("rope", E * (q + kv), not rc.qkv, "q, k after RoPE (SDPA inputs)"))
    t.append(T("attention", E * q + 4 * nh + (E * q if chunked else 0), not rc.att,
               "SDPA output + log-sum-exp (fp32)" + (" + concatenated slices" if chunked else "")))
    if fp8:
        t.append(T("o_in_fp8", q, blk, "e4m3 copy of the attention projection's input"))
    ln2_dropped = rc.norm or rc.ffn
    if compiled:
        t += [T("res_att", E * C, blk, "residual after attention"),
              T("ffn_extra", E * C, blk and rc.ffn, "kept by the partitioner with --recompute-ffn"),
              T("ln2", 4 + (0 if fp8 else E * C), not ln2_dropped, "RMSNorm-2 rstd + output"),
              T("mlp_up", 2 * Fi * E + f8 * C, not rc.ffn, "fused up/gate output (B, T, 2F)"),
              T("swiglu", 0 if fp8 else E * Fi, not rc.swiglu, "SwiGLU output")]
    else:
        # eager RMSNorm-2 keeps an fp32 copy of the residual; when it is recomputed the residual itself stays
        res = E * C if (ln2_dropped or E == 4) else 4 * C
        t += [T("res_att", res, blk,
                "residual after attention" + ("" if res == E * C else " (as RMSNorm-2's fp32 copy)")),
              T("ln2", 4 + E * C + lin * C, not ln2_dropped, "RMSNorm-2 rstd, normalized, output"),
              T("mlp_up", 2 * Fi * E + f8 * C, not rc.ffn, "fused up/gate output (B, T, 2F)"),
              T("swiglu", E * Fi + lin * Fi, not rc.swiglu, "silu(gate), SwiGLU output")]
    if fp8:  # each linear keeps its e4m3 weight and two scales; those inside a recomputed step are rebuilt
        w8 = 1 if fp8_weight_copies else 0  # persistent quants: views of the gathered e4m3 block, not copies
        t += [T("down_in_fp8", Fi, blk, "e4m3 copy of the down projection's input"),
              T("fp8_w_qkv", 0, not rc.qkv, "e4m3 QKV weight", per_layer=w8 * (C * qkv + 8)),
              T("fp8_w_o", 0, blk, "e4m3 attention-projection weight", per_layer=w8 * (q * C + 8)),
              T("fp8_w_up", 0, not rc.ffn, "e4m3 up/gate weight", per_layer=w8 * (2 * Fi * C + 8)),
              T("fp8_w_down", 0, blk, "e4m3 down weight", per_layer=w8 * (Fi * C + 8))]
    return t


def layer_activation_bytes(cfg: ModelConfig, tokens: int, **kw: Any) -> int:
    """Bytes one layer keeps for backward besides its input (`activation_terms` kwargs)."""
    return sum(a.nbytes(tokens) for a in activation_terms(cfg, **kw) if a.kept and a.name != "input")


# ---------------------------------------------------------------------------------------------------------
# the plan
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
        head = (f"[Memory plan] {self.model} | {s['model_dtype']}, matmul {s['matmul_dtype']} | B={self.batch_size} "
                f"T={self.seq_len} | world {self.world} | grads {s['gradients']} | recompute {s['recompute']}"
                f"{' | compiled blocks' if s['compiled'] else ''}")
        unit, scale = ("GiB", GiB) if max(self.device_total, self.host_total, self.budget or 0) >= GiB else ("MiB", MiB)

        def col(n: int, dash: bool = True) -> str:
            if n == 0 and dash:
                return "-"
            v = n / scale
            return f"{v:.3f}" if v < 10 else f"{v:.2f}" if v < 1000 else f"{v:.1f}"

        w = max(30, *(len(i.name) + 2 for i in self.items))
        lines = [head, f"  {'':<{w}} {'device':>9} {'host':>9}   ({unit})"]
        for i in self.items:
            lines.append(f"  {i.name:<{w}} {col(i.device):>9} {col(i.host):>9}" + (f"   {i.detail}" if i.detail else ""))
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


def _sum_padded(groups: Iterable) -> int:
    return sum(g.padded_numel for g in groups)


def _small_block_slot_numel(block: Any, world: int) -> int:
    """Model-dtype elements of one block slot with persistent quants: the small tensors back to back, the
    exchange buffer (a slot per rank as large as the most any shard holds of them), and one element under
    each matrix's value-less leaf."""
    small = {s.short for s in block.segments if s.short not in FP8_MATRICES}
    return (sum(s.numel for s in block.segments if s.short in small) + world * block.max_shard_numel(world, small)
            + len(block.segments) - len(small))


def _split(n: int, on_host: bool) -> dict[str, int]:
    return {"device": 0, "host": n} if on_host else {"device": n, "host": 0}


def _fused_ce() -> bool:
    """Whether the LM head's loss runs the fused in-place cross-entropy kernel on CUDA (loss.py)."""
    from ..kernels import cross_entropy
    return cross_entropy.FUSED_CE_ENABLED


def plan_memory(cfg: ModelConfig, opts: Options, *, world: int = 1, gpu_memory: int | None = None,
                device: str = "cuda", compiled: bool | None = None, reserve: int | None = None,
                layout: FlatLayout | None = None, model_name: str | None = None,
                recompute: Recompute | None = None, attn_chunks: int | None = None) -> MemoryPlan:
    """Bytes per rank for `cfg` trained with `opts` on `world` ranks of `device` ('cuda' or 'cpu').

    compiled: whether blocks run torch.compile'd (None: as `opts.compile` decides on `device`).
    reserve: fixed device reserve (None: 1 GiB on CUDA, 0 on CPU), plus 5% of activations + workspace for
    allocator fragmentation. recompute / attn_chunks: override what `opts` says (what a model was actually
    built with). Options that this version of `Options` does not have count as off."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    layout = layout if layout is not None and layout.world == world else FlatLayout(cfg, world)
    if compiled is None:
        compiled = opts.compile == "on" or (opts.compile == "auto" and device == "cuda")
    E = DTYPE_BYTES[opts.model_dtype]
    matmul = opts.effective_matmul_dtype
    B, T, L = opts.batch_size, opts.seq_len, cfg.num_hidden_layers
    N = B * T
    C, V = cfg.hidden_size, cfg.vocab_size
    rc = recompute if recompute is not None else Recompute.from_options(opts)
    groups = layout.groups
    blocks = [g for g in groups if g.layer is not None]
    non_block = layout.non_block_groups()
    block_padded = blocks[0].padded_numel if blocks else 0
    shard_sizes = [g.shard_size(world) for g in groups]
    items: list[Item] = []

    # ---- weights (parallel/weights.py `ShardedWeights.memory()` or the trainer's replicated buffers) ----
    sharded_w = bool(_opt(opts, "shard_weights")) or opts.zero_level >= 3
    offload_master = bool(_opt(opts, "offload_master"))
    persistent_quants = bool(_opt(opts, "persistent_quants")) and sharded_w and matmul == "e4m3" and L > 0
    if sharded_w:
        shards = sum(shard_sizes) * E
        if persistent_quants:  # the block slots keep only the small tensors (+ their exchange) in the model dtype
            bufs = min(2, L) * _small_block_slot_numel(blocks[0], world) * E
        else:
            bufs = min(2, L) * block_padded * E
        nbb = _sum_padded(non_block) * E
        parts = {"shards": shards, "block_buffers": bufs, "non_block_buffers": nbb}
        items.append(Item(f"weights ({opts.model_dtype}, sharded)", parts=parts,
                          device=bufs + nbb + (0 if offload_master else shards), host=shards if offload_master else 0,
                          detail=f"shards 1/{world}{' on host' if offload_master else ''} (= master) + "
                                 f"{min(2, L)} gathered blocks{' (small tensors)' if persistent_quants else ''} + "
                                 f"non-block groups"))
    else:
        items.append(Item(f"weights ({opts.model_dtype})", device=layout.total_numel() * E,
                          parts={"params": layout.total_numel() * E},
                          detail=f"{_count(cfg.num_params())} parameters; also the master (no separate copy)"))

    # ---- e4m3 block matrices kept across micro-steps (--persistent-quants, llm.q §4.3; ShardedWeights.memory()) ----
    if persistent_quants:
        off = bool(_opt(opts, "offload_quants"))
        q_shards = L * blocks[0].shard_size(world)  # 1 byte per element of the rank's block shards
        q_bufs = min(2, L) * block_padded  # the gathered e4m3 blocks
        q_scales = 4 * L * len(FP8_MATRICES)  # one fp32 inverse scale per (layer, matrix)
        items.append(Item("fp8 weights (e4m3, persistent)", device=q_bufs + q_scales + (0 if off else q_shards),
                          host=q_shards if off else 0,
                          parts={"quant_shards": q_shards, "quant_buffers": q_bufs, "quant_scales": q_scales},
                          detail=f"block matrix shards 1/{world}{' on host' if off else ''}, made once per step, + "
                                 f"{min(2, L)} gathered e4m3 blocks"))

    # ---- Adam moments: this rank's shards (parallel/optimizer.py) ----
    zero_copy = bool(_opt(opts, "use_zero_copy"))
    staged_bytes = 0  # per element of a staging slot
    capacity = staging_capacity(layout, opts.opt_m_dtype)  # elements per staging slot
    staged_extra = 0  # bytes of the staging slots beyond capacity x staged_bytes (e4m3 m scales)
    for which, dt in (("m", opts.opt_m_dtype), ("v", opts.opt_v_dtype)):
        n = sum(shard_sizes) * DTYPE_BYTES[dt]
        if dt == "e4m3":  # fp32 scale per 128-element tensor block of the shard (+ the blocks shards cut)
            n += 4 * sum(group_m_scales(g, world) for g in groups)
        off = bool(_opt(opts, f"offload_opt_{which}"))
        if off and not zero_copy:
            staged_bytes += DTYPE_BYTES[dt]
            if dt == "e4m3":
                staged_extra += STAGING_SLOTS * 4 * scale_slot_numel(layout, capacity)
        items.append(Item(f"adam {which} ({dt}, 1/{world})", **_split(n, off), parts={f"adam.{which}": n},
                          detail="offloaded" if off else ""))
    if offload_master and sharded_w and not zero_copy:
        staged_bytes += E
    grads_on_host = opts.offload_gradients and opts.gradient_manager_kind != "unsharded" and device != "cpu"
    if grads_on_host:
        staged_bytes += E  # gradient shards in host memory are staged too (read only)
    staging = STAGING_SLOTS * capacity * staged_bytes + staged_extra
    if staging:
        items.append(Item("optimizer staging", device=staging, parts={"staging": staging},
                          detail=f"{STAGING_SLOTS} device slots streaming offloaded state through the update"))

    # ---- gradients (parallel/gradients.py `memory()`) ----
    kind = opts.gradient_manager_kind
    nb_bytes = _sum_padded(non_block) * E
    if kind == "unsharded":
        parts = {"non_block": nb_bytes, "blocks": L * block_padded * E}
        dev, host = sum(parts.values()), 0
        detail = "full, replicated (ZeRO-1)"
    else:
        shards = L * (blocks[0].shard_size(world) if blocks else 0) * E
        parts = {"non_block": nb_bytes, "block_shards": shards, "staging": 2 * block_padded * E}
        if opts.offload_gradients and device != "cpu":
            parts["offload_scratch"] = (blocks[0].shard_size(world) if blocks else 0) * E
        host = shards if opts.offload_gradients else 0
        dev = sum(parts.values()) - host
        detail = (f"non-block full, block shards 1/{world}{' on host' if opts.offload_gradients else ''}, "
                  f"2 staging blocks")
    items.append(Item(f"gradients ({kind}, {opts.model_dtype})", device=dev, host=host, parts=parts, detail=detail))

    # ---- activations kept for backward ----
    attn_chunks = max(1, attn_chunks or int(_opt(opts, "attn_bwd_chunks", 1) or 1))
    terms = activation_terms(cfg, model_dtype=opts.model_dtype, matmul_dtype=matmul, compiled=compiled, recompute=rc,
                             attn_chunks=attn_chunks, fp8_weight_copies=not persistent_quants)
    per_layer = sum(a.nbytes(N) for a in terms if a.kept and a.name != "input")
    inp = N * C * E
    offload_res = bool(_opt(opts, "offload_residual")) and rc.block
    # block inputs (on the host with --offload-residual: 2 on the device, the one in use and the prefetched
    # one) + what each layer keeps + the last block's output (alive until the LM head has run)
    act_dev = L * per_layer + (2 * inp if offload_res else L * inp) + inp
    act_host = L * inp if offload_res else 0
    items.append(Item(f"activations ({L} layers)", device=act_dev, host=act_host, kind="activations",
                      parts={"per_layer": per_layer, "inputs": L * inp, "output": inp},
                      detail=f"{_mib(per_layer + inp)} per layer; recompute {rc.label()}"
                             + ("; block inputs on host" if offload_res else "")))

    # ---- workspace: the larger of the transient phases ----
    chunks = max(1, opts.lmhead_chunks)
    rows = -(-N // chunks)
    if device == "cuda" and _fused_ce():
        per_logit = E  # the fused cross-entropy kernel writes d(logits) over the logits: nothing else per logit
    else:
        loss_compiled = device == "cuda"  # loss.py compiles the chunk loss on CUDA whatever --compile says
        per_logit = (2 * E + 4) if loss_compiled else (E + 12 if E != 4 else 12)
        if chunks > 1:
            per_logit += E  # the previous chunk's d(logits) is still referenced while the next one is computed
    up = 4 if E != 4 else 0
    tied = cfg.tie_word_embeddings
    # LM head (loss.py): final RMSNorm (eager), chunk logits + fp32 temporaries, d(hidden), d(W_head)
    head = N * ((up + 2 * E) * C + 4) + rows * (V * per_logit + 32) + N * C * E + V * C * E
    # one block's backward: d(input) and the incoming d(output), fresh weight gradients, activation-gradient
    # temporaries (the largest saved tensors come back as gradients), the tied head's gradient (kept for the
    # embedding), and with --recompute-block the block's recomputed saved set
    block_numel = sum(s.numel for s in blocks[0].segments) if blocks else 0
    full_block = sum(a.nbytes(N) for a in activation_terms(cfg, model_dtype=opts.model_dtype, matmul_dtype=matmul,
                                                            compiled=compiled, attn_chunks=attn_chunks,
                                                            fp8_weight_copies=not persistent_quants)
                     if a.kept and a.name != "input")
    grad_tmp = N * (E * (cfg.intermediate_size + 2 * C) + 4 * cfg.q_dim // attn_chunks)  # CPU-measured bound
    bwd = 2 * inp + block_numel * E + grad_tmp + (V * C * E if tied else 0)
    if rc.block:
        bwd += full_block
    elif rc != Recompute():
        bwd += full_block - per_layer  # the dropped steps of one layer are rebuilt
    embed_bwd = inp + V * C * E * (2 if tied else 1) + N * C * 4
    phases = {"lm_head": head, "block_backward": bwd, "embedding_backward": embed_bwd}
    peak_phase = max(phases, key=phases.get)
    workspace = phases[peak_phase]
    items.append(Item("workspace", device=workspace, kind="workspace", parts=dict(phases),
                      detail=f"largest transient: {peak_phase.replace('_', ' ')} (lm-head {_mib(head)}, "
                             f"{chunks} chunk{'s' if chunks > 1 else ''}; block backward {_mib(bwd)})"))

    # ---- reserve ----
    if reserve is None:
        reserve = CUDA_RESERVE_BYTES if device == "cuda" else 0
    res = reserve + int(FRAGMENTATION * (act_dev + workspace))
    if res:
        items.append(Item("reserve", device=res, kind="reserve",
                          detail=(f"{_gib(reserve)} CUDA context/libraries + " if reserve else "")
                          + f"{int(100 * FRAGMENTATION)}% fragmentation"))

    settings = {"model_dtype": opts.model_dtype, "matmul_dtype": matmul, "opt_m_dtype": opts.opt_m_dtype,
                "opt_v_dtype": opts.opt_v_dtype, "gradients": kind, "offload_gradients": opts.offload_gradients,
                "shard_weights": sharded_w, "recompute": rc.label(), "offload_residual": offload_res,
                "offload_master": offload_master, "offload_opt_m": bool(_opt(opts, "offload_opt_m")),
                "offload_opt_v": bool(_opt(opts, "offload_opt_v")), "lmhead_chunks": chunks,
                "attn_bwd_chunks": attn_chunks, "grad_accumulation": opts.grad_accumulation,
                "compiled": compiled, "device": device}
    breakdown = [{"name": a.name, "bytes": a.nbytes(N), "kept": a.kept, "what": a.what} for a in terms]
    name = model_name or opts.model or "qtrain-tiny"
    return MemoryPlan(model=name, world=world, batch_size=B, seq_len=T, settings=settings, items=items,
                      activation_breakdown=breakdown, budget=gpu_memory, phases=phases)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _mib(n: int | float) -> str:
    return f"{n / MiB:.1f} MiB" if n < GiB else _gib(n)


def plan_for_trainer(trainer: Any, gpu_memory: int | None = None) -> MemoryPlan:
    """The plan of a constructed `Trainer` (its model, options, world size and device)."""
    dev = trainer.device.type
    if gpu_memory is None and dev == "cuda":
        import torch
        gpu_memory = torch.cuda.get_device_properties(trainer.device).total_memory
    run = trainer.model.run
    rc = Recompute.of(*getattr(run, "recompute", ())) if hasattr(run, "recompute") else None
    return plan_memory(trainer.cfg, trainer.opts, world=trainer.ctx.world, gpu_memory=gpu_memory, device=dev,
                       compiled=bool(getattr(run, "compile", False)), layout=trainer.layout, recompute=rc,
                       attn_chunks=getattr(run, "attn_bwd_chunks", None))


# ---------------------------------------------------------------------------------------------------------
# proposal
def _ladder(base: Options, world: int, *, offload_first: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """Cumulative option changes, least intrusive first: recompute (cheap element-wise steps first), then
    host offload of optimizer state, then sharding (world > 1) and offload of weights and gradients, then
    the block inputs. `offload_first`: the optimizer-state offload before the recomputation of GEMMs (ffn,
    block), which is cheaper when an optimizer step has many micro-steps (see `step_cost`). Steps whose
    options this version of `Options` does not have are left out."""
    steps: list[tuple[str, dict[str, Any]]] = [("none", {})]

    def add(label: str, **flags: Any) -> None:
        flags = {k: v for k, v in flags.items() if has_option(k)}
        if flags:
            steps.append((label, flags))
    add("recompute swiglu+norm", recompute_swiglu=True, recompute_norm=True)
    if offload_first:
        add("offload opt m", offload_opt_m=True)
        add("offload opt v", offload_opt_v=True)
    add("recompute ffn", recompute_ffn=True)
    add("recompute block", recompute_block=True)
    if not offload_first:
        add("offload opt m", offload_opt_m=True)
        add("offload opt v", offload_opt_v=True)
    unsharded = base.gradient_manager_kind == "unsharded"
    if world > 1 and unsharded:
        add("shard gradients", shard_gradients=True)
    if base.zero_level < 2:  # --zero-level and --shard-weights are exclusive; level 3 already shards
        add("shard weights", shard_weights=True)
    add("offload master", offload_master=True)
    add("offload gradients", offload_gradients=True, **({"shard_gradients": True} if unsharded and base.zero_level < 2
                                                         else {}))
    add("offload residual", offload_residual=True)
    out, acc = [], {}
    for label, flags in steps:
        acc = {**acc, **flags}
        out.append((label, dict(acc)))
    return out


def _try(cfg: ModelConfig, opts: Options, changes: dict[str, Any], **kw: Any) -> MemoryPlan | None:
    try:
        o = dataclasses.replace(opts, **changes).validate()
    except (OptionsError, TypeError):
        return None
    return plan_memory(cfg, o, **kw)


def propose(cfg: ModelConfig, base_options: Options, gpu_bytes: int, world: int = 1, *, max_batch: int = 64,
            device: str = "cuda", compiled: bool | None = None, reserve: int | None = None,
            model_name: str | None = None) -> list[tuple[dict[str, Any], MemoryPlan]]:
    """Configurations that fit `gpu_bytes` per device, largest micro-batch first: the largest power-of-two
    micro-batch (<= max_batch) that fits, with the least intrusive changes that make it fit; then each
    smaller batch with its own least changes. Each entry: (option changes relative to `base_options`, plan);
    empty if nothing fits. `recommend` picks the one the step model says is fastest.

    For each batch two ladders are climbed (`_ladder`: none -> recompute swiglu+norm -> ffn -> block ->
    offload opt m -> v -> [world > 1: shard gradients] -> shard weights -> offload master -> offload
    gradients -> offload residual; and the same with the optimizer-state offload before recompute ffn);
    at each rung `--lmhead-chunks` is doubled first (cheap, as long as a chunk keeps MIN_CHUNK_ROWS tokens).
    Each first fit is pruned of earlier switches it does not need, and of the two the one `step_cost`
    finds cheaper at the base options' sequences per optimizer step is kept. When the micro-batch changes,
    `--grad-accumulation` changes with it so that the sequences per step stay the same (at least one
    micro-step)."""
    layout = FlatLayout(cfg, world)
    kw = dict(world=world, gpu_memory=gpu_bytes, device=device, compiled=compiled, reserve=reserve, layout=layout,
              model_name=model_name)
    ladders = [_ladder(base_options, world), _ladder(base_options, world, offload_first=True)]
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
        out.append(min(found, key=lambda f: _cost(cfg, base_options, f).seconds_per_token))
    out.reverse()
    return out


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


def _fit_batch(cfg: ModelConfig, base: Options, B: int, ladder, kw) -> tuple[dict[str, Any], MemoryPlan] | None:
    T = base.seq_len
    prev_dev = None
    prev_flags: dict[str, Any] = {}
    for _label, flags in ladder:
        chunks = max(1, base.lmhead_chunks)
        while chunks == max(1, base.lmhead_chunks) or B * T // chunks >= MIN_CHUNK_ROWS:
            changes = {"batch_size": B, **flags}
            if chunks != base.lmhead_chunks:
                changes["lmhead_chunks"] = chunks
            plan = _try(cfg, base, changes, **kw)
            if plan is not None:
                if plan.fits:
                    return _minimize(cfg, base, changes, plan, keep=set(flags) - set(prev_flags), kw=kw)
                if prev_dev is not None and chunks > base.lmhead_chunks and plan.device_total >= prev_dev:
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


# ---------------------------------------------------------------------------------------------------------
# CLI
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(s: str | int) -> int:
    """'80GiB', '80 GB', '141e9', '24g' -> bytes (G/GB are powers of ten, GiB powers of two)."""
    if isinstance(s, int):
        return s
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", str(s))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a memory size: {s!r} (examples: 80GiB, 24GB, 141e9)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def add_plan_args(p: argparse.ArgumentParser) -> None:
    """Arguments of `qtrain plan` besides the training options (add those with `add_train_args` first)."""
    p.add_argument("--gpu-memory", dest="plan_gpu_memory", default=None,
                   help="device memory per GPU, e.g. 80GiB or 141GB (default: the first visible CUDA device)")
    p.add_argument("--max-batch", dest="plan_max_batch", type=int, default=64,
                   help="largest micro-batch the proposal tries (powers of two up to this)")
    p.add_argument("--reserve", dest="plan_reserve", default=None,
                   help="fixed device reserve for CUDA context and libraries (default 1GiB)")
    p.add_argument("--no-propose", dest="plan_propose", action="store_false",
                   help="only print the plan of the given options")
    p.add_argument("--json", dest="plan_json", action="store_true", help="print the plan(s) as JSON")


def _resolve_cfg(opts: Options) -> tuple[ModelConfig, str]:
    """--model as a preset name, an HF directory or `org/name` in the local HF cache; empty: the embedded
    tiny model."""
    from ..model.config import PRESETS, preset
    from .trainer import resolve_model
    name = opts.model
    if name and not os.path.isdir(name):
        key = name.rsplit("/", 1)[-1].lower()
        if any(k.lower() == key for k in PRESETS):
            return preset(name), name
    return resolve_model(opts).cfg, name or "qtrain-tiny"


def options_from_namespace(ns: argparse.Namespace) -> Options:
    """Options from the parsed `qtrain plan` arguments: training options and --config, plan keys ignored."""
    from .options import load_config_file, normalize_mapping
    names = Options.field_names()
    given = {k: v for k, v in vars(ns).items() if k in names}
    base: dict[str, Any] = {}
    if getattr(ns, "config", None):
        base = normalize_mapping(load_config_file(ns.config), source=f"--config {ns.config}")
    return Options(**{**base, **given}).validate()


def run_plan(ns: argparse.Namespace, out=None) -> int:
    """`qtrain plan`: print the plan of the given options and the proposal for --gpu-memory."""
    out = out or sys.stdout
    opts = options_from_namespace(ns)
    cfg, name = _resolve_cfg(opts)
    world = opts.gpus
    gpu_memory = getattr(ns, "plan_gpu_memory", None)
    if gpu_memory is not None:
        gpu_memory = parse_bytes(gpu_memory)
    else:
        import torch
        if not torch.cuda.is_available():
            raise OptionsError("qtrain plan: --gpu-memory is needed when no CUDA device is visible (e.g. 80GiB)")
        gpu_memory = torch.cuda.get_device_properties(0).total_memory
        world = world or torch.cuda.device_count()
    world = max(1, world)
    reserve = getattr(ns, "plan_reserve", None)
    reserve = None if reserve is None else parse_bytes(reserve)
    plan = plan_memory(cfg, opts, world=world, gpu_memory=gpu_memory, reserve=reserve, model_name=name)
    proposals = (propose(cfg, opts, gpu_memory, world, max_batch=getattr(ns, "plan_max_batch", 64), reserve=reserve,
                         model_name=name) if getattr(ns, "plan_propose", True) else [])
    best_i, costs = recommend(cfg, opts, proposals)
    if getattr(ns, "plan_json", False):
        json.dump({"plan": plan.to_dict(), "recommended": best_i,
                   "proposals": [{"changes": c, "plan": p.to_dict(), "estimate": e.to_dict()}
                                 for (c, p), e in zip(proposals, costs)]}, out, indent=1)
        out.write("\n")
        return 0 if plan.fits or proposals else 1
    out.write(plan.format() + "\n")
    if not getattr(ns, "plan_propose", True):
        return 0 if plan.fits else 1
    if not proposals:
        out.write(f"\n[Proposal] nothing fits {_gib(gpu_memory)} per device, even batch 1 with every "
                  f"recompute/offload/sharding option this version has.\n")
        return 1
    seqs = _sequences(opts, {})
    out.write(f"\n[Proposal] each micro-batch that fits, with its cheapest recompute/offload; => the fastest by the "
              f"step model\n  (est.: time per token against =>, at {seqs} sequences per optimizer step; "
              f"see train/step_cost.py)\n")
    for i, ((changes, p), c) in enumerate(zip(proposals, costs)):
        flags = " ".join(_flag(k, v) for k, v in changes.items()) or "(as given)"
        mark = "=>" if i == best_i else "  "
        est = f"{100 * c.overhead(costs[best_i]):+.0f}%"
        n = _sequences(opts, changes)
        other = f"  ({n} sequences per step)" if n != seqs else ""
        out.write(f"  {mark} B={p.batch_size:<4d} {_gib(p.device_total):>11} device, {_gib(p.host_total):>10} host  "
                  f"est. {est:>5}  {flags}{other}\n")
    best = proposals[best_i][1]
    out.write("\n" + best.format() + "\n")
    return 0


def _flag(k: str, v: Any) -> str:
    f = "--" + k.replace("_", "-")
    if v is True:
        return f
    if v is False:
        return "--no-" + k.replace("_", "-")
    return f"{f} {v}"
