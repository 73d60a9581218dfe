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

import re
from dataclasses import dataclass, field
from typing import Any, Iterable

from qtrain.model.config import ModelConfig
from qtrain.model.recompute import recompute_label, resolve_flags
from qtrain.model.transformer import FP8_MATRICES
from qtrain.options import Options
from qtrain.parallel.layout import FlatLayout
from qtrain.parallel.optimizer import STAGING_SLOTS, group_m_scales, scale_slot_numel, staging_capacity

GiB = 1 << 30
MiB = 1 << 20
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "e4m3": 1}

# fixed device reserve on CUDA (context, cuBLAS/cuDNN workspaces, NCCL buffers) + allocator slack
CUDA_RESERVE_BYTES = 1 * GiB
FRAGMENTATION = 0.05  # of activations + workspace: caching-allocator fragmentation

def _opt(opts: Any, name: str, default: Any = False) -> Any:
    """An option that may not exist (yet) in `Options`: absent means off."""
    return getattr(opts, name, default)


def has_option(name: str) -> bool:
    return name in Options.field_names()


# ---------------------------------------------------------------------------------------------------------
# recompute switches
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
                     recompute: frozenset[str] = frozenset(), attn_chunks: int = 1,
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
    rc = resolve_flags(recompute)  # `block` implies every other switch: only the block input stays
    up = 4 if E != 4 else 0  # fp32 copies that eager RMSNorm makes of a bf16 input (none for fp32)
    C, Fi, q, kv, qkv = cfg.hidden_size, cfg.intermediate_size, cfg.q_dim, cfg.kv_dim, cfg.qkv_dim
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    lin = 0 if fp8 else E  # bytes/element of a linear input the linear saves (fp8: an e4m3 copy instead)
    f8 = 1 if fp8 else 0
    chunked = attn_chunks > 1 and not fp8  # SDPA slices' outputs + their concatenation (the projection input)
    blk = "block" not in rc
    T = ActTerm
    t = [T("input", E * C, True, "block input (residual stream)")]
    if compiled:
        t += [T("ln1", 4, not ("norm" in rc or "att" in rc), "RMSNorm-1 rstd"),
              T("ln1_out", 0 if (fp8 and "qkv" not in rc) else E * C, blk and ("qkv" in rc or "norm" not in rc),
                "RMSNorm-1 output" + (" (input of the recomputed QKV step)" if "qkv" in rc else "")),
              T("qkv", E * qkv + f8 * C, "qkv" not in rc, "fused QKV output (v is a view)")]
        if cfg.qk_norm:
            t.append(T("qk_norm", 4 * (nh + nkv), "qkv" not in rc, "q/k RMSNorm rstd"))
        t.append(T("rope", E * (q + kv), blk and ("att" in rc or "qkv" not in rc), "q, k after RoPE (SDPA inputs)"))
    else:
        t += [T("ln1", up * C + 4 + E * C + lin * C, not ("norm" in rc or "att" in rc),
                "RMSNorm-1 fp32 copy, rstd, normalized, output"),
              T("qkv", E * qkv + f8 * C, "qkv" not in rc, "fused QKV output (v is a view)")]
        if cfg.qk_norm:
            t.append(T("qk_norm", up * (q + kv) + 4 * (nh + nkv) + E * (q + kv), "qkv" not in rc, "q/k RMSNorm state"))
        t.append(T("rope", E * (q + kv), "qkv" not in rc, "q, k after RoPE (SDPA inputs)"))
    t.append(T("attention", E * q + 4 * nh + (E * q if chunked else 0), "att" not in rc,
               "SDPA output + log-sum-exp (fp32)" + (" + concatenated slices" if chunked else "")))
    if fp8:
        t.append(T("o_in_fp8", q, blk, "e4m3 copy of the attention projection's input"))
    ln2_dropped = "norm" in rc or "ffn" in rc
    if compiled:
        t += [T("res_att", E * C, blk, "residual after attention"),
              T("ffn_extra", E * C, blk and "ffn" in rc, "kept by the partitioner with --recompute-ffn"),
              T("ln2", 4 + (0 if fp8 else E * C), not ln2_dropped, "RMSNorm-2 rstd + output"),
              T("mlp_up", 2 * Fi * E + f8 * C, "ffn" not in rc, "fused up/gate output (B, T, 2F)"),
              T("swiglu", 0 if fp8 else E * Fi, "swiglu" not in rc, "SwiGLU output")]
    else:
        # eager RMSNorm-2 keeps an fp32 copy of the residual; when it is recomputed the residual itself stays
        res = E * C if (ln2_dropped or E == 4) else 4 * C
        t += [T("res_att", res, blk,
                "residual after attention" + ("" if res == E * C else " (as RMSNorm-2's fp32 copy)")),
              T("ln2", 4 + E * C + lin * C, not ln2_dropped, "RMSNorm-2 rstd, normalized, output"),
              T("mlp_up", 2 * Fi * E + f8 * C, "ffn" not in rc, "fused up/gate output (B, T, 2F)"),
              T("swiglu", E * Fi + lin * Fi, "swiglu" not in rc, "silu(gate), SwiGLU output")]
    if fp8:  # each linear keeps its e4m3 weight and two scales; those inside a recomputed step are rebuilt
        w8 = 1 if fp8_weight_copies else 0  # persistent quants: views of the gathered e4m3 block, not copies
        t += [T("down_in_fp8", Fi, blk, "e4m3 copy of the down projection's input"),
              T("fp8_w_qkv", 0, "qkv" not in rc, "e4m3 QKV weight", per_layer=w8 * (C * qkv + 8)),
              T("fp8_w_o", 0, blk, "e4m3 attention-projection weight", per_layer=w8 * (q * C + 8)),
              T("fp8_w_up", 0, "ffn" not in rc, "e4m3 up/gate weight", per_layer=w8 * (2 * Fi * C + 8)),
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
    from qtrain.kernels import cross_entropy
    return cross_entropy.FUSED_CE_ENABLED


def plan_memory(cfg: ModelConfig, opts: Options, *, world: int = 1, gpu_memory: int | None = None,
                device: str = "cuda", compiled: bool | None = None, reserve: int | None = None,
                layout: FlatLayout | None = None, model_name: str | None = None,
                recompute: frozenset[str] | None = None, attn_chunks: int | None = None) -> MemoryPlan:
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
    rc = resolve_flags(recompute if recompute is not None else opts.recompute)
    groups = layout.groups
    blocks = [g for g in groups if g.layer is not None]
    non_block = layout.non_block_groups()
    block_padded = blocks[0].padded_numel if blocks else 0
    shard_sizes = [g.shard_size(world) for g in groups]
    items: list[Item] = []

    # ---- weights (parallel/weights/sharded.py `ShardedWeights.memory()` or the trainer's replicated buffers) ----
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
    offload_res = bool(_opt(opts, "offload_residual")) and "block" in rc
    # block inputs (on the host with --offload-residual: 2 on the device, the one in use and the prefetched
    # one) + what each layer keeps + the last block's output (alive until the LM head has run)
    act_dev = L * per_layer + (2 * inp if offload_res else L * inp) + inp
    act_host = L * inp if offload_res else 0
    items.append(Item(f"activations ({L} layers)", device=act_dev, host=act_host, kind="activations",
                      parts={"per_layer": per_layer, "inputs": L * inp, "output": inp},
                      detail=f"{_mib(per_layer + inp)} per layer; recompute {recompute_label(rc)}"
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
    if "block" in rc:
        bwd += full_block
    elif rc:
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
                "shard_weights": sharded_w, "recompute": recompute_label(rc), "offload_residual": offload_res,
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
    rc = run.recompute
    return plan_memory(trainer.cfg, trainer.opts, world=trainer.ctx.world, gpu_memory=gpu_memory, device=dev,
                       compiled=bool(getattr(run, "compile", False)), layout=trainer.layout, recompute=rc,
                       attn_chunks=getattr(run, "attn_bwd_chunks", None))


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
