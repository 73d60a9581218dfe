"""Kind `torchtitan`: PyTorch's own LLM trainer (torchtitan 0.2.2 from wheels, unmodified) as a peer in the same
device call as qtrain, through the anchor's driver `.tt/run_tt.sh`. The folder ../shared/anchor/torchtitan/ does
not travel to the device machine: copy it into the git-ignored `.tt/` of the checkout and name `.tt` in the call's
carry (its README has the details; the script installs the wheels to /tmp/site once per machine).

run_tt.sh knows only its own llama3 models (1B, 8B, Q0.5B, Q1.5B, Q7B, tiny). qtrain's additions live in
bench/tt/tt_qtrain.py (qwen3 flavors such as `Q30B-A3B-L10`, the torchao name fix FP8 MoE experts need), which
this kind puts on PYTHONPATH and imports through `--experimental.custom_import`; other models and flavors go in
through TT_EXTRA, which run_tt.sh appends after its own flags (torchtitan's parser keeps the last value). Such a
run's variant reads `tiny-MM` in run_tt.sh's own lines; the result names the real model.

Parameters: model (torchtitan flavor: "8B" = Llama-3.1-8B, "Q30B-A3B-L10", ...), name (torchtitan model:
"llama3" or "qwen3"), batch (micro-batch, sequences), accum (global batch = batch x accum), seq (1024), steps (10;
tokens/s is the median of the steps after the first 3), mm ("bf16" | "fp8-rowwise" | "fp8-tensorwise": torchao
Float8Linear on the linears, `output` kept in bf16), fp8_experts (an MoE's experts in FP8 too:
`quantize.grouped_mm.float8`, torchao's dynamic rowwise scaled grouped GEMM; needs a GPU of SM89+), ac ("none" |
"sac": torchtitan's selective per-op checkpointing | "full"), oom_retry (run_tt.sh's retry of an out-of-memory
`ac = "none"` run with "sac"; off by default: a case says what it measures), flags (more torchtitan flags),
workers (data loader workers, 2), tt_timeout (run_tt.sh's limit on the training process, 290 s: below the case's
timeout, so that its line still comes with the steps logged so far), env (more of the script's environment),
script (".tt/run_tt.sh", relative to the harness's checkout). bf16 weights, gradients and AdamW states,
torch.compile of blocks and loss (.tt/configs/base.toml).
Result (run_tt.sh's `TT ...` line): tps (torchtitan's tokens/s per device, median), mfu (%, its own count: an
MoE's over its active experts), tflops, peak_gib (the largest step's peak reserved memory), step_ms, data_pct,
loss, first_step_s, ac (what ran: an OOM retry says selective-op), tt_status; start_s (from the training process's
launch to its step-1 line: imports, model build, compile and the first step, as the `start` kind measures qtrain's;
bench/tt/launch_stamp.sh, run_tt.sh's TT_PYTHON, stamps the launch). A `start` comparison runs a case twice on one
named compile cache (`env` TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR): cold, then warm.

Dry run: skipped unless TT_CPU_CHECK=1 is in the environment; then the case runs shrunk on the CPU through
run_tt.sh's CPU check (cpu_check.py: a tiny flavor of the same model, compile off, FP8 emulated), with the
torchtitan wheels importable or installed to TT_SITE (bench/tt/README.md says how).
"""
from __future__ import annotations

import datetime
import os
import re
import shlex
import tempfile
from pathlib import Path

from bench.kinds import Skip
from bench.subproc import stream

RUN_TT_MODELS = ("1B", "8B", "Q0.5B", "Q1.5B", "Q7B", "tiny")
"""The models run_tt.sh's variants name (its model_defaults); any other flavor goes in through TT_EXTRA."""
TINY = {"llama3": "tiny", "qwen3": "Qtiny-moe"}
"""The CPU check's flavor of each model (tiny: .tt/tt_flavors.py; Qtiny-moe: bench/tt/tt_qtrain.py)."""
MM = ("bf16", "fp8-rowwise", "fp8-tensorwise")
AC = ("none", "sac", "full")
NUMBERS = {"tok/s": "tps", "mfu": "mfu", "tflops": "tflops", "peak_mem": "peak_gib", "step_s": "step_s",
           "data_load": "data_pct", "last_loss": "loss", "first_step_s": "first_step_s", "wall_s": "tt_wall_s"}
