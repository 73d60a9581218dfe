"""Suite files (bench/suites/NAME.toml): the cases a harness call runs, and the ratios its table shows.

    description = "what the suite answers"
    [defaults]                      # merged into every case (params key by key; with a kind: only into cases
                                    # of that kind, the others take no default params)
    kind = "train"
    timeout = 300                   # seconds per run; the case is killed (its process group) after it
    params = { model = "Qwen2.5-1.5B", batch = 32, accum = 2 }
    [checkouts.base]                # another checkout of qtrain that cases may run against
    path = ".base"                  # relative to the repository root; --baseline / --checkout override it
    commit = "dac8680"              # what it should hold (shown, and checked where it can be read)
    [[case]]
    name = "bf16"
    checkout = ["base", "new", "new", "base"]   # one run per entry, in this order ("new": this checkout)
    params = { lmhead_chunks = 4 }  # a case may also set kind, timeout, gpus ("0" or "0,1"), env, round
    [[ratio]]
    label = "bf16 new / base"       # mean of `metric` over the runs matching num, over that of den
    num = "bf16@new*"               # shell patterns on run ids: NAME, NAME@CHECKOUT, NAME@CHECKOUT.K
    den = "bf16@base*"
    metric = "tps"                  # optional: den_metric (other key for den), den_factor (den x factor),
                                    # best = true (each side its best case: the highest of its cases' means)

Consecutive runs with the same `round` run at the same time (side by side on the GPUs they pin).
Every error names the file and the key (SuiteError, a ValueError).
"""
from __future__ import annotations

import fnmatch
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.kinds import KINDS

SUITES_DIR = Path(__file__).parent / "suites"
REPO_ROOT = Path(__file__).resolve().parent.parent
NEW = "new"  # the checkout the harness runs from
DEFAULT_TIMEOUT = 600.0

TOP_KEYS = {"description", "defaults", "checkouts", "case", "ratio"}
CASE_KEYS = {"name", "kind", "params", "timeout", "gpus", "env", "checkout", "round"}
DEFAULT_KEYS = CASE_KEYS - {"name", "round"}
CHECKOUT_KEYS = {"path", "commit"}
RATIO_KEYS = {"label", "num", "den", "metric", "den_metric", "den_factor", "best"}
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


class SuiteError(ValueError):
    """A suite file that cannot be run: the message names the file and the key."""


@dataclass(frozen=True)
class Checkout:
    name: str
    path: str
    commit: str | None = None


@dataclass(frozen=True)
class Run:
    """One process: a case against one checkout."""
    id: str
    case: str
    kind: str
    params: dict[str, Any]
    checkout: str
    timeout: float
    gpus: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    round: str | None = None


@dataclass(frozen=True)
class Ratio:
    label: str
    num: str
    den: str
    metric: str = "tps"
    den_metric: str | None = None
    den_factor: float = 1.0
    best: bool = False  # each side is its best case (the mean of that case's runs), not the mean of all its runs


@dataclass
class Suite:
    name: str
    path: Path
    description: str
    runs: list[Run]
    ratios: list[Ratio]
    checkouts: dict[str, Checkout]


def suite_path(name_or_path: str) -> Path:
    """A suite name (bench/suites/NAME.toml) or a path to a .toml file."""
    p = Path(name_or_path)
    if p.suffix == ".toml" or p.exists():
        return p
    return SUITES_DIR / f"{name_or_path}.toml"


def suite_names() -> list[str]:
    return sorted(p.stem for p in SUITES_DIR.glob("*.toml"))


def load(name_or_path: str) -> Suite:
    path = suite_path(name_or_path)
    if not path.is_file():
        known = ", ".join(suite_names())
        raise SuiteError(f"{path}: no such suite file (suites in {SUITES_DIR}: {known})")
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise SuiteError(f"{path}: not valid TOML: {e}") from None
    return parse(data, path)


def parse(data: dict[str, Any], path: Path) -> Suite:
    def fail(where: str, msg: str) -> SuiteError:
        return SuiteError(f"{path}: {where}: {msg}")

    def keys(table: Any, allowed: set[str], where: str) -> dict[str, Any]:
        if not isinstance(table, dict):
            raise fail(where, f"must be a table, got {type(table).__name__}")
        bad = sorted(set(table) - allowed)
        if bad:
            raise fail(where, f"unknown key {bad[0]!r} (allowed: {', '.join(sorted(allowed))})")
        return table

    keys(data, TOP_KEYS, "top level")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise fail("description", "must be a string")
    defaults = keys(data.get("defaults", {}), DEFAULT_KEYS, "[defaults]")

    checkouts = {NEW: Checkout(NEW, str(REPO_ROOT))}
    declared = data.get("checkouts", {})
    if not isinstance(declared, dict):
        raise fail("[checkouts]", "must be a table of [checkouts.NAME] tables")
    for name, t in declared.items():
        where = f"[checkouts.{name}]"
        keys(t, CHECKOUT_KEYS, where)
        if name == NEW or not NAME_RE.match(name):
            raise fail(where, f"bad checkout name {name!r} ({NEW!r} is this checkout; use letters, digits, ._+-)")
        for k in CHECKOUT_KEYS & set(t):
            if not isinstance(t[k], str) or not t[k]:
                raise fail(f"{where} {k}", "must be a non-empty string")
        checkouts[name] = Checkout(name, t.get("path", f".{name}"), t.get("commit"))

    cases = data.get("case", [])
    if not isinstance(cases, list) or not cases:
        raise fail("[[case]]", "a suite needs at least one [[case]] table")
    runs: list[Run] = []
    seen: set[str] = set()
    for i, c in enumerate(cases):
        where = f"case[{i}]"
        keys(c, CASE_KEYS, where)
        name = c.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise fail(f"{where} name", f"required: letters, digits and ._+- (got {name!r})")
        where = f"case {name!r}"
        if name in seen:
            raise fail(f"{where} name", "used twice")
        seen.add(name)
        runs += _case_runs(c, defaults, checkouts, where, fail)

    ids = [r.id for r in runs]
    ratios = [_ratio(t, i, ids, fail) for i, t in enumerate(data.get("ratio", []))]
    _check_rounds(runs, fail)
    return Suite(path.stem, path, description.strip(), runs, ratios, checkouts)


