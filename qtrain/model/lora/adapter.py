"""The adapter term a block adds to its linears: y = W x + (alpha / r) * B (A (dropout(x))), per target, as peft's
`lora.Linear.forward` computes it (result + lora_B(lora_A(dropout(x))) * scaling).

A fused block matrix (the Llama family's qkv = [q; k; v], up = [up; gate]) has its targets' adapters fused too
(`tensors.py`): one GEMM x A^T gives every target's r columns (without dropout; with it, each target draws its own
mask, as peft's one dropout module per target does), each target's B makes its rows of the output, and rows of an
untargeted module get nothing added. The block calls `LoraAdapter(name, x, w, y)` after each linear
(`family.BlockOptions.adapter`); the adapter tensors reach it in the block's weight dict like the base's.

Dropout masks come from a counter-based key, not from torch's generator state: target t of layer l in micro-step m
of step s draws its mask from a generator seeded with `kernels.rng.rng_key(seed, DROPOUT_STREAM, s, m, l, t)`. So a
recomputed projection (the recompute switches) draws the mask its forward drew, and a resumed run (--continue) the
masks the uninterrupted run drew. The trainer says where the run is (`at(step, micro)`), the layer is known from the
adapter tensor the block hands over (`bind_layers`), and evaluation runs without dropout (`training`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from qtrain.kernels.rng import rng_key
from qtrain.model.config import ModelConfig
from qtrain.model.lora.spec import LoraSpec
from qtrain.model.lora.tensors import a_name, adapted, b_name
from qtrain.model.registry import family_of
from qtrain.model.weights import block_shapes

DROPOUT_STREAM = 0x10DA  # the dropout keys' stream id in rng_key (apart from stochastic rounding's keys)


class LoraAdapter:
    """Adds the adapter term to a block linear's output (module docstring). One instance serves every layer (the
    layers of a dense family offer the same targets)."""

    def __init__(self, cfg: ModelConfig, spec: LoraSpec, seed: int = 0):
        self.spec, self.r, self.scaling, self.dropout, self.seed = spec, spec.rank, spec.scaling, spec.dropout, seed
        self.num_layers = cfg.num_hidden_layers
        # matrix -> ([(first row, rows) of each target], the matrix's rows), over every layer that has the matrix (a
        # hybrid model's layers have different matrices; a matrix's targets are the same wherever it is)
        self.parts: dict[str, tuple[list[tuple[int, int]], int]] = {}
        self.cols: dict[str, int] = {}
        self.target_ids: dict[str, list[int]] = {}  # the dropout key's target index (the place in spec.targets)
        self.layer_matrices: list[list[str]] = []  # the adapted matrices of each layer
        self.layer_steps: list[dict[str, str]] = []  # each layer's adapted matrix -> the block step running it
        family = family_of(cfg)
        for layer in range(cfg.num_hidden_layers):
            shapes, targets = block_shapes(cfg, layer), adapted(cfg, spec, layer)
            matmuls = family.matmuls(cfg, layer)
            for m, ts in targets.items():
                parts = ([(t.row, t.rows) for t in ts], shapes[m][0])
                if self.parts.setdefault(m, parts) != parts:
                    raise ValueError(f"LoraAdapter: matrix {m!r} has other targets in layer {layer} than before")
                self.cols[m] = ts[0].cols
                self.target_ids[m] = [spec.targets.index(t.name) for t in ts]
            self.layer_matrices.append(list(targets))
            self.layer_steps.append({m: matmuls[m].step for m in targets})
        self.training = True  # False: no dropout (evaluation)
        self.step = self.micro = 0  # where the run is: the dropout key's (step, micro-step)
        self._layer_of: dict[int, int] = {}  # data_ptr of a layer's first adapter A tensor -> the layer

    def covers(self, *matrices: str) -> bool:
        """Whether any of `matrices` has an adapter."""
        return any(m in self.parts for m in matrices)

    def at(self, step: int, micro: int) -> None:
        """The run's position: the masks of the next forwards are those of micro-step `micro` of step `step`."""
        self.step, self.micro = step, micro

    def bind_layers(self, blocks: list[dict[str, torch.Tensor]]) -> None:
        """Learn which layer an adapter tensor belongs to (`blocks[l]`: block l's weights as the model gets them);
        only dropout needs it (its key names the layer)."""
        self._layer_of = {w[a_name(m)].data_ptr(): layer for layer, w in enumerate(blocks) for m in self.parts
                          if a_name(m) in w}

    @torch.compiler.disable
    def _drop(self, x: torch.Tensor, a: torch.Tensor, matrix: str, i: int) -> torch.Tensor:
        """x with target i of `matrix`'s dropout applied (its mask from the counter-based key: module docstring)."""
        if not self.dropout or not self.training:
            return x
        layer = self._layer_of.get(a.data_ptr())
        if layer is None:
            raise RuntimeError("LoraAdapter: dropout needs bind_layers() (which layer an adapter belongs to)")
        key = rng_key(self.seed, DROPOUT_STREAM, self.step, self.micro, layer, self.target_ids[matrix][i])
        gen = torch.Generator(device=x.device).manual_seed(key)
        keep = torch.rand(x.shape, generator=gen, device=x.device) >= self.dropout
        return x * keep.to(x.dtype) / (1.0 - self.dropout)

    def __call__(self, name: str, x: torch.Tensor, w: dict[str, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
        a = w.get(a_name(name))
        if a is None:
            return y
        b, r, s = w[b_name(name)], self.r, self.scaling
        parts, total = self.parts[name]
        if len(parts) == 1 and parts[0] == (0, total):  # an unfused matrix: peft's expression as it is
            return y + F.linear(F.linear(self._drop(x, a, name, 0), a), b) * s
        h = F.linear(x, a) if not self.dropout else None  # (.., t r): every target's A at once
        pieces, pos, brow = [], 0, 0
        for i, (row, rows) in enumerate(parts):
            if row > pos:
                pieces.append(y.new_zeros(*y.shape[:-1], row - pos))
            hi = h[..., i * r:(i + 1) * r] if h is not None else F.linear(self._drop(x, a, name, i),
                                                                          a[i * r:(i + 1) * r])
            pieces.append(F.linear(hi, b[brow:brow + rows]) * s)
            pos, brow = row + rows, brow + rows
        if pos < total:
            pieces.append(y.new_zeros(*y.shape[:-1], total - pos))
        return y + torch.cat(pieces, dim=-1)

    def saved_bytes_per_token(self, dtype_bytes: int, steps: frozenset[str] = frozenset()) -> float:
        """What the adapters keep for backward per token, averaged over the layers: each target's A output (r values,
        B's input), and with dropout each target's dropped input and mask (in the model dtype). The input of A itself
        (without dropout) is the base linear's input: the block's statements count it (`ActivationSettings`'
        `adapter_inputs`). `steps`: the block steps recomputed in backward (`recompute.block_steps`); an adapter of
        a matrix inside one (the family's `MatmulSpec.step`) is rerun with it, so it keeps nothing."""
        total = sum(self.layer_saved_bytes_per_token(layer, dtype_bytes, steps) for layer in range(self.num_layers))
        return total / max(self.num_layers, 1)

    def layer_saved_bytes_per_token(self, layer: int, dtype_bytes: int, steps: frozenset[str] = frozenset()) -> int:
        """`saved_bytes_per_token` of layer `layer` alone."""
        total, step_of = 0, self.layer_steps[layer]
        for m in (m for m in self.layer_matrices[layer] if step_of[m] not in steps):
            n = len(self.parts[m][0])
            total += n * self.r * dtype_bytes + (n * self.cols[m] * 2 * dtype_bytes if self.dropout else 0)
        return total
