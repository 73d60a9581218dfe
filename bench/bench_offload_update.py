"""Kind `offload-update`: the offloaded AdamW update alone (Adam m and v, optionally the weight shards, in pinned host
memory): how long one step takes with the state streamed through device staging slots, against the PCIe ceiling.

Variants of `ShardedAdamW`'s streaming (the bench swaps its staging ring's private streams / slots; the code
default is last):
  1 stream, 2 slots    what qtrain did before: both copy directions on one side stream (serialised)
  2 streams, 2 slots   host->device and device->host on their own streams, two slots
  2 streams, 3 slots   STAGING_SLOTS = 3 (one fetching, one updating, one writing back)
and the raw copy rates of a 1 GiB pinned buffer: host->device, device->host, and both at once.

Parameters: model (preset, 14B), steps (timed updates per variant, 3), master (false; true: the weight
shards offloaded too, --offload-master). Result: copy rates, `rows` (ms per update per variant, each twice).
"""
from __future__ import annotations

import time

import torch

from bench.kinds import Skip
from bench.compat import preset
from qtrain.parallel.layout import FlatLayout
from qtrain.parallel.optimizer import ShardedAdamW

HP = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


class Grads:
    def __init__(self, g: dict[str, torch.Tensor]):
        self.g = g

    def grad_shard(self, key: str) -> torch.Tensor:
        return self.g[key]


def copy_rates(gib: float = 1.0) -> dict[str, float]:
    n = int(gib * 2**30)
    h1, h2 = torch.empty(n, dtype=torch.uint8).pin_memory(), torch.empty(n, dtype=torch.uint8).pin_memory()
    d1, d2 = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / 3

    def both() -> None:
        with torch.cuda.stream(s1):
            d1.copy_(h1, non_blocking=True)
        with torch.cuda.stream(s2):
            h2.copy_(d2, non_blocking=True)

    out = {"h2d GB/s": n / timed(lambda: d1.copy_(h1, non_blocking=True)) / 1e9,
           "d2h GB/s": n / timed(lambda: h2.copy_(d2, non_blocking=True)) / 1e9,
           "both, each GB/s": n / timed(both) / 1e9}
    return out


def run(model: str = "Qwen2.5-14B", steps: int = 3, master: bool = False) -> dict:
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), torch.__version__, model, flush=True)
    rates = copy_rates()
    print({k: round(v, 1) for k, v in rates.items()}, flush=True)
    layout = FlatLayout(preset(model), 1)
    t0 = time.perf_counter()
    shards = layout.allocate(dtype=torch.bfloat16, device="cpu" if master else dev, shard=True,
                             pin_memory=master)
    grads = layout.allocate(dtype=torch.bfloat16, device=dev, shard=True)
    for t in grads.values():
        t.normal_(0, 1e-3)
    for t in shards.values():
        t.copy_(torch.randn(t.shape, dtype=torch.bfloat16, device=dev) * 0.02)
    opt = ShardedAdamW(layout, shards=shards, device=dev, m_dtype="bf16", v_dtype="bf16", offload_m=True,
                       offload_v=True, offload_params=master)
    print(f"setup {time.perf_counter() - t0:.1f} s; {opt.streamed_items} items after the first step", flush=True)
    state_gb = sum(t.numel() * t.element_size() for d in (opt.m, opt.v) for t in d.values()) / 1e9
    if master:
        state_gb += sum(t.numel() * t.element_size() for t in shards.values()) / 1e9
    ring = opt._staging  # qtrain.parallel.staging.StagingRing
    slots3, h2d, d2h = list(ring.slots), ring._h2d, ring._d2h
    variants = {"1 stream, 2 slots": (slots3[:2], h2d, h2d), "2 streams, 2 slots": (slots3[:2], h2d, d2h),
                "2 streams, 3 slots": (slots3, h2d, d2h)}
    rows = []
    for name, (slots, s_in, s_out) in list(variants.items()) * 2:  # twice: the spread between repeats
        ring.slots, ring._h2d, ring._d2h = slots, s_in, s_out
        opt.step(Grads(grads), **HP)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            opt.step(Grads(grads), **HP)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t) / steps * 1e3
        rows.append((name, ms))
        print(f"{name}: {ms:.0f} ms per update", flush=True)
    ceiling = state_gb / rates["h2d GB/s"] * 1e3  # each direction moves the whole state once
    print(f"{model}, offloaded m, v{', master' if master else ''} (bf16): {state_gb:.1f} GB each way; "
          f"one direction alone at the measured h2d rate: {ceiling:.0f} ms")
    print(f"{'variant':22s} {'ms/update':>10}")
    for name, ms in rows:
        print(f"{name:22s} {ms:10.0f}")
    return {"rates_gbs": {k: round(v, 1) for k, v in rates.items()}, "state_gb": round(state_gb, 1),
            "ceiling_ms": round(ceiling), "rows": [dict(variant=n, ms=round(ms)) for n, ms in rows],
            "summary": " | ".join(f"{n}: {ms:.0f}" for n, ms in rows[:3]) + " ms"}


def dry_run(params: dict) -> dict:
    raise Skip("streams optimizer state through pinned host memory and CUDA copy streams: needs a CUDA GPU")
