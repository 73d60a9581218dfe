"""Kind `profile`: one qtrain training step on the GPU: GPU time per kernel category against the step's wall
time, then the top kernels and the GPU's idle gaps, to see where time goes.

Parameters: model, batch, accum, seq (1024), layers (the model's first N, as the train kind), top (kernels listed,
22) and any `Options` field, as the train kind. GPU busy
time well under wall time means gaps (host-bound). Result: wall_ms, busy_ms, `categories` (ms each), `top`
(kernels), `gaps`, and with the one-pass SwiGLU FP8 kernels `onepass_hint_misses` (missed, calls per direction,
counted over two more steps).

With ncu=true the step is timed kernel by kernel under Nsight Compute instead (bench/ncu.py: the same method as
the `llmq-profile` kind's, so the two systems' kernels compare one for one): this module runs again in a child
process under ncu, which times only the kernels between the step's cudaProfilerStart and Stop. Result: busy_ms,
kernels, `categories`, `top`.
"""
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.bench_train import make_options
from bench.compat import qtrain
from bench.kernel_categories import step_report
from bench.kinds import Skip
from bench.shapes import model_arg


def run(model: str, batch: int, accum: int, top: int = 22, ncu: bool = False, seq: int = 1024,
        layers: int | None = None, **p) -> dict:
    model = model_arg(model, layers)
    if ncu:
        return run_under_ncu(model, batch, accum, top, p, seq)
    tr, step = make_step(model, batch, accum, p, seq)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # no CPU tracing: keeps host gaps real
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    report = step_report({e.key: (e.device_time_total / 1e3, e.count) for e in kernels}, top,
                         lambda busy: f"{model} b{batch}x{accum} {p}: wall {wall:.1f} ms/step (unprofiled), GPU busy "
                                      f"{busy:.1f} ms")
    gaps = print_gaps(prof, top)
    misses = hint_misses(step, getattr(tr.model, "swiglu_onepass", False), tr.device)  # dense families only
    return {"wall_ms": round(wall, 1), "onepass_hint_misses": misses, "gaps": gaps, **report}


def make_step(model: str, batch: int, accum: int, p: dict, seq: int = 1024):
    """The Trainer and a function running one optimizer step on a fixed random batch (or, with `fresh`, a new
    random batch each micro-step, as a run)."""
    p = {"compile": "on", **p}
    tr = qtrain("Trainer")(make_options(model, batch, accum, seq, "cuda", p))
    x = torch.randint(0, tr.cfg.vocab_size, (batch, seq + 1), device="cuda")
    inp, tgt = x[:, :-1].contiguous(), x[:, 1:].contiguous()

    def step(fresh: bool = False):
        """One optimizer step on the fixed batch, or with `fresh` a new random batch each micro-step (as a run)."""
        for _ in range(accum):
            if fresh:
                y = torch.randint(0, tr.cfg.vocab_size, (batch, seq + 1), device="cuda")
                inp.copy_(y[:, :-1])
                tgt.copy_(y[:, 1:])
            tr.micro_step(inp, tgt, loss_scale=1.0 / (batch * seq * accum))
        tr.update(lr=1e-4)
    return tr, step


def run_under_ncu(model: str, batch: int, accum: int, top: int, p: dict, seq: int = 1024) -> dict:
    """Time the step's kernels under ncu: this module runs in a child process (`main`) that brackets the step with
    cudaProfilerStart / Stop; ncu times the kernels between them only (warm-up and compilation run unprofiled)."""
    from bench.ncu import find_ncu, keep_raw, ncu_command, read_kernels, summarize
    from bench.subproc import stream
    with tempfile.TemporaryDirectory(prefix="qtrain-ncu-") as tmp:
        log = Path(tmp) / "ncu.csv"
        args = json.dumps({"model": model, "batch": batch, "accum": accum, "p": p, "seq": seq})
        fin = stream([*ncu_command(find_ncu(), log, from_start=False), sys.executable, "-m", "bench.profile_step",
                      args],
                     echo=lambda line: not line.startswith("==PROF==") or "rror" in line)
        if fin.returncode or not log.is_file():
            raise RuntimeError(f"the step under ncu failed (exit status {fin.returncode}): {fin.last(3)}")
        keep_raw(log, f"qtrain-ncu-{Path(model).name}-{batch}x{accum}.csv")
        kernels = read_kernels(log)
    if not kernels:
        raise RuntimeError(f"ncu timed no kernel between the step's profiler start and stop: {fin.last(3)}")
    return {"system": "qtrain", **summarize(kernels, top, f"qtrain {model} {batch} x {accum} {p}")}


