"""Kind `hf-train`: what a user would pick instead of qtrain, on any shape qtrain has: transformers' own model of the
family (AutoModelForCausalLM.from_config: random init, no hub), optionally wrapped by peft's LoRA, trained with
torch's fused AdamW on random tokens, at each of the settings the suite lists; the result is the fastest setting
that ran ("transformers at its fastest setting that fits") and every setting's row.

The shape comes from qtrain: `model` is a qtrain preset or config.json directory, cut to `layers` when given
(bench/shapes.py), written as transformers reads it (the family's `to_hf_dict`), so both systems train one model.
The step is the one `hf` (../shared/bench/hf_baseline.py) times: for each of `accum` micro-batches the loss of
`model(input_ids, labels)` backward, then clip_grad_norm_(1.0), AdamW (lr 1e-4, betas 0.9/0.95, weight decay 0.1,
fused on CUDA) over the trainable parameters; tokens/s = batch * seq * accum * steps / wall time of `steps` steps
after `warmup` (device synchronised). With an MoE config the router's auxiliary loss is on (`aux_loss`), as
qtrain's MoE loss always has it.

Parameters: model, batch; accum (1), steps (5), warmup (3), seq (1024), layers, device ("cuda"), dtype ("bf16"; "fp32"
for CPU smoke runs); LoRA: lora_rank (0: full fine-tune), lora_alpha (0: 2 x rank), lora_targets (qtrain's names
q,k,v,o,gate,up,down or HF module names; default all seven), lora_dropout (0); settings: a list of tables, each tried in
its own process (`isolate`), with keys name, attn ("sdpa", "flash_attention_2", "eager"; default "sdpa"), compile
(torch.compile of the model, default false), grad_ckpt (transformers' gradient checkpointing, default false), experts
(transformers' experts_implementation of an MoE, e.g. "grouped_mm" or "eager"; default: transformers' choice), batch and
accum (this setting's micro-batch and accumulation, default the case's: one global batch at another micro-batch, so that
transformers runs at its fastest one); setting_timeout (s per setting); first_ok (settings listed fastest first, each
after the first a fallback: stop at the first that runs). Result: tps, step_ms, peak_gib, mfu (qtrain's
model_flops_per_token: over the active parameters, against the device's dense bf16 peak), best (the fastest setting's
name), batch and accum (the fastest setting's), layers, trainable (parameters the optimizer updates), rows (every
setting: batch, accum, status, tps, step_ms, peak_gib, warmup_s (compilation included), error).
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import time
from typing import Any

from bench.dry import tiny_model_dir
from bench.shapes import shaped_config

QTRAIN_TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
                  "down": "down_proj"}
SETTING_KEYS = {"name": str, "attn": str, "compile": bool, "grad_ckpt": bool, "experts": str, "batch": int,
                "accum": int}
RESULT = "@@hf-train-setting@@ "  # the child's result line
DTYPES = ("bf16", "fp32")


def check_settings(settings: list[dict] | None) -> list[dict]:
    """The settings with their names (given, or made from the keys); an unknown key or a wrong type is named."""
    out = []
    for i, s in enumerate(settings or [{}]):
        if not isinstance(s, dict):
            raise ValueError(f"settings[{i}]: want a table with keys {', '.join(SETTING_KEYS)}, got {s!r}")
        for k, v in s.items():
            if k not in SETTING_KEYS:
                raise ValueError(f"settings[{i}]: unknown key {k!r} (keys: {', '.join(SETTING_KEYS)})")
            if not isinstance(v, SETTING_KEYS[k]) or (SETTING_KEYS[k] is int and (isinstance(v, bool) or v < 1)):
                want = "positive int" if SETTING_KEYS[k] is int else SETTING_KEYS[k].__name__
                raise ValueError(f"settings[{i}] {k}: want a {want}, got {v!r}")
        name = s.get("name") or "+".join([s.get("attn", "sdpa")] + (["compile"] if s.get("compile") else [])
                                         + (["ckpt"] if s.get("grad_ckpt") else [])
                                         + ([f"experts={s['experts']}"] if s.get("experts") else [])
                                         + [f"{k}={s[k]}" for k in ("batch", "accum") if k in s])
        out.append({**s, "name": name})
    names = [s["name"] for s in out]
    if len(set(names)) != len(names):
        raise ValueError(f"settings: two settings named alike ({', '.join(names)}): give them names")
    return out


def lora_spec(rank: int, alpha: float, targets: list[str] | str | None, dropout: float) -> dict | None:
    """peft's LoraConfig arguments, or None for a full fine-tune; qtrain's target names map to HF's modules."""
    if not rank:
        return None
    names = targets.split(",") if isinstance(targets, str) else list(targets or QTRAIN_TARGETS)
    modules = [QTRAIN_TARGETS.get(t.strip(), t.strip()) for t in names if t.strip()]
    return dict(r=rank, lora_alpha=alpha or 2 * rank, target_modules=modules, lora_dropout=dropout, bias="none")


