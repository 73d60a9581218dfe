"""Kind `start`: how long `qtrain train` takes from its launch to the end of its first step (imports, preflight,
model build, compile, the step), on a cold or a warm compile cache, for any checkout (read from the JSON log's
time stamps, so a checkout without the `startup` event measures the same way).

Parameters: model, batch, accum (1), seq (1024), flags (more `qtrain train` flags), steps (2), cache: "fresh" (a
new empty folder: a first run on a fresh machine) or a name (a folder under $BENCH_CACHE or the temp dir shared by
every case that names it: a second case naming it finds the first one's compiled code). Both inductor's and
Triton's caches go there through TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR, which every qtrain version respects.
Result: start_s (launch -> first step logged), first_step_s (that step alone, compile included), step_ms (a later
step), startup_s (qtrain's own `startup` event, where the checkout has it), phases (that event's seconds from the
process's start to the end of each start-up phase: imports, device, preflight, weights, blocks, model, ready;
where it has them). With profile = true the run goes under cProfile (`python -m cProfile -o`; it slows Python-bound
parts, so its start_s is not the plain one): `profile_top`, the functions with the most cumulative seconds (import
machinery and dispatch wrappers left out) as [name, seconds], and the .prof file under $OUT (`profile_file`).
"""
from __future__ import annotations

import datetime
import os
import shutil
import tempfile

from bench import cli_train
from bench.dry import tiny_model_dir

CACHE_ROOT = os.environ.get("BENCH_CACHE") or os.path.join(tempfile.gettempdir(), "qtrain-bench-cache")


def _t(event: dict) -> float:
    return datetime.datetime.fromisoformat(event["time"]).timestamp()


# frames that every call passes through: the import machinery and the generic wrappers say nothing about where
PROFILE_SKIP = ("<frozen importlib", "{built-in method builtins.exec}", "{built-in method builtins.__import__}",
                "_contextlib.py", "contextlib.py", "runpy.py", "cProfile.py", "<string>:1(<module>)")


def profile_top(path: str, n: int = 40) -> list[list]:
    """The `n` functions of a cProfile file with the most cumulative seconds, less PROFILE_SKIP's frames."""
    import pstats
    stats = pstats.Stats(path).stats  # (file, line, name) -> (calls, primitive calls, total, cumulative, callers)
    rows = sorted(((f"{os.path.basename(f)}:{line}({name})" if f != "~" else name, cum)
                   for (f, line, name), (_, _, _, cum, _) in stats.items()), key=lambda r: -r[1])
    keep = [r for r in rows if not any(s in r[0] for s in PROFILE_SKIP)]
    return [[name, round(cum, 3)] for name, cum in keep[:n]]


def run(model: str, batch: int, accum: int = 1, seq: int = 1024, flags: list[str] = (), steps: int = 2,
        cache: str = "fresh", device: str | None = None, profile: bool = False) -> dict:
    fresh = cache == "fresh"
    folder = tempfile.mkdtemp(prefix="qtrain-start-") if fresh else os.path.join(CACHE_ROOT, cache)
    env = {"TORCHINDUCTOR_CACHE_DIR": os.path.join(folder, "inductor"),
           "TRITON_CACHE_DIR": os.path.join(folder, "triton")}
    prof = None
    if profile:
        out = os.environ.get("OUT") if os.environ.get("OUT") and os.path.isdir(os.environ["OUT"]) else None
        fd, prof = tempfile.mkstemp(prefix=f"start-{model.replace('/', '_')}-", suffix=".prof", dir=out)
        os.close(fd)
    try:
        events = cli_train.run_events(model, batch, accum, steps, seq=seq, flags=flags, device=device, env=env,
                                      python=("-m", "cProfile", "-o", prof) if prof else (), to_exit=bool(prof))
    finally:
        if fresh:
            shutil.rmtree(folder, ignore_errors=True)
    steps_ = [e for e in events if e.get("log") == "step"]
    if not steps_:
        raise RuntimeError("qtrain train logged no step")
    startup = next((e for e in events if e.get("log") == "startup"), {})
    res = dict(system="qtrain", start_s=round(_t(steps_[0]) - _t(events[0]), 1),
               first_step_s=round(steps_[0]["duration_ms"] / 1000, 1),
               step_ms=round(steps_[-1]["duration_ms"], 1) if len(steps_) > 1 else None,
               startup_s=startup.get("seconds_to_first_step"), phases=startup.get("phases"))
    if prof and os.path.getsize(prof):
        res.update(profile_top=profile_top(prof), profile_file=prof)
        for name, cum in res["profile_top"][:25]:
            print(f"  {cum:8.3f} s  {name}", flush=True)
    print(", ".join(f"{k} {v}" for k, v in res.items() if k != "profile_top"), flush=True)
    return res


def dry_run(params: dict) -> dict:
    """A tiny model of the family on the CPU, 2 x 32 tokens, uncompiled."""
    return {**params, "model": tiny_model_dir(params["model"]), "batch": 2, "seq": 32, "accum": 1, "steps": 2,
            "device": "cpu", "flags": [*params.get("flags", []), "--compile", "off"]}
