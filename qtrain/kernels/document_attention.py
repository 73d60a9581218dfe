"""Attention inside documents (--document-masking): a token attends to the earlier tokens of its own document only.

A micro-batch's documents arrive as position ids (B, T) on the host: each token's position in its document, 0 at
a document's first token (a row's first token always starts one: `data/documents.py`). `document_mask(positions,
...)` turns them, once per micro-step, into what attention reads (`DocumentMask`), in one of two forms
(--document-attention, its names in model/choices.DOCUMENT_ATTENTION):

* "varlen": the rows' documents as variable-length sequences of the flattened (B*T) tokens: `cu_seqlens` (D + 1,)
  int32, the documents' first tokens and B*T, and the longest document's length, for `varlen_attention`, an op pair
  (forward, backward) that is torch's flash attention for variable-length sequences on CUDA (the kernel that
  `torch.nn.attention.varlen` wraps, called through aten as kernels/attention.py calls cuDNN, so that the op is
  opaque to torch.compile and stable across torch versions) and its twin elsewhere. Work: the sum over documents of
  L^2 / 2, less than the T^2 / 2 per row of dense causal attention.
* "masked": a (B, 1, T, T) boolean mask (same document and key <= query), built on the device from the positions,
  for F.scaled_dot_product_attention (GQA's key/value heads expanded first, so that torch's memory-efficient kernel
  can take a mask on the GPU): the specification, the CPU path, and the GPU fallback.

"auto" picks varlen for bf16/fp16 on CUDA (flash attention takes nothing else) and masked otherwise.

Both come per attention slice (--attn-bwd-chunks splits the batch into slices whose attention runs, forward and
backward, as separate calls): a slice's rows are whole rows, so its documents are whole documents and its
`cu_seqlens` is the batch's restricted to the slice's tokens.

torch.compile: the block passes the `DocumentMask` (a NamedTuple of tensors) on; the length of `cu_seqlens` changes
from micro-step to micro-step, so it is marked dynamic (one compiled graph serves all), and the longest length
travels as a 0-dim int64 tensor on the host, which the op reads without a device sync, instead of an int (a
compiled block specializes on ints: a recompile for every new length).

The twin (`varlen_attention_twin`, `varlen_attention_backward_twin`) runs each document through kernels/attention.py's
causal twin (fp32 softmax attention, log-sum-exp saved): the specification of the varlen op. Layouts: q (total, nh,
hs), k and v (total, nkv, hs), out the same as q, lse (nh, total) fp32 (flash's varlen layout); GQA as in
kernels/attention.py; scale 1/sqrt(hs), no dropout.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from qtrain.kernels.attention import causal_attention_backward_twin, causal_attention_twin

__all__ = ["DocumentMask", "document_attention", "document_mask", "positions_error",
           "resolve_document_attention", "varlen_attention", "varlen_attention_backward_twin",
           "varlen_attention_twin"]

def resolve_document_attention(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """'auto' -> 'varlen' for bf16/fp16 on CUDA (flash attention's dtypes), 'masked' elsewhere; others as given."""
    if name != "auto":
        return name
    return "varlen" if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) else "masked"


class DocumentMask(NamedTuple):
    """One micro-batch's documents as attention reads them, per attention slice (the module docstring): varlen fills
    `cu_seqlens` and `max_seqlen`, masked fills `masks`."""
    cu_seqlens: tuple[torch.Tensor, ...] = ()  # per slice: (D_s + 1,) int32 on the device
    max_seqlen: tuple[torch.Tensor, ...] = ()  # per slice: the longest document, 0-dim int64 on the host
    masks: tuple[torch.Tensor, ...] = ()  # per slice: (B_s, 1, T, T) bool on the device, True = may attend

    @property
    def slices(self) -> int:
        return len(self.masks) or len(self.cu_seqlens)


def positions_error(positions: np.ndarray) -> str | None:
    """Why (B, T) position ids are not documents' positions (each row starts at 0; a position is 0 or its left
    neighbour's + 1), or None."""
    if positions.ndim != 2 or positions.shape[1] == 0:
        return f"position ids must be (B, T), got shape {positions.shape}"
    if (positions[:, 0] != 0).any():
        return "every row must start a document (position 0)"
    step = positions[:, 1:]
    if not ((step == 0) | (step == positions[:, :-1] + 1)).all():
        return "a position must be 0 (a document's first token) or its left neighbour's + 1"
    return None