def run(model: str, batch: int, accum: int = 1, steps: int = 5, warmup: int = 3, seq: int = 1024,
        layers: int | None = None, device: str = "cuda", dtype: str = "bf16", lora_rank: int = 0,
        lora_alpha: float = 0.0, lora_targets: list[str] | str | None = None, lora_dropout: float = 0.0,
        settings: list[dict] | None = None, aux_loss: bool = True, isolate: bool = True,
        setting_timeout: float | None = None, first_ok: bool = False) -> dict:
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: want one of {', '.join(DTYPES)}")
    cfg = shaped_config(model, layers)
    spec = dict(hf_config=cfg.to_hf_dict(), batch=batch, accum=accum, steps=steps, warmup=warmup, seq=seq,
                device=device, dtype=dtype, lora=lora_spec(lora_rank, lora_alpha, lora_targets, lora_dropout),
                aux_loss=aux_loss)
    rows: list[dict] = []
    for s in check_settings(settings):
        if first_ok and any(r["status"] == "ok" for r in rows):
            rows.append({"setting": s["name"], "status": "skipped", "error": "first_ok: an earlier setting ran"})
            continue
        one = {**spec, "batch": s.get("batch", batch), "accum": s.get("accum", accum), "setting": s}
        row = measure_in_child(one, setting_timeout) if isolate else measure_here(one)
        rows.append({"setting": s["name"], "batch": one["batch"], "accum": one["accum"], **row})
        print(f"hf-train {s['name']}: " + ", ".join(f"{k} {v}" for k, v in row.items() if k != "setting"), flush=True)
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        raise RuntimeError("no setting ran: " + "; ".join(f"{r['setting']}: {r.get('error')}" for r in rows))
    best = max(ok, key=lambda r: r["tps"])
    res = dict(system="hf+peft" if spec["lora"] else "hf", tps=best["tps"], step_ms=best["step_ms"],
               peak_gib=best.get("peak_gib"), best=best["setting"], batch=best["batch"], accum=best["accum"],
               layers=cfg.num_hidden_layers, fla=importlib.util.find_spec("fla") is not None,
               trainable=best.get("trainable"), rows=rows,
               summary="; ".join(f"{r['setting']} {r['tps'] if r['status'] == 'ok' else r['status']}" for r in rows))
    peak = peak_tflops(best.get("device"))
    if peak:
        from bench.compat import qtrain
        res["mfu"] = round(best["tps"] * qtrain("model_flops_per_token")(cfg, seq) / (peak * 1e12), 3)
    print(", ".join(f"{k} {v}" for k, v in res.items() if k != "rows"), flush=True)
    return res


def peak_tflops(device_name: str | None) -> float | None:
    if not device_name:
        return None
    from bench.compat import qtrain
    return qtrain("peak_tflops")(device_name, "bf16")


def measure_in_child(spec: dict, timeout: float | None) -> dict:
    """One setting in a fresh process (`python -m bench.hf_train SPEC`): an out-of-memory error or a compiled
    graph of one setting leaves the next untouched."""
    from bench.subproc import stream
    root = os.environ.get("BENCH_ROOT") or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    t0 = time.monotonic()
    stop = (lambda: time.monotonic() - t0 > timeout) if timeout else None
    fin = stream([sys.executable, "-m", "bench.hf_train", json.dumps(spec)], env=env, stop=stop,
                 echo=lambda line: not line.startswith(RESULT))
    rows = [json.loads(x[len(RESULT):]) for x in fin.lines if x.startswith(RESULT)]
    if rows:
        return rows[-1]
    if fin.stopped:
        return {"status": "timeout", "error": f"setting_timeout {timeout:g} s passed"}
    how = f"killed by signal {-fin.returncode}" if fin.returncode < 0 else f"exit status {fin.returncode}"
    return {"status": "failed", "error": f"{how}, no result: {fin.last(2)}"[:400]}


