"""Kind `hf`: the "what a user would pick instead" baseline, HF transformers' Qwen2ForCausalLM with torch's fused
AdamW (bf16, SDPA, optionally torch.compile), through ../shared/bench/hf_baseline.py. That folder does not travel
to the device machine: copy it into the git-ignored `.devshared/bench/` and carry `.devshared`.

The rows measured with that script stay comparable through this kind; for any other shape (every family qtrain has,
a preset cut to N layers) and for transformers + peft LoRA, the `hf-train` kind (bench/hf_train.py) runs the same
step from this repository, with no script to carry.

Parameters: size ("0.5B", "1.5B", "3B", "7B"), batch, accum, steps (5), seq (1024), compile (true), attn
("sdpa"), script (".devshared/bench/hf_baseline.py", relative to the harness's checkout). Result (its JSON
line): tps, mfu (its own count, against 989 TFLOP/s), peak_gib.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from bench.kinds import Skip
from bench.subproc import stream


def script_path(script: str) -> Path:
    p = Path(script)
    return p if p.is_absolute() else Path(os.environ.get("BENCH_ROOT", ".")) / p


def run(size: str, batch: int, accum: int, steps: int = 5, seq: int = 1024, compile: bool = True,
        attn: str = "sdpa", script: str = ".devshared/bench/hf_baseline.py") -> dict:
    path = script_path(script)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: copy ../shared/bench into .devshared/bench and carry it (bench/README.md)")
    entry = dict(size=size, batch=batch, seq=seq, accum=accum, steps=steps, compile_=compile, attn=attn)
    fin = stream([sys.executable, str(path), json.dumps([entry])])
    rows = [json.loads(x) for x in fin.lines if x.startswith("{")]
    if not rows:
        raise RuntimeError(f"hf_baseline.py printed no result (exit status {fin.returncode}): {fin.last(2)}")
    if "error" in rows[-1]:
        raise RuntimeError(f"hf_baseline.py: {rows[-1]['error']}")
    r = rows[-1]
    return dict(system="hf", tps=r["tps"], mfu=r.get("mfu_989"), peak_gib=r.get("peak_gib"),
                params_count=r.get("params"))


def dry_run(params: dict) -> dict:
    script = params.get("script", ".devshared/bench/hf_baseline.py")
    where = "" if script_path(script).is_file() else f" ({script} is missing: copy ../shared/bench there)"
    raise Skip(f"the HF baseline runs on a CUDA GPU only{where}")
