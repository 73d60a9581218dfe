"""`qtrain plot`: run logs -> one PNG of loss, eval loss, learning rate, gradient norm and tokens/s
against steps and tokens (`qtrain.observe.plot`)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

from qtrain.observe.history import LogError
from qtrain.observe.plot import plot_logs


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("logs", nargs="+", metavar="LOG", help="run log(s): qtrain's JSON Lines (--log-file) or llm.q's JSON")
    p.add_argument("--out", "-o", default="plot.png", help="PNG to write (default: plot.png)")
    p.add_argument("--smooth", type=int, default=21, help="moving-average window in steps (default 21; 1 = none)")
    p.add_argument("--title", default=None, help="figure title")
    p.add_argument("--name", dest="names", action="append", default=None,
                   help="legend name of each log, in order (repeat once per LOG)")
    p.add_argument("--show", action=argparse.BooleanOptionalAction, default=None,
                   help="open the PNG in the desktop's image viewer (default: when a display is available)")


def has_display() -> bool:
    """A desktop to show the picture on: X11 / Wayland, or macOS / Windows."""
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")) or sys.platform in ("darwin", "win32")


def run(ns: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    if ns.smooth < 1:
        raise LogError(f"--smooth must be >= 1, got {ns.smooth}")
    out = plot_logs(ns.logs, ns.out, smooth=ns.smooth, title=ns.title, names=ns.names)
    print(f"wrote {out}")
    if ns.show if ns.show is not None else has_display():
        import webbrowser
        webbrowser.open(Path(out).resolve().as_uri())
    return 0
