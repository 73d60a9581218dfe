"""LM head + cross-entropy that never materialises fp32 logits for the whole micro-batch: the cross-entropy op's entry.

The head runs over `chunks` row-slices of the final hidden states. For each slice: logits in the model
dtype (as HF computes them), then fp32 log-sum-exp, loss and d(logits); the d(logits) slice is turned
into its contributions to d(hidden) and d(W_head) at once, so only one slice of logits is alive at a time.
Because gradients are computed in the forward pass, backward just scales them: this is llm.q's "LM head
only in backward" and Liger's fused linear cross-entropy, written in plain torch around the chunk's cross-entropy
kernels (`inplace.py`; with --fp8-head-backward `fp8.py`). `lm_head_loss_and_grads` returns them without autograd
(the training micro-step, which starts its backward there); `chunked_lm_head_loss` is the same as an autograd
Function (evaluation, tests); `head_workspace_bytes` is what they hold at their peak (the memory plan's).

Loss convention: sum over tokens of (lse - logit[target]) + z_loss * lse^2 (PaLM's z-loss), targets of
-100 ignored; the caller passes `scale` (e.g. 1 / number of valid targets in the global batch) so that
gradient accumulation and data parallelism give the mean over the global batch.
"""
from __future__ import annotations

import torch

from qtrain.kernels.cross_entropy.fp8 import G_SCALE_EXP, cross_entropy_fp8_grads
from qtrain.kernels.cross_entropy.inplace import chunk_loss_and_dlogits, cross_entropy_fwd_bwd_inplace_
from qtrain.kernels.fp8_quant import E4M3, quantize_fp8_transposed
from qtrain.kernels.scaled_mm import scaled_mm

__all__ = ["chunked_lm_head_loss", "fp8_backward_shapes_ok", "head_logits_buffer", "head_workspace_bytes",
           "lm_head_loss_and_grads"]


def _loss_fn(cuda: bool):
    """The chunk's loss and d(logits): CUDA logits go to the fused kernel, which reads each row twice and writes
    d(logits) over the logits buffer (fine here: the logits are not read again), faster than the chunk's ~10
    elementwise passes over fp32 copies of the logits even when torch.compile fuses them, and one fewer (n, V) buffer
    alive (`inplace.py`); the CPU runs the specification, which returns a new d(logits)."""
    return cross_entropy_fwd_bwd_inplace_ if cuda else chunk_loss_and_dlogits


def fp8_backward_shapes_ok(rows: int, hidden: int, vocab: int) -> bool:
    """Whether the FP8 backward GEMMs take this head: cuBLASLt FP8 needs K and N multiples of 16 (the vocabulary and
    hidden size; the rows, which are d(W)'s K, in chunks of multiples of 16)."""
    return rows % 16 == 0 and hidden % 16 == 0 and vocab % 16 == 0


