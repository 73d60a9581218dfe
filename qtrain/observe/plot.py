"""`qtrain plot LOG [LOG ...] --out plot.png`: one PNG of one or more training runs (llm.q's
`scripts/plot_training_run.py`, extended).

Layout: two rows of four panels. Columns: loss (train loss raw, thin and faint; its centred moving average
over `smooth` steps, solid; eval loss, dashed with dots, except evaluations of another size than the usual
one, typically the final evaluation over the whole eval file, which are stars not joined to the line, since
they measure different data), learning rate, gradient norm (log scale) and
training throughput (tokens/s, raw faint + smoothed). The top row is against the optimizer step, the bottom
row against the number of training tokens seen (cumulative `step_tokens`; see `qtrain.observe.history` for the exact
meaning of both axes and for how resumed logs are merged). One colour per run; the legend names each run
and its final eval loss. When a run trained a Mixture-of-Experts model, a third row shows its routers against the
step: the load-balancing loss, the router z-loss and the tokens per expert of a layer in a step (mean solid, min and
max dashed: how unevenly the router spreads the tokens).

matplotlib is imported with the Agg backend unless a backend was already chosen, so this works on a
machine without a display (CI, a remote GPU box).
"""
from __future__ import annotations

import math
import os
from typing import Sequence

from qtrain.observe.history import LogError, RunHistory, load_run

