"""The benchmark harness: run a suite's cases, each in a fresh process, and collect one JSON line per run.

    python -m bench.run SUITE [--out DIR] [--only PATTERN ...] [--skip PATTERN ...] [--param KEY=VALUE ...]
                              [--baseline DIR] [--checkout NAME=DIR ...] [--deadline S] [--dry-run] [--quiet]
    python -m bench.run --list

SUITE is a name in bench/suites/ or a path to a suite file (bench/suite.py has the format). Results go to
OUT/SUITE.jsonl (appended, one line per run; OUT: --out, else $OUT, else output/bench), each run's whole
output to OUT/SUITE/INVOCATION/RUN.log; the console gets the runs' output without warnings and, last, a
table of all runs and the suite's ratios. A run that crashes, runs out of memory or passes its timeout is reported and
the next one starts. --dry-run runs every case shrunk to a tiny model on the CPU (or says why it cannot)
and writes OUT/SUITE.dry.jsonl. Exit status: 0 when every run passed or was skipped, 1 otherwise, 2 for a
bad suite or option.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from bench.case import RESULT
from bench.kinds import KINDS
from bench.report import ratio_lines, table
from bench.suite import NEW, REPO_ROOT, Run, SuiteError, load, select, suite_names

WARNING = re.compile(r"warn", re.IGNORECASE)  # console filter only; the run's log keeps every line
KILL_GRACE_S = 5.0
MIN_RUN_S = 20.0  # with --deadline: a run needs at least this long, else it is skipped


class HarnessError(ValueError):
    """A bad option, checkout or output folder: the message says which and how to fix it."""


class Interrupted(Exception):
    """SIGTERM / SIGINT: stop the runs, keep what finished, print the table."""


def child_command(spec: dict[str, Any]) -> list[str]:
    """`bench` from this checkout, `qtrain` from the run's: the bootstrap imports bench.case with this
    checkout first on sys.path, then removes it, leaving the run's checkout (cwd and PYTHONPATH) first."""
    root = str(REPO_ROOT)
    boot = (f"import sys; sys.path.insert(0, {root!r}); import bench.case as c; sys.path.remove({root!r}); "
            "sys.exit(c.main())")
    return [sys.executable, "-c", boot, json.dumps(spec)]


