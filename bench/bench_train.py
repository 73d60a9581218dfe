"""Kind `train`: training throughput of qtrain on one device through its Python API (Trainer): full optimizer
steps (update included) on one batch of random tokens.

Counts as ../shared/bench/README.md says: tokens/s = batch * seq * grad_accumulation * steps / wall time
of those steps after warm-up, device synchronised before reading the clock.

Parameters: model, batch, accum, steps; optional seq (1024), warmup (3), device ("cuda"), layers (the model cut to
its first N layers, bench/shapes.py: e.g. the largest MoE that fits one GPU), and any `Options` field
(lmhead_chunks, model_dtype, opt_m_dtype, opt_v_dtype, matmul_dtype, recompute_swiglu, offload_opt_m,
compile_tuning, ...; `compile` defaults to "on"). Result: tps, step_ms, host_ms (host time spent queuing the
micro-steps of one step: close to step_ms means the host, not the GPU, sets the pace), loss, mfu (qtrain's
mfu_bf16: of an MoE over the experts a token runs; checkouts before that fix counted every expert), peak_gib
(the allocator's peak), plan_gib (what the memory plan, `qtrain plan`, predicts for the same run without its fixed
reserve for the CUDA context), plan_err (their relative difference), reserved_gib; with e4m3 matmuls fp8 (the
block linears --fp8-policy put in FP8).

Runs against qtrain before the restructure (dac8680) too (bench/compat.py), so a suite can compare the two.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from bench.compat import qtrain
from bench.dry import divisor_or_one, tiny_model_dir
from bench.shapes import model_arg

RUN_KEYS = ("model", "batch", "accum", "steps", "seq", "warmup", "device", "layers", "probe_saved")


def make_options(model: str, batch: int, accum: int, seq: int, device: str, options: dict):
    """The Options of a run; an unknown option is named (Options would only say 'unexpected keyword')."""
    Options = qtrain("Options")
    unknown = sorted(set(options) - {f.name for f in dataclasses.fields(Options)})
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)}: the train kind takes {', '.join(RUN_KEYS)} "
                         f"and the fields of qtrain's Options")
    return Options(model=model, from_scratch=True, batch_size=batch, seq_len=seq, grad_accumulation=accum,
                   learning_rate=1e-4, device=device, **options)


def saved_tensors(tr, inp: torch.Tensor, tgt: torch.Tensor, scale: float) -> dict:
    """What one micro-step keeps for backward, from autograd's pack hook (compiled graphs' saved tensors included):
    the storages it saw, each once, by dtype and shape, MiB per layer (a check of the plan's activation terms)."""
    seen: dict[int, tuple[str, tuple[int, ...], int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.device.type == tr.device.type:
            st = t.untyped_storage()
            seen.setdefault(st.data_ptr(), (str(t.dtype).removeprefix("torch."), tuple(t.shape), st.nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        tr.micro_step(inp, tgt, loss_scale=scale)
    held = _held_storages(tr.weights)  # the weights' own storages: saved by reference, not activations
    L = tr.cfg.num_hidden_layers
    by: dict[tuple[str, tuple[int, ...], bool], list[int]] = {}
    for ptr, (dtype, shape, n) in seen.items():
        by.setdefault((dtype, shape, ptr in held), []).append(n)
    rows = sorted(((sum(v), len(v), k) for k, v in by.items()), reverse=True)
    return {"saved_mib_per_layer": round(sum(r[0] for r in rows if not r[2][2]) / L / 2**20, 1),
            "saved": "; ".join(f"{d} {list(sh)}{' (held)' if h else ''} x{c / L:g}/layer {b / L / 2**20:.1f} MiB"
                               for b, c, (d, sh, h) in rows[:16])}


def _held_storages(obj, depth: int = 0, out: set[int] | None = None) -> set[int]:
    """The storage addresses of every tensor the weight source holds (its attributes, dicts, lists and their objects, 4 deep)."""
    out = set() if out is None else out
    if isinstance(obj, torch.Tensor):
        out.add(obj.untyped_storage().data_ptr())
    elif depth < 4 and isinstance(obj, dict):
        for v in obj.values():
            _held_storages(v, depth + 1, out)
    elif depth < 4 and isinstance(obj, (list, tuple)):
        for v in obj:
            _held_storages(v, depth + 1, out)
    elif depth < 3 and hasattr(obj, "__dict__") and not isinstance(obj, type):
        for v in vars(obj).values():
            _held_storages(v, depth + 1, out)
    return out


def run(model: str, batch: int, accum: int, steps: int, seq: int = 1024, warmup: int = 3, device: str = "cuda",
        layers: int | None = None, probe_saved: bool = False, **options) -> dict:
    options.setdefault("compile", "on")
    opts = make_options(model_arg(model, layers), batch, accum, seq, device, options)
    cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    tr = qtrain("Trainer")(opts)
    plan = qtrain("plan_for_trainer")(tr)
    plan_bytes = plan.device_total - sum(i.device for i in plan.items if i.kind == "reserve")
    V = tr.cfg.vocab_size
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randint(0, V, (batch, seq + 1), device=device, generator=g)
    inp, tgt = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    scale = 1.0 / (batch * seq * accum)
    host = []

    def step() -> dict:
        t0 = time.perf_counter()
        for _ in range(accum):
            tr.micro_step(inp, tgt, loss_scale=scale)
        host.append(time.perf_counter() - t0)
        return tr.update(lr=1e-4)

    for _ in range(warmup):
        step()
    host.clear()
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        stats = step()
    sync()
    dt = (time.perf_counter() - t) / steps
    tps = batch * seq * accum / dt
    res = dict(system="qtrain", tps=round(tps), step_ms=round(dt * 1000, 1),
               host_ms=round(1000 * sum(host) / len(host), 1), loss=round(stats["loss"], 4),
               plan_gib=round(plan_bytes / 2**30, 2), layers=tr.cfg.num_hidden_layers)
    if getattr(tr, "fp8", None) is not None:  # --matmul-dtype e4m3: the linears --fp8-policy put in FP8
        res["fp8"] = "/".join(tr.fp8.fp8) or "none"
    if cuda and probe_saved:  # after the timed steps: the probe's hook slows its own micro-step only
        res.update(saved_tensors(tr, inp, tgt, scale))
    if cuda:
        peak = torch.cuda.max_memory_allocated()
        mfu = qtrain("mfu_bf16")(tps, tr.cfg, seq, torch.cuda.get_device_name())
        res.update(mfu=round(mfu or 0, 3), peak_gib=round(peak / 2**30, 2), plan_err=round(plan_bytes / peak - 1, 3),
                   reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2))
    print(", ".join(f"{k} {v}" for k, v in res.items()), flush=True)
    return res


def dry_run(params: dict) -> dict:
    """The case's options checked as given (on 'cuda'), then run on the CPU: a tiny model of the same family,
    2 x 32 tokens, 2 steps after 1 warm-up, uncompiled (inductor on a CPU takes a minute)."""
    options = {k: v for k, v in params.items() if k not in RUN_KEYS}
    make_options(model_arg(params["model"], params.get("layers")), params["batch"], params["accum"],
                 params.get("seq", 1024), "cuda", options).validate()
    batch, seq = 2, 32
    small = dict(lmhead_chunks=divisor_or_one(options.get("lmhead_chunks", 1), batch * seq),
                 attn_bwd_chunks=divisor_or_one(options.get("attn_bwd_chunks", 1), batch))
    return {**params, **{k: v for k, v in small.items() if k in options}, "model": tiny_model_dir(params["model"]),
            "layers": None, "batch": batch, "seq": seq, "accum": min(params["accum"], 2), "steps": 2, "warmup": 1,
            "device": "cpu", "compile": "off"}