def measure_here(spec: dict) -> dict:
    """One setting in this process: its row, with an out-of-memory error or a failure as the row's status."""
    import torch
    try:
        return measure(spec)
    except torch.OutOfMemoryError as e:
        return {"status": "oom", "error": str(e).splitlines()[0][:300]}
    except Exception as e:  # noqa: BLE001 - one setting's failure is its row; the others still run
        first = (str(e).strip().splitlines() or [""])[0]
        return {"status": "failed", "error": f"{type(e).__name__}: {first}"[:400]}
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def build_model(spec: dict):
    """transformers' model of the config (random init on the device, in the run's dtype), LoRA-wrapped by peft
    when asked; the setting's attention, experts implementation and gradient checkpointing applied."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    s, d = spec["setting"], dict(spec["hf_config"])
    cfg = CONFIG_MAPPING[d["model_type"]].from_dict(d)
    cfg.use_cache = False
    if hasattr(cfg, "output_router_logits"):
        cfg.output_router_logits = bool(spec["aux_loss"])
    dtype = torch.bfloat16 if spec["dtype"] == "bf16" else torch.float32
    kwargs: dict[str, Any] = dict(dtype=dtype, attn_implementation=s.get("attn", "sdpa"))
    if s.get("experts"):
        kwargs["experts_implementation"] = s["experts"]
    torch.manual_seed(0)
    with torch.device(spec["device"]):
        model = AutoModelForCausalLM.from_config(cfg, **kwargs)
    model.to(device=spec["device"], dtype=dtype)
    if spec["lora"]:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **spec["lora"]))
    if s.get("grad_ckpt"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    model.train()
    return model


def measure(spec: dict) -> dict:
    import torch

    dev = torch.device(spec["device"])
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    model = build_model(spec)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)
    fwd = torch.compile(model) if spec["setting"].get("compile") else model
    B, T, accum = spec["batch"], spec["seq"], spec["accum"]
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randint(0, model.config.vocab_size, (B, T), device=dev, generator=g)  # labels shift inside the model

    def step() -> float:
        for _ in range(accum):
            loss = fwd(input_ids=x, labels=x).loss
            (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    t = time.perf_counter()
    for _ in range(spec["warmup"]):
        step()
    sync()
    warm = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(spec["steps"]):
        loss = step()
    sync()
    dt = (time.perf_counter() - t) / spec["steps"]
    row = dict(status="ok", tps=round(B * T * accum / dt), step_ms=round(1000 * dt, 1), warmup_s=round(warm, 1),
               loss=round(float(loss), 4), trainable=sum(p.numel() for p in params))
    if not math.isfinite(row["loss"]):
        row.update(status="failed", error=f"loss {row['loss']}")
    if cuda:
        row.update(peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2), device=torch.cuda.get_device_name())
    return row


def dry_run(params: dict) -> dict:
    """The case's settings and LoRA targets checked, then every setting run on the CPU in this process: a tiny
    model of the same family (bench/dry.tiny_model_dir), fp32, 2 x 32 tokens, 2 steps after 1 warm-up, eager
    (no compile, SDPA: inductor and flash attention are for the GPU)."""
    settings = check_settings(params.get("settings"))
    shaped_config(params["model"], params.get("layers"))  # a bad layers count fails here, as on the GPU
    small = [{**s, "compile": False, "attn": "sdpa", **{k: min(s[k], 2) for k in ("batch", "accum") if k in s}}
             for s in settings]
    return {**params, "model": tiny_model_dir(params["model"]), "layers": None, "batch": 2, "seq": 32,
            "accum": min(params.get("accum", 1), 2), "steps": 2, "warmup": 1, "device": "cpu", "dtype": "fp32",
            "settings": small, "isolate": False, "setting_timeout": None}


def main(argv: list[str]) -> int:
    """The child of `measure_in_child`: one setting, its row printed as the last line."""
    row = measure_here(json.loads(argv[0]))
    print(RESULT + json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
