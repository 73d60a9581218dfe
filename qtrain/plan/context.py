"""The memory plan's row for --context-parallel N (`parallel/context.py`, `parallel/ring_attention.py`), beside the
block's own statements, which already count a rank's B x T/N tokens (its q, k, v, the attention output and its
log-sum-exp, as for any causal attention over those tokens).

* allgather: each layer's SDPA keeps the gathered K and V of the whole sequence (2 x B x nkv x T x hs in the model
  dtype) for its backward; with --recompute-att or --recompute-block only the layer whose backward runs has them
  (its attention's forward, the gather included, reruns there: parallel/context_ops.py); the mask over global positions, (T/N, T) bool made once, or with --document-masking the
  micro-batch's (B, 1, T/N, T) mask and the rows' document indices (B, T) int64.
* ring: nothing more is kept per layer (the ring's saved out and lse are the block's attention output and
  log-sum-exp); in flight during one block's attention: the received K/V block (in backward also its fp32 dK/dV
  accumulators, sent and received), the current block expanded to the query heads in fp32, its (T/N, T/N) mask
  ((B, 1, T/N, T/N) with documents), and the fp32 scores, probabilities and their gradient of one slice of query
  rows, at most `ring_attention.SCORE_BYTES` each; with --document-masking the rows' document indices (B, T) int64.
  An upper bound of the plain-torch ring's transient (the larger of forward and backward).
"""
from __future__ import annotations

from qtrain.model.config import ModelConfig
from qtrain.model.family import DTYPE_BYTES
from qtrain.options import Options
from qtrain.parallel.ring_attention import SCORE_BYTES

__all__ = ["context_parallel_bytes"]


def context_parallel_bytes(cfg: ModelConfig, opts: Options, recompute: frozenset[str] = frozenset()
                           ) -> tuple[int, str] | None:
    """(device bytes, what they are) that --context-parallel's attention adds to a micro-step; None without it.
    recompute: the resolved recompute switches (recompute_flags.resolve_flags)."""
    n = opts.context_parallel
    if n <= 1:
        return None
    B, T, L = opts.batch_size, opts.seq_len, cfg.num_hidden_layers
    t, hs, nh, nkv, e = T // n, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, DTYPE_BYTES[
        opts.model_dtype]
    doc_ids = 8 * B * T if opts.document_masking else 0
    if opts.context_parallel_mode == "ring":
        block, expanded = B * nkv * t * hs, 2 * B * nh * t * hs * 4
        mask = (B if opts.document_masking else 1) * t * t
        scores = 3 * min(SCORE_BYTES, B * nh * t * t * 4)
        transient = 2 * block * e + 2 * 2 * block * 4 + expanded + mask + scores  # backward's: forward's is less
        return doc_ids + transient, (f"ring: one K/V block (and its dK/dV) in flight, fp32 scores of query-row slices "
                                     f"(<= {SCORE_BYTES >> 20} MiB each)")
    kept_layers = 1 if recompute & {"att", "block"} else L
    gathered = kept_layers * 2 * B * nkv * T * hs * e
    mask = B * t * T + doc_ids if opts.document_masking else t * T
    kept = f"{L} layers kept for backward" if kept_layers == L else "the layer in backward (recomputed)"
    return gathered + mask, f"allgather: the gathered K/V of {kept}, the (T/{n}, T) mask"
