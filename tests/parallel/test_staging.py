"""The host <-> device staging ring (`parallel/staging.py`).

- a pass over items of uneven sizes through three slots leaves the host tensors as an in-place computation on
  them would (plain copies on the CPU), slot i % 3 serving item i;
- the memory statement (`StagingRing.bytes`) equals the storages the ring allocates, also after `add`; a ring
  `over` its caller's buffers allocates nothing and copies into those buffers;
- on the GPU (marked `gpu`): several passes back to back with real copy streams and no host sync between
  them give the same bits as the computation on the device; a missing wait shows up as stale or half-copied
  values.
"""
from __future__ import annotations

import pytest
import torch

from qtrain.parallel.staging import STAGING_SLOTS, StagingRing


def _storages(ring: StagingRing) -> int:
    seen = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for s in ring.slots for t in s.values()}
    return sum(seen.values())


def _stream(ring: StagingRing, host: dict[str, torch.Tensor], bounds: list[tuple[int, int]], op, *,
            sync: bool = True) -> None:
    """One pass: item i is elements [a, b) of every host tensor; `op(slot views)` updates them in place."""
    part = lambda i: {k: t[bounds[i][0]:bounds[i][1]] for k, t in host.items()}  # noqa: E731
    ring.begin()
    ring.fetch(0, part(0))
    for i, (a, b) in enumerate(bounds):
        if i + 1 < len(bounds):
            ring.fetch(i + 1, part(i + 1))
        slot = ring.acquire(i)
        op({k: slot[k][:b - a] for k in host})
        ring.write_back(i, part(i))
    ring.end()
    if sync:
        ring.synchronize()


def _update(views: dict[str, torch.Tensor]) -> None:
    views["m"].mul_(0.5).add_(views["v"])
    views["v"].add_(1)


def test_a_pass_updates_the_host_tensors_in_place_through_the_slots():
    g = torch.Generator().manual_seed(0)
    host = {"m": torch.randn(1000, generator=g), "v": torch.randn(1000, generator=g).to(torch.bfloat16)}
    want = {k: t.clone() for k, t in host.items()}
    _update(want)
    bounds = [(0, 300), (300, 310), (310, 610), (610, 900), (900, 1000)]  # uneven, more items than slots
    ring = StagingRing({"m": (300, torch.float32), "v": (300, torch.bfloat16)}, device="cpu")
    seen = []
    _stream(ring, host, bounds, lambda v: seen.append(v["m"].untyped_storage()._cdata) or _update(v))
    for k in host:
        assert torch.equal(host[k], want[k]), k
    slots = [s["m"].untyped_storage()._cdata for s in ring.slots]
    assert seen == [slots[i % STAGING_SLOTS] for i in range(len(bounds))]
    assert ring.slot(4) is ring.slots[1]


def test_memory_statement_equals_what_the_ring_allocates():
    sizes = {"param": (4096, torch.bfloat16), "m": (4096, torch.float8_e4m3fn), "m_scales": (40, torch.float32)}
    ring = StagingRing(sizes, device="cpu")
    assert ring.nbytes == StagingRing.bytes(sizes) == _storages(ring) == 3 * (4096 * 2 + 4096 + 40 * 4)
    ring.add("grad", 4096, torch.float32)
    assert ring.nbytes == StagingRing.bytes({**sizes, "grad": (4096, torch.float32)}) == _storages(ring)
    assert "grad" in ring and "v" not in ring
    one = StagingRing({"shard": (100, torch.bfloat16)}, device="cpu", slots=1, overlap=False)
    assert one.nbytes == StagingRing.bytes({"shard": (100, torch.bfloat16)}, slots=1) == _storages(one) == 200


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_passes_back_to_back_equal_the_device_computation():
    """Pinned host tensors of 64M elements in 24 uneven items through 3 slots on two copy streams; three passes
    queued without a host sync between them (the order between one pass's copy-backs and the next pass's fetches
    is on the streams alone). The compute is slow enough (a few element-wise passes per item) that a fetch not
    waiting for its slot's copy-back, or a copy-back not waiting for the compute, changes the bits."""
    dev = torch.device("cuda")
    n = 64 << 20
    g = torch.Generator(device=dev).manual_seed(0)
    dev_m, dev_v = torch.randn(n, device=dev, generator=g), torch.randn(n, device=dev, generator=g).bfloat16()
    host = {"m": dev_m.cpu().pin_memory(), "v": dev_v.cpu().pin_memory()}
    cuts = sorted({0, n, *torch.randint(1, n, (23,), generator=torch.Generator().manual_seed(1)).tolist()})
    bounds = list(zip(cuts, cuts[1:]))
    cap = max(b - a for a, b in bounds)
    ring = StagingRing({"m": (cap, torch.float32), "v": (cap, torch.bfloat16)}, device=dev)

    def op(v: dict[str, torch.Tensor]) -> None:
        for _ in range(4):
            _update(v)

    want = {"m": dev_m, "v": dev_v}
    for _ in range(3):
        op(want)
        _stream(ring, host, bounds, op, sync=False)
    ring.synchronize()
    for k in host:
        assert torch.equal(host[k].to(dev).view(torch.uint8), want[k].view(torch.uint8)), k
