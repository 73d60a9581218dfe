"""Training throughput of qtrain on one GPU: full optimizer steps (update included) on random tokens.

Counts as ../shared/bench/README.md says: tokens/s = batch * seq * grad_accumulation * steps / wall time
of those steps after warm-up, device synchronised before reading the clock. Run it in the same device
call as the HF baseline (`hf_baseline.py`) so both see the same machine:

    PYTHONPATH=. python3 bench/bench_train.py '[{"model":"Qwen2.5-0.5B","batch":16,"accum":2,"steps":8}]'

Each entry may also set seq, warmup, fused_ce (false: the compiled cross-entropy instead of the Triton
kernel) and any `Options` field
(lmhead_chunks, model_dtype, opt_m_dtype, opt_v_dtype, matmul_dtype, recompute_block, use_cuda_graphs,
offload_opt_m, ...). Prints one JSON line per entry. `host_ms` is the host time spent queuing the
micro-steps of one step: close to `step_ms` means the host, not the GPU, sets the pace. Memory: `peak_gib`
is the allocator's peak, `plan_gib` what the memory plan (`qtrain plan`) predicted for the same run
without its fixed reserve for the CUDA context, `plan_err` their relative difference.
"""
from __future__ import annotations

import json
import sys
import time

import torch

from qtrain.kernels import cross_entropy
from qtrain.plan.memory import plan_for_trainer
from qtrain.observe.metrics import mfu_bf16
from qtrain.options import Options
from qtrain.train.trainer import Trainer


def run(model: str, batch: int, accum: int, steps: int, seq: int = 1024, warmup: int = 3,
        fused_ce: bool = True, **options) -> dict:
    options.setdefault("compile", "on")
    opts = Options(model=model, from_scratch=True, batch_size=batch, seq_len=seq, grad_accumulation=accum,
                   learning_rate=1e-4, device="cuda", **options)
    cross_entropy.FUSED_CE_ENABLED = fused_ce
    torch.cuda.reset_peak_memory_stats()
    tr = Trainer(opts)
    plan = plan_for_trainer(tr)
    plan_bytes = plan.device_total - sum(i.device for i in plan.items if i.kind == "reserve")
    V = tr.cfg.vocab_size
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randint(0, V, (batch, seq + 1), device="cuda", generator=g)
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
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        stats = step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / steps
    tps = batch * seq * accum / dt
    res = dict(system="qtrain", model=model, batch=batch, seq=seq, accum=accum, fused_ce=fused_ce, **options,
               tps=round(tps), step_ms=round(dt * 1000, 1), host_ms=round(1000 * sum(host) / len(host), 1),
               loss=round(stats["loss"], 4),
               mfu=round(mfu_bf16(tps, tr.cfg, seq, torch.cuda.get_device_name()) or 0, 3),
               peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2), plan_gib=round(plan_bytes / 2**30, 2),
               plan_err=round(plan_bytes / torch.cuda.max_memory_allocated() - 1, 3),
               reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2))
    del tr
    cross_entropy.FUSED_CE_ENABLED = True
    torch.cuda.empty_cache()
    return res


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    for p in json.loads(sys.argv[1]):
        try:
            print(json.dumps(run(**p)), flush=True)
        except Exception as e:  # keep going: one OOM must not lose the other rows
            print(json.dumps(dict(p, error=repr(e)[:400])), flush=True)
            torch.cuda.empty_cache()
