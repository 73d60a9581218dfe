"""qtrain.observe.history: reading run logs into series (resumed runs merged, token axis) and `qtrain plot`'s figure."""
from __future__ import annotations

import argparse
import io
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from qtrain.observe.history import LogError, history_from_events, load_run  # noqa: E402
from qtrain.cli.plot import add_arguments as add_plot_args  # noqa: E402
from qtrain.cli.plot import run as run_plot  # noqa: E402
from qtrain.observe.plot import build_figure, moving_average, plot_logs  # noqa: E402
from qtrain.observe.log import RunLogger  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_log(path, *, name, steps=30, step_tokens=256, eval_every=10, loss0=10.0, resume_at=None):
    log = RunLogger(path, stream=io.StringIO())
    log.log_cmd(["qtrain", "train"])
    log.log_options({"name": name, "learning_rate": 1e-3})
    for s in range(steps):
        if s and s % eval_every == 0:
            log.log_eval(s, loss=loss0 - 0.1 * s + 0.5, eval_tokens=1024, duration_ms=10.0)
        log.log_step(s, step_tokens=step_tokens, duration_ms=100.0 + s, norm=2.0 / (s + 1), loss=loss0 - 0.1 * s,
                     lr=1e-3 * min(1.0, (s + 1) / 5))
    if resume_at is None:
        log.log_eval(steps, loss=loss0 - 0.1 * steps + 0.5, eval_tokens=4096, duration_ms=30.0)
    log.close()
    if resume_at is not None:  # killed after `steps` steps, resumed from the checkpoint at `resume_at`
        log = RunLogger(path, stream=io.StringIO())
        log.log_cmd(["qtrain", "train", "--continue"])
        log.log_options({"name": name, "learning_rate": 1e-3})
        log.log_eval(resume_at, loss=1.25, eval_tokens=1024, duration_ms=10.0)
        for s in range(resume_at, steps + 5):
            log.log_step(s, step_tokens=step_tokens, duration_ms=50.0, norm=0.5, loss=1.0 if s != resume_at + 1
                         else float("nan"), lr=2e-3)
        log.log_eval(steps + 5, loss=0.75, eval_tokens=4096, duration_ms=30.0)
        log.close()
    return str(path)


def test_moving_average():
    assert moving_average([1, 2, 3, 4, 5, 6], 1) == [1, 2, 3, 4, 5, 6]
    assert moving_average([1, 2, 3, 4, 5, 6], 3) == [1, 2, 3, 4, 5, 6]  # linear data is unchanged
    assert moving_average([0, 0, 9, 0, 0], 3) == [0, 3, 3, 3, 0]  # ends stay, interior averages 3 points
    assert moving_average([5, 1, 2, 3, 0, 7, 8], 5) == [5, 8 / 3, 11 / 5, 13 / 5, 20 / 5, 5, 8]
    got = moving_average([1.0, math.nan, 3.0, math.inf], 3)  # non-finite values are skipped
    assert got[:3] == [1.0, 2.0, 3.0] and math.isnan(got[3])
    assert math.isnan(moving_average([math.nan, math.nan], 3)[0])
    assert moving_average([], 21) == []


def test_load_run_merges_resumed_run_and_counts_tokens(tmp_path):
    path = write_log(tmp_path / "r.jsonl", name="resumed", steps=12, resume_at=8)
    run = load_run(path)
    assert run.name == "resumed" and run.options["learning_rate"] == 1e-3
    assert run.steps == list(range(17))  # 0-7 from the first run, 8-16 from the resumed one
    assert run.loss[:8] == [10.0 - 0.1 * s for s in range(8)]
    assert run.loss[8] == 1.0 and math.isnan(run.loss[9]) and run.lr[8:] == [2e-3] * 9
    assert run.tokens == [256.0 * s for s in range(17)]
    assert run.tokens_per_s[0] == 2560.0 and run.tokens_per_s[8] == 5120.0
    # evals: the first run's eval at 10 (after the resume point) is dropped; the resumed run's at 8 and 17 kept
    assert run.eval_steps == [8, 17] and run.eval_loss == [1.25, 0.75]
    assert run.eval_train_tokens == [8 * 256.0, 17 * 256.0]
    assert run.eval_ppl == [pytest.approx(math.exp(1.25)), pytest.approx(math.exp(0.75))]
    assert run.final_eval_loss == 0.75


