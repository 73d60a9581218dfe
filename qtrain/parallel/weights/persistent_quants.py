"""Persistent quants for sharded weights (`--persistent-quants` with `--shard-weights` / `--zero-level 3`; llm.q's
quantized shards): this rank's e4m3 copy of its shard of every block matrix, made once per weights version.

With FP8 matmuls every linear would quantize the gathered bf16 matrix again in every forward; instead each
rank keeps an e4m3 copy of *its shard* of every block matrix (`PersistentQuants`), made once per weights
version, lazily at the first block gather after `invalidate()` (so once per optimizer step, reused by every
micro-step and by evaluation). The scale is the FULL tensor's: each rank takes the abs-max of its pieces of
every (layer, matrix), one all-reduce MAX over that small fp32 (L, 4) tensor gives every rank the exact
full-tensor abs-max, and each rank quantizes its pieces with `kernels.fp8_quant.quantize_fp8(piece, amax=...)`,
the helper the linears use on the whole tensor: the codes are bit-identical to quantizing the gathered
tensor (the quantization is element-wise once the scale is fixed). The class also holds the static maps of where a
block's pieces sit in a shard (the same for every layer), which the gathers use: the matrices' codes go as they lie in
the block's flat layout, the small tensors through an exchange buffer (`ShardedWeights`' docstring says how).
"""
from __future__ import annotations

import torch

from qtrain import host_memory
from qtrain.kernels.fp8_quant import E4M3, quantize_fp8
from qtrain.parallel.comm import Communicator
from qtrain.parallel.footprint import Footprint
from qtrain.parallel.layout import FlatLayout, Group

__all__ = ["PersistentQuants"]


_ROW = 4096  # elements: flat pieces are quantized as (rows, _ROW) + a tail, keeping GPU grids small


