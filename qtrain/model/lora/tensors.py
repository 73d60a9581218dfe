"""The adapters of a layer as tensor statements, derived from its family's statements, with PEFT's names.

A target is one HF module of a block matrix (the family's `TensorSpec.hf` part `<hf_prefix>layers.{l}.<module>.weight`,
`hf_prefix` the config's: `model.`, or `model.language_model.` for a multimodal Qwen3.5 checkpoint; e.g.
`self_attn.q_proj`): its name is the module's last component without `_proj` (q, k, v, o, gate, up, down for the
Llama family). The targets of one (possibly fused) block matrix M share two adapter tensors in the layer's group
`lora` (`TensorSpec.group`), fused as the matrix is:

    {M}_lora_a  (t x r, in)     rows [A_1; A_2; ...]  <- base_model.model.<module_i>.lora_A.weight  (r, in)
    {M}_lora_b  (sum out_i, r)  rows [B_1; B_2; ...]  <- base_model.model.<module_i>.lora_B.weight  (out_i, r)

so the layout, the checkpoints and the PEFT export need no code of their own for them (`weights.to_hf`'s rule: a
tensor is its HF tensors back to back). B's rows are the matrix's, in its order: where a module holds its rows in
another order than the matrix (Qwen3-Next's in_proj_qkvz = [q_g; k_g; v_g; z_g] per key-head group g, in_proj_ba =
[b_g; a_g], of qtrain's in_proj [q; k; v; z; b; a]: `TensorSpec.hf_rows`), B_i = P_i B'_i for peft's B'_i and that
row permutation P_i, since P_i (B'_i A_i) x = (P_i B'_i) A_i x: {M}_lora_b's own `hf_rows` (`Target.hf_rows` at
its place in B) permutes them on the way to and from peft. A module whose rows are not one range of the matrix
would be no target (none is).

A routed layer's experts (the MoE families) are targets too: gate, up and down name its experts' projections, as peft
maps `gate_proj`/`up_proj`/`down_proj` onto an MoE model's experts under transformers 5, where they are 3-D parameters
of the module `mlp.experts` (`gate_up_proj` (E, 2F, C) rows [gate; up], `down_proj` (E, C, F)) that peft adapts with a
`ParamWrapper` (peft/tuners/lora/layer.py): per expert e a low-rank update W_e + (alpha / r) B_e A_e of the whole
(out x in) matrix, A_e (r', in), B_e (out, r'), kept as two 2-D tensors of all experts at once:

    lora_A.weight  (E r', in)   rows [A_0; A_1; ...]              (expert-major: A_e = lora_A.view(E, r', in)[e])
    lora_B.weight  (out, E r')  column j E + e is column j of B_e  (expert-minor: B_e = lora_B.view(out, r', E)[..., e])

gate and up share transformers' fused gate_up_proj, so they are named together and adapted as one matrix of rank
r' = 2 r with alpha 2 alpha (what peft's conversion of `target_modules=[..., 'gate_proj', 'up_proj']` makes:
`rank_pattern`/`alpha_pattern` '.*\\.gate_up_proj'); down has r' = r. The adapter tensors here are peft's two tensors
as they are (`experts_up_gate_lora_a` = lora_A ...; B's rows in transformers' [gate; up] order), each one HF part:
`base_model.model.model.layers.{l}.mlp.experts[.base_layer].lora_{A,B}.weight`, `.base_layer` for gate_up when down is
adapted too (peft wraps the parameters in the order the module registers them: gate_up_proj inside, down_proj around).
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
EXPERTS_MODULE = "mlp.experts"  # transformers 5's module of a routed layer's experts (every MoE family qtrain has)
EXPERT_MATRICES = {"experts_up_gate": ("gate_up_proj", ("gate", "up")), "experts_down": ("down_proj", ("down",))}
# the transformers-4 module names of each fused expert parameter, which peft >= 0.22 keeps in an adapter's
# target_modules beside the target_parameters it converted them to, where a linear of that name exists too (a dense
# MLP, a shared expert; Mixtral's w1/w3/w2 are listed for completeness)
PEFT_V4_EXPERT_MODULES = {"gate_up_proj": ("gate_proj", "up_proj", "w1", "w3"), "down_proj": ("down_proj", "w2")}


@dataclass(frozen=True)
class Target:
    """One adaptable HF module of a block matrix: rows [row, row + rows) of matrix `matrix` (in features: `cols`)."""
    name: str  # 'q'
    matrix: str  # the block tensor it is part of: 'qkv'
    module: str  # HF module under the layer: 'self_attn.q_proj'
    row: int
    rows: int
    cols: int
    hf_rows: tuple[tuple[int, int], ...] = ()  # () or the module's rows as runs (start, count) of rows - row, in the
    # order the module holds them (Qwen3-Next's in_proj_qkvz / in_proj_ba: the matrix's `TensorSpec.hf_rows`)


def _merged(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """`runs` with each run that continues the one before joined to it."""
    out: list[tuple[int, int]] = []
    for start, count in runs:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + count)
        else:
            out.append((start, count))
    return out


def _part_rows(spec: TensorSpec) -> list[tuple[int, tuple[tuple[int, int], ...]] | None]:
    """Where each HF part of matrix `spec` (`TensorSpec.hf`) sits in it: (its first row, its rows as runs relative to
    that row in the part's order, () when in order), or None when its rows are not one range of the matrix (a row
    permutation, `TensorSpec.hf_rows`, may spread them: no adapter's rows could be those of the module)."""
    runs, out = list(spec.hf_rows) or [(0, spec.shape[0])], []
    for _, shape in spec.hf:
        need, mine = shape[0], []
        while need:
            start, count = runs.pop(0)
            take = min(count, need)
            mine.append((start, take))
            if take < count:
                runs.insert(0, (start + take, count - take))
            need -= take
        first = min(start for start, _ in mine)
        rel = _merged([(start - first, count) for start, count in mine])
        if max(start + count for start, count in rel) != shape[0]:
            out.append(None)
        else:
            out.append((first, () if rel == [(0, shape[0])] else tuple(rel)))
    return out


def _layer_prefix(cfg: ModelConfig, layer: int) -> str:
    """Where layer `layer`'s modules sit in the base checkpoint (and, under PEFT_PREFIX, in peft's adapter keys):
    `model.layers.{l}.`, or `model.language_model.layers.{l}.` in Qwen3.5's multimodal layout."""
    return f"{cfg.hf_prefix}layers.{layer}."


def layer_targets(cfg: ModelConfig, layer: int) -> dict[str, Target]:
    """Every target block `layer` offers, by name, in block order: the HF modules (`.weight` parts under
    `<hf_prefix>layers.{layer}.`) of the block matrices that run through the block's linear, where the adapter term is
    added (the family's `fp8_matrices`: not a router, an MoE's experts or shared-expert gate, which the block
    multiplies itself). In an MoE model the dense MLP matrices of its dense layers are not targets either: peft < 0.22
    maps gate_proj/up_proj/down_proj of such a model onto its experts only, so an adapter of them would not load as
    trained (peft >= 0.22 adapts both; --lora-init-from refuses such an adapter, peft_io.read_adapter)."""
    out, prefix, linears = {}, _layer_prefix(cfg, layer), family_of(cfg).fp8_matrices
    if getattr(cfg, "router", None):
        linears = tuple(m for m in linears if m not in MLP_MATRICES)
    for spec in statements(cfg).blocks[layer]:
        if len(spec.shape) != 2 or spec.experts or spec.group or spec.name not in linears:
            continue
        for (hf, shape), where in zip(spec.hf, _part_rows(spec)):
            module = hf.removeprefix(prefix).removesuffix(".weight")
            if where is not None and hf.startswith(prefix) and hf.endswith(".weight") and len(shape) == 2:
                name = module.rsplit(".", 1)[-1].removesuffix("_proj")
                out[name] = Target(name, spec.name, module, where[0], shape[0], shape[1], where[1])
    return out


@dataclass(frozen=True)
class ExpertTarget:
    """The adapter of a routed layer's expert stack `matrix` (E, rows, cols) (module docstring): transformers'
    parameter `param` of EXPERTS_MODULE, adapted when every one of `names` is a target; rank multiple len(names)."""
    names: tuple[str, ...]  # ('gate', 'up') or ('down',)
    matrix: str  # 'experts_up_gate' / 'experts_down'
    param: str  # 'gate_up_proj' / 'down_proj'
    experts: int
    rows: int
    cols: int

    def rank(self, r: int) -> int:
        """The per-expert rank r' of this adapter at --lora-rank r."""
        return r * len(self.names)

    @property
    def swapped(self) -> bool:
        """qtrain's rows of the stack are [up; gate], transformers' (and the adapter's B) [gate; up]."""
        return self.matrix == "experts_up_gate"


def expert_targets(cfg: ModelConfig, layer: int) -> dict[str, ExpertTarget]:
    """Block `layer`'s expert stacks that take an adapter, by matrix (none in a dense layer or a dense model)."""
    out = {}
    for spec in statements(cfg).blocks[layer]:
        if spec.experts and spec.name in EXPERT_MATRICES:
            param, names = EXPERT_MATRICES[spec.name]
            out[spec.name] = ExpertTarget(names, spec.name, param, spec.experts, spec.shape[1], spec.shape[2])
    return out


def known_targets(cfg: ModelConfig) -> tuple[str, ...]:
    """The target names of every layer, in order of first appearance (what --lora-targets may name; a hybrid
    model's layers offer different ones: an adapter exists where its target does, as peft's target_modules)."""
    out: dict[str, None] = {}
    for layer in range(cfg.num_hidden_layers):
        out.update(dict.fromkeys(layer_targets(cfg, layer)))
        out.update(dict.fromkeys(n for t in expert_targets(cfg, layer).values() for n in t.names))
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


def adapted_experts(cfg: ModelConfig, spec: LoraSpec, layer: int) -> dict[str, ExpertTarget]:
    """Expert stack -> its adapter, for block `layer`: those whose every name is a target."""
    return {m: t for m, t in expert_targets(cfg, layer).items() if all(n in spec.targets for n in t.names)}


def expert_adapter_tensors(cfg: ModelConfig, spec: LoraSpec, layer: int) -> tuple[TensorSpec, ...]:
    """Block `layer`'s expert adapters (module docstring): peft's lora_A and lora_B of each adapted stack."""
    experts, out = adapted_experts(cfg, spec, layer), []
    for matrix, t in experts.items():
        inner = ".base_layer" if matrix == "experts_up_gate" and len(experts) > 1 else ""
        key = f"{PEFT_PREFIX}{_layer_prefix(cfg, layer)}{EXPERTS_MODULE}{inner}.lora_"
        n = t.experts * t.rank(spec.rank)
        out.append(TensorSpec(a_name(matrix), (n, t.cols), ((f"{key}A.weight", (n, t.cols)),), group=GROUP))
        out.append(TensorSpec(b_name(matrix), (t.rows, n), ((f"{key}B.weight", (t.rows, n)),), init="zeros",
                              group=GROUP))
    return tuple(out)


def _b_rows(targets: list[Target]) -> tuple[tuple[int, int], ...]:
    """The fused B's `TensorSpec.hf_rows`: each target's rows (`Target.hf_rows`) at its place in B, or () when every
    target holds its rows in order (module docstring)."""
    if not any(t.hf_rows for t in targets):
        return ()
    out, at = [], 0
    for t in targets:
        out += [(at + start, count) for start, count in t.hf_rows or ((0, t.rows),)]
        at += t.rows
    return tuple(out)


def adapter_tensors(cfg: ModelConfig, spec: LoraSpec, layer: int) -> tuple[TensorSpec, ...]:
    """Block `layer`'s adapter tensors (module docstring), PEFT's names as their HF parts."""
    r, prefix, out = spec.rank, PEFT_PREFIX + _layer_prefix(cfg, layer), []
    for matrix, targets in adapted(cfg, spec, layer).items():
        cols = targets[0].cols
        out.append(TensorSpec(a_name(matrix), (len(targets) * r, cols),
                              tuple((f"{prefix}{t.module}.lora_A.weight", (r, cols)) for t in targets), group=GROUP))
        out.append(TensorSpec(b_name(matrix), (sum(t.rows for t in targets), r),
                              tuple((f"{prefix}{t.module}.lora_B.weight", (t.rows, r)) for t in targets),
                              init="zeros", group=GROUP, hf_rows=_b_rows(targets)))
    return tuple(out) + expert_adapter_tensors(cfg, spec, layer)


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


def peft_v4_expert_modules(target_parameters: list[str]) -> set[str]:
    """The transformers-4 module names an adapter's `target_modules` may list for the expert parameters it adapts
    (`PEFT_V4_EXPERT_MODULES`): names peft >= 0.22 writes beside the converted target_parameters."""
    return {m for p in target_parameters for m in PEFT_V4_EXPERT_MODULES.get(str(p).rsplit(".", 1)[-1], ())}


def base_parameter_names(cfg: ModelConfig, spec: LoraSpec) -> list[str]:
    """PEFT's `target_parameters`: the adapted expert parameters ('mlp.experts.gate_up_proj', ...)."""
    out: dict[str, None] = {}
    for layer in range(cfg.num_hidden_layers):
        out.update(dict.fromkeys(f"{EXPERTS_MODULE}.{t.param}" for t in adapted_experts(cfg, spec, layer).values()))
    return list(out)
