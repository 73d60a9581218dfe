"""Host memory (qtrain/plan/host.py): on the CPU the plan is the run's peak resident memory within 10%
(measured in a fresh process: RSS before the model is built + the plan vs the peak RSS after some steps),
and runs whose plan does not fit the available host memory are refused with the numbers."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from qtrain.model.llama import LlamaConfig
from qtrain.model.registry import preset
from qtrain.options import Options
from qtrain.plan.host import HostMemoryError, available_host_memory, check_host_memory, host_bytes
from qtrain.plan.memory import GiB
from qtrain.plan.resolution import plan_memory
from tests.run_utils import subprocess_env

# embedding-heavy, like the real models: 8M of its 11M parameters are the (tied) embedding
CFG = dict(model_type="qwen2", vocab_size=32000, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)

MEASURE = r"""
import json, sys
import torch
torch.set_num_threads(1)
from qtrain.model.llama import LlamaConfig
from qtrain.model.registry import preset
from qtrain.options import Options
from qtrain.plan.host import host_bytes, process_rss, return_freed_memory
from qtrain.plan.resolution import plan_for_trainer
from qtrain.train.trainer import Trainer
cfg_d, opts_d, model_dir = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
return_freed_memory()  # what run_training does on the CPU
base = process_rss()
tr = Trainer(Options(model=model_dir, from_scratch=True, device="cpu", compile="off", **opts_d))
g = torch.Generator().manual_seed(0)
for step in range(2):
    for _ in range(tr.opts.grad_accumulation):
        x = torch.randint(0, cfg_d["vocab_size"], (tr.opts.batch_size, tr.opts.seq_len + 1), generator=g)
        tr.micro_step(x[:, :-1], x[:, 1:])
    tr.update(lr=1e-4)
# VmHWM: this process image's peak (ru_maxrss would carry the forking parent's peak across exec: a large pytest
# process made every measurement its own size in a full run)
peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"base": base, "plan": host_bytes(plan_for_trainer(tr)), "peak": peak}))
"""


@pytest.mark.parametrize("opts", [
    dict(batch_size=4, seq_len=128),
    dict(batch_size=2, seq_len=128, grad_accumulation=2),
    dict(batch_size=8, seq_len=128, recompute_block=True, lmhead_chunks=4),
    dict(batch_size=4, seq_len=128, recompute_ffn=True, recompute_att=True),
], ids=["default", "accumulation", "recompute-block,lmhead-chunks", "recompute-ffn,att"])
def test_cpu_plan_is_the_peak_rss_within_10_percent(tmp_path, opts):
    (tmp_path / "config.json").write_text(json.dumps(LlamaConfig(**CFG).to_hf_dict()))
    opts = {"model_dtype": "fp32", "grad_accumulation": 1, **opts}
    r = subprocess.run([sys.executable, "-c", MEASURE, json.dumps(CFG), json.dumps(opts), str(tmp_path)],
                       env=subprocess_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    predicted = m["base"] + m["plan"]
    assert m["plan"] > m["base"] / 2  # the model's memory, not the interpreter's, decides the comparison
    assert abs(predicted - m["peak"]) <= 0.10 * m["peak"], m


def test_cpu_run_that_cannot_fit_is_refused_with_the_numbers():
    plan = plan_memory(preset("Qwen2.5-7B"), Options(model_dtype="fp32", batch_size=4, seq_len=1024), device="cpu")
    with pytest.raises(HostMemoryError) as e:
        check_host_memory(plan, 1, available=16 * GiB)
    msg = str(e.value)
    need = host_bytes(plan) / GiB
    assert f"the CPU run needs {need:.2f} GiB" in msg and "16.00 GiB are available" in msg
    assert "--no-memory-check" in msg and "qtrain plan" in msg


def test_pinned_offload_buffers_that_cannot_fit_are_refused():
    """On CUDA only the host column counts: offloaded Adam moments of 7B in pinned memory, per process."""
    opts = Options(model_dtype="bf16", zero_level=1, offload_opt_m=True, offload_opt_v=True)
    plan = plan_memory(preset("Qwen2.5-7B"), opts, world=2, device="cuda")
    host = host_bytes(plan)
    assert host == plan.host_total > 10 * GiB
    check_host_memory(plan, 2, available=2 * host + GiB)  # fits
    with pytest.raises(HostMemoryError, match=r"pinned host buffers \(offload\) needs .* \(2 process\(es\) x"):
        check_host_memory(plan, 2, available=2 * host - GiB)


def test_available_memory_is_read_from_the_kernel():
    avail = available_host_memory()
    assert avail is None or 0 < avail < 1 << 50


def test_a_merged_export_that_cannot_fit_beside_the_run_is_refused_up_front():
    """--lora-merge of a 7B bf16 LoRA run: the merged model (~15 GiB in bf16; twice that with sharded weights, the
    gathered model beside it) must fit beside the run's own host memory at its end, or the OOM killer stops the
    export; refused before the model is built, naming --lora-merge and what to do instead."""
    from qtrain.model.weights import num_params
    from qtrain.plan.host import merged_export_bytes
    cfg = preset("Qwen2.5-7B")
    n = num_params(cfg)
    assert merged_export_bytes(n, 2, weights_sharded=False) == 2 * n
    assert merged_export_bytes(n, 2, weights_sharded=True) == 4 * n
    opts = Options(model_dtype="bf16", lora_rank=16, offload_opt_m=True)
    plan = plan_memory(cfg, opts, device="cuda")
    host, merged = host_bytes(plan), merged_export_bytes(n, 2, weights_sharded=False)
    check_host_memory(plan, 1, available=host + merged + GiB, merged_export=merged)  # fits
    with pytest.raises(HostMemoryError, match=r"--lora-merge holds 14\.\d\d GiB of the merged model in host memory at "
                                              r"the end of the run.* drop --lora-merge"):
        check_host_memory(plan, 1, available=host + merged - GiB, merged_export=merged)
    with pytest.raises(HostMemoryError, match=r"pinned host buffers"):  # the run itself first
        check_host_memory(plan, 1, available=host - GiB, merged_export=merged)


def test_the_preflight_counts_the_merged_export(tmp_path, monkeypatch):
    """`qtrain train --lora-merge` hands the merged model's bytes to the host check; without it, none."""
    import qtrain.plan.host as host_mod
    from qtrain.cli.main import main
    from qtrain.model.weights import num_params
    from tests.hf_fixtures import save_tiny_hf_model
    from tests.run_utils import make_run_root, train_argv
    seen: list[int] = []
    real = host_mod.check_host_memory

    def spy(plan, procs, **kw):
        seen.append(kw.get("merged_export", 0))
        return real(plan, procs, **kw)
    monkeypatch.setattr(host_mod, "check_host_memory", spy)
    root = make_run_root(tmp_path)
    save_tiny_hf_model("qwen2", root / "base")
    for name, extra in (("plain", ()), ("merged", ("--lora-merge",))):
        argv = train_argv(root, steps=1, name=name, model=root / "base",
                          extra=("--lora-rank", "4", "--quiet", *extra))
        argv.remove("--from-scratch")
        assert main(argv) == 0
    from qtrain.model.hf_io import load_model_config
    assert seen == [0, num_params(load_model_config(root / "base")) * 4]  # fp32 master in the tiny run
