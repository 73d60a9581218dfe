"""The Qwen3.5 family's block tensors and their Hugging Face names, as data (one table per layer kind).

Fused as llm.q fuses them (one GEMM where HF runs several), everything else one to one:
  in_proj  (conv_dim + value_dim + 2H, C)  rows [qkv; z; b; a]  <- linear_attn.in_proj_qkv / in_proj_z / _b / _a
  qkv      (2 q_dim + 2 kv_dim, C)         rows [q + gate; k; v] <- self_attn.q_proj / k_proj / v_proj
  up       (2F, C)                         rows [up; gate]       <- mlp.up_proj / mlp.gate_proj
  experts_up_gate (E, 2F, C)               per expert [up; gate] <- mlp.experts.{e}.up_proj / gate_proj
An MoE layer's experts are written one by one, as transformers' save_pretrained writes them (5.x: its weight
converters split its fused parameters); loading also takes those fused parameters (`mlp.experts.gate_up_proj`
(E, 2F, C) rows [gate; up], `mlp.experts.down_proj` (E, C, F): `moe_family.fused_expert_layouts`), a checkpoint of
transformers' state_dict.
Qwen3-Next (model_type qwen3_next) holds the same in_proj as two HF tensors whose rows interleave per key-head group
g (of Hk; r = H / Hk value heads each): linear_attn.in_proj_qkvz = [q_g; k_g; v_g; z_g] for g = 0..Hk-1 and
linear_attn.in_proj_ba = [b_g; a_g], which `next_in_proj_rows` maps onto qtrain's [q; k; v; z; b; a] rows
(`TensorSpec.hf_rows`: a permutation in the mapping, so the block is the same code for both).
Names sit under the config's `hf_prefix`: 'model.' for a text checkpoint, 'model.language_model.' for the
multimodal one (what `Qwen3_5ForConditionalGeneration` reads; `Qwen3_5ForCausalLM` reads both); the LM head is
'lm_head.weight' in both.
"""
from __future__ import annotations

from qtrain.model.family import HfLayout, TensorSpec
from qtrain.model.moe_family import EXPERTS_GROUP, fused_expert_layouts
from qtrain.model.qwen3_5.config import Qwen35Config
from qtrain.model.qwen3_5.next_config import NEXT_TYPE

# short name -> HF suffix(es) under "{prefix}layers.{i}."; a tuple means rows concatenated in order
MIXER_HF: dict[str, dict[str, str | tuple[str, ...]]] = {
    "linear_attention": {
        "in_proj": ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight", "linear_attn.in_proj_b.weight",
                    "linear_attn.in_proj_a.weight"),
        "conv": "linear_attn.conv1d.weight",
        "dt_bias": "linear_attn.dt_bias",
        "A_log": "linear_attn.A_log",
        "gnorm": "linear_attn.norm.weight",
        "out": "linear_attn.out_proj.weight",
    },
    "full_attention": {
        "qkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "q_norm": "self_attn.q_norm.weight",
        "k_norm": "self_attn.k_norm.weight",
        "o": "self_attn.o_proj.weight",
    },
}
DENSE_MLP_HF = {"up": ("mlp.up_proj.weight", "mlp.gate_proj.weight"), "down": "mlp.down_proj.weight"}
MOE_MLP_HF = {"router": "mlp.gate.weight", "shared_up": ("mlp.shared_expert.up_proj.weight",
                                                         "mlp.shared_expert.gate_proj.weight"),
              "shared_down": "mlp.shared_expert.down_proj.weight", "shared_gate": "mlp.shared_expert_gate.weight"}
NO_DECAY = frozenset({"ln1", "ln2", "q_norm", "k_norm", "gnorm", "dt_bias", "A_log"})  # gains, biases, the decay rate
# from-scratch init (model/init.py): the zero-centred norms start at w = 0 (a gain of 1), the gated norm at 1; A_log
# as transformers and fla-core draw it (log of U(1, 16)); dt_bias 1 (transformers)
INIT = {"ln1": "zeros", "ln2": "zeros", "q_norm": "zeros", "k_norm": "zeros", "gnorm": "ones", "dt_bias": "ones",
        "A_log": "log_uniform", "o": "residual", "out": "residual", "down": "residual", "shared_down": "residual",
        "experts_down": "residual"}


def block_shapes(cfg: Qwen35Config, layer: int) -> dict[str, tuple[int, ...]]:
    """Block `layer`'s tensors and shapes, in the fixed order used for buffers and RNG keys."""
    C, H = cfg.hidden_size, cfg.linear_num_value_heads
    shapes: dict[str, tuple[int, ...]] = {"ln1": (C,)}
    if cfg.is_linear(layer):
        shapes.update(in_proj=(cfg.in_proj_dim, C), conv=(cfg.conv_dim, 1, cfg.linear_conv_kernel_dim),
                      dt_bias=(H,), A_log=(H,), gnorm=(cfg.linear_value_head_dim,), out=(C, cfg.linear_value_dim))
    else:
        shapes.update(qkv=(cfg.attn_qkv_dim, C), q_norm=(cfg.head_dim,), k_norm=(cfg.head_dim,), o=(C, cfg.q_dim))
    shapes["ln2"] = (C,)
    if cfg.is_moe_layer(layer):
        E, Fm, Fs = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        shapes.update(router=(E, C), experts_up_gate=(E, 2 * Fm, C), experts_down=(E, C, Fm),
                      shared_up=(2 * Fs, C), shared_down=(C, Fs), shared_gate=(1, C))
    else:
        F = cfg.intermediate_size
        shapes.update(up=(2 * F, C), down=(C, F))
    return shapes


