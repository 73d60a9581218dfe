"""Kind `pytest`: a pytest run in the case's checkout, e.g. the GPU tests (`-m gpu tests/`), as one case of a
suite so that they run in the same device call as the benchmarks and land in the same table.

Parameters: args (pytest arguments, ["-m", "gpu", "tests/"]), isolate (test files run each in a pytest process of
its own after the main run, which leaves them out: one illegal memory access poisons the CUDA context and fails every
later test of its process, so new GPU paths run apart), parts (the runs to make: "main" and/or isolated files; default
every one: a suite splits a run too long for one device call into cases of parts), collect_only (false; the dry run
collects).
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


def _pytest(args: list[str], collect_only: bool) -> tuple[dict, list[str], int]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, *(["--collect-only"] if collect_only
                                                                                  else [])]
    print("$", " ".join(cmd), flush=True)
    fin = stream(cmd)
    res = parse_summary(fin.lines)
    if fin.returncode != 0 and not res:
        res["summary"] = fin.last(2)
    bad = [x.split(" - ")[0] for x in fin.lines if x.startswith(("FAILED ", "ERROR "))]
    return res, bad, fin.returncode


def run(args: list[str] = ("-m", "gpu", "tests/"), isolate: list[str] = (), collect_only: bool = False,
        parts: list[str] | None = None) -> dict:
    marks = [a for i, a in enumerate(args) if a == "-m" or (i and args[i - 1] == "-m")]
    unknown = sorted(set(parts or ()) - {"main", *isolate})
    if unknown:
        raise ValueError(f"parts {unknown}: neither 'main' nor an isolated file")
    main = [*(a for a in args if a not in isolate), *(f"--ignore={f}" for f in isolate)]
    runs = [one for name, one in (("main", main), *((f, [*marks, f]) for f in isolate))
            if parts is None or name in parts]
    total: dict = {}
    bad: list[str] = []
    summaries: list[str] = []
    status = 0
    for one in runs:
        res, failed, rc = _pytest(one, collect_only)
        for k, v in res.items():
            if isinstance(v, int):
                total[k] = total.get(k, 0) + v
        summaries.append(res.get("summary", ""))
        bad += failed
        # 5: no test selected (a file without tests of the mark) is no failure
        status = status or (rc if rc not in (0, 5) else 0)
    total["summary"] = " | ".join(summaries)
    if status != 0:
        raise RuntimeError(f"pytest exited with status {status}: {total['summary']}"
                           + (f"; {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}" if bad else ""))
    return total


def dry_run(params: dict) -> dict:
    """Collect the same tests (imports every test module, applies the markers) instead of running them."""
    return {**params, "collect_only": True}
