"""The run's one resolution (qtrain/plan/resolution.py): a CPU start resolves once and plans once, and the run log's
memory plan and the Trainer's model settings are the record's; a Trainer built without a preflight resolves for
itself; the record of a CUDA run holds what the model and the plan read (compile, the gated FP8 dtype, CUDA graphs)."""
from __future__ import annotations

import json

import pytest

import qtrain.plan.resolution as resolution
from qtrain.cli.main import main
from qtrain.model.registry import preset
from qtrain.options import Options
from qtrain.plan.resolution import RunResolution, plan_memory, resolve_run
from qtrain.train.trainer import Trainer
from tests.run_utils import CFG, make_run_root, train_argv


def test_a_cpu_start_resolves_and_plans_once(tmp_path, monkeypatch, capsys):
    """Before: the preflight planned (host memory), the log header planned again (and on CUDA the Trainer a third
    time for --fp8-keep-transposes). Now the preflight's record carries the plan to the Trainer and the header."""
    import qtrain.train.preflight as preflight
    import qtrain.train.trainer as trainer
    calls = {"resolve_run": 0, "build_plan": 0}

    def counting(module, name):
        real = getattr(module, name)

        def counted(*a, **kw):
            calls[name] += 1
            return real(*a, **kw)
        monkeypatch.setattr(module, name, counted)
    for module in (preflight, trainer):  # who resolves: the preflight, or a Trainer built without it
        counting(module, "resolve_run")
    counting(resolution, "build_plan")  # every plan is built there
    root = make_run_root(tmp_path)
    monkeypatch.chdir(root)
    assert main(train_argv(root, steps=2)) == 0
    assert calls == {"resolve_run": 1, "build_plan": 1}
    events = [json.loads(line) for line in (root / "logs" / "run.jsonl").read_text().splitlines()]
    [logged] = [e for e in events if e["log"] == "memory-plan"]
    opts = Options(model=str(root / "model"), from_scratch=True, batch_size=2, seq_len=16, grad_accumulation=1,
                   model_dtype="fp32", compile="off", device="cpu", steps=2)
    want = plan_memory(CFG, opts, device="cpu", model_name=str(root / "model")).to_dict()
    assert {k: logged[k] for k in want} == json.loads(json.dumps(want))  # what `qtrain plan` plans for the CPU
    assert "[Memory plan]" in capsys.readouterr().out


def test_trainer_resolves_for_itself_or_takes_the_given_record(tmp_path):
    root = make_run_root(tmp_path)
    opts = Options(model=str(root / "model"), from_scratch=True, batch_size=2, seq_len=16, grad_accumulation=1,
                   model_dtype="fp32", device="cpu", memory_check=False)
    tr = Trainer(opts)
    assert isinstance(tr.run, RunResolution) and (tr.run.device, tr.run.world, tr.run.compile) == ("cpu", 1, False)
    assert tr.model.run.sdpa_backend == tr.run.sdpa_backend and tr.grads is not None
    given = resolve_run(CFG, opts, world=1, device="cpu")
    assert Trainer(opts, run=given).run is given
    with pytest.raises(ValueError, match="resolved for 2 x cpu"):
        Trainer(opts, run=resolve_run(CFG, opts, world=2, device="cpu"))


def test_a_cuda_record_on_any_machine():
    """What a CUDA run of Qwen2.5-0.5B resolves to, described on this machine: compiled blocks; e4m3 whose FP8
    policy puts no linear in FP8 at 4 x 1024 runs the model dtype's path (block_matmul_dtype '') and so CUDA
    graphs stay on; --fp8-policy all puts the four in FP8, and graphs go off."""
    cfg = preset("Qwen2.5-0.5B")
    base = dict(model="Qwen2.5-0.5B", seq_len=1024, batch_size=4, matmul_dtype="e4m3")
    auto = resolve_run(cfg, Options(**base).validate(), device="cuda", gpu_memory=80 << 30)
    assert auto.compile and auto.matmul_dtype == "e4m3" and auto.block_matmul_dtype == "" and auto.fp8_linears == ()
    assert auto.cuda_graphs and auto.cuda_graph_blockers == () and auto.gradients == "unsharded"
    assert auto.fp8_swiglu_onepass and not auto.fp8_keep_transposes  # no FP8 linear: nothing to keep
    every = resolve_run(cfg, Options(**base, fp8_policy="all").validate(), device="cuda", gpu_memory=80 << 30)
    assert every.block_matmul_dtype == "e4m3" and len(every.fp8_linears) == 4 and not every.cuda_graphs
    assert every.fp8_keep_transposes and every.plan.settings["fp8_keep_transposes"]  # fits 80 GiB with the margin
    zero3 = resolve_run(cfg, Options(**base, zero_level=3).validate(), world=2, device="cuda")
    assert not zero3.cuda_graphs and len(zero3.cuda_graph_blockers) == 3 and zero3.gradients == "reduce-scatter"
    cpu = resolve_run(cfg, Options(**base).validate(), device="cpu")
    assert not cpu.compile and not cpu.cuda_graphs and cpu.plan.settings["device"] == "cpu"
    # what an out-of-memory report tells each run to turn off first: only what that run spends memory on
    assert auto.fp8_head_backward  # e4m3 on a GPU whose plan fits it, graphs on beside it (no FP8 linear)
    assert auto.memory_for_speed_switches == ("--no-use-cuda-graphs", "--no-fp8-head-backward")
    assert every.memory_for_speed_switches == ("--no-fp8-head-backward", "--no-fp8-keep-transposes")
    assert cpu.memory_for_speed_switches == ()
