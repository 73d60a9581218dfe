"""The harness's closing output: one aligned table of the runs and the suite's ratios (printed last, since the
device tool returns only the tail of a call's output)."""
from __future__ import annotations

import fnmatch
import re
import statistics
from typing import Any

from bench.kinds import KINDS
from bench.suite import Ratio

NOTE_WIDTH = 72


def cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


SOURCE = re.compile(r"^.*?, case '[^']*': ")  # errors name the suite file and case; the table row already does


def note(row: dict[str, Any]) -> str:
    text = row.get("error") or row.get("reason") or row.get("summary") or ""
    text = SOURCE.sub("", " ".join(str(text).split()))
    return text if len(text) <= NOTE_WIDTH else text[:NOTE_WIDTH - 3] + "..."


def table(rows: list[dict[str, Any]]) -> str:
    """run | status | the result columns of the kinds present (those any row has) | note."""
    cols: list[tuple[str, str]] = []
    for kind in dict.fromkeys(r["kind"] for r in rows):
        for key, head in KINDS[kind].columns:
            if key not in {k for k, _ in cols} and any(r.get(key) is not None for r in rows):
                cols.append((key, head))
    header = ["run", "status", *(h for _, h in cols), "note"]
    body = [[r["run"], r["status"], *(cell(r.get(k)) for k, _ in cols), note(r)] for r in rows]
    widths = [max(len(x[i]) for x in [header, *body]) for i in range(len(header))]
    numeric = {i for i in range(2, len(header) - 1)}

    def line(vals: list[str]) -> str:
        parts = [v.rjust(w) if i in numeric else v.ljust(w) for i, (v, w) in enumerate(zip(vals, widths))]
        return "  ".join(parts).rstrip()
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, body)])


def ratio_lines(rows: list[dict[str, Any]], ratios: list[Ratio]) -> list[str]:
    """'label  value  (num: a b | den: c d)' per declared ratio, the mean of each side's ok runs (with `best`: of
    the side's best case, named before its values)."""
    out = []
    width = max((len(r.label) for r in ratios), default=0)
    for rt in ratios:
        def side(pattern: str, metric: str) -> tuple[str, list[float]]:
            ok = [r for r in rows if r["status"] == "ok" and fnmatch.fnmatchcase(r["run"], pattern)
                  and isinstance(r.get(metric), (int, float))]
            by_case: dict[str, list[float]] = {}
            for r in ok:
                by_case.setdefault(r.get("case") or r["run"].split("@")[0], []).append(float(r[metric]))
            if not rt.best or not by_case:
                return "", [float(r[metric]) for r in ok]
            case = max(by_case, key=lambda c: statistics.mean(by_case[c]))
            return f"{case}: ", by_case[case]
        (num_case, num), (den_case, den) = side(rt.num, rt.metric), side(rt.den, rt.den_metric or rt.metric)
        if not num or not den:
            missing = rt.num if not num else rt.den
            out.append(f"{rt.label.ljust(width)}  -      (no ok run with a value matches {missing!r})")
            continue
        value = statistics.mean(num) / (statistics.mean(den) * rt.den_factor)
        vals = lambda xs: " ".join(cell(x) for x in xs)  # noqa: E731
        factor = f" x {rt.den_factor:g}" if rt.den_factor != 1 else ""
        out.append(f"{rt.label.ljust(width)}  {value:.3f}  ({num_case}{vals(num)} / {den_case}{vals(den)}{factor})")
    return out
