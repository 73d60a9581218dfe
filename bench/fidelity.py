"""Kind `fidelity`: does a low-bit precision mode train as well as fp32 master weights? (issue 21, item 3)

One case per mode; all of them train Qwen2.5-0.5B from ONE shared random init on the same real-text token file
in the same data order, with `qtrain train` (the real run loop: schedule, clipping, periodic and final
evaluation), and the suite's ratios compare each mode's final eval loss with the fp32-master run's.

Shared inputs, made by the first case that needs them and reused by the others (under `work`, by default the
git-ignored output/fidelity-work of the checkout: not under $OUT, whose files travel back from the device):
  tokens/   `qtrain tokenize TEXT --eval-fraction 0.02` (qwen2 tokenizer): train*.bin + eval*.bin. TEXT is local
            text carried to the device in the git-ignored `data/fidelity/text` (made here with
            `python3 -m bench.fidelity --prepare-text data/fidelity/text`: the Python standard library's
            modules and then its tests, one document each, 20 MiB).
  init/     the shared init: `Trainer(--from-scratch --seed SEED, fp32)` exported as a HF directory in fp32, so the
            fp32-master run starts from it exactly and bf16 runs from its round-to-nearest bf16 copy.

MODES (flags on top of the recipe): fp32-master (`--model-dtype bf16 --master-dtype fp32`, fp32 Adam states; the
reference), bf16-sr (bf16 weights and states, stochastic rounding), e4m3 (+ `--matmul-dtype e4m3`, with the default
`--fp8-swiglu-onepass`: power-of-two scales for the SwiGLU output and its gradient), e4m3-m (+ `--opt-m-dtype e4m3`),
bf16-rn (bf16 with `--no-stochastic-rounding`: what SR buys), e4m3-exact (e4m3 with `--no-fp8-swiglu-onepass`: every
tensor at its exact abs-max scale: what the power-of-two scales are measured against), e4m3-fh (e4m3
with `--fp8-head-backward`: the LM head's gradient GEMMs in FP8).

Recipe (defaults): 300 steps of 16 x 512 tokens x 2 micro-batches (16k tokens per step, 4.9M tokens: ~1.1 epochs
of the text's ~4.4M training tokens at ~4.7 bytes per token), AdamW lr 3e-4, beta2 0.95, weight decay 0.1, clip 1.0,
warmup 100 steps (a third of the run: issue 21's runs with warmup 10 spiked to loss 10.8 in their first 20 steps),
cosine to 10%, eval every 50 steps on 20 batches and over the whole eval split at the end. At ~120k tokens/s (0.5B
bf16 at M = 8k tokens) a bf16 run trains in ~45 s; the five runs with start-up and two cold compiles (bf16, e4m3)
fit ~7-8 minutes.

Result: final_eval (the end-of-run evaluation over the whole eval split), evals (step -> loss), max_norm and
max_loss_after_warmup (a spike shows there), tps (median of the steady steps), log (the JSON Lines log under the
harness output, for `qtrain plot` and BENCHMARKS.md: bench/fidelity_report.py).
"""
from __future__ import annotations

import glob
import json
import os
import statistics
import sys
import sysconfig
from pathlib import Path

