"""The Llama-family decoder (Qwen2 / Llama 2-3 / Qwen3) with an explicit per-block forward/backward loop.

Reading order: `make_block_fn` (one pre-norm block, functional) -> `Transformer.forward_backward`
(embedding -> blocks -> final norm + chunked LM head loss -> blocks backward, one block at a time ->
embedding backward).

Why an explicit loop instead of one autograd graph: the backward of block l ends inside our code, so the
gradient manager receives that block's weight gradients at once (`GradientSink.accumulate_block`) and can
start communicating them while block l-1 runs its backward (llm.q's `notify_block`); recomputation and
weight gathering hook into the same loop. Within a block, autograd (and, on the GPU, torch.compile) does
the work. Weights come from a `WeightSource`, so replicated, sharded or quantized weights look the same here.

Dimension letters: B batch, T sequence, C hidden, nh / nkv query / kv heads, hs head size, V vocab.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .layers import apply_rope, rms_norm, rope_tables, swiglu
from .loss import IGNORE_INDEX, chunked_lm_head_loss
from .weights import block_tensor_names, param_shapes

Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
BlockFn = Callable[[torch.Tensor, dict, torch.Tensor, torch.Tensor], torch.Tensor]


class WeightSource(Protocol):
    """Where the model gets its weights. `block(l)` / `non_block()` return tensors that require grad (the
    model differentiates with respect to exactly these); `release_block(l)` says block l is no longer
    needed in this pass (a sharded source may free or reuse its buffer)."""

    def block(self, layer: int) -> dict[str, torch.Tensor]: ...
    def non_block(self) -> dict[str, torch.Tensor]: ...
    def release_block(self, layer: int) -> None: ...


class GradientSink(Protocol):
    """Receives weight gradients of one micro-step as soon as they exist. Tensors handed over are fresh
    (owned by the sink); names are the short block names or 'embed' / 'norm' / 'lm_head'."""

    def accumulate_block(self, layer: int, grads: dict[str, torch.Tensor]) -> None: ...
    def accumulate_non_block(self, grads: dict[str, torch.Tensor]) -> None: ...


class ParamWeights:
    """The plain weight source: a flat dict of full parameter tensors (replicated weights)."""

    def __init__(self, cfg: ModelConfig, params: dict[str, torch.Tensor]):
        self.params = params
        self._block_names = block_tensor_names(cfg)
        self._tied = cfg.tie_word_embeddings

    def block(self, layer: int) -> dict[str, torch.Tensor]:
        return {n: self.params[f"layers.{layer}.{n}"] for n in self._block_names}

    def non_block(self) -> dict[str, torch.Tensor]:
        names = ("embed", "norm") if self._tied else ("embed", "norm", "lm_head")
        return {n: self.params[n] for n in names}

    def release_block(self, layer: int) -> None:
        pass


def make_block_fn(cfg: ModelConfig, linear: Linear = F.linear) -> BlockFn:
    """One pre-norm decoder block as a function of (x, weights, cos, sin), so one compiled graph serves
    every layer (weights are inputs, not captured constants)."""
    nh, nkv, hs, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    q_dim, kv_dim, qk_norm, gqa = cfg.q_dim, cfg.kv_dim, cfg.qk_norm, nh != nkv

    def block(x: torch.Tensor, w: dict[str, torch.Tensor], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # 1) attention: norm -> fused QKV projection -> (qk-norm) -> RoPE -> causal SDPA -> output projection
        h = rms_norm(x, w["ln1"], eps)
        qkv = linear(h, w["qkv"], w.get("qkv_bias"))  # (B, T, q_dim + 2 kv_dim)
        q, k, v = qkv.split([q_dim, kv_dim, kv_dim], dim=-1)
        q, k, v = q.view(B, T, nh, hs), k.view(B, T, nkv, hs), v.view(B, T, nkv, hs)
        if qk_norm:
            q, k = rms_norm(q, w["q_norm"], eps), rms_norm(k, w["k_norm"], eps)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, nh|nkv, T, hs)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)  # (B, nh, T, hs)
        att = att.transpose(1, 2).reshape(B, T, q_dim)
        x = x + linear(att, w["o"], None)
        # 2) MLP: norm -> fused up/gate projection -> SwiGLU -> down projection
        h = rms_norm(x, w["ln2"], eps)
        return x + linear(swiglu(linear(h, w["up"], None)), w["down"], None)

    return block


@dataclass(kw_only=True)
class RunOptions:
    """How the model executes (not what it computes)."""

    lmhead_chunks: int = 1  # row chunks of the LM head + loss: fp32 logits live for 1/chunks of the batch
    recompute_block: bool = False  # keep only each block's input; rerun its forward inside backward
    compile: bool = False  # torch.compile the block function (GPU)
    linear: Linear = F.linear  # the block linears; FP8 swaps in its own


class Transformer:
    """Runs forward, backward and evaluation of a decoder whose weights come from a WeightSource."""

    def __init__(self, cfg: ModelConfig, run: RunOptions | None = None):
        self.cfg = cfg
        self.run = run or RunOptions()
        fn = make_block_fn(cfg, self.run.linear)
        self.block_fn: BlockFn = torch.compile(fn, dynamic=False) if self.run.compile else fn
        self._rope: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def rope(self, T: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (T, str(device), dtype)
        if key not in self._rope:
            self._rope[key] = rope_tables(self.cfg, T, device, dtype)
        return self._rope[key]

    def _head_weight(self, nb: dict[str, torch.Tensor]) -> torch.Tensor:
        return nb["embed"] if self.cfg.tie_word_embeddings else nb["lm_head"]

    # ---- training ----
    def forward_backward(self, weights: WeightSource, inputs: torch.Tensor, targets: torch.Tensor, *,
                         grads: GradientSink, loss_scale: float, z_loss: float = 0.0) -> torch.Tensor:
        """One micro-step. inputs/targets: (B, T) int64 on the compute device. Differentiates
        loss_scale * (summed token loss) and hands every weight gradient to `grads`; returns that scaled
        loss as a detached fp32 scalar (no host sync)."""
        cfg, C = self.cfg, self.cfg.hidden_size
        B, T = inputs.shape
        nb = weights.non_block()
        embed = nb["embed"]
        cos, sin = self.rope(T, embed.device, embed.dtype)

        # forward: keep each block's input (a leaf, so backward can stop there) and, unless recomputing, its graph
        x = F.embedding(inputs, embed.detach())  # (B, T, C)
        saved: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        for layer in range(cfg.num_hidden_layers):
            w = weights.block(layer)
            x_in = x.detach().requires_grad_(True)
            if self.run.recompute_block:
                with torch.no_grad():
                    x = self.block_fn(x_in, w, cos, sin)
                saved.append((x_in, None))
            else:
                with torch.enable_grad():
                    x = self.block_fn(x_in, w, cos, sin)
                saved.append((x_in, x))
            weights.release_block(layer)

        # head: final norm + chunked LM head + loss; its gradients are computed right here
        x_last = x.detach().requires_grad_(True)
        head_w, norm_w = self._head_weight(nb), nb["norm"]
        with torch.enable_grad():
            h = rms_norm(x_last, norm_w, cfg.rms_norm_eps).view(B * T, C)
            loss = chunked_lm_head_loss(h, head_w, targets.reshape(-1), chunks=self.run.lmhead_chunks,
                                        z_loss=z_loss, scale=loss_scale)
            dx, d_norm, d_head = torch.autograd.grad(loss, [x_last, norm_w, head_w])
        del h, x, x_last
        if cfg.tie_word_embeddings:
            grads.accumulate_non_block({"norm": d_norm})
        else:
            grads.accumulate_non_block({"norm": d_norm, "lm_head": d_head})
            d_head = None

        # backward through the blocks, last to first; each block's weight gradients leave immediately
        for layer in reversed(range(cfg.num_hidden_layers)):
            x_in, y = saved.pop()
            w = weights.block(layer)
            names = list(w)
            with torch.enable_grad():
                if y is None:
                    y = self.block_fn(x_in, w, cos, sin)
                g = torch.autograd.grad(y, [x_in] + [w[n] for n in names], dx)
            dx = g[0]
            del y, x_in
            weights.release_block(layer)
            grads.accumulate_block(layer, dict(zip(names, g[1:])))

        grads.accumulate_non_block({"embed": self._embedding_backward(inputs, dx, embed, d_head)})
        return loss.detach()

    def _embedding_backward(self, inputs: torch.Tensor, dx: torch.Tensor, embed: torch.Tensor,
                            d_head: torch.Tensor | None) -> torch.Tensor:
        """Dense (V, C) gradient of the embedding (+ the tied LM head's). aten's embedding backward sums
        rows deterministically in fp32 (sort + segment sum on CUDA) without a host sync."""
        g = torch.ops.aten.embedding_dense_backward(dx, inputs, embed.shape[0], -1, False)
        if d_head is None:
            return g
        return d_head.add_(g)

    # ---- evaluation ----
    @torch.no_grad()
    def hidden_states(self, weights: WeightSource, inputs: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states (B, T, C)."""
        nb = weights.non_block()
        cos, sin = self.rope(inputs.shape[1], nb["embed"].device, nb["embed"].dtype)
        x = F.embedding(inputs, nb["embed"])
        for layer in range(self.cfg.num_hidden_layers):
            x = self.block_fn(x, weights.block(layer), cos, sin)
            weights.release_block(layer)
        return rms_norm(x, nb["norm"], self.cfg.rms_norm_eps)

    @torch.no_grad()
    def logits(self, weights: WeightSource, inputs: torch.Tensor) -> torch.Tensor:
        """Full logits (B, T, V) in the model dtype: for tests and small-scale use only."""
        h = self.hidden_states(weights, inputs)
        return h @ self._head_weight(weights.non_block()).t()

    @torch.no_grad()
    def loss_sum(self, weights: WeightSource, inputs: torch.Tensor, targets: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed token loss fp32, number of valid targets) of one batch, without gradients."""
        B, T = inputs.shape
        h = self.hidden_states(weights, inputs).view(B * T, -1)
        t = targets.reshape(-1)
        loss = chunked_lm_head_loss(h, self._head_weight(weights.non_block()), t, chunks=self.run.lmhead_chunks)
        return loss, (t != IGNORE_INDEX).sum()


def allocate_params(cfg: ModelConfig, *, dtype: torch.dtype, device: torch.device | str,
                    requires_grad: bool = True) -> dict[str, torch.Tensor]:
    """Uninitialised parameters of every internal name (fill them with `init.init_params` or a loader)."""
    return {n: torch.empty(s, dtype=dtype, device=device).requires_grad_(requires_grad)
            for n, s in param_shapes(cfg).items()}