def test_history_without_cmd_and_with_gaps():
    t = "2026-01-01T00:00:00.000+00:00"
    ev = [{"log": "step", "time": t, "step": s, "loss": float(s), "step_tokens": 100} for s in (5, 6, 7)]
    ev += [{"log": "step", "time": t, "step": 6, "loss": -1.0, "step_tokens": 100}]  # restart without a cmd line
    ev += [{"log": "eval", "time": t, "step": 7, "loss": 2.0}, {"log": "message", "step": 7}, {"log": "bogus"}]
    h = history_from_events(ev, path="x/run.jsonl")
    assert h.name == "run" and h.steps == [5, 6] and h.loss == [5.0, -1.0]
    # a log starting at step 5 counts the 5 missing steps with the first known step size
    assert h.tokens == [500.0, 600.0] and h.eval_train_tokens == [700.0]
    assert h.eval_ppl == [pytest.approx(math.exp(2.0))]
    assert math.isnan(h.norm[0]) and math.isnan(h.tokens_per_s[0])


def test_figure_contents(tmp_path):
    a = write_log(tmp_path / "a.jsonl", name="alpha", steps=30, step_tokens=512)
    b = write_log(tmp_path / "b.jsonl", name="beta", steps=20, step_tokens=1024, loss0=9.0)
    runs = [load_run(a), load_run(b)]
    fig = build_figure(runs, smooth=5, title="t")
    try:
        axes = fig.axes
        assert len(axes) == 8
        assert [ax.get_title() for ax in axes] == [
            "loss vs step", "learning rate vs step", "gradient norm vs step", "tokens / s vs step",
            "loss vs tokens", "learning rate vs tokens", "gradient norm vs tokens", "tokens / s vs tokens"]
        assert axes[2].get_yscale() == "log" and axes[4].get_xlabel() == "tokens (k)"
        loss_lines = axes[0].get_lines()  # per run: raw, smoothed, periodic evals, the final (whole-file) eval
        assert len(loss_lines) == 8
        raw, smooth, ev, final = loss_lines[:4]
        assert list(raw.get_xdata()) == list(range(30)) and list(raw.get_ydata()) == runs[0].loss
        assert list(smooth.get_ydata()) == pytest.approx(moving_average(runs[0].loss, 5))
        assert list(ev.get_xdata()) == [10, 20] and list(ev.get_ydata()) == runs[0].eval_loss[:2]
        assert ev.get_linestyle() == "--" and final.get_linestyle() == "None" and final.get_marker() == "*"
        assert list(final.get_xdata()) == [30] and list(final.get_ydata()) == [7.5]
        assert raw.get_color() == smooth.get_color() == ev.get_color() == final.get_color() != \
            loss_lines[4].get_color()
        # bottom row: x = tokens before each step, in thousands
        tok_raw = axes[4].get_lines()[4]
        assert list(tok_raw.get_xdata()) == pytest.approx([1024 * s / 1000 for s in range(20)])
        assert list(axes[5].get_lines()[0].get_ydata()) == runs[0].lr
        assert list(axes[7].get_lines()[2].get_ydata()) == runs[1].tokens_per_s
        legend = [t.get_text() for leg in fig.legends for t in leg.get_texts()]
        assert legend == ["alpha | eval 7.5000 @ step 30", "beta | eval 7.5000 @ step 20"]
        assert [t.get_text() for t in axes[0].get_legend().get_texts()] == [
            "train (raw)", "train (5-step average)", "eval", "eval, other size (final: whole file)"]
    finally:
        import matplotlib.pyplot as plt
        plt.close(fig)


def test_plot_logs_writes_png(tmp_path):
    a = write_log(tmp_path / "a.jsonl", name="alpha", steps=40)
    b = write_log(tmp_path / "b.jsonl", name="alpha", steps=25, resume_at=10)  # same name: told apart by file
    out = plot_logs([a, b], tmp_path / "figs" / "plot.png")
    data = Path(out).read_bytes()
    assert data[:8] == PNG_MAGIC
    import matplotlib.image as mpimg
    img = mpimg.imread(out)
    assert img.shape[0] > 500 and img.shape[1] > 1500
    # both run colours (matplotlib's C0 blue, C1 orange) are on the image
    def has(rgb):
        d = abs(img[..., 0] - rgb[0]) + abs(img[..., 1] - rgb[1]) + abs(img[..., 2] - rgb[2])
        return int((d < 0.05).sum())
    assert has((0x1f / 255, 0x77 / 255, 0xb4 / 255)) > 500 and has((0xff / 255, 0x7f / 255, 0x0e / 255)) > 500
    # a log with only options (a run that died at startup) still plots
    empty = tmp_path / "empty.jsonl"
    RunLogger(empty, stream=io.StringIO()).log_options({"name": "dead"})
    assert Path(plot_logs(empty, tmp_path / "empty.png", smooth=1)).read_bytes()[:8] == PNG_MAGIC


