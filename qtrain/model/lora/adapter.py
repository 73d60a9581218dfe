"""The adapter term a block adds to its linears: y = W x + (alpha / r) * B (A (dropout(x))), per target, as peft's
`lora.Linear.forward` computes it (result + lora_B(lora_A(dropout(x))) * scaling).

A fused block matrix (the Llama family's qkv = [q; k; v], up = [up; gate]) has its targets' adapters fused too
(`tensors.py`): one GEMM x A^T gives every target's r columns (without dropout; with it, each target draws its own
mask, as peft's one dropout module per target does), each target's B makes its rows of the output, and rows of an
untargeted module get nothing added. The block calls `LoraAdapter(name, x, w, y)` after each linear
(`family.BlockOptions.adapter`); the adapter tensors reach it in the block's weight dict like the base's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from qtrain.model.config import ModelConfig
from qtrain.model.lora.spec import LoraSpec
from qtrain.model.lora.tensors import a_name, adapted, b_name
from qtrain.model.weights import block_shapes


class LoraAdapter:
    """Adds the adapter term to a block linear's output (module docstring). One instance serves every layer (the
    layers of a dense family offer the same targets)."""

    def __init__(self, cfg: ModelConfig, spec: LoraSpec):
        self.spec, self.r, self.scaling, self.dropout = spec, spec.rank, spec.scaling, spec.dropout
        shapes = block_shapes(cfg, 0)
        # matrix -> ([(first row, rows) of each target], the matrix's rows)
        targets = adapted(cfg, spec, 0)
        self.parts = {m: ([(t.row, t.rows) for t in ts], shapes[m][0]) for m, ts in targets.items()}
        self.cols = {m: ts[0].cols for m, ts in targets.items()}

    def covers(self, *matrices: str) -> bool:
        """Whether any of `matrices` has an adapter."""
        return any(m in self.parts for m in matrices)

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.dropout, training=True) if self.dropout else x

    def __call__(self, name: str, x: torch.Tensor, w: dict[str, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
        a = w.get(a_name(name))
        if a is None:
            return y
        b, r, s = w[b_name(name)], self.r, self.scaling
        parts, total = self.parts[name]
        if len(parts) == 1 and parts[0] == (0, total):  # an unfused matrix: peft's expression as it is
            return y + F.linear(F.linear(self._drop(x), a), b) * s
        h = F.linear(x, a) if not self.dropout else None  # (.., t r): every target's A at once
        pieces, pos, brow = [], 0, 0
        for i, (row, rows) in enumerate(parts):
            if row > pos:
                pieces.append(y.new_zeros(*y.shape[:-1], row - pos))
            hi = h[..., i * r:(i + 1) * r] if h is not None else F.linear(self._drop(x), a[i * r:(i + 1) * r])
            pieces.append(F.linear(hi, b[brow:brow + rows]) * s)
            pos, brow = row + rows, brow + rows
        if pos < total:
            pieces.append(y.new_zeros(*y.shape[:-1], total - pos))
        return y + torch.cat(pieces, dim=-1)

    def saved_bytes_per_token(self, dtype_bytes: int) -> int:
        """What the adapters keep for backward per token and layer: each target's A output (r values, B's input;
        the linears' inputs are kept for the base already), and with dropout each target's dropped input and mask."""
        per = sum(len(p) * self.r * dtype_bytes for p, _ in self.parts.values())
        if self.dropout:  # the dropped input (A's input) and the mask (1 byte), per target
            per += sum(len(p) * self.cols[m] * (dtype_bytes + 1) for m, (p, _) in self.parts.items())
        return per
