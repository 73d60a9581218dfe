"""The adapter term a block adds to its linears: y = W x + (alpha / r) * B (A (dropout(x))), per target, as peft's
`lora.Linear.forward` computes it (result + lora_B(lora_A(dropout(x))) * scaling).

A fused block matrix (the Llama family's qkv = [q; k; v], up = [up; gate]) has its targets' adapters fused too
(`tensors.py`): one GEMM h = x A^T gives every target's r columns (without dropout; with it, each target draws its own
mask, as peft's one dropout module per target does, and has its own A GEMM), and one GEMM adds h Bbd^T, scaled, into the
base output (`torch.addmm`): Bbd is the targets' B block-diagonal (`block_diagonal`: target i's rows of the output from
its r columns of h), zero on the rows of an untargeted module, which get nothing added. So the output is read and
written once, not per target piece, scaled and concatenated (several passes over a (tokens, 3C or 2F) tensor a layer).
Its costs: autograd keeps Bbd (rows x targets r, per layer: `layer_saved_bytes`), and backward computes Bbd's whole
gradient, of which only the diagonal blocks reach B: 2 tokens (targets r) rows FLOPs, against the base GEMM's 2 tokens C
rows, (targets r) / C of it (48 / 3584 = 1.3% of Qwen2.5-7B's qkv, 32 / 3584 of its up). The block calls
`LoraAdapter(name, x, w, y)` after each linear (`family.BlockOptions.adapter`); the adapter tensors reach it in the
block's weight dict like the base's.

Dropout masks come from a counter-based key, not from torch's generator state: target t of layer l in micro-step m
of step s draws its mask from a generator seeded with `kernels.rng.rng_key(seed, DROPOUT_STREAM, s, m, l, t)`. So a
recomputed projection (the recompute switches) draws the mask its forward drew, and a resumed run (--continue) the
masks the uninterrupted run drew. The trainer says where the run is (`at(step, micro)`), the layer is known from the
adapter tensor the block hands over (`bind_layers`; with sharded weights, whose layers share two slots, the
slot's current layer: `bind_holder`), and evaluation runs without dropout (`training`). The
generators are made outside a compiled block's graph (`_drop`: one graph break per adapted matrix with dropout, none
without). Under context parallelism (`context`: this rank holds some positions of each sequence) a rank draws the
mask of the whole sequence and keeps its positions' rows, so each token gets the mask one process draws for it (the
generator cannot skip to a row: the draw costs N times one rank's share, a transient of one process's mask).

An MoE layer's experts (`expert_term`, called by `model/moe.py` on the rows it has grouped by expert): expert e's rows
x_e get s B_e A_e dropout(x_e) added, peft's `ParamWrapper` update W_e + s B_e A_e (tensors.py) applied to the input
instead of the weight, through the grouped GEMM the experts run (`kernels/grouped_gemm.expert_linear`, twice: A then
B). One dropout mask per adapted stack and layer over its (rows, in) input, keyed as a linear's.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from qtrain.kernels.grouped_gemm import expert_linear
from qtrain.kernels.rng import rng_key
from qtrain.model.config import ModelConfig
from qtrain.model.lora.spec import LoraSpec
from qtrain.model.lora.tensors import ExpertTarget, a_name, adapted, adapted_experts, b_name
from qtrain.model.registry import family_of
from qtrain.model.sequence_split import SequenceSplit
from qtrain.model.weights import block_shapes

DROPOUT_STREAM = 0x10DA  # the dropout keys' stream id in rng_key (apart from stochastic rounding's keys)


def block_diagonal(b: torch.Tensor, parts: list[tuple[int, int]], total: int, r: int) -> torch.Tensor:
    """The fused targets' B (rows [B_1; B_2; ...], each (rows_i, r)) as one (total, t r) matrix: B_i in rows
    [row_i, row_i + rows_i) and columns [i r, (i + 1) r), zeros elsewhere (an untargeted module's rows too), so one GEMM
    h B^T (h: every target's r columns) makes every target's rows of the output (module docstring)."""
    n, blocks, pos, brow = len(parts), [], 0, 0
    for i, (row, rows) in enumerate(parts):
        if row > pos:
            blocks.append(b.new_zeros(row - pos, n * r))
        blocks.append(F.pad(b[brow:brow + rows], (i * r, (n - 1 - i) * r)))
        pos, brow = row + rows, brow + rows
    if pos < total:
        blocks.append(b.new_zeros(total - pos, n * r))
    return torch.cat(blocks)


class LoraAdapter:
    """Adds the adapter term to a block linear's output (module docstring). One instance serves every layer (the
    layers of a dense family offer the same targets)."""

    def __init__(self, cfg: ModelConfig, spec: LoraSpec, seed: int = 0, context: SequenceSplit | None = None):
        self.context = context  # --context-parallel: the masks are drawn for whole sequences (module docstring)
        self.spec, self.r, self.scaling, self.dropout, self.seed = spec, spec.rank, spec.scaling, spec.dropout, seed
        self.num_layers = cfg.num_hidden_layers
        # matrix -> ([(first row, rows) of each target], the matrix's rows), over every layer that has the matrix (a
        # hybrid model's layers have different matrices; a matrix's targets are the same wherever it is)
        self.parts: dict[str, tuple[list[tuple[int, int]], int]] = {}
        self.cols: dict[str, int] = {}
        self.target_ids: dict[str, list[int]] = {}  # the dropout key's target index (the place in spec.targets)
        self.layer_matrices: list[list[str]] = []  # the adapted matrices of each layer
        self.layer_steps: list[dict[str, str]] = []  # each layer's adapted matrix -> the block step running it
        self.experts: dict[str, ExpertTarget] = {}  # an MoE layer's adapted expert stacks (the same in every layer)
        self.layer_experts: list[list[str]] = []
        self.top_k = getattr(cfg, "num_experts_per_tok", 0)
        family = family_of(cfg)
        for layer in range(cfg.num_hidden_layers):
            shapes, targets = block_shapes(cfg, layer), adapted(cfg, spec, layer)
            matmuls = family.matmuls(cfg, layer)
            experts = adapted_experts(cfg, spec, layer)
            for m, t in experts.items():
                self.experts[m] = t
                self.target_ids[m] = [spec.targets.index(t.names[0])]
            self.layer_experts.append(list(experts))
            for m, ts in targets.items():
                parts = ([(t.row, t.rows) for t in ts], shapes[m][0])
                if self.parts.setdefault(m, parts) != parts:
                    raise ValueError(f"LoraAdapter: matrix {m!r} has other targets in layer {layer} than before")
                self.cols[m] = ts[0].cols
                self.target_ids[m] = [spec.targets.index(t.name) for t in ts]
            self.layer_matrices.append(list(targets))
            self.layer_steps.append({m: matmuls[m].step for m in (*targets, *experts)})
        self.training = True  # False: no dropout (evaluation)
        self.step = self.micro = 0  # where the run is: the dropout key's (step, micro-step)
        self._layer_of: dict[int, int] = {}  # data_ptr of a layer's first adapter A tensor -> the layer
        self._holder: Callable[[torch.Tensor], int | None] | None = None  # or who says it (`bind_holder`)

    def covers(self, *matrices: str) -> bool:
        """Whether any of `matrices` has an adapter."""
        return any(m in self.parts for m in matrices)

    def at(self, step: int, micro: int) -> None:
        """The run's position: the masks of the next forwards are those of micro-step `micro` of step `step`."""
        self.step, self.micro = step, micro

    def bind_layers(self, blocks: list[dict[str, torch.Tensor]]) -> None:
        """Learn which layer an adapter tensor belongs to (`blocks[l]`: block l's weights as the model gets them);
        only dropout needs it (its key names the layer)."""
        self._layer_of = {w[a_name(m)].data_ptr(): layer for layer, w in enumerate(blocks)
                          for m in (*self.parts, *self.experts) if a_name(m) in w}

    def bind_holder(self, layer_of: Callable[[torch.Tensor], int | None]) -> None:
        """Ask `layer_of(tensor)` which layer an adapter tensor belongs to, at the time it is used: a weight source
        whose layers share memory (sharded weights' rotating slots) knows which layer a slot holds now."""
        self._holder = layer_of

    @property
    def dropping(self) -> bool:
        """Whether the adapters apply dropout now (a rate, and training)."""
        return bool(self.dropout) and self.training

    @torch._disable_dynamo  # torch.compiler.disable, made at the first call: importing torch._dynamo costs ~1.5 s
    def _drop(self, x: torch.Tensor, a: torch.Tensor, matrix: str, targets: int = 1) -> list[torch.Tensor]:
        """x with the dropout of each of the `targets` targets of `matrix` applied, each mask from its counter-based
        key (module docstring). Called only while `dropping`: out of a compiled block's graph (a graph break), so one
        call draws every target's mask of a matrix, and none is made without dropout."""
        layer = self._holder(a) if self._holder is not None else self._layer_of.get(a.data_ptr())
        if layer is None:
            raise RuntimeError("LoraAdapter: dropout needs bind_layers() (which layer an adapter belongs to)")
        out = []
        for i in range(targets):
            key = rng_key(self.seed, DROPOUT_STREAM, self.step, self.micro, layer, self.target_ids[matrix][i])
            gen = torch.Generator(device=x.device).manual_seed(key)
            if self.context is None:
                keep = torch.rand(x.shape, generator=gen, device=x.device) >= self.dropout
            else:  # (.., t, in) of this rank's positions: those rows of the whole (.., t N, in) sequence's mask
                if x.dim() < 3:
                    raise RuntimeError("LoraAdapter: context parallel dropout needs (.., tokens, features) inputs")
                t = x.shape[-2]
                whole = torch.rand(*x.shape[:-2], t * self.context.parts, x.shape[-1], generator=gen, device=x.device)
                keep = whole.index_select(-2, self.context.positions(t, x.device)) >= self.dropout
                del whole  # before the dropped input is made: `context_dropout_bytes` is then the peak here
            out.append(x * keep.to(x.dtype) / (1.0 - self.dropout))
        return out

    def context_dropout_bytes(self, batch: int, seq_len: int, parts: int) -> int:
        """The transient `_drop` makes under --context-parallel `parts` (> 1) with dropout: the fp32 uniforms of the
        whole (batch, seq_len, in) sequence and the fp32 rows of this rank's positions picked from them, at once,
        for the adapted matrix with the widest input (the mask, bool, and the dropped input come after `whole` is
        freed and are smaller). 0 without dropout or context parallelism."""
        if not self.dropout or parts <= 1 or not self.cols:
            return 0
        return batch * max(self.cols.values()) * 4 * (seq_len + seq_len // parts)

    def __call__(self, name: str, x: torch.Tensor, w: dict[str, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
        a = w.get(a_name(name))
        if a is None:
            return y
        b, r = w[b_name(name)], self.r
        parts, total = self.parts[name]
        if self.dropping:  # each target's own mask: one A GEMM per target
            dropped = self._drop(x, a, name, len(parts))
            h = torch.cat([F.linear(xi, a[i * r:(i + 1) * r]) for i, xi in enumerate(dropped)], -1)
        else:
            h = F.linear(x, a)  # (.., t r): every target's A at once
        bd = b if parts == [(0, total)] else block_diagonal(b, parts, total, r)
        out = torch.addmm(y.reshape(-1, total), h.reshape(-1, h.shape[-1]), bd.t(), alpha=self.scaling)
        return out.view(y.shape)

    def experts_of(self, w: dict[str, torch.Tensor]):
        """`model.moe.ExpertAdapter` of the block whose weights are `w`: `expert_term` over them, or None when the
        block has no expert adapter."""
        if not any(a_name(m) in w for m in self.experts):
            return None
        return lambda matrix, x, offsets: self.expert_term(matrix, x, w, offsets)

    def expert_term(self, matrix: str, x: torch.Tensor, w: dict[str, torch.Tensor], offsets: torch.Tensor
                    ) -> torch.Tensor | None:
        """The adapter term of expert stack `matrix` for rows x (M, in) grouped by expert (`offsets`, the grouped
        GEMM's int32 row ends): s B_e A_e dropout(x_e) per expert e, (M, out) in qtrain's row order; None when the
        stack has no adapter (module docstring)."""
        a = w.get(a_name(matrix))
        if a is None:
            return None
        t = self.experts[matrix]
        E, r = t.experts, t.rank(self.r)
        b = w[b_name(matrix)].view(t.rows, r, E).permute(2, 0, 1)  # (E, out, r'): B_e, the adapter's expert-minor cols
        if t.swapped:  # B's rows are transformers' [gate; up], the stack's [up; gate]
            half = t.rows // 2
            b = torch.cat([b[:, half:], b[:, :half]], dim=1)
        h = expert_linear(self._drop(x, a, matrix)[0] if self.dropping else x, a.view(E, r, t.cols), offsets)
        return expert_linear(h, b.contiguous(), offsets) * self.scaling

    def saved_bytes_per_token(self, dtype_bytes: int, steps: frozenset[str] = frozenset()) -> float:
        """What the adapters keep for backward per token, averaged over the layers: each target's A output (r values,
        B's input), and with dropout each target's dropped input and mask (in the model dtype). The input of A itself
        (without dropout) is the base linear's input: the block's statements count it (`ActivationSettings`'
        `adapter_inputs`). `steps`: the block steps recomputed in backward (`recompute.block_steps`); an adapter of
        a matrix inside one (the family's `MatmulSpec.step`) is rerun with it, so it keeps nothing."""
        total = sum(self.layer_saved_bytes_per_token(layer, dtype_bytes, steps) for layer in range(self.num_layers))
        return total / max(self.num_layers, 1)

    def saved_bytes_per_layer(self, dtype_bytes: int, steps: frozenset[str] = frozenset()) -> float:
        """What the adapters keep for backward whatever the tokens, averaged over the layers (`layer_saved_bytes`)."""
        total = sum(self.layer_saved_bytes(layer, dtype_bytes, steps) for layer in range(self.num_layers))
        return total / max(self.num_layers, 1)

    def layer_saved_bytes(self, layer: int, dtype_bytes: int, steps: frozenset[str] = frozenset()) -> int:
        """What layer `layer`'s adapters keep for backward whatever the tokens, unless a recomputed step runs them:
        each fused matrix's block-diagonal B (rows x targets r, `block_diagonal`: the GEMM's second operand, a
        tensor of its own; an unfused matrix's B is the adapter tensor itself), each adapted expert stack's B in
        expert-major order (E, out, r'), the copy its grouped GEMM reads (`expert_term`)."""
        step_of, total = self.layer_steps[layer], 0
        for m in (m for m in self.layer_matrices[layer] if step_of[m] not in steps):
            parts, rows = self.parts[m]
            total += 0 if parts == [(0, rows)] else rows * len(parts) * self.r * dtype_bytes
        for t in (self.experts[m] for m in self.layer_experts[layer] if step_of[m] not in steps):
            total += t.experts * t.rows * t.rank(self.r) * dtype_bytes
        return total

    def layer_saved_bytes_per_token(self, layer: int, dtype_bytes: int, steps: frozenset[str] = frozenset()) -> int:
        """`saved_bytes_per_token` of layer `layer` alone."""
        total, step_of = 0, self.layer_steps[layer]
        for m in (m for m in self.layer_matrices[layer] if step_of[m] not in steps):
            n = len(self.parts[m][0])
            total += n * self.r * dtype_bytes + (n * self.cols[m] * 2 * dtype_bytes if self.dropout else 0)
        for t in (self.experts[m] for m in self.layer_experts[layer] if step_of[m] not in steps):  # k expert rows
            total += self.top_k * (t.rank(self.r) + (t.cols * 2 if self.dropout else 0)) * dtype_bytes
        return total