def _case_runs(c: dict[str, Any], defaults: dict[str, Any], checkouts: dict[str, Checkout], where: str,
               fail) -> list[Run]:
    merged = {**defaults, **c}
    kind = merged.get("kind")
    if kind not in KINDS:
        raise fail(f"{where} kind", f"{kind!r} is not a kind (kinds: {', '.join(KINDS)})")
    params = {}
    inherit = "kind" not in defaults or defaults["kind"] == kind
    for src, label in (((defaults, "[defaults] params"),) if inherit else ()) + ((c, f"{where} params"),):
        p = src.get("params", {})
        if not isinstance(p, dict):
            raise fail(label, "must be a table")
        params.update(p)
    timeout = merged.get("timeout", DEFAULT_TIMEOUT)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise fail(f"{where} timeout", f"must be a positive number of seconds, got {timeout!r}")
    gpus = merged.get("gpus")
    if gpus is not None:
        gpus = ",".join(str(g) for g in gpus) if isinstance(gpus, list) else str(gpus)
        if not re.fullmatch(r"\d+(,\d+)*", gpus):
            raise fail(f"{where} gpus", f"must be a GPU index or a list of them (\"0\", \"0,1\", [0, 1]), got {gpus!r}")
    env = merged.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise fail(f"{where} env", "must be a table of strings")
    rnd = c.get("round")
    if rnd is not None and not isinstance(rnd, str):
        raise fail(f"{where} round", "must be a string")
    ck = merged.get("checkout", NEW)
    order = ck if isinstance(ck, list) else [ck]
    if not order or not all(isinstance(x, str) for x in order):
        raise fail(f"{where} checkout", "must be a checkout name or a non-empty list of them")
    for x in order:
        if x not in checkouts:
            raise fail(f"{where} checkout", f"{x!r} is not declared (add [checkouts.{x}] or use {NEW!r})")
    runs, count = [], {}
    for x in order:
        count[x] = count.get(x, 0) + 1
        rid = c["name"] if x == NEW and not isinstance(ck, list) else f"{c['name']}@{x}"
        if isinstance(ck, list):
            rid += f".{count[x]}"
        runs.append(Run(rid, c["name"], kind, dict(params), x, float(timeout), gpus, dict(env), rnd))
    return runs


def _ratio(t: Any, i: int, ids: list[str], fail) -> Ratio:
    where = f"ratio[{i}]"
    if not isinstance(t, dict):
        raise fail(where, "must be a table")
    bad = sorted(set(t) - RATIO_KEYS)
    if bad:
        raise fail(where, f"unknown key {bad[0]!r} (allowed: {', '.join(sorted(RATIO_KEYS))})")
    for k in ("num", "den"):
        pat = t.get(k)
        if not isinstance(pat, str):
            raise fail(f"{where} {k}", "required: a pattern on run ids")
        if not fnmatch.filter(ids, pat):
            raise fail(f"{where} {k}", f"{pat!r} matches no run (runs: {', '.join(ids)})")
    for k in ("label", "metric", "den_metric"):
        if k in t and not isinstance(t[k], str):
            raise fail(f"{where} {k}", "must be a string")
    factor = t.get("den_factor", 1.0)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
        raise fail(f"{where} den_factor", f"must be a positive number, got {factor!r}")
    if not isinstance(t.get("best", False), bool):
        raise fail(f"{where} best", f"must be true or false, got {t['best']!r}")
    return Ratio(t.get("label", f"{t['num']} / {t['den']}"), t["num"], t["den"], t.get("metric", "tps"),
                 t.get("den_metric"), float(factor), t.get("best", False))


def _check_rounds(runs: list[Run], fail) -> None:
    """Runs of one round must be consecutive and pin disjoint GPUs (they run at the same time)."""
    done: set[str] = set()
    prev = None
    for r in runs:
        if r.round is not None and r.round != prev and r.round in done:
            raise fail(f"case {r.case!r} round", f"round {r.round!r} must be one block of consecutive cases")
        if r.round is not None:
            done.add(r.round)
        prev = r.round
    for rnd in done:
        used: set[str] = set()
        for r in (r for r in runs if r.round == rnd):
            if not r.gpus:
                raise fail(f"case {r.case!r} gpus", f"cases of round {rnd!r} run side by side: each must pin gpus")
            mine = set(r.gpus.split(","))
            if used & mine:
                raise fail(f"case {r.case!r} gpus", f"round {rnd!r} uses GPU {sorted(used & mine)[0]} twice")
            used |= mine


def select(runs: list[Run], only: list[str], skip: list[str]) -> list[Run]:
    """Runs whose id or case name matches one of `only` (all if empty) and none of `skip`."""
    def hit(r: Run, pats: list[str]) -> bool:
        return any(fnmatch.fnmatchcase(r.id, p) or fnmatch.fnmatchcase(r.case, p) for p in pats)
    return [r for r in runs if (not only or hit(r, only)) and not hit(r, skip)]