def test_cli_and_errors(tmp_path, capsys):
    a = write_log(tmp_path / "a.jsonl", name="alpha", steps=12)
    p = argparse.ArgumentParser()
    add_plot_args(p)
    ns = p.parse_args([a, a, "--out", str(tmp_path / "cli.png"), "--smooth", "3", "--name", "x", "--name", "y",
                       "--title", "two"])
    assert run_plot(ns) == 0
    assert "wrote" in capsys.readouterr().out and (tmp_path / "cli.png").read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(LogError, match="cannot read log"):
        plot_logs([tmp_path / "missing.jsonl"], tmp_path / "x.png")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"log": "step"\n{"log": "eval", "step": 1}\n')
    with pytest.raises(LogError, match="bad.jsonl:1"):
        plot_logs([bad], tmp_path / "x.png")
    with pytest.raises(LogError, match="--name"):
        plot_logs([a], tmp_path / "x.png", names=["x", "y"])
    with pytest.raises(LogError, match="--smooth"):
        run_plot(p.parse_args([a, "--smooth", "0"]))


def test_headless_uses_agg(tmp_path):
    """No display and no MPLBACKEND: the plot still renders (Agg)."""
    a = write_log(tmp_path / "a.jsonl", name="alpha", steps=5)
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "MPLBACKEND")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    code = ("import sys, matplotlib; from qtrain.observe.plot import plot_logs; plot_logs([sys.argv[1]], sys.argv[2]); "
            "print(matplotlib.get_backend())")
    r = subprocess.run([sys.executable, "-c", code, a, str(tmp_path / "h.png")], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().lower() == "agg"
    assert (tmp_path / "h.png").read_bytes()[:8] == PNG_MAGIC


def _subcommands() -> set[str]:
    import argparse as ap

    from qtrain.cli.main import build_parser
    return {name for a in build_parser()._actions if isinstance(a, ap._SubParsersAction) for name in a.choices}


@pytest.mark.skipif("plot" not in _subcommands(), reason="`qtrain plot` not wired into qtrain/cli/main.py yet")
def test_qtrain_plot_command(tmp_path, capsys):
    from qtrain.cli.main import main

    a = write_log(tmp_path / "a.jsonl", name="alpha", steps=8)
    b = write_log(tmp_path / "b.jsonl", name="beta", steps=8)
    assert main(["plot", a, b, "--out", str(tmp_path / "p.png"), "--smooth", "3"]) == 0
    assert (tmp_path / "p.png").read_bytes()[:8] == PNG_MAGIC
    assert main(["plot", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "q.png")]) == 2
    assert "cannot read log" in capsys.readouterr().err


def test_figure_router_row_for_moe_runs(tmp_path):
    """An MoE run's log (the router fields of its steps) adds a third row: the load-balancing loss and the router z-loss
    (raw and smoothed) and the tokens per expert (mean solid, min and max dashed), each against the step; a dense run
    beside it draws nothing there, and a dense run alone has no third row."""
    log = RunLogger(tmp_path / "moe.jsonl", stream=io.StringIO())
    log.log_options({"name": "moe"})
    for s in range(12):
        log.log_step(s, step_tokens=256, duration_ms=100.0, norm=1.0, loss=5.0 - 0.1 * s, lr=1e-3,
                     aux_loss=1.0 + 0.01 * s, router_z_loss=0.5 - 0.01 * s, expert_load_min=10.0 + s,
                     expert_load_mean=32.0, expert_load_max=60.0 - s)
    log.close()
    moe, dense = load_run(tmp_path / "moe.jsonl"), load_run(write_log(tmp_path / "d.jsonl", name="dense", steps=12))
    assert moe.has_routers and not dense.has_routers
    fig = build_figure([dense, moe], smooth=3, title="t")
    try:
        axes = fig.axes
        assert len(axes) == 12
        assert [ax.get_title() for ax in axes[8:11]] == [
            "load-balancing loss vs step", "router z-loss vs step", "tokens per expert (min / mean / max) vs step"]
        aux_raw, aux_smooth = axes[8].get_lines()  # the dense run draws none
        assert list(aux_raw.get_xdata()) == list(range(12)) and list(aux_raw.get_ydata()) == moe.aux_loss
        assert list(aux_smooth.get_ydata()) == pytest.approx(moving_average(moe.aux_loss, 3))
        assert list(axes[9].get_lines()[0].get_ydata()) == moe.router_z_loss
        mean, low, high = axes[10].get_lines()
        assert list(mean.get_ydata()) == [32.0] * 12 and mean.get_linestyle() == "-"
        assert list(low.get_ydata()) == moe.expert_load_min and list(high.get_ydata()) == moe.expert_load_max
        assert low.get_linestyle() == high.get_linestyle() == "--"
        assert not axes[11].axison
    finally:
        import matplotlib.pyplot as plt
        plt.close(fig)
    fig = build_figure([dense], smooth=3, title="t")
    try:
        assert len(fig.axes) == 8
    finally:
        import matplotlib.pyplot as plt
        plt.close(fig)