NEXT_IN_PROJ = ("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight")


def next_in_proj_rows(cfg: Qwen35Config) -> tuple[tuple[int, int], ...]:
    """Qwen3-Next's in_proj_qkvz rows then in_proj_ba rows as runs (start, count) of qtrain's in_proj rows
    [q (Hk dk); k (Hk dk); v (H dv); z (H dv); b (H); a (H)] (module docstring)."""
    Hk, H, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, \
        cfg.linear_value_head_dim
    r, kd, vd = H // Hk, cfg.linear_key_dim, cfg.linear_value_dim
    q, k, v, z, b, a = 0, kd, 2 * kd, 2 * kd + vd, 2 * kd + 2 * vd, 2 * kd + 2 * vd + H
    qkvz = tuple(run for g in range(Hk) for run in ((q + g * dk, dk), (k + g * dk, dk), (v + g * r * dv, r * dv),
                                                     (z + g * r * dv, r * dv)))
    return qkvz + tuple(run for g in range(Hk) for run in ((b + g * r, r), (a + g * r, r)))


def _hf_parts(cfg: Qwen35Config, layer: int, short: str, shape: tuple[int, ...]
              ) -> tuple[tuple[str, tuple[int, ...]], ...]:
    prefix = f"{cfg.hf_prefix}layers.{layer}."
    if short == "in_proj" and cfg.model_type == NEXT_TYPE:
        C = shape[1]  # [q_g; k_g; v_g; z_g] and [b_g; a_g] per key-head group
        return ((prefix + NEXT_IN_PROJ[0], (cfg.conv_dim + cfg.linear_value_dim, C)),
                (prefix + NEXT_IN_PROJ[1], (2 * cfg.linear_num_value_heads, C)))
    if short == "experts_up_gate":
        E, F2, C = shape
        return tuple((f"{prefix}mlp.experts.{e}.{p}.weight", (F2 // 2, C)) for e in range(E)
                     for p in ("up_proj", "gate_proj"))
    if short == "experts_down":
        return tuple((f"{prefix}mlp.experts.{e}.down_proj.weight", shape[1:]) for e in range(shape[0]))
    hf = {"ln1": "input_layernorm.weight", "ln2": "post_attention_layernorm.weight",
          **MIXER_HF[cfg.layer_types[layer]], **(MOE_MLP_HF if cfg.is_moe_layer(layer) else DENSE_MLP_HF)}[short]
    if isinstance(hf, str):
        return ((prefix + hf, shape),)
    C = shape[1]
    rows = {"in_proj": [cfg.conv_dim, cfg.linear_value_dim, cfg.linear_num_value_heads, cfg.linear_num_value_heads],
            "qkv": [cfg.q_gate_dim, cfg.kv_dim, cfg.kv_dim]}.get(short, [shape[0] // 2, shape[0] // 2])
    return tuple((prefix + s, (r, C)) for s, r in zip(hf, rows))


def _hf_alternatives(cfg: Qwen35Config, layer: int, short: str) -> tuple[HfLayout, ...]:
    """The other layout loading accepts: an MoE layer's experts fused as transformers' modules hold them (what a
    checkpoint of its state_dict has), as the MoE families take them."""
    if not short.startswith("experts_"):
        return ()
    ug, down = fused_expert_layouts(f"{cfg.hf_prefix}layers.{layer}.", cfg.num_experts, cfg.moe_intermediate_size,
                                    cfg.hidden_size)
    return (ug,) if short == "experts_up_gate" else (down,)


def block_tensors(cfg: Qwen35Config, layer: int) -> tuple[TensorSpec, ...]:
    """Block `layer`'s tensors (linear- and full-attention layers hold different ones); an MoE layer's expert stacks
    in a layout group of their own, 'block.{l}.experts', as the MoE families' (expert parallelism gives ranks whole
    experts of it)."""
    rows = next_in_proj_rows(cfg) if cfg.model_type == NEXT_TYPE else ()
    return tuple(TensorSpec(short, shape, _hf_parts(cfg, layer, short, shape), decay=short not in NO_DECAY,
                            init=INIT.get(short, "normal"), experts=cfg.num_experts if short.startswith("experts_")
                            else 0, group=EXPERTS_GROUP if short.startswith("experts_") else "",
                            hf_alternatives=_hf_alternatives(cfg, layer, short),
                            hf_rows=rows if short == "in_proj" else ())
                 for short, shape in block_shapes(cfg, layer).items())


def non_block_tensors(cfg: Qwen35Config) -> tuple[TensorSpec, ...]:
    """The embedding, the final norm (zero-centred: starts at 0) and the untied LM head under `hf_prefix`."""
    V, C, p = cfg.vocab_size, cfg.hidden_size, cfg.hf_prefix
    specs = [TensorSpec("embed", (V, C), ((f"{p}embed_tokens.weight", (V, C)),)),
             TensorSpec("norm", (C,), ((f"{p}norm.weight", (C,)),), decay=False, init="zeros")]
    if not cfg.tie_word_embeddings:
        specs.append(TensorSpec("lm_head", (V, C), (("lm_head.weight", (V, C)),)))
    return tuple(specs)


def ignored_hf_tensor(cfg: Qwen35Config, name: str) -> str | None:
    """Why a checkpoint tensor outside the text model is skipped ('the vision tower', 'the MTP head'), None if it
    is not one of those (then it is unexpected)."""
    if name.startswith(("model.visual.", "visual.")):
        return "the vision tower"
    if name.startswith("mtp."):
        return "the MTP (multi-token prediction) head"
    return None
