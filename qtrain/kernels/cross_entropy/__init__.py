"""Cross-entropy's one home: the LM head and its loss, chunk by chunk, with the gradients made in the forward.

The entries the model calls:
* `lm_head_loss_and_grads(h, w, targets, ...)`: the training micro-step's loss, d(hidden) and d(W_head), no autograd
  (with `fp8_backward`, --fp8-head-backward, the two gradient GEMMs in FP8), its chunk's logits in
  `head_logits_buffer(...)`, which the micro-step claims before its blocks run;
* `chunked_lm_head_loss(h, w, targets, ...)`: the same as an autograd function (evaluation);
* `head_workspace_bytes(...)`: what they hold at their peak (the memory plan's row); `IGNORE_INDEX`: the target
  label the loss skips.

Modules: head (the chunked LM head: GEMMs, the FP8 backward's operands, the workspace statement), inplace (one
chunk's loss and d(logits) written over the logits: kernel, twin, specification), fp8 (d(logits) as e5m2 codes and
their transpose: kernel and twin).
"""
from qtrain.kernels.cross_entropy.head import (chunked_lm_head_loss, fp8_backward_shapes_ok, head_logits_buffer,
                                               head_workspace_bytes, lm_head_loss_and_grads)
from qtrain.kernels.cross_entropy.inplace import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "chunked_lm_head_loss", "fp8_backward_shapes_ok", "head_logits_buffer",
           "head_workspace_bytes", "lm_head_loss_and_grads"]
