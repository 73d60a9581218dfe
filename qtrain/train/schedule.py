"""Learning-rate schedule: linear warmup, then cosine / linear decay or a constant (WSD), then an
optional 1-sqrt cooldown.

Same options as llm.q (`--lr`, `--steps`, `--warmup`, `--cooldown`, `--final-lr-fraction`,
`--lr-schedule`; see `src/training/schedule.h` there), with its quirks fixed (reference/llmq.md §3.7):

* llm.q warms up with `peak*step/warmup`, so step 0 trains with lr 0 and is wasted. Here step 0 uses
  `peak/warmup`.
* llm.q's cosine position is `(step-warmup)/(steps-cooldown)`: the denominator ignores the warmup, so
  with a warmup the floor is never reached. Here the decay spans exactly the steps it owns.
* llm.q's cooldown multiplies towards 0 (ignoring `--final-lr-fraction`, which for `wsd` it ignores
  altogether) and would reach 0 only at the step after the last one. Here the last step of the run
  always trains with exactly `final_lr_fraction * peak_lr`: that is what the option promises. For
  llm.q's "cool down to zero", pass `--final-lr-fraction 0`.

One rule for every phase. A phase owns `n` consecutive steps; its k-th step (k = 0..n-1) uses progress
`p = (k+1)/n`, moving from the phase's start value (the previous phase's end value) to its end value.
So every phase lands exactly on its end value at its own last step. (Consequence: without a warmup,
step 0 is already the first decay step, slightly below the peak, just as with a warmup step 0 is
slightly above 0.)

  phase      steps                 start -> end           shape of p
  warmup     [0, W)                0 -> peak               p            (step 0: peak/W)
  decay      [W, E), E = N - Cd    peak -> floor           cosine: (1-cos(pi p))/2; linear: p
  (wsd)      [W, E)                peak -> peak            constant
  cooldown   [E, N)                lr(E-1) -> floor        1-sqrt: sqrt(p)
  floor = final_lr_fraction * peak

The cooldown is the 1-sqrt shape (Hägele et al. 2024, "Scaling laws and compute-optimal training beyond
fixed training durations"): `lr = floor + (start - floor) * (1 - sqrt(p))`. Its start is the LR of the
step before it: the peak for `wsd` (the cooldown *is* the decay) or when warmup and cooldown fill the
run; the floor for cosine/linear with a non-empty decay, whose decay already reaches the floor, so the
cooldown then holds the floor. Use `wsd` for a warmup-stable-decay run with a 1-sqrt tail.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

KINDS = ("cosine", "linear", "wsd")


@dataclass(frozen=True, kw_only=True)
class LRSchedule:
    """`schedule(step)` is the LR for optimizer step `step` (0-based: the step about to be taken)."""

    peak_lr: float  # --lr: the LR at the end of the warmup
    total_steps: int  # --steps: number of optimizer steps in the run
    warmup: int = 0  # --warmup: steps of linear warmup at the start
    cooldown: int = 0  # --cooldown: steps of 1-sqrt cooldown at the end
    final_lr_fraction: float = 1.0  # --final-lr-fraction: LR of the last step, as a fraction of peak_lr
    kind: str = "cosine"  # --lr-schedule: cosine | linear | wsd

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the offending option (the CLI flag) and its value."""
        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if self.kind not in KINDS:
            raise ValueError(f"--lr-schedule must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not (isinstance(self.peak_lr, (int, float)) and math.isfinite(self.peak_lr) and self.peak_lr > 0):
            raise ValueError(f"--lr must be a positive finite number, got {self.peak_lr!r}")
        if not is_int(self.total_steps) or self.total_steps < 1:
            raise ValueError(f"--steps must be a positive integer, got {self.total_steps!r}")
        for flag, v in (("--warmup", self.warmup), ("--cooldown", self.cooldown)):
            if not is_int(v) or v < 0:
                raise ValueError(f"{flag} must be a non-negative integer number of steps, got {v!r}")
        if self.warmup + self.cooldown > self.total_steps:
            raise ValueError(f"--warmup ({self.warmup}) + --cooldown ({self.cooldown}) exceeds "
                             f"--steps ({self.total_steps})")
        f = self.final_lr_fraction
        if not (isinstance(f, (int, float)) and 0.0 <= f <= 1.0):
            raise ValueError(f"--final-lr-fraction must be in [0, 1], got {f!r}")

    @property
    def floor_lr(self) -> float:
        return self.peak_lr * self.final_lr_fraction

    @property
    def decay_end(self) -> int:
        """E: first cooldown step (== total_steps without a cooldown)."""
        return self.total_steps - self.cooldown

    def _main(self, step: int) -> float:
        """LR over [0, E): warmup then decay (or constant for wsd)."""
        peak, floor = self.peak_lr, self.floor_lr
        if step < self.warmup:
            return peak * (step + 1) / self.warmup
        if self.kind == "wsd":
            return peak
        p = (step - self.warmup + 1) / (self.decay_end - self.warmup)
        shape = p if self.kind == "linear" else 0.5 * (1.0 - math.cos(math.pi * p))
        # written as floor + ... so that p == 1 gives exactly `floor`, bit for bit
        return floor + (peak - floor) * (1.0 - shape)

    def __call__(self, step: int) -> float:
        if step < 0:
            raise ValueError(f"LR schedule: step must be >= 0, got {step}")
        step = min(step, self.total_steps - 1)  # past the end: keep the last step's LR
        end = self.decay_end
        if step < end:
            return self._main(step)
        start = self._main(end - 1) if end > 0 else self.peak_lr
        p = (step - end + 1) / self.cooldown
        return self.floor_lr + (start - self.floor_lr) * (1.0 - math.sqrt(p))