def document_mask(positions: torch.Tensor, *, kind: str, slices: int = 1, device: torch.device | str = "cpu",
                  dynamic: bool = False) -> DocumentMask:
    """The `DocumentMask` of (B, T) position ids (best given on the host: the varlen form is made there), for `kind`
    'varlen' or 'masked', in `slices` batch slices (`torch.tensor_split`'s); `dynamic`: mark the cu_seqlens dynamic
    for torch.compile (the module docstring). A ValueError when the positions are no documents'."""
    host = positions.detach().cpu().numpy()
    why = positions_error(host)
    if why:
        raise ValueError(f"document_mask: {why}")
    B, T = host.shape
    rows = np.array_split(np.arange(B), slices)  # tensor_split's slices
    if kind == "masked":
        doc = (positions.to(device) == 0).cumsum(1)  # (B, T) document index within its row
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        mask = ((doc[:, :, None] == doc[:, None, :]) & causal).unsqueeze(1)  # (B, 1, T, T)
        return DocumentMask(masks=tuple(mask[r[0]:r[-1] + 1] for r in rows if len(r)))
    if kind != "varlen":
        raise ValueError(f"document_mask: kind must be 'varlen' or 'masked', got {kind!r}")
    cus, longest = [], []
    for r in rows:
        if not len(r):
            continue
        starts = np.flatnonzero(host[r[0]:r[-1] + 1].reshape(-1) == 0)
        bounds = np.append(starts, len(r) * T).astype(np.int32)
        cu = torch.from_numpy(bounds).to(device, non_blocking=True)
        if dynamic:
            torch._dynamo.maybe_mark_dynamic(cu, 0)
        cus.append(cu)
        longest.append(torch.tensor(int(np.diff(bounds).max()), dtype=torch.int64))
    return DocumentMask(cu_seqlens=tuple(cus), max_seqlen=tuple(longest))


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: DocumentMask) -> torch.Tensor:
    """Causal attention within documents: q (B, nh, T, hs), k, v (B, nkv, T, hs) (the block's transposed views of
    its (B, T, heads, hs) projection) -> (B, T, nh, hs), one call per slice of `docs`."""
    n = docs.slices
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, T, heads, hs)
    qs, ks, vs = ((t.tensor_split(n) if n > 1 else (t,)) for t in (q, k, v))
    if docs.masks:
        outs = [_masked(*qkv, mask) for *qkv, mask in zip(qs, ks, vs, docs.masks)]
    else:
        outs = [varlen_attention(qi.reshape(-1, *qi.shape[2:]), ki.reshape(-1, *ki.shape[2:]),
                                 vi.reshape(-1, *vi.shape[2:]), cu, longest).view(qi.shape)
                for qi, ki, vi, cu, longest in zip(qs, ks, vs, docs.cu_seqlens, docs.max_seqlen)]
    return torch.cat(outs) if n > 1 else outs[0]


def _masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA with the documents' mask: (b, T, heads, hs) in, (b, T, nh, hs) out."""
    groups = q.shape[2] // k.shape[2]
    if groups > 1:  # expanded: torch's memory-efficient kernel takes a mask but no GQA
        k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2)


