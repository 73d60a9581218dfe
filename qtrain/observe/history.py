"""Tools that read a run's log: `plot` (PNG figure) and `wandb_export` (replay into a Weights & Biases run).
This module holds what both need: `read_events`, which reads qtrain's JSON Lines log (`qtrain.observe.log`) or
llm.q's JSON array (`qtrain.observe.llmq_log`), and `load_run`, which turns a log into the per-step series of
one run.

Resumed runs. `qtrain train --continue` appends to the same log, and a run resumed from a checkpoint at
step S logs steps S, S+1, ... again, although the first run may have logged steps past S before it was
stopped. Those later entries describe training that was thrown away, so `load_run` keeps only the last
run's version of every step: when a run starts (a `cmd` object) or a step number goes backwards, every
earlier step/eval entry at or after the new run's first step is dropped. The result is one monotone
history, as if the run had never been interrupted.

x axes. `step` is the 0-based optimizer step as logged. The train loss of step s is measured with the
weights that s steps produced (before step s's update), and an evaluation logged at step s runs before
step s too, so both are plotted at x = s. `tokens` is, in the same sense, the number of training tokens
the weights have seen at that point: the sum of `step_tokens` over steps 0..s-1 (for a resumed log whose
earlier steps are missing, the missing steps are counted with the first known step's `step_tokens`).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterable

__all__ = ["LogError", "RunHistory", "load_run", "read_events", "history_from_events", "finite_or_nan"]


ROUTER_SERIES = ("aux_loss", "router_z_loss", "expert_load_min", "expert_load_mean", "expert_load_max")


class LogError(ValueError):
    """A log that cannot be read (missing, unreadable or corrupt); the message names the file."""


def finite_or_nan(v: Any) -> float:
    """A log value as a float; None, strings and non-finite values become NaN (drawn as gaps)."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return math.nan
    return f if math.isfinite(f) else math.nan


@dataclass
class RunHistory:
    """The series of one run, in step order. Train lists are aligned with `steps`, eval lists with
    `eval_steps`; missing values are NaN."""

    path: str
    name: str
    options: dict[str, Any] = field(default_factory=dict)
    steps: list[int] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)  # tokens trained on before each step
    loss: list[float] = field(default_factory=list)
    norm: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    # an MoE model's routers (train/router_metrics.py), NaN for a dense model's steps
    aux_loss: list[float] = field(default_factory=list)
    router_z_loss: list[float] = field(default_factory=list)
    expert_load_min: list[float] = field(default_factory=list)
    expert_load_mean: list[float] = field(default_factory=list)
    expert_load_max: list[float] = field(default_factory=list)
    step_events: list[dict[str, Any]] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval_train_tokens: list[float] = field(default_factory=list)  # tokens trained on before each evaluation
    eval_sizes: list[float] = field(default_factory=list)  # tokens each evaluation scored (its `eval_tokens`)
    eval_loss: list[float] = field(default_factory=list)
    eval_ppl: list[float] = field(default_factory=list)
    eval_events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def final_eval_loss(self) -> float | None:
        return self.eval_loss[-1] if self.eval_loss else None

    @property
    def has_routers(self) -> bool:
        """Whether the run logged an MoE model's router fields."""
        return any(math.isfinite(v) for v in self.aux_loss)


def _drop_from(events: list[dict[str, Any]], step: int) -> None:
    events[:] = [e for e in events if int(e["step"]) < step]


def history_from_events(events: Iterable[dict[str, Any]], *, path: str = "", name: str | None = None) -> RunHistory:
    """Build a RunHistory from log objects (see the module docstring for resumed runs and x axes)."""
    options: dict[str, Any] = {}
    steps: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    new_run = False
    for e in events:
        kind = e.get("log")
        if kind == "cmd":
            new_run = True
        elif kind == "options" and isinstance(e.get("options"), dict):
            options = dict(e["options"])
        elif kind in ("step", "eval") and "step" in e:
            s = int(e["step"])
            if new_run or (kind == "step" and steps and s <= int(steps[-1]["step"])):
                _drop_from(steps, s)
                _drop_from(evals, s)
                new_run = False
            (steps if kind == "step" else evals).append(e)

    h = RunHistory(path=path, name=name or str(options.get("name") or "") or _stem(path), options=options)
    # cumulative tokens before each step; a gap in the step numbers (a log that starts mid-run) is filled
    # with the neighbouring step's size
    cum: dict[int, float] = {}
    total, prev_step, prev_size = 0.0, -1, None
    for e in steps:
        s, size = int(e["step"]), finite_or_nan(e.get("step_tokens"))
        size = 0.0 if math.isnan(size) else size
        gap = s - prev_step - 1
        if gap > 0:
            total += gap * (prev_size if prev_size is not None else size)
        cum[s] = total
        total += size
        prev_step, prev_size = s, size
        h.steps.append(s)
        h.tokens.append(cum[s])
        h.loss.append(finite_or_nan(e.get("loss")))
        h.norm.append(finite_or_nan(e.get("norm")))
        h.lr.append(finite_or_nan(e.get("lr")))
        h.tokens_per_s.append(finite_or_nan(e.get("tokens_per_s")))
        for k in ROUTER_SERIES:
            getattr(h, k).append(finite_or_nan(e.get(k)))
        h.step_events.append(e)
    for e in evals:
        s = int(e["step"])
        if s in cum:
            t = cum[s]
        elif s == prev_step + 1:
            t = total  # the final evaluation, after the last step
        else:
            t = s * prev_size if prev_size else math.nan
        h.eval_steps.append(s)
        h.eval_train_tokens.append(t)
        h.eval_sizes.append(finite_or_nan(e.get("eval_tokens")))
        loss = finite_or_nan(e.get("loss"))
        h.eval_loss.append(loss)
        ppl = e.get("ppl")
        h.eval_ppl.append(finite_or_nan(ppl) if ppl is not None else
                          (math.exp(loss) if loss < 700 else math.nan))
        h.eval_events.append(e)
    return h


def _stem(path: str) -> str:
    base = os.path.basename(path)
    for ext in (".jsonl", ".json", ".log"):
        if base.endswith(ext):
            return base[: -len(ext)]
    return base or "run"


def read_events(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The objects of a run log, qtrain's (JSON Lines, `qtrain.observe.log.read_log`) or llm.q's (a JSON array,
    `qtrain.observe.llmq_log`); LogError naming the file if it cannot be read."""
    from qtrain.observe.llmq_log import is_llmq_log, parse_llmq_log
    from qtrain.observe.log import read_log

    p = os.fspath(path)
    try:
        with open(p, encoding="utf-8") as f:
            head = f.read(4096)
        if is_llmq_log(head):
            with open(p, encoding="utf-8") as f:
                return parse_llmq_log(f.read(), p)
        return read_log(p)
    except OSError as e:
        raise LogError(f"{p}: cannot read log ({e.strerror or e})") from None
    except ValueError as e:  # a corrupt line names itself; undecodable bytes do not: name the file
        raise LogError(str(e) if p in str(e) else f"{p}: not a qtrain log ({e})") from None


def load_run(path: str | os.PathLike, *, name: str | None = None) -> RunHistory:
    """Read a run log (`read_events`) into a RunHistory. The run's name is `name`, else its `name` option,
    else the file name without extension."""
    p = os.fspath(path)
    return history_from_events(read_events(p), path=p, name=name)