__all__ = ["plot_logs", "plot_runs", "build_figure", "moving_average"]


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Centred moving average over `window` points. Near the ends the window shrinks symmetrically (the
    first and last points stay as they are), so a steadily falling loss is not pulled down at the start
    the way a one-sided window would; NaNs are skipped (a window of only NaNs gives NaN)."""
    n = len(values)
    if window <= 1 or n == 0:
        return [float(v) for v in values]
    # prefix sums over finite values and their count, so the whole thing is O(n)
    s, c = [0.0], [0]
    for v in values:
        ok = isinstance(v, (int, float)) and math.isfinite(v)
        s.append(s[-1] + (float(v) if ok else 0.0))
        c.append(c[-1] + (1 if ok else 0))
    left, right = (window - 1) // 2, window // 2
    out = []
    for i in range(n):
        k = min(i, n - 1 - i)
        lo, hi = i - min(left, k), i + min(right, k) + 1
        cnt = c[hi] - c[lo]
        out.append((s[hi] - s[lo]) / cnt if cnt else math.nan)
    return out


def _matplotlib():
    import matplotlib
    if "matplotlib.pyplot" not in __import__("sys").modules and not os.environ.get("MPLBACKEND"):
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _main_eval_mask(run: RunHistory) -> list[bool]:
    """True for the evaluations of the most common size (`eval_tokens`); ties go to the earliest size."""
    sizes = run.eval_sizes
    if not sizes:
        return []
    counts: dict[float, int] = {}
    for v in sizes:
        counts[v] = counts.get(v, 0) + 1
    best = max(counts.values())
    main = next(v for v in sizes if counts[v] == best)
    return [v == main or (math.isnan(v) and math.isnan(main)) for v in sizes]


def _label(run: RunHistory, names: list[str]) -> str:
    label = run.name if names.count(run.name) == 1 else f"{run.name} ({os.path.basename(run.path)})"
    if run.final_eval_loss is not None and math.isfinite(run.final_eval_loss):
        label += f" | eval {run.final_eval_loss:.4f} @ step {run.eval_steps[-1]}"
    return label


def build_figure(runs: Sequence[RunHistory], *, smooth: int = 21, title: str | None = None):
    """The matplotlib Figure for already loaded runs; `fig.axes[:4]` are the per-step panels (loss, lr, norm,
    tokens/s), `fig.axes[4:8]` the same against tokens, and for MoE runs `fig.axes[8:11]` their routers (load-balancing
    loss, z-loss, tokens per expert). The caller closes it (`plt.close(fig)`)."""
    if not runs:
        raise LogError("plot: no runs given")
    plt = _matplotlib()
    from matplotlib.lines import Line2D

    routers = any(r.has_routers for r in runs)
    fig, axes = plt.subplots(3 if routers else 2, 4, figsize=(22, 13.5 if routers else 9), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key().get("color") or ["C0"]
    names = [r.name for r in runs]
    tokens_scale, tokens_unit = _token_unit(max((max(r.tokens, default=0.0) for r in runs), default=0.0))
    any_norm = any_other_eval = False
    for i, run in enumerate(runs):
        color = colors[i % len(colors)]
        main_eval = _main_eval_mask(run)
        any_other_eval |= not all(main_eval)
        for row, (xs, exs) in enumerate(((run.steps, run.eval_steps),
                                         ([t / tokens_scale for t in run.tokens],
                                          [t / tokens_scale for t in run.eval_train_tokens]))):
            ax_loss, ax_lr, ax_norm, ax_tps = axes[row]
            if xs:
                ax_loss.plot(xs, run.loss, color=color, alpha=0.25, linewidth=0.8)
                ax_loss.plot(xs, moving_average(run.loss, smooth), color=color, linewidth=1.6)
                ax_lr.plot(xs, run.lr, color=color, linewidth=1.4)
                if any(v > 0 for v in run.norm if not math.isnan(v)):
                    any_norm = True
                    ax_norm.plot(xs, [v if v > 0 else math.nan for v in run.norm], color=color, alpha=0.35,
                                 linewidth=0.8)
                    ax_norm.plot(xs, moving_average(run.norm, smooth), color=color, linewidth=1.4)
                ax_tps.plot(xs, run.tokens_per_s, color=color, alpha=0.25, linewidth=0.8)
                ax_tps.plot(xs, moving_average(run.tokens_per_s, smooth), color=color, linewidth=1.4)
            if exs:
                # periodic evals (the most common size) as one dashed line; evals of another size (the final
                # one over the whole eval file) as stars: different data, so not joined to the line
                pts = [(x, y) for x, y, m in zip(exs, run.eval_loss, main_eval) if m]
                ax_loss.plot([p[0] for p in pts], [p[1] for p in pts], color=color, linestyle="--", marker="o",
                             markersize=3.5, linewidth=1.2)
                other = [(x, y) for x, y, m in zip(exs, run.eval_loss, main_eval) if not m]
                if other:
                    ax_loss.plot([p[0] for p in other], [p[1] for p in other], color=color, linestyle="none",
                                 marker="*", markersize=10)

    if routers:
        _router_row(axes[2], runs, colors, smooth)
    titles = ("loss", "learning rate", "gradient norm", "tokens / s")
    for row, xlabel in enumerate(("step", f"tokens ({tokens_unit})" if tokens_unit else "tokens")):
        for col, ax in enumerate(axes[row]):
            ax.set_title(f"{titles[col]} vs {xlabel.split(' ')[0]}", fontsize=10)
            ax.set_xlabel(xlabel)
            ax.grid(True, alpha=0.3)
        if any_norm:
            axes[row][2].set_yscale("log")
        axes[row][1].ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))

    run_handles = [Line2D([], [], color=colors[i % len(colors)], linewidth=2, label=_label(r, names))
                   for i, r in enumerate(runs)]
    style_handles = [Line2D([], [], color="0.4", alpha=0.35, linewidth=0.8, label="train (raw)"),
                     Line2D([], [], color="0.4", linewidth=1.6, label=f"train ({smooth}-step average)"),
                     Line2D([], [], color="0.4", linestyle="--", marker="o", markersize=3.5, label="eval")]
    if any_other_eval:
        style_handles.append(Line2D([], [], color="0.4", linestyle="none", marker="*", markersize=10,
                                    label="eval, other size (final: whole file)"))
    axes[0][0].legend(handles=style_handles, loc="upper right", fontsize=8)
    fig.legend(handles=run_handles, loc="upper center", ncol=min(len(runs), 4), fontsize=9,
               bbox_to_anchor=(0.5, 0.995), frameon=False)
    fig.suptitle(title if title is not None else "", y=0.955, fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    return fig


def _router_row(axes, runs: Sequence[RunHistory], colors: list, smooth: int) -> None:
    """The third row, for MoE runs: load-balancing loss, router z-loss, tokens per expert (min / mean / max)."""
    ax_aux, ax_z, ax_load, ax_spare = axes
    for i, run in enumerate(runs):
        if not run.has_routers:
            continue
        color, xs = colors[i % len(colors)], run.steps
        for ax, ys in ((ax_aux, run.aux_loss), (ax_z, run.router_z_loss)):
            ax.plot(xs, ys, color=color, alpha=0.25, linewidth=0.8)
            ax.plot(xs, moving_average(ys, smooth), color=color, linewidth=1.4)
        ax_load.plot(xs, run.expert_load_mean, color=color, linewidth=1.4)
        for ys in (run.expert_load_min, run.expert_load_max):
            ax_load.plot(xs, ys, color=color, linestyle="--", linewidth=1.0)
    for ax, title in ((ax_aux, "load-balancing loss"), (ax_z, "router z-loss"),
                      (ax_load, "tokens per expert (min / mean / max)")):
        ax.set_title(f"{title} vs step", fontsize=10)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
    ax_spare.axis("off")


def plot_runs(runs: Sequence[RunHistory], out_png: str | os.PathLike, *, smooth: int = 21,
              title: str | None = None, dpi: int = 110) -> str:
    """Draw already loaded runs (see `plot_logs`) into a PNG; returns its path."""
    plt = _matplotlib()
    fig = build_figure(runs, smooth=smooth, title=title)
    out = os.fspath(out_png)
    parent = os.path.dirname(out)
    if parent:
        os.makedirs(parent, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


def _token_unit(max_tokens: float) -> tuple[float, str]:
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if max_tokens >= 10 * scale:
            return scale, unit
    return 1.0, ""


def plot_logs(paths: Sequence[str | os.PathLike] | str | os.PathLike, out_png: str | os.PathLike, *,
              smooth: int = 21, title: str | None = None, names: Sequence[str] | None = None) -> str:
    """Plot the JSON Lines logs `paths` (one run each) into the PNG `out_png`; returns its path.

    `smooth`: moving-average window in steps for the smoothed curves (1 = none). `names`: legend names,
    one per log (default: each run's `name` option, else the file name)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if names is not None and len(names) != len(paths):
        raise LogError(f"plot: {len(names)} --name values for {len(paths)} logs")
    runs = [load_run(p, name=None if names is None else names[i]) for i, p in enumerate(paths)]
    return plot_runs(runs, out_png, smooth=smooth, title=title)
