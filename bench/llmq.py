"""Kind `llmq`: llm.q's own trainer (IST-DASLab/llmq, unmodified build) through its driver script, in the same
device call as qtrain. The folder ../shared/anchor/llmq/ does not travel to the device machine: copy it into the
git-ignored `.llmq/` of the checkout and name `.llmq` in the call's carry (its README has the details).

Parameters: size (a Qwen2.5 preset size such as "0.5B", or another --model word), batch (per GPU), accum,
steps (10), mm (matmul dtype, "bf16"; llm.q's e4m3 aborts with CUDA 13), flags (extra llm.q flags, e.g.
["--lmhead-chunks=4"]), gpus (1; threads mode), env (more of the script's environment: GRAPHS, SKIP, ...),
script (".llmq/bench_llmq.sh", relative to the harness's checkout). The script adds bf16 weights and Adam
states, --use-cuda-graphs and seq 1024 unless the flags set them, and makes its own random-token files.
Result (its summary line): tps (median of steady steps), peak_tps, step_ms, sol (%), peak_gib (nvidia-smi),
loss, steps_logged, steady.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from bench.kinds import Skip
from bench.subproc import stream

NUMBERS = {"tok/s": "tps", "peak_tok/s": "peak_tps", "ms/step": "step_ms", "sol": "sol", "peak_mem": "peak_gib",
           "loss": "loss", "wall": "wall"}


def parse_summary(line: str) -> dict:
    """The script's `LLMQ size=.. mm=.. tok/s=.. ... status=..` line as numbers; status may hold spaces."""
    m = re.search(r"\bstatus=(.*)$", line)
    status = m.group(1).strip() if m else "missing"
    head = line[:m.start()] if m else line
    fields = dict(kv.split("=", 1) for kv in head.split()[1:] if "=" in kv)
    out: dict = {"llmq_status": status}
    for key, name in NUMBERS.items():
        v = fields.get(key, "")
        num = re.match(r"-?[\d.]+", v)
        if num:
            out[name] = float(num.group(0))
    for key in ("tps", "peak_tps"):
        if key in out:
            out[key] = round(out[key])
    for key in ("steps_logged", "steady"):
        if key in fields:
            out[key] = fields[key]
    return out


def spec(size: str, mm: str, batch: int, accum: int, steps: int, flags: list[str]) -> str:
    return " ".join([size, mm, str(batch), str(accum), str(steps), *flags])


def script_path(script: str) -> Path:
    p = Path(script)
    return p if p.is_absolute() else Path(os.environ.get("BENCH_ROOT", ".")) / p


def run(size: str, batch: int, accum: int, steps: int = 10, mm: str = "bf16", flags: list[str] = (), gpus: int = 1,
        env: dict[str, str] | None = None, script: str = ".llmq/bench_llmq.sh") -> dict:
    path = script_path(script)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: copy ../shared/anchor/llmq into .llmq/ and carry it (bench/README.md)")
    fin = stream(["bash", str(path), spec(size, mm, batch, accum, steps, list(flags))],
                 env={**os.environ, "GPUS": str(gpus), **(env or {})})
    lines = [x for x in fin.lines if x.startswith("LLMQ ")]
    if not lines:
        raise RuntimeError(f"bench_llmq.sh printed no LLMQ line (exit status {fin.returncode}): {fin.last(2)}")
    res = parse_summary(lines[-1])
    if res["llmq_status"] != "ok" or "tps" not in res:
        raise RuntimeError(f"llm.q: {res['llmq_status']}")
    return {"system": "llm.q", **res}


def dry_run(params: dict) -> dict:
    p = {"steps": 10, "mm": "bf16", "flags": [], "script": ".llmq/bench_llmq.sh", **params}
    cmd = f"bash {p['script']} '{spec(p['size'], p['mm'], p['batch'], p['accum'], p['steps'], p['flags'])}'"
    if not script_path(p["script"]).is_file():
        raise Skip(f"{p['script']} is missing (copy ../shared/anchor/llmq there); on the GPU: {cmd}")
    raise Skip(f"llm.q needs a CUDA GPU; on the GPU: {cmd}")
