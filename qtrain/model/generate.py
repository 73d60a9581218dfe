"""Sampling text from a model: `qtrain generate` (nanoGPT's `sample.py`, HF's `generate`) on qtrain's own model
code, so any export or Hugging Face directory qtrain can load can be tried out without writing code.

Each new token runs the model over the whole sequence so far (no KV cache): simple and exact, and quick
enough for the short samples this is for (a few hundred tokens from a model that fits one device); serving
belongs to vLLM or transformers. The next token is drawn from the last position's logits, in fp32:

    temperature == 0            greedy (argmax; the first of equal maxima, as torch.argmax and HF do)
    otherwise                   logits / temperature, then top-k (keep the k largest), then top-p (keep the
                                smallest set of most likely tokens whose probability reaches p), then a draw
                                from the renormalised distribution with a seeded torch.Generator.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from qtrain.model.transformer import Transformer, WeightSource


class SamplingError(ValueError):
    """Bad sampling settings (temperature, top-k, top-p, lengths); the message names the setting."""


@dataclass(frozen=True, kw_only=True)
class Sampling:
    max_new_tokens: int = 100
    temperature: float = 0.8
    """0 = greedy."""
    top_k: int = 0
    """Keep only the k most likely tokens (0 = all)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the most likely tokens until their probability reaches p (1 = all)."""
    seed: int = 1337

    def validate(self) -> "Sampling":
        if self.max_new_tokens < 1:
            raise SamplingError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):  # NaN fails every comparison
            raise SamplingError(f"--temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise SamplingError(f"--top-k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"--top-p must be in (0, 1], got {self.top_p}")
        return self


def next_token_distribution(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """Probabilities (V,) to draw the next token from, given the last position's logits (V,); temperature > 0."""
    x = logits.float() / s.temperature
    if s.top_k and s.top_k < x.numel():
        kth = torch.topk(x, s.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if s.top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of the more likely tokens
        drop = before >= s.top_p  # the most likely token always stays (its `before` is 0)
        probs = probs.scatter(0, order, sorted_p.masked_fill(drop, 0.0))
        probs = probs / probs.sum()
    return probs


@torch.no_grad()
def generate(model: Transformer, weights: WeightSource, prompt: Sequence[int], s: Sampling, *,
             stop_ids: Sequence[int] = (), device: torch.device | str = "cpu") -> Iterator[int]:
    """Yield new token ids one by one after `prompt` (ids), until `max_new_tokens` or a token in `stop_ids`
    (which is yielded too). The context is cut to the model's `context_length` last tokens (its max_position_embeddings,
    or what its RoPE scaling extends them to)."""
    s.validate()
    if not prompt:
        raise SamplingError("the prompt is empty: give some text (or a BOS token) to continue from")
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    gen = torch.Generator(device=ids.device).manual_seed(s.seed)
    head = model._head_weight(weights.non_block())
    limit = model.cfg.context_length
    for _ in range(s.max_new_tokens):
        h = model.hidden_states(weights, ids[:, -limit:])[0, -1]  # (C,) last position
        logits = (h @ head.t()).float()
        if s.temperature == 0:
            nxt = int(torch.argmax(logits))
        else:
            nxt = int(torch.multinomial(next_token_distribution(logits, s), 1, generator=gen))
        yield nxt
        if nxt in stop_ids:
            return
        ids = torch.cat([ids, ids.new_tensor([[nxt]])], dim=1)
