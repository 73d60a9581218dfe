"""What a LoRA run adapts: rank, alpha, dropout, the target matrices and the frozen base's dtype (one record, read
by the layout, the block, the weights and the PEFT export).

A target is named as PEFT names its module without the `_proj` suffix: q, k, v, o (attention), gate, up, down (MLP);
`q_proj` etc. are accepted too. The adapter of a target W (out x in) is y = W x + (alpha / r) * B (A (dropout(x)))
with A (r x in), B (out x r), exactly as peft's `LoraLayer` computes it.
"""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
BASE_DTYPES = ("", "e4m3")  # '' = the model dtype; e4m3 = the frozen base's block matrices only as e4m3 + scale


class LoraError(ValueError):
    """A LoRA setting or adapter file that cannot serve this model (one line; names the option or file)."""


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float  # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    base_dtype: str = ""

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def record(self) -> dict:
        """What a checkpoint records (and compares on --continue)."""
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "targets": list(self.targets),
                "base_dtype": self.base_dtype}


def parse_targets(text: str, known: tuple[str, ...] = DEFAULT_TARGETS, why_not: dict[str, str] | None = None
                  ) -> tuple[str, ...]:
    """'q,k,v' -> ('q', 'k', 'v') in the order of `known`; 'q_proj' means 'q'. LoraError naming the option (and, for a
    name in `why_not`, why this model has no such target)."""
    names = [t.strip().removesuffix("_proj") for t in text.split(",") if t.strip()]
    if not names:
        raise LoraError("--lora-targets: no target given (choose from " + ",".join(known) + ")")
    unknown = [n for n in names if n not in known]
    if unknown:
        why = (why_not or {}).get(unknown[0])
        what = f"target {unknown[0]!r} is {why}" if why else f"unknown target {unknown[0][:40]!r}"
        raise LoraError(f"--lora-targets: {what} (choose from {','.join(known)})")
    return tuple(t for t in known if t in names)


def default_alpha(rank: int) -> float:
    """--lora-alpha unset: 2 x rank, so the adapter's scale alpha / r is 2 at every rank (a common recipe; peft's own
    default, a fixed 8, would shrink the scale as the rank grows)."""
    return 2.0 * rank