def commit_of(path: Path) -> str | None:
    """The commit a checkout holds: from git when `path` is the top of its own work tree (+changes when it has
    uncommitted edits), else from a `.commit` file (what `git archive` copies can carry)."""
    try:
        top = subprocess.run(["git", "-C", str(path), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, timeout=10)
        if top.returncode == 0 and Path(top.stdout.strip()).resolve() == path.resolve():
            head = subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True,
                                  text=True, timeout=10).stdout.strip()
            dirty = subprocess.run(["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return head + ("+changes" if dirty else "") if head else None
    except (OSError, subprocess.TimeoutExpired):
        pass
    f = path / ".commit"
    return f.read_text().strip() or None if f.is_file() else None


def resolve_checkouts(suite, runs: list[Run], overrides: dict[str, str]) -> dict[str, tuple[Path, str | None]]:
    """name -> (directory, commit) for the checkouts the selected runs use; a missing one is an error that
    says how to make it."""
    out: dict[str, tuple[Path, str | None]] = {}
    for name in dict.fromkeys([NEW, *(r.checkout for r in runs)]):
        if name == NEW:
            out[name] = (REPO_ROOT, commit_of(REPO_ROOT))
            continue
        ck = suite.checkouts[name]
        given = overrides.get(name)
        path = Path(given or ck.path)
        path = path if path.is_absolute() else (Path.cwd() if given else REPO_ROOT) / path
        if not (path / "qtrain" / "__init__.py").is_file():
            commit = ck.commit or "COMMIT"
            raise HarnessError(
                f"checkout {name!r}: {path} holds no qtrain/ (suite {suite.path}, [checkouts.{name}]); make it "
                f"with `mkdir -p {ck.path} && git archive {commit} | tar -x -C {ck.path} && echo {commit} > "
                f"{ck.path}/.commit` (carry it to the device), or pass --checkout {name}=DIR")
        commit = commit_of(path)
        if ck.commit and commit and not commit.startswith(ck.commit) and not ck.commit.startswith(commit[:7]):
            print(f"bench: note: checkout {name!r} at {path} holds {commit}, the suite expects {ck.commit}",
                  flush=True)
        out[name] = (path.resolve(), commit)
    return out


def parse_value(text: str) -> Any:
    """--param values are TOML values (4, 1e-4, true, "x", [1, 2]); anything else is a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


@dataclass
class Proc:
    run: Run
    popen: subprocess.Popen
    log: TextIO
    started: float
    timeout: float
    reader: threading.Thread
    result: list[dict[str, Any]] = field(default_factory=list)
    tail: list[str] = field(default_factory=list)
    timed_out: bool = False
    killed_at: float | None = None


class Harness:
    def __init__(self, suite, runs: list[Run], checkouts, out: Path, *, dry_run: bool, quiet: bool,
                 deadline: float | None):
        self.suite, self.runs, self.checkouts, self.out = suite, runs, checkouts, out
        self.dry_run, self.quiet, self.deadline = dry_run, quiet, deadline
        self.t0 = time.monotonic()
        self.invocation = datetime.datetime.now().strftime("%Y%m%dT%H%M%S") + f"-{os.getpid()}"
        self.rows: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.logs = out / (suite.name + (".dry" if dry_run else "")) / self.invocation  # never overwritten
        self.results_path = out / f"{suite.name}{'.dry' if dry_run else ''}.jsonl"
        try:
            self.logs.mkdir(parents=True, exist_ok=True)
            self.results = open(self.results_path, "a")
        except OSError as e:
            raise HarnessError(f"cannot write results under {out}: {e.strerror or e} (choose another --out)") from None

    def log_path(self, run: Run) -> Path:
        """A run's log file: its id with `@` spelled `_` (the device machine sends back no file whose name has one)."""
        return self.logs / f"{run.id.replace('@', '_')}.log"

    # ---- one round: the runs that start together ----
    def start(self, run: Run, timeout: float) -> Proc:
        path, _ = self.checkouts[run.checkout]
        spec = dict(kind=run.kind, params=run.params, dry_run=self.dry_run,
                    source=f"{self.suite.path}, case {run.case!r}")
        env = dict(os.environ, PYTHONUNBUFFERED="1", BENCH_ROOT=str(REPO_ROOT), BENCH_CHECKOUT=str(path))
        paths = [str(path)] + ([str(REPO_ROOT)] if path != REPO_ROOT else [])
        env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])
        if run.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = run.gpus
        env.update(run.env)
        log = open(self.log_path(run), "w")
        log.write(f"# {' '.join(child_command(spec)[:2])} ... {json.dumps(spec)}\n# cwd {path}\n")
        popen = subprocess.Popen(child_command(spec), cwd=path, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
        proc = Proc(run, popen, log, time.monotonic(), timeout, threading.Thread(target=lambda: None))
        proc.reader = threading.Thread(target=self.pump, args=(proc,), daemon=True)
        proc.reader.start()
        return proc

    def pump(self, proc: Proc) -> None:
        """Copy the run's output to its log and (without warnings) to the console; keep its result line."""
        for line in proc.popen.stdout:
            if line.startswith(RESULT):
                try:
                    proc.result.append(json.loads(line[len(RESULT):]))
                except json.JSONDecodeError:
                    pass
            proc.log.write(line)
            if line.strip() and not line.startswith(RESULT):
                proc.tail = (proc.tail + [line.rstrip()])[-20:]
                if not self.quiet and not WARNING.search(line):
                    with self.lock:
                        print(f"[{proc.run.id}] {line}", end="" if line.endswith("\n") else "\n", flush=True)

    def kill(self, proc: Proc, sig: int) -> None:
        try:
            os.killpg(proc.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def wait(self, procs: list[Proc]) -> None:
        while any(p.popen.poll() is None for p in procs):
            now = time.monotonic()
            for p in procs:
                if p.popen.poll() is not None:
                    continue
                if p.killed_at is None and now - p.started > p.timeout:
                    p.timed_out, p.killed_at = True, now
                    self.kill(p, signal.SIGTERM)
                elif p.killed_at is not None and now - p.killed_at > KILL_GRACE_S:
                    self.kill(p, signal.SIGKILL)
            time.sleep(0.1)
        for p in procs:
            self.kill(p, signal.SIGKILL)  # what the run left behind in its process group
            p.reader.join(timeout=10)
            p.log.close()

    def row(self, proc: Proc | None, run: Run, *, status: str | None = None, why: str | None = None) -> dict:
        path, commit = self.checkouts[run.checkout]
        row: dict[str, Any] = dict(suite=self.suite.name, run=run.id, case=run.case, kind=run.kind,
                                   checkout=run.checkout, commit=commit, params=run.params,
                                   gpus=run.gpus, dry_run=self.dry_run, invocation=self.invocation)
        if proc is not None:
            row["log"] = str(self.log_path(run))
            if proc.result:
                row.update(proc.result[-1])
            elif proc.timed_out:
                row.update(status="timeout", error=f"killed after {proc.timeout:.0f} s (the run's timeout)")
            else:
                rc = proc.popen.returncode
                how = "still running" if rc is None else f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"
                if rc == -signal.SIGKILL:
                    how += " (out of host memory?)"
                last = next((x for x in reversed(proc.tail) if not WARNING.search(x)), "")
                row.update(status="failed", error=f"{how}, no result; last output: {last}"[:600])
                row["wall_s"] = round(time.monotonic() - proc.started, 1)
        if status is not None:
            row.update({"status": status, "reason" if status == "skipped" else "error": why})
        return row

    def record(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        self.results.write(json.dumps(row, default=str) + "\n")
        self.results.flush()
        os.fsync(self.results.fileno())
        metrics = "  ".join(f"{h} {row[k]}" for k, h in KINDS[row["kind"]].columns if row.get(k) is not None)
        why = row.get("error") or row.get("reason") or ""
        with self.lock:
            print(f"== {row['run']}: {row['status']} {row.get('wall_s', '-')} s  {metrics}  {why}".rstrip(),
                  flush=True)

    def rounds(self) -> list[list[Run]]:
        groups: list[list[Run]] = []
        for r in self.runs:
            if groups and r.round is not None and groups[-1][0].round == r.round:
                groups[-1].append(r)
            else:
                groups.append([r])
        return groups

    def run_all(self) -> None:
        running: list[Proc] = []
        try:
            for group in self.rounds():
                timeouts = [r.timeout for r in group]
                if self.deadline is not None:
                    left = self.deadline - (time.monotonic() - self.t0)
                    if left < MIN_RUN_S:
                        for r in group:
                            self.record(self.row(None, r, status="skipped",
                                                 why=f"--deadline {self.deadline:g} s: {left:.0f} s left"))
                        continue
                    timeouts = [min(t, left) for t in timeouts]
                for r, t in zip(group, timeouts):
                    gpus = f", gpus {r.gpus}" if r.gpus else ""
                    print(f"== start {r.id} ({r.kind}, checkout {r.checkout}{gpus}, timeout {t:.0f} s)", flush=True)
                for r, t in zip(group, timeouts):
                    running.append(self.start(r, t))
                self.wait(running)
                while running:
                    self.record(self.row(running[0], running[0].run))
                    running.pop(0)
        except Interrupted:
            for p in running:
                self.kill(p, signal.SIGTERM)  # SIGTERM first: a run lets its own subprocesses go with it
            time.sleep(min(KILL_GRACE_S, 2.0))
            for p in running:
                self.kill(p, signal.SIGKILL)
                try:
                    p.popen.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
                p.reader.join(timeout=5)
                done = bool(p.result)  # it had finished: keep its result
                self.record(self.row(p, p.run, **({} if done else dict(status="interrupted",
                                                                     why="the harness was stopped"))))
            raise
        finally:
            self.results.close()

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for r in self.rows:
            counts[r["status"]] = counts.get(r["status"], 0) + 1
        head = (f"== {self.suite.name}{' (dry run)' if self.dry_run else ''}: {len(self.rows)} runs, "
                + ", ".join(f"{n} {s}" for s, n in counts.items()) + f"; results in {self.results_path}")
        parts = [head, table(self.rows)] if self.rows else [head]
        lines = ratio_lines(self.rows, self.suite.ratios)
        return "\n".join(parts + (["", *lines] if lines else []))


def list_suites() -> str:
    out = ["suites (bench/suites):"]
    for name in suite_names():
        try:
            s = load(name)
            first = s.description.splitlines()[0] if s.description else ""
            out.append(f"  {name:16s} {len(s.runs):3d} runs  {first}")
        except SuiteError as e:
            out.append(f"  {name:16s} BROKEN: {e}")
    out.append("kinds:")
    out += [f"  {k:16s} {v.doc}" for k, v in KINDS.items()]
    return "\n".join(out)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", nargs="?", help="suite name (bench/suites/NAME.toml) or path to a suite file")
    p.add_argument("--out", help="results folder (default: $OUT, else output/bench)")
    p.add_argument("--only", action="append", default=[], metavar="PATTERN",
                   help="run only the runs whose id or case name matches (shell pattern; repeatable)")
    p.add_argument("--skip", action="append", default=[], metavar="PATTERN", help="leave these runs out")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="set a parameter of every selected case (TOML value, e.g. steps=4)")
    p.add_argument("--baseline", metavar="DIR", help="the checkout named 'base' (same as --checkout base=DIR)")
    p.add_argument("--checkout", action="append", default=[], metavar="NAME=DIR",
                   help="directory of a checkout the suite declares")
    p.add_argument("--deadline", type=float, metavar="S",
                   help="start no run after S seconds and cut timeouts to end by then (device calls have a limit)")
    p.add_argument("--dry-run", action="store_true", help="every case shrunk to a tiny model on the CPU")
    p.add_argument("--quiet", action="store_true", help="no run output on the console (it stays in the logs)")
    p.add_argument("--list", action="store_true", help="list suites and kinds")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.list or not args.suite:
        print(list_suites())
        return 0 if args.list else 2
    try:
        suite = load(args.suite)
        runs = select(suite.runs, args.only, args.skip)
        if not runs:
            raise HarnessError(f"--only/--skip leave no run of {suite.path} "
                               f"(runs: {', '.join(r.id for r in suite.runs)})")
        overrides = dict(x.split("=", 1) for x in args.checkout if "=" in x)
        bad = [x for x in args.checkout if "=" not in x or x.split("=", 1)[0] not in suite.checkouts
               or x.startswith(f"{NEW}=")]
        if bad:
            raise HarnessError(f"--checkout {bad[0]}: want NAME=DIR with NAME one of the suite's checkouts "
                               f"({', '.join(n for n in suite.checkouts if n != NEW) or 'none declared'})")
        if args.baseline:
            if "base" not in suite.checkouts:
                raise HarnessError(f"--baseline: {suite.path} declares no [checkouts.base]")
            overrides["base"] = args.baseline
        params = {}
        for x in args.param:
            if "=" not in x:
                raise HarnessError(f"--param {x}: want KEY=VALUE")
            k, v = x.split("=", 1)
            params[k] = parse_value(v)
        runs = [Run(**{**r.__dict__, "params": {**r.params, **params}}) for r in runs]
        checkouts = resolve_checkouts(suite, runs, overrides)
        out = Path(args.out or os.environ.get("OUT") or REPO_ROOT / "output" / "bench")
        harness = Harness(suite, runs, checkouts, out, dry_run=args.dry_run, quiet=args.quiet, deadline=args.deadline)
    except (SuiteError, HarnessError) as e:
        print(f"bench: error: {e}", file=sys.stderr)
        return 2

    def stop(signum, frame):  # noqa: ARG001
        raise Interrupted()
    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    status = 0
    try:
        print(f"== {suite.name}: {len(runs)} runs{' (dry run)' if args.dry_run else ''}; "
              + "; ".join(f"{n} = {p} ({c or 'commit unknown'})" for n, (p, c) in checkouts.items()), flush=True)
        harness.run_all()
    except Interrupted:
        status = 130
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    print("\n" + harness.summary(), flush=True)
    if status:
        return status
    return 0 if all(r["status"] in ("ok", "skipped") for r in harness.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
