"""Kind `pytest`: a pytest run in the case's checkout, e.g. the GPU tests (`-m gpu tests/`), as one case of a
suite so that they run in the same device call as the benchmarks and land in the same table.

Parameters: args (pytest arguments, ["-m", "gpu", "tests/"]), collect_only (false; the dry run collects).
Result: passed, failed, skipped, errors, deselected, collected (the numbers of pytest's last line), summary.
A run with failures or errors is a failed case.
"""
from __future__ import annotations

import re
import sys

from bench.subproc import stream

COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)")
COLLECTED = re.compile(r"(\d+)(?:/(\d+))? tests? collected")


def parse_summary(lines: list[str]) -> dict:
    """The counts of pytest's closing line(s) (`-q`: '3 passed, 1 skipped in 2.1s'; collect-only: '5/300 tests
    collected (295 deselected) in 3.0s')."""
    out: dict = {}
    for line in reversed(lines):
        counts = COUNT.findall(line)
        collected = COLLECTED.search(line)
        if counts or collected:
            for n, what in counts:
                out[{"error": "errors"}.get(what, what)] = int(n)
            if collected:
                out["collected"] = int(collected.group(1))
            out["summary"] = line.strip("= ").strip()
            break
    return out


def run(args: list[str] = ("-m", "gpu", "tests/"), collect_only: bool = False) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, *(["--collect-only"] if collect_only
                                                                                  else [])]
    print("$", " ".join(cmd), flush=True)
    fin = stream(cmd)
    res = parse_summary(fin.lines)
    bad = [x.split(" - ")[0] for x in fin.lines if x.startswith(("FAILED ", "ERROR "))]
    if fin.returncode != 0:
        raise RuntimeError(f"pytest exited with status {fin.returncode}: {res.get('summary') or fin.last(2)}"
                           + (f"; {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}" if bad else ""))
    return res


def dry_run(params: dict) -> dict:
    """Collect the same tests (imports every test module, applies the markers) instead of running them."""
    return {**params, "collect_only": True}