MODES: dict[str, list[str]] = {
    "fp32-master": ["--model-dtype", "bf16", "--master-dtype", "fp32"],
    "bf16-sr": ["--model-dtype", "bf16", "--opt-m-dtype", "bf16", "--opt-v-dtype", "bf16"],
    # the e4m3 modes name the head's backward: unset it is on where it fits (session 32), and e4m3-fh / e4m3 compares
    "e4m3": ["--model-dtype", "bf16", "--opt-m-dtype", "bf16", "--opt-v-dtype", "bf16", "--matmul-dtype", "e4m3",
             "--fp8-policy", "all", "--no-fp8-head-backward"],
    "e4m3-m": ["--model-dtype", "bf16", "--opt-m-dtype", "e4m3", "--opt-v-dtype", "bf16", "--matmul-dtype", "e4m3",
               "--fp8-policy", "all", "--no-fp8-head-backward"],
    "bf16-rn": ["--model-dtype", "bf16", "--opt-m-dtype", "bf16", "--opt-v-dtype", "bf16",
                "--no-stochastic-rounding"],
    "e4m3-exact": ["--model-dtype", "bf16", "--opt-m-dtype", "bf16", "--opt-v-dtype", "bf16", "--matmul-dtype",
                   "e4m3", "--fp8-policy", "all", "--no-fp8-swiglu-onepass", "--no-fp8-head-backward"],
    "e4m3-fh": ["--model-dtype", "bf16", "--opt-m-dtype", "bf16", "--opt-v-dtype", "bf16", "--matmul-dtype", "e4m3",
                "--fp8-policy", "all", "--fp8-head-backward"],
}
TEXT_DIR = "data/fidelity/text"
TEXT_BYTES = 20 << 20


def out_root() -> Path:
    return Path(os.environ.get("OUT") or "output/bench")


