"""Print one of README.md's set-up commands (`install` or `test`), so CI runs exactly what a new user runs.

The install command is the README's first indented command line that starts with `pip install`, without its
final `&& qtrain train`; the test command is its first indented line that starts with `python -m pytest`.
"""
from __future__ import annotations

import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
STARTS = {"install": "pip install ", "test": "python -m pytest "}
RUN_SUFFIX = " && qtrain train"


def command(kind: str, text: str) -> str:
    for line in text.splitlines():
        if line.startswith("    " + STARTS[kind]):
            cmd = line.strip()
            return cmd[: -len(RUN_SUFFIX)] if kind == "install" and cmd.endswith(RUN_SUFFIX) else cmd
    raise SystemExit(f"README.md has no `{STARTS[kind].strip()}` command line")


if __name__ == "__main__":
    print(command(sys.argv[1], README.read_text(encoding="utf-8")))
