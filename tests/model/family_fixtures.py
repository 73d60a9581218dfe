"""Tiny models of the families for the tests, built with transformers' config classes (never a hub download), and
what the family tests share: a gradient sink and the cosine of two tensors. One home for the builders that the MoE,
Qwen3.5, Qwen3-Next, LoRA and document-masking tests use (transformers is imported where a builder needs it: the
tests that use one skip without it).
"""
from __future__ import annotations

import torch

from qtrain.model.qwen3_5 import Qwen35Config


class Collect:
    """A gradient sink for `Transformer.forward_backward`: every gradient under its internal name."""

    def __init__(self):
        self.grads: dict[str, torch.Tensor] = {}

    def accumulate_block(self, layer, grads):
        self.grads.update({f"layers.{layer}.{k}": v for k, v in grads.items()})

    def accumulate_non_block(self, grads):
        self.grads.update(grads)


def cosine(a, b):
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


# ---- the MoE families (qwen3_moe, olmoe, mixtral) ----
MOE_BASE = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            rope_theta=10000.0, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
# name -> (transformers config class, its keyword arguments): every routing and layer variant the families have
MOE_CASES = {
    # a dense layer (mlp_only_layers), renormalised top-k, untied
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=16, intermediate_size=48, moe_intermediate_size=24, num_experts=8,
                                          num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[1],
                                          router_aux_loss_coef=0.05)),
    # decoder_sparse_step 2 (layer 0 dense, layer 1 routed), no renormalisation, tied embeddings
    "qwen3_moe-step": ("Qwen3MoeConfig", dict(intermediate_size=40, moe_intermediate_size=16, num_experts=4,
                                               num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=2,
                                               tie_word_embeddings=True, router_aux_loss_coef=0.02)),
    # whole-projection qk-norm and the q/k/v clamp
    # (no pad_token_id: transformers' embedding would freeze that row, nn.Embedding's padding_idx, which qtrain
    # trains in every family)
    "olmoe": ("OlmoeConfig", dict(intermediate_size=24, num_experts=8, num_experts_per_tok=2, clip_qkv=0.4,
                                  router_aux_loss_coef=0.05, pad_token_id=None)),
    "mixtral": ("MixtralConfig", dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                                      router_aux_loss_coef=0.05)),
}


def moe_hf_model(case: str, seed: int = 3, **over):
    """transformers' model of MoE case `case` (config fields `over` replaced), every tensor random."""
    import transformers
    cls, kw = MOE_CASES[case]
    hf_cfg = getattr(transformers, cls)(**MOE_BASE, **{**kw, **over})
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa").float()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # every tensor random (HF starts norms at 1 and the routers at 0)
        for n, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.1 if "norm" in n else 0.3) + (1.0 if "norm" in n else 0.0))
    return model


# ---- Qwen3.5 ----
QWEN35_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=256, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
            rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
QWEN35_TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48)


def qwen35_cfg(*, tied: bool = False, moe: bool = False, **over) -> Qwen35Config:
    """A tiny Qwen3.5 text config (dense, or MoE with a shared expert)."""
    extra = QWEN35_TINY_MOE if moe else {}
    return Qwen35Config(model_type="qwen3_5_moe_text" if moe else "qwen3_5_text", tie_word_embeddings=tied,
                        **{**QWEN35_TINY, **extra, **over})


def randomize(model, seed: int = 0):
    """Every parameter random (norms near their identity, A_log in its usual range), so each gradient is checked."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1, 16, generator=gen).log())
            elif "norm" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if "linear_attn.norm" in n else 0.0))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


def qwen35_hf_model(cfg: Qwen35Config, seed: int = 0):
    import transformers
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf_dict(dtype="float32"))
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa").float()
    return randomize(model, seed)


def hf_state(model) -> dict[str, torch.Tensor]:
    """The HF model's tensors under the names a checkpoint holds (MoE experts one by one, as save_pretrained
    writes them)."""
    sd = {}
    for n, t in model.state_dict().items():
        if n.endswith("mlp.experts.gate_up_proj"):  # (E, 2F, C) rows [gate; up] per expert
            base = n.removesuffix("gate_up_proj")
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2)
                sd[f"{base}{e}.gate_proj.weight"], sd[f"{base}{e}.up_proj.weight"] = gate, up
        elif n.endswith("mlp.experts.down_proj"):
            base = n.removesuffix("down_proj")
            for e in range(t.shape[0]):
                sd[f"{base}{e}.down_proj.weight"] = t[e]
        else:
            sd[n] = t
    return sd


def hf_grads(model, tied: bool) -> dict[str, torch.Tensor]:
    g = {n: p.grad for n, p in model.named_parameters() if not (tied and n == "lm_head.weight")}
    return hf_state(_GradView(g))


class _GradView:
    def __init__(self, d):
        self.d = d

    def state_dict(self):
        return self.d


def qwen35_multimodal_model(seed: int = 0, *, moe: bool = False):
    """A tiny random Qwen3.5 VLM (transformers' Qwen3_5ForConditionalGeneration, or with `moe`
    Qwen3_5MoeForConditionalGeneration: the text model under `model.language_model.`, a vision tower under
    `model.visual.`)."""
    import transformers
    text = qwen35_cfg(moe=moe, num_hidden_layers=2, layer_types=("linear_attention", "full_attention")).text_hf_dict(
        dtype="float32")
    text.pop("architectures")
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
    config_cls, model_cls = ((transformers.Qwen3_5MoeConfig, transformers.Qwen3_5MoeForConditionalGeneration) if moe
                             else (transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration))
    cfg = config_cls(text_config=text, vision_config=vision, tie_word_embeddings=False)
    return randomize(model_cls(cfg).float(), seed)