def _chunk_bounds(n: int, chunks: int, fp8: bool) -> list[int]:
    """Row bounds of the head's chunks over `n` rows; FP8's in whole 16-row groups (d(W)'s K and q^T's column
    offset)."""
    step = 16 if fp8 else 1
    return [step * (n // step * i // chunks) for i in range(chunks)] + [n]


def _fp8_head(n: int, hidden: int, vocab: int, *, need_grad: bool, fp8_backward: bool) -> bool:
    return need_grad and fp8_backward and n > 0 and fp8_backward_shapes_ok(n, hidden, vocab)


def head_logits_buffer(h_rows: int, w: torch.Tensor, *, chunks: int, fp8_backward: bool = False) -> torch.Tensor:
    """The bytes one chunk's logits take in `lm_head_loss_and_grads` (its `logits_buffer`), for a training micro-step
    to claim before its blocks run. The head's logits are the micro-step's largest allocation (9.27 GiB at
    Qwen2.5-0.5B, 32 x 1024, one chunk); made at the head, after the activations, they needed a free block that
    size in memory the activations had just cut up, and a step the plan fitted in 46 of 79 GiB ran out with 39.6
    GiB free in pieces (one H100, session 31). At the micro-step's start only the persistent state is live, so the
    allocator has that block, or can release whole free segments to make it; the peak stays the head's."""
    if chunks < 1:
        raise ValueError(f"--lmhead-chunks must be >= 1, got {chunks}")
    bounds = _chunk_bounds(h_rows, chunks, _fp8_head(h_rows, w.shape[1], w.shape[0], need_grad=True,
                                                     fp8_backward=fp8_backward))
    rows = max(hi - lo for lo, hi in zip(bounds[:-1], bounds[1:]))
    return torch.empty((rows, w.shape[0]), dtype=w.dtype, device=w.device)


def lm_head_loss_and_grads(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, *, chunks: int, z_loss: float,
                           scale: float, need_grad: bool = True, fp8_backward: bool = False,
                           need_weight_grad: bool = True, logits_buffer: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(scale * summed token loss, d(h), d(w)) of `h` (N, C) under the head `w` (V, C), chunk by chunk (module
    docstring); the gradients are those of the returned loss, None without `need_grad`; d(w) None without
    `need_weight_grad` too (a frozen head, as under LoRA: its gradient GEMM, 2 N V C FLOPs, and the (V, C) buffer are
    not made). No autograd: a caller that starts its backward here (the Transformer's micro-step) uses d(h) and d(w)
    as they are, with no multiplication by an upstream gradient of 1 (two passes over d(w), 467 MB at Qwen2.5-1.5B,
    per micro-step).

    `fp8_backward` (--fp8-head-backward): the two gradient GEMMs in FP8 (`_Fp8HeadOperands`) where the shapes allow
    (`fp8_backward_shapes_ok`, else bf16 as without); the logits and the loss are the same either way.
    `logits_buffer`: `head_logits_buffer`'s tensor for the same rows, head and options: each chunk's logits are
    written there (None: each chunk allocates its own)."""
    if chunks < 1:
        raise ValueError(f"--lmhead-chunks must be >= 1, got {chunks}")
    n = h.shape[0]
    dh = torch.empty_like(h) if need_grad else None
    # d(w) is written by the first chunk's GEMM (beta 0) and accumulated by the others: no memset of it first
    need_weight_grad = need_grad and need_weight_grad
    dw = (torch.empty_like(w) if n else torch.zeros_like(w)) if need_weight_grad else None
    first = True
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    use_fp8 = _fp8_head(n, h.shape[1], w.shape[0], need_grad=need_grad, fp8_backward=fp8_backward)
    fp8 = _Fp8HeadOperands.of(h, w, scale, weight_grad=need_weight_grad) if use_fp8 else None
    bounds = _chunk_bounds(n, chunks, use_fp8)
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi == lo:
            continue
        hc = h[lo:hi]
        if logits_buffer is None:
            logits = hc @ w.t()  # (n_c, V) in model dtype
        else:
            logits = torch.mm(hc, w.t(), out=logits_buffer[:hi - lo])
        if fp8 is not None:
            ls, _, g, g_t = cross_entropy_fp8_grads(logits, targets[lo:hi], z_loss=z_loss)
            del logits  # g lives in its bytes
            fp8.chunk_grads(g, g_t, lo, hi, dh, dw, first=first)
            del g, g_t
        else:
            ls, lse, dl = _loss_fn(logits.is_cuda)(logits, targets[lo:hi], z_loss=z_loss, need_grad=need_grad)
            # the CPU's specification returns a new d(logits): the logits go before the GEMMs, and the rows'
            # log-sum-exp is not kept into the next chunk
            del logits, lse
            if need_grad:
                _addmm_(dh[lo:hi], dl, w, beta=0, alpha=scale)
                if dw is not None:
                    _addmm_(dw, dl.t(), hc, beta=0 if first else 1, alpha=scale)
            del dl  # free this chunk's d(logits) before the next chunk's logits exist
        loss += ls
        first = False
    return loss * scale, dh, dw


class _Fp8HeadOperands:
    """The LM head's backward in FP8 (--fp8-head-backward): d(h) = G W and d(W) = G^T h as e5m2 x e4m3 GEMMs, G the
    cross-entropy's d(logits) in e5m2 at the fixed scale 2^15 (`fp8.py` says why), W and h in
    e4m3 with per-tensor abs-max scales, quantized once per call of `lm_head_loss_and_grads` (per micro-step: the
    weight changes at every update, and a cache keyed on it would miss writes into reused gather buffers). The
    forward GEMM (the logits) stays in the model dtype, so the loss is unchanged. Why: the head's three GEMMs are
    ~16% of a Qwen2.5-1.5B e4m3 step on the H200 and FP8 runs GEMMs at up to twice bf16's rate.

    cuBLASLt multiplies FP8 row-major by column-major only: d(h) takes G (n_c, V) and W^T (C, V); d(W) takes G^T
    (V, n_c) and h^T (C, n); the quantize kernel writes W^T and h^T, the cross-entropy kernel G and G^T. Memory
    beyond the bf16 head (`head_workspace_bytes`): G^T (one chunk, 1 byte per logit), W's and h's two e4m3 copies,
    and with several chunks one fp32 (V, C) product per chunk after the first, added into d(W) (one rounding, as
    the bf16 path's accumulating GEMM)."""

    def __init__(self, w_t: torch.Tensor, w_inv: torch.Tensor, h_t: torch.Tensor, h_inv: torch.Tensor,
                 g_inv: torch.Tensor) -> None:
        self.w_t, self.w_inv, self.h_t, self.h_inv, self.g_inv = w_t, w_inv, h_t, h_inv, g_inv

    @classmethod
    def of(cls, h: torch.Tensor, w: torch.Tensor, scale: float, *, weight_grad: bool = True) -> "_Fp8HeadOperands":
        """`weight_grad` False (a frozen head): h is not quantized, d(W) is not made (`chunk_grads` with dw None)."""
        w_t, w_inv = quantize_fp8_transposed(w, E4M3)  # (C, V)
        h_t, h_inv = quantize_fp8_transposed(h, E4M3) if weight_grad else (None, None)  # (C, n)
        # G's inverse scale times the loss scale: the GEMMs apply both (a fill kernel; CUDA graphs capture it)
        g_inv = torch.full((), 2.0 ** -G_SCALE_EXP * scale, dtype=torch.float32, device=h.device)
        return cls(w_t, w_inv, h_t, h_inv, g_inv)

    def chunk_grads(self, g: torch.Tensor, g_t: torch.Tensor, lo: int, hi: int, dh: torch.Tensor,
                    dw: torch.Tensor | None, *, first: bool) -> None:
        """d(h)[lo:hi] = scale G W; d(W) = (first ? 0 : d(W)) + scale G^T h[lo:hi], for one chunk's G (rows lo:hi);
        no d(W) when `dw` is None (a frozen head)."""
        scaled_mm(g, self.w_t.t(), self.g_inv, self.w_inv, out_dtype=dh.dtype, out=dh[lo:hi])
        if dw is None:
            return
        h_c = self.h_t[:, lo:hi].t()  # (n_c, C), column-major
        if first:
            scaled_mm(g_t, h_c, self.g_inv, self.h_inv, out_dtype=dw.dtype, out=dw)
        else:
            dw.add_(scaled_mm(g_t, h_c, self.g_inv, self.h_inv, out_dtype=torch.float32))


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
                        cuda: bool = True, fp8_backward: bool = False, weight_grad: bool = True) -> int:
    """Bytes `chunked_lm_head_loss` holds at its peak in training (an estimate, checked against a CPU allocation
    tracker and the H200's peaks): one chunk's logits with the loss's temporaries per logit, d(hidden) and
    d(W_head). On CUDA the fused cross-entropy (`_loss_fn`) writes d(logits) over the logits, so a logit costs
    one model-dtype value; the CPU's specification keeps fp32 copies (plus, with several chunks, the previous
    chunk's d(logits) until the next one exists).
    `fp8_backward` (`_Fp8HeadOperands`) adds, at its peak: the chunk's G^T (a byte per logit), the e4m3 copies of W
    and h (both orders: the quantize kernel writes both), and with several chunks one fp32 (V, C) product.
    `weight_grad` False (a frozen head): no d(W_head), nor h's e4m3 copies or the fp32 product."""
    E = dtype_bytes
    rows = -(-tokens // max(1, chunks))
    if fp8_backward and fp8_backward_shapes_ok(tokens, hidden, vocab):
        extra = rows * vocab + 2 * vocab * hidden + (
            2 * tokens * hidden + (4 * vocab * hidden if chunks > 1 else 0) if weight_grad else 0)
        return extra + head_workspace_bytes(tokens, hidden, vocab, dtype_bytes=dtype_bytes, chunks=chunks, cuda=cuda,
                                            weight_grad=weight_grad)
    if cuda:
        per_logit = E
    else:
        per_logit = E + 12 if E != 4 else 12
        if chunks > 1:
            per_logit += E  # the previous chunk's d(logits) is still referenced while the next one is computed
    chunk = rows * (vocab * per_logit + 32)  # the loss's moment
    if not cuda and E != 4:  # `_addmm_`'s moment on the CPU: the logits buffer (`head_logits_buffer`: the
        # specification's d(logits) is a new tensor), d(logits), its fp32 copy, the weight's, the product, and the
        # running and the chunk's loss (two fp32 scalars)
        chunk = max(chunk, rows * vocab * (2 * E + 4) + vocab * hidden * 4 + rows * hidden * 4 + 8)
    return chunk + tokens * hidden * E + (vocab * hidden * E if weight_grad else 0)
