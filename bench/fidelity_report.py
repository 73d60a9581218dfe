"""The `fidelity` suite's logs -> the BENCHMARKS.md table and the docs/ figure (run after the device call).

    python3 -m bench.fidelity_report LOGDIR [--figure docs/img/fidelity.png]

LOGDIR holds the suite's `MODE.jsonl` run logs (`$OUT/fidelity` of the call, i.e. `<files_at>/fidelity`). Prints a
Markdown table: each mode's eval loss at every evaluation, the final eval loss (over the whole eval split) and its
relative difference to fp32-master, the largest gradient norm and training loss after warmup, tokens/s. The figure
is `qtrain plot` of all logs in the suite's order (train and eval loss, learning rate, norm, tokens/s).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.fidelity import MODES, summarize

REFERENCE = "fp32-master"


def table(logdir: Path, warmup: int = 100, steps: int = 300) -> tuple[str, list[str]]:
    """(the Markdown table, the modes in it: those whose log is complete)."""
    res = {}
    for m in MODES:
        try:
            res[m] = summarize(logdir / f"{m}.jsonl", warmup, steps)
        except (OSError, RuntimeError, ValueError) as e:  # missing or unfinished (a run the deadline cut)
            print(f"skipped {m}: {e}", file=sys.stderr)
    if REFERENCE not in res:
        raise SystemExit(f"{logdir}: no {REFERENCE}.jsonl (the reference run)")
    steps = sorted({s for r in res.values() for s in r["evals"]})
    ref = res[REFERENCE]["final_eval"]
    head = ["mode", *(f"eval @{s}" for s in steps[:-1]), "final eval", "vs fp32-master", "max norm",
            "max loss after warmup", "tokens/s"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m, r in res.items():
        rel = f"{100 * (r['final_eval'] / ref - 1):+.2f}%"
        cells = [m, *(f"{r['evals'].get(s, float('nan')):.4f}" for s in steps[:-1]), f"{r['final_eval']:.4f}",
                 "-" if m == REFERENCE else rel, f"{r['max_norm']:.2f}",
                 "-" if r["max_loss_after_warmup"] is None else f"{r['max_loss_after_warmup']:.3f}",
                 f"{r['tps'] / 1000:.1f}k" if r["tps"] else "-"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows), list(res)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logdir", type=Path)
    p.add_argument("--figure", default=None, help="PNG to write with `qtrain plot` (e.g. docs/img/fidelity.png)")
    p.add_argument("--warmup", type=int, default=100, help="the suite's warmup steps (spikes are looked for after)")
    p.add_argument("--steps", type=int, default=300, help="the suite's steps (a log without its final eval is skipped)")
    a = p.parse_args(argv)
    text, found = table(a.logdir, a.warmup, a.steps)
    print(text)
    if a.figure:
        from qtrain.cli.main import main as qtrain
        logs = [str(a.logdir / f"{m}.jsonl") for m in found]
        names = [x for m in found for x in ("--name", m)]
        return qtrain(["plot", *logs, "--out", a.figure, "--title", "Qwen2.5-0.5B, one init, 300 steps: precision "
                       "modes", "--no-show", *names])
    return 0


if __name__ == "__main__":
    sys.exit(main())
