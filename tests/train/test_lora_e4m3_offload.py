"""An e4m3 LoRA base offloaded to the host (`--lora-base-dtype e4m3 --offload-quants --recompute-block`,
parallel/weights/e4m3_base.py): each layer's codes in pinned host memory, two layers' slots on the device.

Claim: where the codes live changes nothing the math reads. A layer's codes are copied byte for byte into its slot
before its forward (and again before its backward's recomputed forward), so the run equals the held-base run bit for
bit: losses, evaluation loss, every adapter after each step, on a tiny qwen2 base and a tiny Qwen3.5 base (whose
linear- and full-attention layers hold different matrices, so the slots are the larger layer's and each layer's views
sit at its own offsets). A slot handed out with the wrong layer's codes (a stale slot, a prefetch into the slot being
read) would change the first loss. The memory statement is what is allocated: the codes (each matrix at a multiple of
16 bytes) on the host, two slots of the largest layer's on the device. On CUDA the copies run on their own stream
(the GPU test: the same equality, where a copy not ordered after the slot's last reader would change the bits).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qtrain.options import Options
from qtrain.parallel.weights.e4m3_base import CODE_ALIGN, E4m3BaseWeights
from qtrain.train.trainer import Trainer
from tests.hf_fixtures import tiny_hf_model
from tests.train.test_lora_e4m3 import QWEN35_TARGETS, _batches, _opts

BASES = {"qwen2": ("base4", "q,v,o,gate,down"), "qwen35": ("qwen35_base4", QWEN35_TARGETS)}


@pytest.fixture(scope="module")
def base4(tmp_path_factory) -> Path:
    """A tiny random qwen2 checkpoint of 4 layers: more than the two slots, so layers take turns in them."""
    d = tmp_path_factory.mktemp("e4m3-offload") / "qwen2"
    tiny_hf_model("qwen2", num_hidden_layers=4).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def qwen35_base4(tmp_path_factory) -> Path:
    """A tiny random Qwen3.5 checkpoint of 4 layers (3 linear-attention, 1 full-attention, as the real ones)."""
    from tests.model.family_fixtures import qwen35_cfg, qwen35_hf_model
    d = tmp_path_factory.mktemp("e4m3-offload") / "qwen35"
    cfg = qwen35_cfg(num_hidden_layers=4, layer_types=("linear_attention",) * 3 + ("full_attention",))
    qwen35_hf_model(cfg).save_pretrained(d)
    return d


def _pair(model, targets: str, **kw) -> dict[str, Trainer]:
    opts = dict(lora_base_dtype="e4m3", recompute_block=True, lora_targets=targets, grad_accumulation=2, **kw)
    return {"held": Trainer(_opts(model, **opts)), "offloaded": Trainer(_opts(model, offload_quants=True, **opts))}


def _run(t: Trainer, steps: int = 3) -> tuple[list[float], float, list[dict[str, torch.Tensor]]]:
    batches = _batches(2 * steps)
    losses, adapters = [], []
    for s in range(steps):
        losses.append(t.step(batches[2 * s:2 * s + 2], lr=1e-2)["loss"])
        adapters.append({n: p.detach().clone() for n, p in t.params.items() if "_lora_" in n})
    return losses, t.evaluate(_batches(2)), adapters


@pytest.mark.parametrize("which,dropout", [("qwen2", 0.0), ("qwen35", 0.0), ("qwen2", 0.25)])
def test_offloaded_base_trains_bitwise_like_the_held_one(which, dropout, request):
    """(With dropout the adapters learn their layer from the held params, not by asking every block at start.)"""
    fixture, targets = BASES[which]
    runs = _pair(request.getfixturevalue(fixture), targets, lora_dropout=dropout)
    held, off = runs["held"].weights, runs["offloaded"].weights
    assert isinstance(off, E4m3BaseWeights) and off.offload and not held.offload
    assert off.fetches == 0  # building the trainer (dropout's layer binding too) copied nothing in
    L = runs["held"].cfg.num_hidden_layers
    for layer in range(L):  # the same codes, held on the device against kept on the host
        for n, q in held.codes[layer].items():
            h = off.codes[layer][n]
            assert h.device.type == "cpu" and torch.equal(h.view(torch.uint8), q.view(torch.uint8)), (layer, n)
    want, got = _run(runs["held"]), _run(runs["offloaded"])
    assert got[0] == want[0] and got[1] == want[1]  # losses, evaluation loss
    for s, (a, b) in enumerate(zip(got[2], want[2])):
        assert all(torch.equal(a[n], b[n]) for n in b), f"step {s}"
    assert any(v.abs().max() > 0 for n, v in want[2][-1].items() if n.endswith("_lora_b"))  # the adapters trained
    # the layers took turns in the slots: per micro-step the forward copies in all but the two layers the last
    # backward left in place, the backward all but the two the forward left (2 L - 4 copies)
    assert off.fetches >= 3 * 2 * (2 * L - 4) > 0



@pytest.mark.parametrize("which", BASES)
def test_memory_statement_is_what_is_allocated(which, request):
    fixture, targets = BASES[which]
    t = Trainer(_opts(request.getfixturevalue(fixture), lora_base_dtype="e4m3", recompute_block=True,
                      offload_quants=True, lora_targets=targets))
    w = t.weights
    fp = E4m3BaseWeights.footprint_of(t.layout, torch.bfloat16, offload=True)
    places, sizes = E4m3BaseWeights.code_places(t.layout)
    assert fp.parts["base_codes"] == sum(h.numel() for h in w._host) == sum(sizes)
    assert fp.parts["base_slots"] == sum(s.numel() for s in w._slots) == 2 * max(sizes)
    assert fp.host_keys == frozenset({"base_codes"})
    assert all(a % CODE_ALIGN == 0 for p in places for a, _ in p.values())
    if which == "qwen35":  # the layers hold different matrices: the slot is the larger one's
        assert len(set(sizes)) == 2
    row = t.run.plan.item("weights (bf16, e4m3 base)")  # the plan's row states the same bytes
    assert row.host == fp.parts["base_codes"] and row.device == sum(v for k, v in fp.parts.items() if k != "base_codes")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("which", BASES)
def test_gpu_offloaded_base_trains_bitwise_like_the_held_one(which, request):
    """On CUDA the copies run on their own stream, ordered after the slot's last reader (`release_block`) and before
    its next one (`block`): out of order, a layer would read another's codes and the bits would differ."""
    fixture, targets = BASES[which]
    runs = _pair(request.getfixturevalue(fixture), targets, device="cuda")
    assert runs["offloaded"].weights._host[0].is_pinned()
    want, got = _run(runs["held"]), _run(runs["offloaded"])
    assert got[0] == want[0] and got[1] == want[1]
    for a, b in zip(got[2], want[2]):
        assert all(torch.equal(a[n], b[n]) for n in b)


