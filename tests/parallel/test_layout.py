"""The flat layout's arithmetic (`parallel/layout.py`) for what the next families need, on hand-written tensor
statements: layers that hold different tensors (a hybrid model), a group of its own within a layer (adapters),
frozen groups, and stacks of identical experts that expert parallelism splits into whole experts. Every offset
below is worked out by hand from the shapes."""
from __future__ import annotations

import pytest
import torch

from qtrain.model.family import TensorSpec
from qtrain.model.llama import LlamaConfig
from qtrain.parallel.layout import ALIGN, FlatLayout

C, F, E, V = 8, 4, 4, 16  # hidden, expert width, experts, vocabulary
CFG = LlamaConfig(model_type="llama", vocab_size=V, hidden_size=C, intermediate_size=F, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True, attention_bias=False)


def spec(name: str, *shape: int, experts: int = 0, group: str = "", decay: bool = True) -> TensorSpec:
    return TensorSpec(name, tuple(shape), ((f"hf.{name}", tuple(shape)),), decay=decay, experts=experts, group=group)


NON_BLOCK = [spec("embed", V, C), spec("norm", C, decay=False)]
MOE = [spec("ln1", C, decay=False), spec("router", E, C), spec("up", E, 2 * F, C, experts=E, group="experts"),
       spec("down", E, C, F, experts=E, group="experts")]
LINEAR_ATTENTION = [spec("ln1", C, decay=False), spec("in_proj", 3 * C, C), spec("out_proj", C, C)]


def test_expert_stacks_and_per_layer_tensors():
    world = 2
    layout = FlatLayout(CFG, world, tensors=(NON_BLOCK, [MOE, LINEAR_ATTENTION]))
    unit = world * ALIGN  # 128
    assert [g.key for g in layout.groups] == ["embed", "norm", "block.0", "block.0.experts", "block.1"]
    assert [g.index for g in layout.groups] == [0, 1, 2, 3, 4]  # RNG keys: the position in the layout
    assert layout.group_of["layers.0.up"].key == "block.0.experts"
    assert [g.key for g in layout.layer_groups(0)] == ["block.0", "block.0.experts"]
    # block.0: ln1 8 + router 32 = 40 -> 128; experts: up 4*8*8 = 256 at 0, down 4*8*4 = 128 at 256 -> 384
    own, experts, lin = layout.by_key["block.0"], layout.by_key["block.0.experts"], layout.block(1)
    assert [(s.short, s.start) for s in own.segments] == [("ln1", 0), ("router", 8)] and own.padded_numel == 128
    assert [(s.short, s.start, s.experts) for s in experts.segments] == [("up", 0, E), ("down", 256, E)]
    assert experts.padded_numel == 384 and experts.content_numel == 384 and experts.experts == E
    assert own.experts == 0 and own.segments[1].decay and not own.segments[0].decay  # router decays, ln1 not
    # block.1 (linear attention): ln1 8 + in_proj 192 + out_proj 64 = 264 -> 384
    assert [(s.short, s.start) for s in lin.segments] == [("ln1", 0), ("in_proj", 8), ("out_proj", 200)]
    assert lin.padded_numel == 3 * unit
    up, down = experts.segments
    assert up.expert_numel == 64 and down.expert_numel == 32
    assert up.expert_span(1) == (64, 128) and down.expert_span(2, 2) == (256 + 64, 256 + 128)
    with pytest.raises(ValueError, match=r"experts \[3, 5\) outside \[0, 4\)"):
        up.expert_span(3, 2)
    # expert parallelism over 2 ranks: rank 1 holds experts 2 and 3 of each stack, back to back
    pieces = experts.expert_pieces(1, 2)
    assert [(p.segment.short, p.tensor_offset, p.shard_offset, p.numel) for p in pieces] == [
        ("up", 128, 0, 128), ("down", 64, 128, 64)]
    assert sum(p.numel for r in range(4) for p in experts.expert_pieces(r, 4)) == experts.content_numel
    with pytest.raises(ValueError, match="4 experts cannot be split evenly over 3 ranks"):
        experts.expert_pieces(0, 3)
    with pytest.raises(ValueError, match="cannot be split"):
        own.expert_pieces(0, 2)  # no stacks
    # views: expert e of a stack is t[e], a contiguous slice of the group buffer
    buffers = {g.key: torch.arange(g.padded_numel, dtype=torch.float32) for g in layout.groups}
    views = layout.views(buffers)
    assert views["layers.0.up"].shape == (E, 2 * F, C)
    assert torch.equal(views["layers.0.down"][2].flatten(), torch.arange(256 + 64, 256 + 96, dtype=torch.float32))


def test_frozen_groups_are_marked_and_checked():
    layout = FlatLayout(CFG, 1, frozen={"embed", "block.0"})
    assert [g.key for g in layout.groups if not g.trainable] == ["embed", "block.0"]
    assert [g.key for g in layout.trainable_groups()] == ["norm", "block.1"]
    assert [g.key for g in layout.trainable_groups(blocks=True)] == ["block.1"]
    assert [g.key for g in layout.trainable_groups(blocks=False)] == ["norm"]
    shards = layout.allocate(dtype=torch.float32, device="cpu", shard=True, groups=layout.trainable_groups())
    assert set(shards) == {"norm", "block.1"}
    with pytest.raises(ValueError, match=r"frozen groups \['block.7'\] are not groups of this model"):
        FlatLayout(CFG, 1, frozen={"block.7"})
    with pytest.raises(ValueError, match="tensor names repeat"):
        FlatLayout(CFG, 1, tensors=(NON_BLOCK, [MOE + [spec("ln1", C)]]))
    with pytest.raises(ValueError, match=r"a stack of 4 experts needs shape \(4, ...\)"):
        spec("up", 2, 3, experts=E)
