"""A LoRA run's frozen base held only as e4m3 (`--lora-base-dtype e4m3`): each block matrix of the base is kept as
its e4m3 codes (float8_e4m3fn, its own shape) and one fp32 inverse scale (per-tensor current scaling, as every FP8
copy in qtrain: `kernels.fp8_quant.quantize_fp8`); nothing else of it stays, on the device or on the host.

What stays in the model dtype: the non-block tensors (embedding, final norm, LM head), a block's small tensors (norm
gains, biases) and the adapters (the trainable groups, in flat buffers as `ParamWeights` keeps them, which the
optimizer updates in place; the frozen block groups have no buffer at all).

Loading streams the HF checkpoint one internal tensor at a time (`hf_io.stream_hf_weights`): a block matrix is read
in fp32, quantized on the device and dropped before the next is read; from scratch each block is initialised in a
temporary buffer (keyed by tensor name, as `init.init_params` always is) and quantized. `block(l)` hands a matrix's
codes under its own name and as its FP8 copy (`FP8_WEIGHT` / `FP8_INV_SCALE`), which the block's linear for this
base reads (`numerics.frozen_e4m3.frozen_e4m3_linear`: the Transformer uses it with `RunOptions.frozen_e4m3`).

Offloaded (`offload`, `--offload-quants`): each layer's codes live back to back in one pinned host buffer (each matrix
at a multiple of 16 bytes, as an FP8 GEMM operand needs), and the device holds two slots of the largest layer's: layer
l is copied into slot l % 2 when it is asked for, the layer after it in the pass's direction (`LayerWalk`) into the
other slot meanwhile. On CUDA the copies run on a stream of their own: a copy into a slot waits for the compute queued
before the slot's last `release_block`, and the compute waits for the copy at `block`. The run recomputes every block
(`--recompute-block`, which the options require): a block's backward then uses the codes its re-run forward just read,
never a slot that a later layer has overwritten. A 72B base is then ~70 GB of host memory and two layers' ~1.7 GB of
device memory.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from qtrain.kernels.fp8_quant import E4M3, quantize_fp8
from qtrain.model.config import ModelConfig
from qtrain.model.hf_io import stream_hf_weights
from qtrain.model.init import init_params
from qtrain.model.registry import family_of
from qtrain.model.weight_source import FP8_INV_SCALE, FP8_WEIGHT
from qtrain.model.weights import block_shapes, split_name, tensor_specs
from qtrain.numerics.frozen_e4m3 import dequantize
from qtrain import host_memory
from qtrain.parallel.footprint import Footprint
from qtrain.parallel.layout import FlatLayout
from qtrain.parallel.weights.layer_walk import LayerWalk
from qtrain.parallel.weights.replicated import ParamWeights

CODE_ALIGN = 16  # bytes: where each matrix's codes start in an offloaded layer's buffer (FP8 GEMM operand alignment)


def base_matrices(cfg: ModelConfig, layer: int) -> tuple[str, ...]:
    """The block matrices of `layer` held as e4m3: the family's FP8 linears' matrices (the dense Llama family's qkv,
    o, up, down: every 2-D tensor of its block)."""
    shapes = block_shapes(cfg, layer)
    return tuple(n for n in family_of(cfg).fp8_matrices if n in shapes)


class E4m3BaseWeights(ParamWeights):
    """A WeightSource over the e4m3 base and the model-dtype rest (module docstring). `params`: the tensors kept in
    the model dtype (non-block, small block tensors, adapters), views into `buffers` (trainable and non-block groups);
    `codes[l][m]`, `inv_scales[l][m]`: block matrix m of layer l."""

    def __init__(self, layout: FlatLayout, *, dtype: torch.dtype, device: torch.device, offload: bool = False):
        cfg = layout.cfg
        self.layout, self.dtype, self.device, self.offload = layout, dtype, device, offload
        dense = [g for g in layout.groups if g.trainable or g.layer is None]
        self.buffers = layout.allocate(dtype=dtype, device=device, groups=dense)
        params = {s.name: self.buffers[g.key][s.start:s.start + s.numel].view(s.shape).requires_grad_(g.trainable)
                  for g in dense for s in g.segments}
        self.matrices = [base_matrices(cfg, layer) for layer in range(cfg.num_hidden_layers)]
        for layer in range(cfg.num_hidden_layers):  # a frozen block's small tensors, each its own model-dtype tensor
            for s in layout.block(layer).segments:
                if s.short not in self.matrices[layer]:
                    params[s.name] = torch.zeros(s.shape, dtype=dtype, device=device)
        super().__init__(cfg, params)
        self.codes: list[dict[str, torch.Tensor]] = [{} for _ in range(cfg.num_hidden_layers)]
        self.inv_scales: list[dict[str, torch.Tensor]] = [{} for _ in range(cfg.num_hidden_layers)]
        if offload:
            self._offload_setup(layout)

    def _offload_setup(self, layout: FlatLayout) -> None:
        """Pinned host buffers of each layer's codes (`codes` are views into them), two device slots, each layer's
        views into its slot, the copy stream and the slots' state (module docstring)."""
        L, cuda = layout.cfg.num_hidden_layers, self.device.type == "cuda"
        places, sizes = self.code_places(layout)
        self._host = [host_memory.zeros(n, torch.uint8, "cpu", pin=cuda) for n in sizes]
        self.codes = [{n: self._host[l][a:a + math.prod(shape)].view(E4M3).view(shape)
                       for n, (a, shape) in places[l].items()} for l in range(L)]
        slots = [torch.zeros(max(sizes, default=0), dtype=torch.uint8, device=self.device) for _ in range(min(2, L))]
        self._slots, self._sizes = slots, sizes
        self._slot_codes = [{n: slots[l % len(slots)][a:a + math.prod(shape)].view(E4M3).view(shape)
                             for n, (a, shape) in places[l].items()} for l in range(L)]
        self._holds: list[int | None] = [None] * len(slots)
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        if self._stream is not None:  # the slots' zero fill (queued on the current stream) before any copy into them
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        self._ready: list[torch.cuda.Event | None] = [None] * len(slots)
        self._freed: list[torch.cuda.Event | None] = [None] * len(slots)
        self._walk = LayerWalk(L)
        self.fetches = 0  # host -> device layer copies issued

    @staticmethod
    def code_places(layout: FlatLayout) -> tuple[list[dict[str, tuple[int, tuple[int, ...]]]], list[int]]:
        """Per layer, where each base matrix's codes sit in its offloaded buffer (byte offset, shape), and each
        layer's buffer size in bytes."""
        places, sizes = [], []
        for layer in range(layout.cfg.num_hidden_layers):
            names, at, off = base_matrices(layout.cfg, layer), {}, 0
            for s in layout.block(layer).segments:
                if s.short in names:
                    at[s.short], off = (off, tuple(s.shape)), off + -(-s.numel // CODE_ALIGN) * CODE_ALIGN
            places.append(at)
            sizes.append(off)
        return places, sizes

    def block(self, layer: int) -> dict[str, torch.Tensor]:
        out = {n: self.params[f"layers.{layer}.{n}"] for n in self._block_names[layer]
               if n not in self.matrices[layer]}
        codes = self.codes[layer] if not self.offload else self._fetched(layer)
        for n in self.matrices[layer]:
            q = codes[n]
            out[n], out[FP8_WEIGHT.format(n)], out[FP8_INV_SCALE.format(n)] = q, q, self.inv_scales[layer][n]
        return out

    def release_block(self, layer: int) -> None:
        """Offloaded: the slot of `layer` may be refilled once the compute queued so far is done."""
        if self.offload and self._stream is not None:
            s = layer % len(self._slots)
            self._freed[s] = torch.cuda.current_stream(self.device).record_event()

    def _fetched(self, layer: int) -> dict[str, torch.Tensor]:
        """Layer `layer`'s codes in its device slot (copied unless there already), with the next layer of the pass
        on its way into the other slot; the compute stream waits for the copy."""
        nxt = self._walk.step(layer)
        self._fetch(layer)
        if nxt is not None and nxt % len(self._slots) != layer % len(self._slots):
            self._fetch(nxt)
        ready = self._ready[layer % len(self._slots)]
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
        return self._slot_codes[layer]

    def _fetch(self, layer: int) -> None:
        s = layer % len(self._slots)
        if self._holds[s] == layer:
            return
        n, slot = self._sizes[layer], self._slots[s]
        if self._stream is None:  # the CPU: a copy, in order
            slot[:n].copy_(self._host[layer])
        else:
            with torch.cuda.stream(self._stream):
                if self._freed[s] is not None:
                    self._stream.wait_event(self._freed[s])  # the slot's last reader is done
                slot[:n].copy_(self._host[layer], non_blocking=True)
                self._ready[s] = self._stream.record_event()
        self._holds[s] = layer
        self.fetches += 1

    @torch.no_grad()
    def set_tensor(self, name: str, value: torch.Tensor) -> None:
        """Hold internal tensor `name` of the base: a block matrix as e4m3 codes and scale, else copied in place."""
        layer, short = split_name(name)
        if layer is not None and short in self.matrices[layer]:
            q, inv = quantize_fp8(value.to(self.device, torch.float32), E4M3)
            if self.offload:
                self.codes[layer][short].copy_(q)
            else:
                self.codes[layer][short] = q
            self.inv_scales[layer][short] = inv
        else:
            self.params[name].copy_(value)

    def dequantized(self, layer: int, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Block matrix `name` of `layer` as the codes stand for it (`frozen_e4m3.dequantize`), for tests."""
        scale = self.inv_scales[layer][name]
        return dequantize(self.codes[layer][name].to(scale.device), scale, dtype)  # offloaded codes: on the host

    @classmethod
    def footprint_of(cls, layout: FlatLayout, dtype: torch.dtype, *, offload: bool = False) -> Footprint:
        """Bytes: the trainable and non-block groups and the blocks' small tensors in `dtype`, the base's block
        matrices at 1 byte per element plus a 4-byte scale each; offloaded, the codes (each matrix at a multiple of
        16 bytes) in host memory and two device slots of the largest layer's."""
        cfg = layout.cfg
        dense = sum(g.padded_numel for g in layout.groups if g.trainable or g.layer is None)
        codes = scales = small = 0
        for layer in range(cfg.num_hidden_layers):
            names = base_matrices(cfg, layer)
            for s in layout.block(layer).segments:
                if s.short in names:
                    codes, scales = codes + s.numel, scales + 4
                else:
                    small += s.numel
        parts = {"params": (dense + small) * dtype.itemsize, "base_codes": codes, "base_scales": scales}
        if not offload:
            return Footprint(parts)
        sizes = cls.code_places(layout)[1]
        parts.update(base_codes=sum(sizes), base_slots=min(2, cfg.num_hidden_layers) * max(sizes, default=0))
        return Footprint(parts, frozenset({"base_codes"}))


@torch.no_grad()
def build_e4m3_base(layout: FlatLayout, *, dtype: torch.dtype, device: torch.device, weights_dir: str | None,
                    seed: int, init_proj_to_zero: bool,
                    adapters: Callable[[dict[str, torch.Tensor]], None], offload: bool = False) -> E4m3BaseWeights:
    """The source, filled: the base from `weights_dir` (streamed) or the from-scratch init, the adapters by
    `adapters` (given their views by internal name); `offload`: the codes in host memory."""
    source = E4m3BaseWeights(layout, dtype=dtype, device=device, offload=offload)
    own = tensor_specs(layout.cfg)
    adapters({s.name: source.params[s.name] for g in layout.trainable_groups() for s in g.segments
              if s.name not in own})
    if weights_dir is not None:
        for name, t in stream_hf_weights(weights_dir, layout.cfg, dtype=torch.float32, device="cpu"):
            source.set_tensor(name, t)
            del t
        return source
    for g in layout.groups:  # from scratch: a group at a time, in fp32 (what build_weights' master would hold)
        if g.trainable:
            continue
        views = {s.name: torch.empty(s.shape, dtype=torch.float32, device=device) for s in g.segments}
        init_params(layout.cfg, views, seed=seed, init_proj_to_zero=init_proj_to_zero)
        for name, t in views.items():
            source.set_tensor(name, t)
        del views
    return source