# ---- inputs ------------------------------------------------------------------------------------------------
def prepare_text(dest: str, max_bytes: int = TEXT_BYTES) -> int:
    """Copy the standard library's modules (no site-packages), the library first and then its tests, each sorted
    by path, as .txt documents into `dest` until `max_bytes`; returns the bytes written. Real text available on
    every machine with Python (3.11 here: 11.6 MiB of library, 18.5 MiB of tests); files that are not UTF-8 are left
    out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    tests = {"test", "tests", "idle_test"}
    files = sorted((p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts),
                   key=lambda p: (bool(tests & set(p.relative_to(root).parts)), p))
    out = Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    total = 0
    for p in files:
        data = p.read_bytes()
        try:  # the tests' deliberately mis-encoded modules (iso-8859-1, koi8-r) are not text `qtrain tokenize` takes
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if total + len(data) > max_bytes:
            break
        (out / ("__".join(p.relative_to(root).parts) + ".txt")).write_bytes(data)
        total += len(data)
    return total


def _qtrain(argv: list[str]) -> None:
    from qtrain.cli.main import main
    rc = main(argv)
    if rc:
        raise RuntimeError(f"qtrain {' '.join(argv[:1])} exited with {rc}: qtrain {' '.join(argv)}")


def ensure_tokens(text: str, work: Path) -> Path:
    tokens = work / "tokens"
    if not glob.glob(str(tokens / "train*.bin")):
        if not os.path.isdir(text) or not os.listdir(text):
            raise FileNotFoundError(f"no text in {text}: make it with `python3 -m bench.fidelity --prepare-text "
                                    f"{text}` and carry it to the device (carry=['{text.split('/')[0]}'])")
        _qtrain(["tokenize", text, "--out-dir", str(tokens), "--eval-fraction", "0.02", "--no-progress"])
    return tokens


def ensure_init(model: str, seed: int, work: Path, device: str) -> Path:
    init = work / "init"
    if not (init / "config.json").exists():
        from qtrain.options import Options
        from qtrain.train.trainer import Trainer
        tr = Trainer(Options(model=model, from_scratch=True, seed=seed, model_dtype="fp32", device=device,
                             compile="off"))
        tr.export(str(init))
        del tr
    return init


# ---- one mode ------------------------------------------------------------------------------------------------
def summarize(log: Path, warmup: int, total_steps: int) -> dict:
    """A finished run's log -> the kind's result (the final evaluation is the last eval record at `total_steps`)."""
    events = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    steps = [e for e in events if e.get("log") == "step"]
    evals = [e for e in events if e.get("log") == "eval"]
    if not steps or not evals or evals[-1]["step"] < total_steps:
        raise RuntimeError(f"{log}: unfinished (no final evaluation at step {total_steps})")
    tps = [e["step_tokens"] / (e["duration_ms"] / 1000) for e in steps[len(steps) // 4:] if e.get("duration_ms")]
    after = [e["loss"] for e in steps if e["step"] >= warmup]
    return {"final_eval": round(evals[-1]["loss"], 5), "evals": {int(e["step"]): round(e["loss"], 5) for e in evals},
            "max_norm": round(max(e["norm"] for e in steps), 3),
            "max_loss_after_warmup": round(max(after), 4) if after else None,
            "tps": round(statistics.median(tps)) if tps else None, "log": str(log)}


def run(mode: str, steps: int = 300, batch: int = 16, seq: int = 512, accum: int = 2, lr: float = 3e-4,
        warmup: int = 100, eval_every: int = 50, eval_batches: int = 20, model: str = "Qwen2.5-0.5B",
        seed: int = 1234, text: str = TEXT_DIR, work: str = "", device: str = "cuda", flags: list | None = None
        ) -> dict:
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
    # tokens, the init and the runs' exports (GBs): in the checkout, not under $OUT (which travels back)
    work_dir = Path(work) if work else Path("output/fidelity-work")
    tokens = ensure_tokens(text, work_dir)
    init = ensure_init(model, seed, work_dir, device)
    logs = out_root() / "fidelity"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{mode}.jsonl"
    run_dir = work_dir / "runs" / mode  # --start-over: an earlier call's export there is replaced, its log kept aside
    argv = ["train", "--model", str(init), "--train-file", str(tokens / "train*.bin"),
            "--eval-file", str(tokens / "eval*.bin"), "--batch-size", str(batch), "--seq-len", str(seq),
            "--grad-accumulation", str(accum), "--steps", str(steps), "--lr", str(lr), "--warmup", str(warmup),
            "--final-lr-fraction", "0.1", "--lr-schedule", "cosine", "--eval-every-n-steps", str(eval_every),
            "--eval-num-steps", str(eval_batches), "--seed", str(seed), "--device", device,
            "--no-compile-tuning", "--ckpt-interval", str(10 * steps), "--no-save-training-state",
            "--start-over", "--name", mode, "--out-dir", str(run_dir / "export"),
            "--checkpoint-dir", str(run_dir / "ckpt"),
            "--log-file", str(log), *MODES[mode], *(flags or [])]
    print("qtrain " + " ".join(argv), flush=True)
    _qtrain(argv)
    res = summarize(log, warmup, steps)
    print(f"{mode}: final eval {res['final_eval']}, evals {res['evals']}, max norm {res['max_norm']}, "
          f"max loss after warmup {res['max_loss_after_warmup']}, {res['tps']} tokens/s", flush=True)
    return res


def dry_run(params: dict) -> dict:
    """A tiny model of the same family (with the real vocabulary: the token files are qwen2's) on a few of qtrain's
    own source files, on the CPU, uncompiled: 2 steps."""
    from bench.compat import model_config
    from bench.dry import tiny_model_dir
    work = Path("output/fidelity-dry")
    text = work / "text"
    if not text.exists():
        text.mkdir(parents=True)
        src = sorted(Path(__file__).resolve().parent.parent.joinpath("qtrain").rglob("*.py"))
        for p in [p for p in src if 1000 < p.stat().st_size < 3000][:8]:  # short documents: a short final eval
            (text / (p.name + ".txt")).write_bytes(p.read_bytes())
    model = params.get("model", "Qwen2.5-0.5B")
    return {**params, "model": tiny_model_dir(model, vocab_size=model_config(model).vocab_size), "steps": 2, "batch": 2,
            "seq": 16, "accum": 1, "warmup": 1, "eval_every": 1, "eval_batches": 1, "device": "cpu",
            "text": str(text), "work": str(work), "flags": ["--compile", "off"]}


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--prepare-text":
        n = prepare_text(sys.argv[2])
        print(f"{n / 2**20:.1f} MiB of standard-library text in {sys.argv[2]}")
    else:
        sys.exit("usage: python3 -m bench.fidelity --prepare-text DIR")
