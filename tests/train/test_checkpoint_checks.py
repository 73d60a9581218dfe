"""checkpoint_checks: the values a checkpoint may not hold, named by parameter and element."""
from pathlib import Path

import torch

from qtrain.parallel.layout import FlatLayout
from qtrain.train.checkpoint_checks import expected_tensors, header_problem, value_problem
from tests.run_utils import CFG


def test_value_problems_name_the_parameter():
    layout = FlatLayout(CFG, 2)
    g = layout.by_key["block.1"]
    w = torch.zeros(g.shard_size(2), dtype=torch.bfloat16)
    assert value_problem(Path("f"), "weights", "block.1", w, layout, 1) is None
    w[100] = float("inf")
    at = g.shard_range(1, 2)[0] + 100  # rank 1's element 100 is this element of the group
    seg = next(s for s in g.segments if s.start <= at < s.start + s.numel)
    assert value_problem(Path("f"), "weights", "block.1", w, layout, 1) == (
        f"f: tensor block.1 holds 1 NaN/inf value(s), the first at element 100 (parameter {seg.name}, element "
        f"{at - seg.start})")
    v = torch.ones(50)
    v[[7, 9]] = -0.5
    assert "2 negative value(s) (Adam's v is a running mean of squares), the first at element 7" in value_problem(
        Path("f"), "adam.v", "x", v)
    assert value_problem(Path("f"), "adam.m", "x", v) is None  # m may be negative
    assert value_problem(Path("f"), "adam.v", "x", torch.tensor([0.0, -0.0])) is None
    codes = torch.ones(300).to(torch.float8_e4m3fn)
    codes.view(torch.uint8)[299] = 0x7F  # e4m3's NaN (it has no inf)
    assert "holds 1 NaN/inf value(s), the first at element 299" in value_problem(Path("f"), "adam.m", "x", codes)
    assert "negative value(s) (a block scale)" in value_problem(Path("f"), "adam.m", "x.scales", torch.tensor([-1.0]))


def test_header_problems():
    f = Path("ck/adam.m.shard_001_of_002.safetensors")
    want = expected_tensors(CFG, 2, "adam.m", "e4m3")
    found = {k: (d, s) for k, (d, s) in want.items()}
    assert header_problem(f, "adam.m", want, found, "adam.m.shard_001_of_002") is None
    assert "holds the shard written as adam.m.shard_000_of_002.safetensors (files swapped" in header_problem(
        f, "adam.m", want, found, "adam.m.shard_000_of_002")
    assert "has no tensor block.1.scales" in header_problem(f, "adam.m", want, {k: v for k, v in found.items()
                                                                                 if k != "block.1.scales"})
    assert "has unexpected tensor(s) extra" in header_problem(f, "adam.m", want, {**found, "extra": found["embed"]})
    bad_shape = {**found, "norm": (torch.float8_e4m3fn, (3,))}
    assert "tensor norm has shape [3], a shard of adam.m has [64] here" in header_problem(f, "adam.m", want, bad_shape)
    bf16 = {**found, "norm": (torch.bfloat16, found["norm"][1])}
    assert "tensor norm is bfloat16, this run keeps adam.m in float8_e4m3fn" in header_problem(f, "adam.m", want, bf16)
    # a meta that records no dtypes: any dtype the kind can have, but one for all, and e4m3 codes with their scales
    anyd = expected_tensors(CFG, 2, "adam.m", None)
    assert header_problem(f, "adam.m", anyd, found) is None
    fp32 = {k: (torch.float32, s) for k, (d, s) in found.items() if not k.endswith(".scales")}
    assert header_problem(f, "adam.m", anyd, fp32) is None
    assert "only an e4m3 m has them" in header_problem(f, "adam.m", anyd, {**fp32, "embed.scales": found["embed.scales"]})
    assert "mix dtypes" in header_problem(f, "adam.m", anyd, {**fp32, "norm": (torch.bfloat16, fp32["norm"][1])})
