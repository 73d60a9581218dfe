"""The adapters of a layer as tensor statements, derived from its family's statements, with PEFT's names.

A target is one HF module of a block matrix (the family's `TensorSpec.hf` part `<hf_prefix>layers.{l}.<module>.weight`,
`hf_prefix` the config's: `model.`, or `model.language_model.` for a multimodal Qwen3.5 checkpoint; e.g.
`self_attn.q_proj`): its name is the module's last component without `_proj` (q, k, v, o, gate, up, down for the
Llama family). The targets of one (possibly fused) block matrix M share two adapter tensors in the layer's group
`lora` (`TensorSpec.group`), fused as the matrix is:

    {M}_lora_a  (t x r, in)     rows [A_1; A_2; ...]  <- base_model.model.<module_i>.lora_A.weight  (r, in)
    {M}_lora_b  (sum out_i, r)  rows [B_1; B_2; ...]  <- base_model.model.<module_i>.lora_B.weight  (out_i, r)

so the layout, the checkpoints and the PEFT export need no code of their own for them (`weights.internal_to_hf`'s
rule: a tensor is its HF tensors back to back).
"""
from __future__ import annotations

from dataclasses import dataclass

from qtrain.model.config import ModelConfig
from qtrain.model.family import TensorSpec
from qtrain.model.lora.spec import LoraSpec
from qtrain.model.registry import family_of
from qtrain.model.weights import statements

GROUP = "lora"  # the layer's layout group of its adapters: 'block.{l}.lora'
PEFT_PREFIX = "base_model.model."  # peft's prefix of the base model's module names in adapter_model.safetensors
MLP_MATRICES = ("up", "down")  # a dense MLP's block matrices (Llama family, Qwen3.5)


@dataclass(frozen=True)
class Target:
    """One adaptable HF module of a block matrix: rows [row, row + rows) of matrix `matrix` (in features: `cols`)."""
    name: str  # 'q'
    matrix: str  # the block tensor it is part of: 'qkv'
    module: str  # HF module under the layer: 'self_attn.q_proj'
    row: int
    rows: int
    cols: int


def _layer_prefix(cfg: ModelConfig, layer: int) -> str:
    """Where layer `layer`'s modules sit in the base checkpoint (and, under PEFT_PREFIX, in peft's adapter keys):
    `model.layers.{l}.`, or `model.language_model.layers.{l}.` in Qwen3.5's multimodal layout."""
    return f"{cfg.hf_prefix}layers.{layer}."


def layer_targets(cfg: ModelConfig, layer: int) -> dict[str, Target]:
    """Every target block `layer` offers, by name, in block order: the HF modules (`.weight` parts under
    `<hf_prefix>layers.{layer}.`) of the block matrices that run through the block's linear, where the adapter term is
    added (the family's `fp8_matrices`: not a router, an MoE's experts or shared-expert gate, which the block
    multiplies itself). In an MoE model the dense MLP matrices of its dense layers are not targets either: peft maps
    gate_proj/up_proj/down_proj of such a model onto its experts, so an adapter of them would not load as trained."""
    out, prefix, linears = {}, _layer_prefix(cfg, layer), family_of(cfg).fp8_matrices
    if getattr(cfg, "router", None):
        linears = tuple(m for m in linears if m not in MLP_MATRICES)
    for spec in statements(cfg).blocks[layer]:
        if len(spec.shape) != 2 or spec.experts or spec.group or spec.hf_rows or spec.name not in linears:
            continue
        row = 0
        for hf, shape in spec.hf:
            module = hf.removeprefix(prefix).removesuffix(".weight")
            if hf.startswith(prefix) and hf.endswith(".weight") and len(shape) == 2:
                name = module.rsplit(".", 1)[-1].removesuffix("_proj")
                out[name] = Target(name, spec.name, module, row, shape[0], shape[1])
            row += shape[0]
    return out


def known_targets(cfg: ModelConfig) -> tuple[str, ...]:
    """The target names of every layer, in order of first appearance (what --lora-targets may name; a hybrid
    model's layers offer different ones: an adapter exists where its target does, as peft's target_modules)."""
    out: dict[str, None] = {}
    for layer in range(cfg.num_hidden_layers):
        out.update(dict.fromkeys(layer_targets(cfg, layer)))
    return tuple(out)


def a_name(matrix: str) -> str:
    return f"{matrix}_lora_a"


def b_name(matrix: str) -> str:
    return f"{matrix}_lora_b"


def adapted(cfg: ModelConfig, spec: LoraSpec, layer: int) -> dict[str, list[Target]]:
    """Block matrix -> its targeted modules in row order, for block `layer`."""
    out: dict[str, list[Target]] = {}
    for t in layer_targets(cfg, layer).values():
        if t.name in spec.targets:
            out.setdefault(t.matrix, []).append(t)
    return out


def adapter_tensors(cfg: ModelConfig, spec: LoraSpec, layer: int) -> tuple[TensorSpec, ...]:
    """Block `layer`'s adapter tensors (module docstring), PEFT's names as their HF parts."""
    r, prefix, out = spec.rank, PEFT_PREFIX + _layer_prefix(cfg, layer), []
    for matrix, targets in adapted(cfg, spec, layer).items():
        cols = targets[0].cols
        out.append(TensorSpec(a_name(matrix), (len(targets) * r, cols),
                              tuple((f"{prefix}{t.module}.lora_A.weight", (r, cols)) for t in targets), group=GROUP))
        out.append(TensorSpec(b_name(matrix), (sum(t.rows for t in targets), r),
                              tuple((f"{prefix}{t.module}.lora_B.weight", (t.rows, r)) for t in targets),
                              init="zeros", group=GROUP))
    return tuple(out)


def model_tensors(cfg: ModelConfig, spec: LoraSpec) -> tuple[tuple[TensorSpec, ...], tuple[tuple[TensorSpec, ...], ...]]:
    """(non-block tensors, each layer's tensors: the base's then its adapters'): the layout's `tensors=`."""
    st = statements(cfg)
    return st.non_block, tuple(tuple(b) + adapter_tensors(cfg, spec, i) for i, b in enumerate(st.blocks))


def adapter_specs(cfg: ModelConfig, spec: LoraSpec) -> dict[str, TensorSpec]:
    """Internal name ('layers.{l}.qkv_lora_a') -> statement, of every adapter tensor."""
    return {f"layers.{i}.{s.name}": s for i in range(cfg.num_hidden_layers) for s in adapter_tensors(cfg, spec, i)}


def base_module_names(cfg: ModelConfig, spec: LoraSpec) -> list[str]:
    """PEFT's `target_modules`: the HF module names of the targets ('q_proj', ...), in order of first appearance."""
    out: dict[str, None] = {}
    for layer in range(cfg.num_hidden_layers):
        out.update(dict.fromkeys(t.module.rsplit(".", 1)[-1] for t in layer_targets(cfg, layer).values()
                                 if t.name in spec.targets))
    return list(out)
