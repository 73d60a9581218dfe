"""Parameter names, shapes and the Hugging Face name mapping of a whole model, from its family's tensor statements.

qtrain keeps a model's parameters in one flat `dict[str, Tensor]` with short internal names: the non-block
tensors by their own names ('embed', 'norm', 'lm_head') and block l's as 'layers.{l}.{short}' (the family's
`TensorSpec.name`, e.g. 'layers.3.qkv'). Each tensor is its HF tensors' elements back to back (a fused tensor
concatenates several, `TensorSpec.hf`; its rows permuted first where `TensorSpec.hf_rows` says so), so `to_hf` /
`from_hf` need no per-family code: they are the only places that move between the two layouts (a model's tensors
through `internal_to_hf` / `hf_to_internal`, LoRA's adapters through lora/peft_io.py and lora/init.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import torch

from qtrain.model.config import ModelConfig
from qtrain.model.family import HfLayout, TensorSpec
from qtrain.model.registry import family_of


def block_tensors(cfg: ModelConfig, layer: int = 0) -> tuple[TensorSpec, ...]:
    """Block `layer`'s tensor statements (its family's)."""
    return statements(cfg).blocks[layer]


def block_tensor_names(cfg: ModelConfig, layer: int = 0) -> list[str]:
    """Short names of block `layer`'s tensors, in the fixed order used for buffers and RNG keys."""
    return [s.name for s in block_tensors(cfg, layer)]


def non_block_names(cfg: ModelConfig) -> list[str]:
    return [s.name for s in statements(cfg).non_block]


def block_shapes(cfg: ModelConfig, layer: int = 0) -> dict[str, tuple[int, ...]]:
    return {s.name: s.shape for s in block_tensors(cfg, layer)}


@dataclass(frozen=True)
class Statements:
    """A model's tensors as its family states them: the non-block ones, each layer's, and the layers grouped by
    kind (layers holding the same tensors, names and shapes: their statements about a block agree)."""
    non_block: tuple[TensorSpec, ...]
    blocks: tuple[tuple[TensorSpec, ...], ...]
    kinds: tuple[tuple[int, ...], ...]  # layer indices of each kind, first layer first


def statements(cfg: ModelConfig) -> Statements:
    """`cfg`'s tensor statements (asked once per config: plans and layouts ask often)."""
    key = repr(cfg)  # configs are mutable dataclasses (no hash); their repr names the class and every field
    if key not in _STATEMENTS:
        family = family_of(cfg)
        blocks = tuple(family.block_tensors(cfg, i) for i in range(cfg.num_hidden_layers))
        kinds: dict[tuple, list[int]] = {}
        for i, specs in enumerate(blocks):
            kinds.setdefault(tuple((s.name, s.shape) for s in specs), []).append(i)
        if len(_STATEMENTS) >= 16:
            _STATEMENTS.pop(next(iter(_STATEMENTS)))
        _STATEMENTS[key] = Statements(tuple(family.non_block_tensors(cfg)), blocks,
                                      tuple(tuple(v) for v in kinds.values()))
    return _STATEMENTS[key]


_STATEMENTS: dict[str, Statements] = {}  # a few recent configs'


def sum_over_layers(cfg: ModelConfig, f: Callable[[int], float]) -> float:
    """The sum of f(layer) over the layers, f asked once per kind of layer (`Statements.kinds`): for per-layer
    statements of a family (FLOPs, bytes), which agree for layers that hold the same tensors."""
    return sum(len(layers) * f(layers[0]) for layers in statements(cfg).kinds)