def test_options():
    with pytest.raises(Exception, match="--offload-quants with --lora-base-dtype e4m3 needs --recompute-block"):
        Options(model="x", lora_rank=4, lora_base_dtype="e4m3", offload_quants=True).validate()
    Options(model="x", lora_rank=4, lora_base_dtype="e4m3", offload_quants=True, recompute_block=True).validate()


def test_qtrain_train_with_the_base_on_the_host_exports_the_held_runs_adapter_and_continues_bitwise(tmp_path):
    """Through `qtrain train` (from scratch, the run root's tiny model): the preflight takes the options, the checkpoint holds the
    adapters, --continue re-reads the base into host memory and ends where the uninterrupted run ended, and the
    exported adapter is the held-base run's, bit for bit."""
    import shutil

    from qtrain.cli.main import main
    from tests.run_utils import make_run_root, train_argv
    root = make_run_root(tmp_path)
    lora = ("--lora-rank", "4", "--lora-base-dtype", "e4m3", "--recompute-block", "--quiet")
    held = train_argv(root, steps=4, name="held", model_dtype="bf16", extra=lora)
    off = train_argv(root, steps=4, name="off", model_dtype="bf16", extra=lora + ("--offload-quants",))
    assert main(held) == 0 and main(off) == 0
    adapter = "adapter_model.safetensors"
    first = (root / "out" / "off" / adapter).read_bytes()
    assert first == (root / "out" / "held" / adapter).read_bytes()
    shutil.rmtree(root / "ckpt" / "off" / "step_00000004")
    assert main(off + ["--continue"]) == 0
    assert (root / "out" / "off" / adapter).read_bytes() == first