def _quantize_flat(x: torch.Tensor, amax: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """e4m3 codes of the 1-D `x` (scale from the given abs-max) written into `out` (uint8, same length);
    returns the inverse scale. The quantization is element-wise once the scale is fixed, so the shape only
    matters to the kernel's launch grid: a long piece goes as (rows, _ROW) (a (1, n) grid would exceed CUDA's
    65535 limit on grid y for tens of millions of elements) plus the remainder. An empty `x` still returns
    the scale (a rank that holds no piece of a matrix needs it too)."""
    n = x.numel()
    cut = n - n % _ROW
    inv = None
    if cut:
        q, inv = quantize_fp8(x[:cut].view(-1, _ROW), E4M3, amax)
        out[:cut].copy_(q.view(torch.uint8).view(-1))
    if n > cut or inv is None:
        q, inv = quantize_fp8(x[cut:], E4M3, amax)
        out[cut:].copy_(q.view(torch.uint8))
    return inv


class PersistentQuants:
    """This rank's e4m3 shard of every block matrix, made once per weights version, and the static maps of
    where a block's pieces sit in a shard (the same for every layer: all block groups share one layout).

    `refresh()` is a collective (one all-reduce MAX); `ShardedWeights` calls it at the first block gather of a
    new version, which every rank reaches at the same point of the same pass."""

    def __init__(self, layout: FlatLayout, names: tuple[str, ...], *, rank: int, world: int, dtype: torch.dtype,
                 device: torch.device, offload: bool):
        g = layout.uniform_block()
        shorts = [s.short for s in g.segments]
        unknown = [n for n in names if n not in shorts]
        if unknown:
            raise ValueError(f"persistent quants: {unknown} are not block tensors (block tensors: {shorts})")
        for s in g.segments:
            if s.short in names and (s.start % 16 or len(s.shape) != 2):
                raise ValueError(f"persistent quants: block matrix {s.short!r} {s.shape} starts at element {s.start} "
                                 "of the block buffer; its e4m3 view needs a 2-D tensor at a multiple of 16 "
                                 "(FP8 GEMM alignment)")
        self.names, self.device, self.dtype = names, device, dtype
        self.num_layers = layout.cfg.num_hidden_layers
        self.layout, self.rank, self.world = layout, rank, world
        # own pieces of each matrix: (offset in the shard, numel), or None
        own = {p.segment.short: (p.shard_offset, p.numel) for p in g.shard_pieces(rank, world, names)}
        self.own = [own.get(n) for n in names]
        self._init_small(g, world, rank)
        pin = offload and torch.cuda.is_available()
        where = torch.device("cpu") if offload else device
        self.codes: dict[str, torch.Tensor] = {
            layout.block(l).key: host_memory.zeros(g.shard_size(world), torch.uint8, where, pin=pin)
            for l in range(self.num_layers)}
        # host codes go into the rank's own slice of the gather buffer first (on CPU too: one tested path)
        self.staged = offload
        self.inv_scales: list[list[torch.Tensor]] = []  # [layer][matrix] 0-dim fp32, of `version`
        self.version = -1
        self.quantizations = 0  # (layer, matrix) quantizations done: once per matrix per weights version

    def _init_small(self, g: Group, world: int, rank: int) -> None:
        """The small tensors (everything but `names`), back to back in block order, and how each rank's part of
        them travels: rank r packs its pieces (in shard order) into slot r of the exchange buffer;
        `recv_idx[i]` is where element i of the back-to-back small tensors sits in the gathered exchange."""
        self.small_segments = tuple(s for s in g.segments if s.short not in self.names)
        small = {s.short for s in self.small_segments}
        offsets, n = {}, 0
        for s in self.small_segments:
            offsets[s.short], n = n, n + s.numel
        self.small_offsets = offsets
        self.small_numel, self.slot = self.slot_numel(self.layout, self.names)
        idx = torch.empty(n, dtype=torch.long)
        for r in range(world):
            pos = r * self.slot
            for p in g.shard_pieces(r, world, small):
                start = offsets[p.segment.short] + p.tensor_offset
                idx[start:start + p.numel] = torch.arange(pos, pos + p.numel)
                pos += p.numel
        self.recv_idx = idx.to(self.device)
        self.pack: list[tuple[int, int, int]] = []  # (offset in the shard, offset in the slot, numel)
        pos = 0
        for p in g.shard_pieces(rank, world, small):
            self.pack.append((p.shard_offset, pos, p.numel))
            pos += p.numel

    def _on_device(self, shard: torch.Tensor) -> torch.Tensor:
        """The shard's values where the kernels run (an offloaded master shard: a stream-ordered copy), in the
        compute dtype (an fp32 master shard: rounded as the gathered weights are)."""
        shard = shard if shard.device == self.device else shard.to(self.device, non_blocking=True)
        return shard if shard.dtype == self.dtype else shard.to(self.dtype)

    @torch.no_grad()
    def refresh(self, shards: dict[str, torch.Tensor], version: int, comm: Communicator) -> None:
        """Quantize this rank's pieces of every block matrix with the scale of the full tensor (module doc).
        Two passes over the shards (abs-max, then quantize, the all-reduce between them); with --offload-master
        on a GPU each pass copies one layer's shard to the device at a time (llm.q instead quantizes right
        after the update touched the layer, which would need the optimizer to all-reduce the abs-maxes)."""
        L, M = self.num_layers, len(self.names)
        keys = [self.layout.block(l).key for l in range(L)]
        amax = torch.zeros(L, M, dtype=torch.float32, device=self.device)
        for l, key in enumerate(keys):
            shard = self._on_device(shards[key])
            for i, piece in enumerate(self.own):
                if piece is not None:
                    a, n = piece
                    amax[l, i] = torch.linalg.vector_norm(shard[a:a + n], float("inf"))
        comm.all_reduce(amax, op="max").wait()  # the full tensors' abs-maxes, exact, on every rank
        inv_scales = []
        for l, key in enumerate(keys):
            shard = self._on_device(shards[key])
            codes = self.codes[key]
            out = codes if codes.device == self.device else torch.zeros_like(codes, device=self.device)
            row = []
            for i, piece in enumerate(self.own):
                a, n = piece or (0, 0)  # no piece here: the scale is still needed
                row.append(_quantize_flat(shard[a:a + n], amax[l, i], out[a:a + n]))
            if out is not codes:
                codes.copy_(out, non_blocking=True)
            inv_scales.append(row)
        self.inv_scales, self.version = inv_scales, version
        self.quantizations += L * M

    @staticmethod
    def footprint_of(layout: FlatLayout, names: tuple[str, ...], *, offload: bool) -> Footprint:
        """Bytes: the e4m3 shards (1 per element; host with `offload`) and one fp32 inverse scale per (layer,
        matrix) (made anew with each version, the previous ones freed once no graph refers to them)."""
        L, block = layout.cfg.num_hidden_layers, layout.uniform_block()
        parts = {"quant_shards": L * block.shard_size(layout.world), "quant_scales": 4 * L * len(names)}
        return Footprint(parts, frozenset({"quant_shards"} if offload else ()))

    @staticmethod
    def slot_numel(layout: FlatLayout, names: tuple[str, ...]) -> tuple[int, int]:
        """(elements of the small tensors back to back, elements of one rank's slot of the exchange buffer)."""
        g = layout.uniform_block()
        small = {s.short for s in g.segments if s.short not in names}
        return sum(s.numel for s in g.segments if s.short in small), g.max_shard_numel(layout.world, small)
