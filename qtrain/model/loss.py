"""LM head + cross-entropy that never materialises fp32 logits for the whole micro-batch.

The head runs over `chunks` row-slices of the final hidden states. For each slice: logits in the model
dtype (as HF computes them), then fp32 log-sum-exp, loss and d(logits); the d(logits) slice is turned
into its contributions to d(hidden) and d(W_head) at once, so only one slice of logits is alive at a time.
Because gradients are computed in the forward pass, backward just scales them: this is llm.q's "LM head
only in backward" and Liger's fused linear cross-entropy, written in plain torch. `lm_head_loss_and_grads` returns
them without autograd (the training micro-step, which starts its backward there); `chunked_lm_head_loss` is the
same as an autograd Function (evaluation, tests).

Loss convention: sum over tokens of (lse - logit[target]) + z_loss * lse^2 (PaLM's z-loss), targets of
-100 ignored; the caller passes `scale` (e.g. 1 / number of valid targets in the global batch) so that
gradient accumulation and data parallelism give the mean over the global batch.
"""
from __future__ import annotations

import torch

from qtrain.kernels import cross_entropy
from qtrain.kernels.cross_entropy import IGNORE_INDEX  # noqa: F401  (re-exported: the model's ignore label)
from qtrain.kernels.cross_entropy import chunk_loss_and_dlogits as _chunk_loss_and_dlogits  # noqa: F401

_compiled_loss_fn = None


def _loss_fn(cuda: bool):
    """On the GPU, torch.compile fuses the chunk's ~10 elementwise passes over fp32 logits (upcast,
    logsumexp, softmax, scatter, downcast) into a few kernels; measured as ~40% of a Qwen2.5-0.5B step
    when run eagerly. The CPU runs the plain function (the specification). By default
    (``qtrain.kernels.cross_entropy.FUSED_CE_ENABLED``) CUDA logits go to the fused Triton kernel instead,
    which reads each row twice and writes d(logits) over the logits buffer (fine here: the logits are not
    read again): faster than the compiled version and one fewer (n, V) buffer alive."""
    global _compiled_loss_fn
    if not cuda:
        return _chunk_loss_and_dlogits
    if cross_entropy.FUSED_CE_ENABLED:
        return cross_entropy.cross_entropy_fwd_bwd_inplace_
    if _compiled_loss_fn is None:
        _compiled_loss_fn = torch.compile(_chunk_loss_and_dlogits, dynamic=False)
    return _compiled_loss_fn