def main(args: str) -> None:
    """The child under ncu: three warm-up steps, then one step between cudaProfilerStart and Stop."""
    a = json.loads(args)
    _, step = make_step(a["model"], a["batch"], a["accum"], a["p"], a.get("seq", 1024))
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def hint_misses(step, onepass: bool, device: torch.device, steps: int = 2) -> dict | None:
    """With the one-pass SwiGLU FP8 kernels: how many of their calls missed the scale hint (and took the second
    pass) over `steps` more steps, counted apart from the timed and profiled ones (the counting adds small kernels):
    first on the profiled batch again, then on fresh random batches (a run's case: each batch's abs-max differs)."""
    if not onepass:
        return None
    from qtrain.kernels.swiglu.fp8_onepass import count_hint_misses
    out = {"steps": steps}
    for fresh in (False, True):
        counts = count_hint_misses(device)
        for _ in range(steps):
            step(fresh)
        (fwd_calls, fwd_missed), (bwd_calls, bwd_missed) = counts.tolist()
        count_hint_misses(None)
        if not fwd_calls + bwd_calls:  # e.g. eager blocks, or CUDA graphs replaying without the launchers' Python
            print(f"one-pass SwiGLU FP8: no kernel call counted over {steps} steps (the MLP does not run them here)")
            return None
        batches = "fresh random batches" if fresh else "the profiled batch"
        print(f"one-pass SwiGLU FP8 over {steps} more steps on {batches}: forward missed the hint in {fwd_missed} of "
              f"{fwd_calls} calls, backward in {bwd_missed} of {bwd_calls}")
        out["fresh" if fresh else "same"] = {"forward": [fwd_missed, fwd_calls], "backward": [bwd_missed, bwd_calls]}
    return out


def dry_run(params: dict) -> dict:
    """The options are checked as the GPU run would take them; the profile itself needs CUDA."""
    run_keys = ("model", "batch", "accum", "top", "ncu", "seq", "layers")
    options = {k: v for k, v in params.items() if k not in run_keys}
    make_options(model_arg(params["model"], params.get("layers")), params["batch"], params["accum"],
                 params.get("seq", 1024), "cuda", options).validate()
    raise Skip("profiles CUDA kernels: needs a CUDA GPU (options checked)")


def print_gaps(prof, top_n: int) -> dict:
    """GPU idle time between consecutive kernels, summed by the kernel that ends the gap: a gap before a
    kernel means the host had not queued it yet (host-bound stretch) or waited on something."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    if not spans:
        return {}
    by_next: dict[str, list[float]] = {}
    end = spans[0][1]
    for s, e, name in spans[1:]:
        gap = s - end
        if gap > 2.0:  # us; below that it is the normal launch-to-launch spacing
            by_next.setdefault(name[:90], []).append(gap)
        end = max(end, e)
    total = sum(sum(v) for v in by_next.values())
    n_gaps = sum(len(v) for v in by_next.values())
    print(f"GPU idle gaps > 2 us: {total / 1e3:.1f} ms in {n_gaps} gaps; by next kernel:")
    for name, gaps in sorted(by_next.items(), key=lambda kv: -sum(kv[1]))[:top_n // 2]:
        print(f"  {sum(gaps) / 1e3:7.2f} ms {len(gaps):5d}x max {max(gaps) / 1e3:6.2f} ms  {name}")
    return {"idle_ms": round(total / 1e3, 2), "count": sum(len(v) for v in by_next.values())}


if __name__ == "__main__":
    main(sys.argv[1])
