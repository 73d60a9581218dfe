"""FP8 weight copies made once per optimizer step and reused by every micro-step (and evaluation) until the
weights change: a weight source that wraps the replicated one.

Per-tensor current scaling of a weight depends only on the weight, which changes only at the update, so
with gradient accumulation over G micro-steps quantizing it in every forward repeats the same work G times.
`QuantizedWeights.block(l)` adds the e4m3 copy, its inverse scale and its transpose for each block matrix (the
entries named by `model.weight_source.FP8_WEIGHT` / `FP8_INV_SCALE` / `FP8_WEIGHT_T`), from a
`numerics.fp8.Fp8WeightCache`; the block hands them to its linears. The transpose is the input-gradient GEMM's
operand (cuBLASLt multiplies only row-major by column-major): cached, the backward stops re-making it every
micro-step (at Qwen2.5-7B, 6.5 GB read and written per micro-step). The trainer calls `invalidate()` after
every update and load (the AdamW kernel and the all-gather write the weights without bumping their version
counters, which the cache also checks).

Memory: the copies of all layers stay alive from the first forward until the next update, 2 bytes per block
parameter (the copy and its transpose; 1 byte before the transposes were cached), and that shows at the peak:
measured on the H200 at Qwen2.5-1.5B (batch 16 x 2, copies only), 42.38 GiB against 41.14 GiB without
(+1.24 GiB, one full set), for no measurable speed change there (e4m3 / bf16 in one call 1.217x, 1.216x
before); at Qwen2.5-14B a set is ~13 GB, enough to turn a fitting run into an out-of-memory one. So the
trainer uses it only when asked, with `--persistent-quants` (llm.q's name for keeping the FP8 weights across
micro-steps). This module is the replicated-weights half: sharded weights reuse two gather buffers for all
layers, and their FP8 copies are `--persistent-quants`' job (`parallel.weights.ShardedWeights(
quantized=...)`: each rank keeps an e4m3 copy of its shard of these matrices, made once per step with the full
tensor's scale, and the blocks gather those instead of the bf16 matrices). Which matrices: the caller's list,
of the family's `fp8_matrices` (those the FP8 policy puts in FP8).
"""
from __future__ import annotations

import torch

from qtrain.model.config import ModelConfig
from qtrain.model.weight_source import FP8_INV_SCALE, FP8_WEIGHT, FP8_WEIGHT_T, WeightSource
from qtrain.model.weights import block_shapes
from qtrain.numerics.fp8 import Fp8WeightCache
from qtrain.parallel.footprint import Footprint


class QuantizedWeights:
    """A WeightSource: `source`'s weights plus cached e4m3 copies of the block matrices (module docstring)."""

    def __init__(self, source: WeightSource, names: tuple[str, ...]):
        self.source, self.names = source, names
        self.cache = Fp8WeightCache()

    def block(self, layer: int) -> dict[str, torch.Tensor]:
        w = self.source.block(layer)
        out = dict(w)
        for n in (n for n in self.names if n in w):  # a layer may lack some of them (a hybrid model's)
            q, inv, qt = self.cache.get_with_transpose(w[n])
            out[FP8_WEIGHT.format(n)], out[FP8_INV_SCALE.format(n)], out[FP8_WEIGHT_T.format(n)] = q, inv, qt
        return out

    def non_block(self) -> dict[str, torch.Tensor]:
        return self.source.non_block()

    def release_block(self, layer: int) -> None:
        self.source.release_block(layer)

    def invalidate(self) -> None:
        self.cache.clear()
        self.source.invalidate()

    @staticmethod
    def footprint_of(cfg: ModelConfig, names: tuple[str, ...]) -> Footprint:
        """Bytes of the copies at their peak (from a step's first forward to its update): every layer's e4m3
        matrices `names` and their transposes (1 byte per element each) and one fp32 inverse scale each. The
        linears keep views of them for backward, not copies (`model.activations`: `fp8_weight_copies=False`)."""
        shapes = [block_shapes(cfg, layer) for layer in range(cfg.num_hidden_layers)]
        numel = sum(s[n][0] * s[n][1] for s in shapes for n in names if n in s)
        count = sum(n in s for s in shapes for n in names)
        return Footprint({"quant_copies": numel, "quant_transposes": numel, "quant_scales": 4 * count})