def tensor_specs(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Every internal parameter name -> its statement, in canonical order (non-block first, then blocks)."""
    st = statements(cfg)
    specs = {s.name: s for s in st.non_block}
    for i, block in enumerate(st.blocks):
        specs.update((f"layers.{i}.{s.name}", s) for s in block)
    return specs


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every internal parameter name -> shape, in canonical order (non-block first, then blocks)."""
    return {n: s.shape for n, s in tensor_specs(cfg).items()}


def num_params(cfg: ModelConfig, *, include_embedding: bool = True) -> int:
    """Parameters of the model, tied ones once; without the embedding the untied LM head still counts (it is a real
    matmul)."""
    st = statements(cfg)
    blocks = sum(math.prod(s.shape) for block in st.blocks for s in block)
    return blocks + sum(math.prod(s.shape) for s in st.non_block if include_embedding or s.name != "embed")


def split_name(name: str) -> tuple[int | None, str]:
    """'layers.3.qkv' -> (3, 'qkv'); 'embed' -> (None, 'embed')."""
    if name.startswith("layers."):
        _, i, short = name.split(".", 2)
        return int(i), short
    return None, name


def is_decayed(cfg: ModelConfig, name: str) -> bool:
    """Whether AdamW decays parameter `name` (its family's statement: matrices and embeddings yes, gains no)."""
    return tensor_specs(cfg)[name].decay


def hf_parts(cfg: ModelConfig, name: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The HF tensors (name, shape) whose elements, back to back, make up internal tensor `name`."""
    return tensor_specs(cfg)[name].hf


def hf_names(cfg: ModelConfig) -> Iterator[str]:
    """All HF tensor names this config expects in a checkpoint."""
    for spec in tensor_specs(cfg).values():
        for hf, _ in spec.hf:
            yield hf


def _rows_to_hf(t: torch.Tensor, runs: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """t's rows in the checkpoint's order (`TensorSpec.hf_rows`): a copy."""
    return torch.cat([t[start:start + count] for start, count in runs])


def _rows_from_hf(t: torch.Tensor, runs: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """The inverse of `_rows_to_hf`."""
    out, at = torch.empty_like(t), 0
    for start, count in runs:
        out[start:start + count] = t[at:at + count]
        at += count
    return out


def to_hf(spec: TensorSpec, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """Tensor `t` of statement `spec` as its HF tensors (`TensorSpec.hf`): views, no copies, but of a tensor whose
    rows the checkpoint orders otherwise (`TensorSpec.hf_rows`). A model's tensors and LoRA's adapters alike."""
    if spec.hf_rows:
        t = _rows_to_hf(t, spec.hf_rows)
    if len(spec.hf) == 1:
        return {spec.hf[0][0]: t}
    out, flat, start = {}, t.reshape(-1), 0
    for hf, shape in spec.hf:
        n = math.prod(shape)
        out[hf] = flat[start:start + n].view(shape)
        start += n
    return out


def from_hf(spec: TensorSpec, parts: list[torch.Tensor]) -> torch.Tensor:
    """The inverse of `to_hf`: the tensor of statement `spec` from its HF tensors, in `spec.hf`'s order (or an
    alternative layout's that needs no conversion of its own, `HfLayout.to_ours` None)."""
    t = parts[0] if len(parts) == 1 else torch.cat([p.reshape(-1) for p in parts]).view(spec.shape)
    return _rows_from_hf(t, spec.hf_rows) if spec.hf_rows else t


def internal_to_hf(cfg: ModelConfig, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Split fused tensors into HF tensors (`to_hf`)."""
    specs = tensor_specs(cfg)
    return {hf: part for name, t in params.items() for hf, part in to_hf(specs[name], t).items()}


def hf_to_internal(cfg: ModelConfig, get: Callable[[str], torch.Tensor], layouts: Mapping[str, HfLayout] | None = None
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (internal name, tensor) built from HF tensors fetched one by one through `get(hf_name)`,
    so a loader can stream without holding the whole HF state dict twice. `layouts`: internal name -> the
    alternative layout (`TensorSpec.hf_alternatives`) its checkpoint holds it in, for those not in `TensorSpec.hf`."""
    for name, spec in tensor_specs(cfg).items():
        layout = (layouts or {}).get(name)
        parts = [get(hf) for hf, _ in (spec.hf if layout is None else layout.hf)]
        if layout is not None and layout.to_ours is not None:
            t = layout.to_ours(parts)
            if tuple(t.shape) != spec.shape:
                raise ValueError(f"{name}: {[hf for hf, _ in layout.hf]} make a {tuple(t.shape)} tensor, "
                                 f"expected {spec.shape}")
            yield name, t
            continue
        yield name, from_hf(spec, parts)