def lm_head_loss_and_grads(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, *, chunks: int, z_loss: float,
                           scale: float, need_grad: bool = True
                           ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(scale * summed token loss, d(h), d(w)) of `h` (N, C) under the head `w` (V, C), chunk by chunk (module
    docstring); the gradients are those of the returned loss, None without `need_grad`. No autograd: a caller that
    starts its backward here (the Transformer's micro-step) uses d(h) and d(w) as they are, with no multiplication
    by an upstream gradient of 1 (two passes over d(w), 467 MB at Qwen2.5-1.5B, per micro-step)."""
    if chunks < 1:
        raise ValueError(f"--lmhead-chunks must be >= 1, got {chunks}")
    n = h.shape[0]
    dh = torch.empty_like(h) if need_grad else None
    # d(w) is written by the first chunk's GEMM (beta 0) and accumulated by the others: no memset of it first
    dw = (torch.empty_like(w) if n else torch.zeros_like(w)) if need_grad else None
    beta = 0
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    bounds = [n * i // chunks for i in range(chunks + 1)]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi == lo:
            continue
        hc = h[lo:hi]
        logits = hc @ w.t()  # (n_c, V) in model dtype
        ls, _, dl = _loss_fn(logits.is_cuda)(logits, targets[lo:hi], z_loss=z_loss, need_grad=need_grad)
        del logits
        loss += ls
        if need_grad:
            _addmm_(dh[lo:hi], dl, w, beta=0, alpha=scale)
            _addmm_(dw, dl.t(), hc, beta=beta, alpha=scale)
            beta = 1
        del dl  # free this chunk's d(logits) before the next chunk's logits exist
    return loss * scale, dh, dw


class _ChunkedHeadLoss(torch.autograd.Function):
    """`lm_head_loss_and_grads` as an autograd Function: the gradients are made in forward, backward scales them
    by the upstream gradient."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, chunks: int, z_loss: float,
                scale: float) -> torch.Tensor:
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        loss, dh, dw = lm_head_loss_and_grads(h, w, targets, chunks=chunks, z_loss=z_loss, scale=scale,
                                              need_grad=need_grad)
        ctx.save_for_backward(dh, dw)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        dh, dw = ctx.saved_tensors
        # scale on the device (testing grad_loss == 1 on the host would cost a sync per call)
        if dh is not None:
            dh.mul_(grad_loss.to(dh.dtype))
            dw.mul_(grad_loss.to(dw.dtype))
        return dh, dw, None, None, None, None


def _addmm_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float, alpha: float) -> None:
    """out = beta * out + alpha * (a @ b), accumulated in fp32 and rounded once to out's dtype: what cuBLAS
    does for bf16. The CPU's own bf16 GEMMs over a 50k vocabulary are slow (4.3 s for the embedded tiny model's
    256 x 50257 x 128 d(hidden) on the CI machine, 0.07 s in fp32), so the CPU computes the same thing in fp32."""
    if out.is_cuda or out.dtype == torch.float32:
        torch.addmm(out, a, b, beta=beta, alpha=alpha, out=out)
        return
    acc = torch.mm(a.float(), b.float()).mul_(alpha)
    if beta:
        acc.add_(out, alpha=beta)  # promoted into the fp32 sum: no fp32 copy of `out`
    out.copy_(acc)


def chunked_lm_head_loss(h: torch.Tensor, w_head: torch.Tensor, targets: torch.Tensor, *, chunks: int = 1,
                         z_loss: float = 0.0, scale: float = 1.0) -> torch.Tensor:
    """`scale` times the summed token loss of `h` (N, C) under LM head `w_head` (V, C) for `targets` (N,),
    as an fp32 scalar whose gradient is computed chunk by chunk during this call (see module docstring)."""
    if not (torch.is_grad_enabled() and (h.requires_grad or w_head.requires_grad)):
        with torch.no_grad():
            return lm_head_loss_and_grads(h, w_head, targets, chunks=chunks, z_loss=float(z_loss), scale=float(scale),
                                          need_grad=False)[0]
    return _ChunkedHeadLoss.apply(h, w_head, targets, chunks, float(z_loss), float(scale))


def head_workspace_bytes(tokens: int, hidden: int, vocab: int, *, dtype_bytes: int, chunks: int = 1,
                        cuda: bool = True) -> int:
    """Bytes `chunked_lm_head_loss` holds at its peak in training (an estimate, checked against a CPU allocation
    tracker and the H200's peaks): one chunk's logits with the loss's temporaries per logit, d(hidden) and
    d(W_head). On CUDA the fused cross-entropy (`_loss_fn`) writes d(logits) over the logits, so a logit costs
    one model-dtype value; the compiled loss keeps d(logits) and fp32 temporaries, and the plain CPU function
    fp32 copies (plus, with several chunks, the previous chunk's d(logits) until the next one exists)."""
    E = dtype_bytes
    rows = -(-tokens // max(1, chunks))
    if cuda and cross_entropy.FUSED_CE_ENABLED:
        per_logit = E
    else:
        per_logit = (2 * E + 4) if cuda else (E + 12 if E != 4 else 12)
        if chunks > 1:
            per_logit += E  # the previous chunk's d(logits) is still referenced while the next one is computed
    chunk = rows * (vocab * per_logit + 32)  # the loss's moment
    if not cuda and E != 4:  # `_addmm_`'s moment on the CPU: d(logits), its fp32 copy, the weight's, the product
        chunk = max(chunk, rows * vocab * (E + 4) + vocab * hidden * 4 + rows * hidden * 4)
    return chunk + tokens * hidden * E + vocab * hidden * E
