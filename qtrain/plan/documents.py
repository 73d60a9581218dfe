"""The memory plan's row for --document-masking (`kernels/document_attention.py`), beside the block's own statements.

* varlen (the default for bf16 on CUDA): flash attention over the documents saves exactly what causal flash
  attention saves (q, k, v, out and the (nh, B*T) fp32 log-sum-exp), so the activations do not change; the row holds
  only the documents' offsets (`cu_seqlens`, at most B*T + 1 int32 per attention slice).
* masked (fp32 runs, or --document-attention masked): the micro-batch's (B, 1, T, T) bool mask lives through the
  micro-step, and with grouped-query attention each layer's SDPA keeps its expanded key and value heads
  (2 x B*T*nh*hs in the model dtype) for its backward, unless the attention is recomputed; an upper bound.
"""
from __future__ import annotations

import torch

from qtrain.kernels.document_attention import resolve_document_attention
from qtrain.model.config import ModelConfig
from qtrain.model.family import DTYPE_BYTES
from qtrain.options import Options

__all__ = ["document_masking_bytes"]


def document_masking_bytes(cfg: ModelConfig, opts: Options, device: str, recompute: frozenset[str]
                           ) -> tuple[int, str] | None:
    """(device bytes, what they are) that --document-masking adds to a micro-step, None without the option."""
    if not opts.document_masking:
        return None
    B, T, L = opts.batch_size, opts.seq_len, cfg.num_hidden_layers
    dtype = torch.bfloat16 if opts.model_dtype == "bf16" else torch.float32
    kind = resolve_document_attention(opts.document_attention, torch.device(device), dtype)
    if kind == "varlen":
        return 4 * (B * T + max(1, opts.attn_bwd_chunks)), "varlen attention: the documents' offsets only"
    groups = cfg.num_attention_heads // max(cfg.num_key_value_heads, 1)
    kept_layers = 0 if groups == 1 else (1 if recompute & {"att", "block"} else L)
    expanded = kept_layers * 2 * B * T * cfg.num_attention_heads * cfg.head_dim * DTYPE_BYTES[opts.model_dtype]
    return B * T * T + expanded, ("masked attention: the (B, 1, T, T) mask"
                                  + (f" + expanded K/V heads of {kept_layers} layer(s), at most" if expanded else ""))