TT_DIR = Path(__file__).resolve().parent / "tt"
LAUNCH_RE = re.compile(r"^TT-LAUNCH (\d+(?:\.\d+)?)$", re.M)
TITAN_TS_RE = re.compile(r"\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) - root - INFO - step:\s*1\s")


def parse_summary(line: str) -> dict:
    """run_tt.sh's `TT model=.. mm=.. tok/s=.. ... status=..` line (parse_tt.py) as numbers."""
    fields = dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)
    out: dict = {"tt_status": fields.get("status", "missing")}
    for key, name in NUMBERS.items():
        num = re.match(r"-?[\d.]+", fields.get(key, ""))
        if num:
            out[name] = float(num.group(0))
    if "tps" in out:
        out["tps"] = round(out["tps"])
    if "step_s" in out:
        out["step_ms"] = round(out.pop("step_s") * 1000, 1)
    for key in ("ac", "variant", "batch", "steps_logged"):
        if key in fields:
            out[key] = fields[key]
    return out


def start_seconds(log_text: str) -> float | None:
    """Seconds from the training process's launch (launch_stamp.sh's first `TT-LAUNCH` line) to torchtitan's step-1
    line (its logger's local time, as `date` on the same machine); None where either is missing."""
    launch, step1 = LAUNCH_RE.search(log_text), TITAN_TS_RE.search(log_text)
    if not launch or not step1:
        return None
    t1 = datetime.datetime.strptime(step1.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return round(t1 - float(launch.group(1)), 2)


def command(model: str, name: str, batch: int, accum: int, seq: int, steps: int, mm: str, fp8_experts: bool,
            ac: str, oom_retry: bool, flags: list[str], workers: int) -> tuple[str, dict[str, str]]:
    """run_tt.sh's variant and the environment that makes it this run."""
    if mm not in MM:
        raise ValueError(f"mm {mm!r}: one of {', '.join(MM)}")
    if ac not in AC:
        raise ValueError(f"ac {ac!r}: one of {', '.join(AC)}")
    native = name == "llama3" and model in RUN_TT_MODELS
    variant = f"{model if native else 'tiny'}-{mm}{'-sac' if ac == 'sac' else ''}"
    extra = ["--experimental.custom_import", "tt_qtrain"]
    if not native:
        extra += ["--model.name", name, "--model.flavor", model]
    if ac == "full":
        extra += ["--activation_checkpoint.mode", "full"]
    if fp8_experts:
        converters = (["quantize.linear.float8"] if mm != "bf16" else []) + ["quantize.grouped_mm.float8"]
        extra += ["--model.converters", ",".join(converters), "--quantize.grouped_mm.float8.fqns", "experts"]
    extra += list(flags)
    bad = [x for x in extra if not x or re.search(r"[\s*?\[]", x)]
    if bad:
        raise ValueError(f"flags {bad!r}: run_tt.sh splits TT_EXTRA at spaces and expands wildcards")
    env = {"TT_LBS": str(batch), "TT_GBS": str(batch * accum), "TT_SEQ": str(seq), "TT_STEPS": str(steps),
           "TT_WORKERS": str(workers), "TT_OOM_FALLBACK": "1" if oom_retry and ac == "none" else "0",
           "TT_EXTRA": " ".join(extra)}
    return variant, env


def script_path(script: str) -> Path:
    p = Path(script)
    return p if p.is_absolute() else Path(os.environ.get("BENCH_ROOT", ".")) / p


def scratch_dir() -> str:
    """Where run_tt.sh writes torchtitan's log (kept: under $OUT on the device, so it comes back) and dumps."""
    out = os.environ.get("OUT")
    if out and os.path.isdir(out):
        os.makedirs(os.path.join(out, "tt"), exist_ok=True)
        return tempfile.mkdtemp(prefix="run-", dir=os.path.join(out, "tt"))
    return tempfile.mkdtemp(prefix="tt-run-")


def run(model: str, batch: int, accum: int, seq: int = 1024, steps: int = 10, name: str = "llama3",
        mm: str = "bf16", fp8_experts: bool = False, ac: str = "none", oom_retry: bool = False,
        flags: list[str] = (), workers: int = 2, tt_timeout: int = 290, env: dict[str, str] | None = None,
        script: str = ".tt/run_tt.sh") -> dict:
    path = script_path(script)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: copy ../shared/anchor/torchtitan into .tt/ and carry it (bench/tt/README.md)")
    variant, tt_env = command(model, name, batch, accum, seq, steps, mm, fp8_experts, ac, oom_retry, list(flags),
                              workers)
    work = scratch_dir()
    full_env = {**os.environ, **tt_env, "TT_TIMEOUT": str(tt_timeout), "TT_LOGDIR": work,
                "TT_DUMPDIR": os.path.join(work, "dump"), **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join([str(TT_DIR)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    if "TT_PYTHON" not in full_env:  # the launch stamp for start_s; the Python run_tt.sh would have run
        full_env["TT_PYTHON"], full_env["TT_REAL_PYTHON"] = str(TT_DIR / "launch_stamp.sh"), "python3"
    print(f"TT-KIND {name} {model} as run_tt.sh variant {variant}; TT_EXTRA={tt_env['TT_EXTRA']}; logs {work}",
          flush=True)
    fin = stream(["bash", str(path), variant], env=full_env)
    lines = [x for x in fin.lines if x.startswith("TT model=")]
    if not lines:
        raise RuntimeError(f"run_tt.sh printed no TT line (exit status {fin.returncode}): {fin.last(2)}")
    res = parse_summary(lines[-1])  # after an OOM retry: the retry's
    v = res.get("variant", variant)
    log = next((p for p in (Path(work) / f"{v}-retry.log", Path(work) / f"{v}.log") if p.is_file()), None)
    if log is not None and (start := start_seconds(log.read_text(errors="replace"))) is not None:
        res["start_s"] = start  # after an OOM retry: the retry's (run_tt.sh's `-retry` log)
    # a start case's 2 steps have no steady ones (`ok(no_steady_steps)`): its start time is the result
    if not res["tt_status"].startswith("ok") or ("tps" not in res and "start_s" not in res):
        raise RuntimeError(f"torchtitan: {res['tt_status']} (log {work}/{v}*.log)")
    if ac == "full":  # run_tt.sh labels its own modes only; TT_EXTRA's full checkpointing won
        res["ac"] = "full"
    return {"system": "torchtitan", "model": model, "tt_log": work, **res}


def dry_run(params: dict) -> dict:
    p = {"seq": 1024, "steps": 10, "name": "llama3", "mm": "bf16", "fp8_experts": False, "ac": "none",
         "oom_retry": False, "flags": [], "workers": 2, "script": ".tt/run_tt.sh", **params}
    variant, env = command(p["model"], p["name"], p["batch"], p["accum"], p["seq"], p["steps"], p["mm"],
                           p["fp8_experts"], p["ac"], p["oom_retry"], list(p["flags"]), p["workers"])
    env["TT_TIMEOUT"] = str(p.get("tt_timeout", 290))
    cmd = ("PYTHONPATH=bench/tt " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
           + f" bash {p['script']} {variant}")
    if not script_path(p["script"]).is_file():
        raise Skip(f"{p['script']} is missing (copy ../shared/anchor/torchtitan there); on the GPU: {cmd}")
    if os.environ.get("TT_CPU_CHECK") != "1":
        raise Skip(f"torchtitan needs a CUDA GPU (TT_CPU_CHECK=1 runs it tiny on the CPU); on the GPU: {cmd}")
    if p["name"] not in TINY:
        raise Skip(f"no CPU-sized flavor of torchtitan's {p['name']!r} (known: {', '.join(TINY)})")
    if p["fp8_experts"]:
        print("dry run: FP8 experts left out (torchao's scaled grouped GEMM needs a GPU)", flush=True)
    return {**params, "model": TINY[p["name"]], "batch": 2, "accum": 2, "seq": 64, "steps": 5, "workers": 0,
            "fp8_experts": False}
