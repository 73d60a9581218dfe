"""What a micro-step keeps for backward and needs besides, per token, without running it: the activation and
workspace rows of the memory plan (`plan/memory.py`; docs/memory.md).

    terms = activation_terms(cfg, model_dtype="bf16", compiled=True, recompute=resolve_flags({"ffn"}))
    acts = activation_memory(cfg, tokens=B * T, model_dtype="bf16", compiled=True)  # .device, .host
    phases = workspace_phases(cfg, tokens=B * T, model_dtype="bf16", cuda=True)    # lm_head, block_backward, ...

Nothing is derived here: a block's terms are its family's statements, written beside the block's steps (for the
Llama family, the `saved_by_*` functions of `model/llama/block.py`), and this module adds them up over the
layers (layers that hold the same tensors keep the same bytes, so each kind of layer is asked once) together
with what the family-independent loop keeps (the last block's output) and its transients (the LM head,
`kernels.cross_entropy.head_workspace_bytes`; the embedding backward). tests/model/test_activations.py and
tests/plan/test_memory.py check the sums against what autograd saves and what a real micro-step holds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from qtrain.model.config import ModelConfig
from qtrain.model.family import DTYPE_BYTES, ActivationSettings, ActTerm
from qtrain.kernels.cross_entropy import head_workspace_bytes
from qtrain.model.lora.adapter import LoraAdapter
from qtrain.model.lora.spec import LoraSpec
from qtrain.model.lora.tensors import adapter_tensors
from qtrain.model.recompute import block_steps, resolve_flags
from qtrain.model.registry import family_of
from qtrain.model.weights import statements

__all__ = ["DTYPE_BYTES", "ActTerm", "Activations", "activation_terms", "layer_activation_bytes",
           "activation_memory", "workspace_phases"]


def _settings(model_dtype: str = "bf16", matmul_dtype: str = "", compiled: bool = False,
              recompute: frozenset[str] = frozenset(), attn_chunks: int = 1, mlp_chunks: int = 1,
              fp8_weight_copies: bool = True,
              fp8_keep_transposes: bool = False, documents: bool = False, frozen_base: bool = False,
              adapter_inputs: frozenset[str] = frozenset(), seq_len: int = 0,
              delta_rule_kernels: bool = False, fp8_experts: bool = False, expert_parallel: int = 1,
              balanced_experts: bool = False, swiglu_epilogue: bool = False) -> ActivationSettings:
    return ActivationSettings(model_dtype=model_dtype, matmul_dtype=matmul_dtype, compiled=compiled,
                              recompute=frozenset(recompute), attn_chunks=attn_chunks, mlp_chunks=mlp_chunks,
                              fp8_weight_copies=fp8_weight_copies, fp8_keep_transposes=fp8_keep_transposes,
                              documents=documents, frozen_base=frozen_base, adapter_inputs=frozenset(adapter_inputs),
                              seq_len=seq_len, delta_rule_kernels=delta_rule_kernels, fp8_experts=fp8_experts,
                              expert_parallel=expert_parallel, balanced_experts=balanced_experts,
                              swiglu_epilogue=swiglu_epilogue)


def activation_terms(cfg: ModelConfig, *, layer: int = 0, **kw: Any) -> list[ActTerm]:
    """What autograd keeps for backward in block `layer`, term by term (its family's statements). Keywords:
    model_dtype ('bf16'), matmul_dtype ('' or 'e4m3'), compiled, recompute (switches), attn_chunks, mlp_chunks,
    fp8_weight_copies (False with --persistent-quants), fp8_keep_transposes, documents (--document-masking),
    frozen_base and adapter_inputs (LoRA), seq_len, delta_rule_kernels, fp8_experts, expert_parallel,
    balanced_experts and swiglu_epilogue (family.ActivationSettings)."""
    return family_of(cfg).activation_terms(cfg, layer, _settings(**kw))


def _kept(terms: list[ActTerm], tokens: int) -> int:
    return sum(a.nbytes(tokens) for a in terms if a.kept and a.name != "input")


def layer_activation_bytes(cfg: ModelConfig, tokens: int, **kw: Any) -> int:
    """Bytes the largest layer keeps for backward besides its input (`activation_terms` keywords)."""
    return max((_kept(activation_terms(cfg, layer=layers[0], **kw), tokens) for layers in statements(cfg).kinds),
               default=0)


@dataclass(frozen=True)
class Activations:
    """What one micro-step keeps for backward on a rank: `blocks` bytes of the layers' saved tensors (`per_layer`:
    the largest layer's), each block's `input` (the residual stream), and the last block's output (alive until the
    LM head has run). With `offload_residual` (--recompute-block) the block inputs wait in host memory and two are on
    the device: the one in use and the prefetched one (`recompute.ResidualStash`)."""
    layers: int
    blocks: int
    per_layer: int
    input: int
    offload_residual: bool
    terms: tuple[ActTerm, ...]  # the first layer's

    @property
    def device(self) -> int:
        inputs = 2 * self.input if self.offload_residual else self.layers * self.input
        return self.blocks + inputs + self.input

    @property
    def host(self) -> int:
        return self.layers * self.input if self.offload_residual else 0


def activation_memory(cfg: ModelConfig, tokens: int, *, model_dtype: str = "bf16", offload_residual: bool = False,
                      **kw: Any) -> Activations:
    """The activations of a micro-step of `tokens` tokens (`activation_terms` keywords; `offload_residual` only
    counts with the `block` switch)."""
    by_kind = [(len(layers), activation_terms(cfg, layer=layers[0], model_dtype=model_dtype, **kw))
               for layers in statements(cfg).kinds]
    kept = [(n, _kept(terms, tokens)) for n, terms in by_kind]
    offload = offload_residual and "block" in resolve_flags(kw.get("recompute", ()))
    return Activations(cfg.num_hidden_layers, blocks=sum(n * b for n, b in kept), per_layer=max(b for _, b in kept),
                       input=tokens * cfg.hidden_size * DTYPE_BYTES[model_dtype], offload_residual=offload,
                       terms=tuple(by_kind[0][1]))


def _mlp_slice_bytes(cfg: ModelConfig, layer: int, tokens: int, chunks: int, **kw: Any) -> int:
    """What one slice of a sliced MLP (--mlp-chunks) saves while its backward reruns it: the terms the slicing drops
    (the family's statements mark them), at tokens / chunks tokens."""
    kw = {**kw, "recompute": frozenset()}
    whole = activation_terms(cfg, layer=layer, **{**kw, "mlp_chunks": 1})
    sliced = activation_terms(cfg, layer=layer, **{**kw, "mlp_chunks": chunks})
    return sum(t.nbytes(tokens // chunks) for t, u in zip(whole, sliced, strict=True) if t.kept and not u.kept)


def workspace_phases(cfg: ModelConfig, tokens: int, *, model_dtype: str = "bf16", lmhead_chunks: int = 1,
                     cuda: bool = True, fp8_head_backward: bool = False, lora: LoraSpec | None = None,
                     **kw: Any) -> dict[str, int]:
    """Transient bytes of a micro-step's phases beyond the activations (`activation_terms` keywords), estimates
    checked against a CPU allocation tracker and the H200's peaks:
      lm_head             the final RMSNorm (eager: fp32 copy, normalized value, output, rstd) and the chunked
                          head and loss (`kernels.cross_entropy.head_workspace_bytes`, with --fp8-head-backward's
                          operands);
      block_backward      one block's backward (the largest): d(input) and the incoming d(output), fresh weight
                          gradients (over a frozen base, `lora`: the layer's adapters' only), activation-gradient
                          temporaries (the family's `backward_temporaries`), the tied head's gradient (kept for the
                          embedding), and the recomputed steps' saved tensors (with `block`: the block's whole saved
                          set), the adapters' inside them included; with --mlp-chunks one slice's MLP saved set;
      embedding_backward  d(input), the dense embedding gradient (+ the tied head's), fp32 row sums."""
    E = DTYPE_BYTES[model_dtype]
    N, C, V = tokens, cfg.hidden_size, cfg.vocab_size
    rc = resolve_flags(kw.pop("recompute", ()))
    family, settings = family_of(cfg), _settings(model_dtype=model_dtype, recompute=rc, **kw)
    up = 4 if E != 4 else 0
    tied = cfg.tie_word_embeddings
    inp = N * C * E
    head = N * ((up + 2 * E) * C + 4) + head_workspace_bytes(N, C, V, dtype_bytes=E, chunks=lmhead_chunks, cuda=cuda,
                                                             fp8_backward=fp8_head_backward,
                                                             weight_grad=not settings.frozen_base)  # LoRA: frozen head
    st, bwd = statements(cfg), 0
    adapter = LoraAdapter(cfg, lora) if lora is not None else None
    layers_to_ask = [layers[0] for layers in st.kinds] if adapter is None else range(cfg.num_hidden_layers)
    for layer in layers_to_ask:  # a LoRA run's layers of one kind may offer different targets
        trained = () if settings.frozen_base else st.blocks[layer]
        if lora is not None:
            trained = (*trained, *adapter_tensors(cfg, lora, layer))
        block_numel = sum(math.prod(s.shape) for s in trained)  # the fresh weight gradients
        full_block = _kept(activation_terms(cfg, layer=layer, model_dtype=model_dtype, **kw), N)
        temporaries = family.backward_temporaries(cfg, layer, N, settings)
        b = 2 * inp + block_numel * E + temporaries + (V * C * E if tied else 0)
        if "block" in rc:
            b += full_block
        elif rc:  # the dropped steps of one layer are rebuilt
            b += full_block - _kept(activation_terms(cfg, layer=layer, model_dtype=model_dtype, recompute=rc, **kw), N)
        if settings.mlp_chunks > 1:  # --mlp-chunks: one slice of the MLP's saved set is rebuilt at a time
            b += _mlp_slice_bytes(cfg, layer, N, settings.mlp_chunks, model_dtype=model_dtype, **kw)
        if adapter is not None and rc:  # the adapters rerun with their steps (all of them with `block`)
            steps = block_steps(rc)
            kept = 0 if "block" in rc else N * adapter.layer_saved_bytes_per_token(layer, E, steps) + \
                adapter.layer_saved_bytes(layer, E, steps)
            b += N * adapter.layer_saved_bytes_per_token(layer, E) + adapter.layer_saved_bytes(layer, E) - kept
        bwd = max(bwd, b)
    embed = inp + V * C * E * (2 if tied else 1) + N * C * 4
    return {"lm_head": head, "block_backward": bwd, "embedding_backward": embed}