# ---------------------------------------------------------------------------------------------- twin
def _documents(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    b = cu_seqlens.tolist()
    return [(s, e) for s, e in zip(b[:-1], b[1:]) if e > s]


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    if q.dim() != 3 or k.shape != v.shape or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] \
            or q.shape[1] % k.shape[1]:
        raise ValueError(f"varlen_attention: q must be (total, nh, hs) and k, v (total, nkv, hs) with nkv | nh, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32:
        raise ValueError(f"varlen_attention: cu_seqlens must be 1-D int32, got {tuple(cu_seqlens.shape)} "
                         f"{cu_seqlens.dtype}")


def varlen_attention_twin(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The specification of the forward: (out (total, nh, hs) in q's dtype, lse (nh, total) fp32), each document
    [cu_seqlens[i], cu_seqlens[i+1]) causal attention of its own."""
    _check(q, k, v, cu_seqlens)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)
    for s, e in _documents(cu_seqlens.cpu()):
        o, l = causal_attention_twin(*(t[s:e].transpose(0, 1)[None] for t in (q, k, v)))
        out[s:e] = o[0].transpose(0, 1)
        lse[:, s:e] = l[0]
    return out, lse


def varlen_attention_backward_twin(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                                   lse: torch.Tensor, dout: torch.Tensor, cu_seqlens: torch.Tensor
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The specification of the backward: dq, dk, dv in the inputs' dtype and shapes (fp32 math per document)."""
    dq, dk, dv = (torch.zeros_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    for s, e in _documents(cu_seqlens.cpu()):
        grads = causal_attention_backward_twin(*(t[s:e].transpose(0, 1)[None] for t in (q, k, v, out)),
                                               lse[None, :, s:e], dout[s:e].transpose(0, 1)[None])
        for d, g in zip((dq, dk, dv), grads):
            d[s:e] = g[0].transpose(0, 1)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------- ops
@torch.library.custom_op("qtrain::varlen_attention_fwd", mutates_args=())
def _varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                max_seqlen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return varlen_attention_twin(q, k, v, cu_seqlens)


@_varlen_fwd.register_kernel("cuda")
def _varlen_fwd_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                      max_seqlen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check(q, k, v, cu_seqlens)
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"varlen_attention: flash attention takes bf16 or fp16 q, k, v on CUDA, got {q.dtype}, "
                        f"{k.dtype}, {v.dtype} (fp32 runs: --document-attention masked)")
    n = int(max_seqlen)  # a host tensor: no device sync
    out, lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, cu_seqlens, cu_seqlens, n, n, 0.0, True, False)
    return out, lse


@_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens, max_seqlen):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[1], q.shape[0],
                                                                                   dtype=torch.float32)


@torch.library.custom_op("qtrain::varlen_attention_bwd", mutates_args=())
def _varlen_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                dout: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return varlen_attention_backward_twin(q, k, v, out, lse, dout, cu_seqlens)


_UNUSED: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _no_dropout_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """flash's philox state arguments, read only with dropout (as torch.nn.attention.varlen passes them)."""
    if device not in _UNUSED:
        _UNUSED[device] = (torch.zeros(2, dtype=torch.uint64, device=device), torch.empty(0, device=device))
    return _UNUSED[device]


@_varlen_bwd.register_kernel("cuda")
def _varlen_bwd_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                      dout: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = int(max_seqlen)
    rng, unused = _no_dropout_state(q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(dout.contiguous(), q, k, v, out, lse, cu_seqlens,
                                                          cu_seqlens, n, n, 0.0, True, rng, unused)
    return dq, dk, dv


@_varlen_bwd.register_fake
def _(q, k, v, out, lse, dout, cu_seqlens, max_seqlen):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens, max_seqlen = inputs
    ctx.save_for_backward(q, k, v, *output, cu_seqlens, max_seqlen)
    ctx.set_materialize_grads(False)  # lse has no gradient


def _backward(ctx, dout: torch.Tensor, _dlse: torch.Tensor | None):
    q, k, v, out, lse, cu_seqlens, max_seqlen = ctx.saved_tensors
    dq, dk, dv = _varlen_bwd(q, k, v, out, lse, dout, cu_seqlens, max_seqlen)
    return dq, dk, dv, None, None


_varlen_fwd.register_autograd(_backward, setup_context=_setup_context)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: torch.Tensor) -> torch.Tensor:
    """Causal attention within each document [cu_seqlens[i], cu_seqlens[i+1]) of the flattened tokens: q (total, nh,
    hs), k, v (total, nkv, hs) -> (total, nh, hs); max_seqlen: the longest document (0-dim int64 on the host). Flash
    attention on CUDA, the twin elsewhere; differentiable; opaque to torch.compile."""
    return _varlen_fwd(q, k, v, cu_seqlens, max_seqlen)[0]
