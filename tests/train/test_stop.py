"""Runs that stop early (qtrain/train/stop.py), end to end on a tiny model: SIGINT / SIGTERM finish the step,
write a checkpoint, exit with a message that says how to resume, and the resumed run ends bit-identical to
an uninterrupted one; a second signal ends the process at once; a streak of non-finite steps stops with
exit code 3 and the newest finite checkpoint kept through keep-n."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from qtrain.cli.main import main
from qtrain.observe.log import read_log
from qtrain.train.stop import NonFiniteGuard, out_of_memory
from tests.run_utils import make_run_root, qtrain_popen, train_argv


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run of 8 steps: its export and per-step losses."""
    root = make_run_root(tmp_path_factory.mktemp("ref"))
    assert main(train_argv(root, steps=8, name="ref")) == 0
    steps = {e["step"]: e for e in read_log(root / "logs" / "ref.jsonl") if e["log"] == "step"}
    return root, load_file(root / "out" / "ref" / "model.safetensors"), steps


def _signal_when_logged(log, step: int, signum: int) -> threading.Thread:
    """Send `signum` to this process once `log` shows `step` (the loop then finishes the step it is in)."""
    def watch():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if os.path.exists(log) and any(e.get("log") == "step" and e["step"] >= step for e in read_log(log)):
                os.kill(os.getpid(), signum)
                return
            time.sleep(0.01)
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_checkpoints_and_resume_is_bitwise_equal(tmp_path, capsys, reference, signum):
    ref_root, ref_weights, ref_steps = reference
    root = make_run_root(tmp_path)
    argv = train_argv(root, steps=8, name="run", ckpt_interval=100)  # no periodic checkpoint: the signal's only
    t = _signal_when_logged(root / "logs" / "run.jsonl", 2, signum)
    rc = main(argv)
    t.join()
    err = capsys.readouterr().err
    assert rc == 128 + signum
    stopped = [e["step"] for e in read_log(root / "logs" / "run.jsonl") if e["log"] == "step"][-1] + 1
    ckpt = root / "ckpt" / "run" / f"step_{stopped:08d}"
    assert f"{signal.Signals(signum).name} at step {stopped}: checkpoint {ckpt} written; resume with the same " \
           f"command and --continue" in err
    assert (ckpt / "checkpoint.json").is_file() and not (root / "out" / "run").exists()
    assert main(argv + ["--continue"]) == 0
    steps = {e["step"]: e for e in read_log(root / "logs" / "run.jsonl") if e["log"] == "step"}
    assert sorted(steps) == list(range(8))
    for s in range(8):
        assert steps[s]["loss"] == ref_steps[s]["loss"] and steps[s]["norm"] == ref_steps[s]["norm"], s
    got = load_file(root / "out" / "run" / "model.safetensors")
    assert got.keys() == ref_weights.keys() and all(torch.equal(got[k], ref_weights[k]) for k in got)


def test_second_signal_exits_at_once(tmp_path):
    root = make_run_root(tmp_path, tokens=40000)
    p = qtrain_popen(train_argv(root, steps=100000, name="run", ckpt_interval=100000), cwd=root)
    log = root / "logs" / "run.jsonl"
    deadline = time.monotonic() + 300
    while not (log.exists() and any(e["log"] == "step" for e in read_log(log))):
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    first = p.stderr.readline()  # the handler has run once it says so
    assert "SIGINT: finishing the current step" in first
    p.send_signal(signal.SIGINT)  # the first one reset the handler: the default action ends the process
    out, err = p.communicate(timeout=60)
    assert p.returncode == -signal.SIGINT, (p.returncode, err[-2000:])
    assert "Traceback" not in err


def test_nonfinite_streak_stops_and_keeps_the_newest_finite_checkpoint(tmp_path, capsys):
    """--lr 1e30 blows the weights up after step 0: every later step is non-finite and skipped. With
    --ckpt-keep-n 1 the checkpoint of step 1 (written after the last finite step) survives the rotation."""
    root = make_run_root(tmp_path)
    rc = main(train_argv(root, steps=20, lr=1e30, ckpt_interval=1, ckpt_keep_n=1, max_nonfinite_steps=3))
    err = capsys.readouterr().err
    assert rc == 3
    finite = root / "ckpt" / "run" / "step_00000001"
    assert "3 steps in a row with a non-finite loss or gradient norm (steps 1..3)" in err
    assert f"resume from it with --continue {finite}" in err
    assert sorted(os.listdir(root / "ckpt" / "run")) == ["qtrain-run.json", "step_00000001", "step_00000003"]
    messages = [e["message"] for e in read_log(root / "logs" / "run.jsonl") if e["log"] == "message"]
    assert len([m for m in messages if m.startswith("step ") and "non-finite" in m]) == 3  # each one reported
    assert len([m for m in messages if "3 steps in a row with a non-finite loss" in m]) == 1  # the stop, as printed


def test_a_step_out_of_device_memory_stops_with_the_plan_and_the_newest_checkpoint(tmp_path, capsys, monkeypatch):
    """A step that runs out of device memory (raised here by the allocation torch makes for step 3's batch: a CPU
    run has no device allocator to exhaust) ends the run with exit code 4 and one line: the step, torch's message,
    the memory plan, what to change and the newest checkpoint to resume from; that checkpoint and the rest of the
    run's files stay as they were, and nothing is written for the half-done step (no checkpoint, no export)."""
    from qtrain.train.trainer import Trainer
    root = make_run_root(tmp_path)
    real_step = Trainer.step

    def step(self, batches, lr):
        if self.steps_done == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.27 GiB. GPU 0 has a total capacity "
                                         "of 139.80 GiB of which 6.26 GiB is free.\nmore lines")
        return real_step(self, batches, lr=lr)

    monkeypatch.setattr(Trainer, "step", step)
    rc = main(train_argv(root, steps=6))
    err = capsys.readouterr().err
    newest = root / "ckpt" / "run" / "step_00000002"
    assert rc == 4, err
    assert "qtrain: out of memory: out of device memory in step 3 (CUDA out of memory. Tried to allocate 9.27 GiB." \
           in err and "more lines" not in err
    assert "); memory plan " in err and " B=2 T=16 world 1: " in err  # the plan's summary, its numbers
    assert "--lmhead-chunks" in err and "--grad-accumulation" in err
    assert f"the newest checkpoint is {newest}: resume from it with --continue and one of those changes" in err
    # the run log says it too (a run in the background may have lost its console)
    assert any(e["log"] == "message" and "out of device memory in step 3" in e["message"]
               for e in read_log(root / "logs" / "run.jsonl"))
    assert sorted(os.listdir(root / "ckpt" / "run")) == ["qtrain-run.json", "step_00000002"]
    assert not (root / "out" / "run").exists() or not any((root / "out" / "run").iterdir())
    # the checkpoint is whole: the same run resumes from it (the step no longer fails) and finishes
    monkeypatch.setattr(Trainer, "step", real_step)
    assert main(train_argv(root, steps=6, extra=("--continue",))) == 0
    assert [e["step"] for e in read_log(root / "logs" / "run.jsonl") if e["log"] == "step"] == [0, 1, 2, 2, 3, 4, 5]


def test_nonfinite_guard_counts_streaks():
    g = NonFiniteGuard(2)
    assert g.update(0, 1.0, 1.0) is None
    assert "1 in a row" in g.update(1, float("nan"), 1.0)
    assert g.update(2, 1.0, 1.0) is None and g.streak == 0  # a finite step ends the streak
    g.update(3, 1.0, float("inf"))
    assert not g.exceeded
    g.update(4, float("nan"), float("nan"))
    assert g.exceeded and g.first_bad == 3
    assert not NonFiniteGuard(0).exceeded  # 0: never stop


# ---- --debug-stack-dump-after: a stalled step says where it waits -------------------------------------------
def _stall_here_for(seconds: float) -> None:
    time.sleep(seconds)


def test_a_step_past_its_time_writes_every_threads_stack_and_goes_on(capfd):
    """faulthandler writes to file descriptor 2 from its own thread while the step is still running; the stack
    names the function the main thread waits in."""
    from qtrain.train.stop import StackDump
    dump = StackDump(1)
    dump.arm()
    _stall_here_for(1.6)
    dump.disarm()
    err = capfd.readouterr().err
    assert "most recent call first" in err and "_stall_here_for" in err, err[-2000:]


def test_a_step_in_time_writes_nothing_and_zero_is_off(capfd):
    from qtrain.train.stop import StackDump
    dump = StackDump(1)
    dump.arm()
    dump.disarm()  # the step ended in time
    off = StackDump(0)
    off.arm()  # off: no timer
    _stall_here_for(1.3)
    off.disarm()
    assert "most recent call first" not in capfd.readouterr().err


def test_the_option_is_validated():
    from qtrain.options import Options, OptionsError
    with pytest.raises(OptionsError, match="--debug-stack-dump-after must be >= 0 seconds"):
        Options(debug_stack_dump_after=-1).validate()


# torch's message of the Qwen2.5-0.5B 32 x 4 step that ran out of memory on an H100 (session 31), in torch 2.11's words
H100_OOM = ("CUDA out of memory. Tried to allocate 9.27 GiB. GPU 0 has a total capacity of 79.18 GiB of which 4.95 GiB "
            "is free. Including non-PyTorch memory, this process has 74.22 GiB memory in use. Of the allocated memory "
            "33.65 GiB is allocated by PyTorch, and 39.57 GiB is reserved by PyTorch but unallocated. If reserved but "
            "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
            "fragmentation.  See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html"
            "#environment-variables)")


def test_the_out_of_memory_report_keeps_torchs_numbers_and_the_peak():
    """The report keeps every number of torch's message (a cut at 200 characters lost what PyTorch held allocated and
    reserved, the two that tell fragmentation from a full device), drops torch's advice for its own, does not say the
    fragments twice, and gives the allocator's peak beside the plan."""
    gib = 1 << 30
    oom = torch.OutOfMemoryError(H100_OOM)
    msg = out_of_memory(0, oom, "PLAN", int(39.57 * gib), None, peak=int(43.1 * gib)).args[0]
    assert "33.65 GiB is allocated by PyTorch, and 39.57 GiB is reserved by PyTorch but unallocated" in msg
    assert "See documentation" not in msg and "If reserved but unallocated" not in msg
    assert msg.count("39.57") == 1  # torch said it: qtrain's own fragments phrase is left out
    assert "the allocator's peak in this run: 43.10 GiB allocated" in msg and "memory plan PLAN" in msg
    cut = out_of_memory(0, oom, "PLAN", int(39.57 * gib), None, peak=int(43.1 * gib), largest_free=3 * gib).args[0]
    assert "43.10 GiB allocated, its largest free block 3.00 GiB" in cut
    # a message without torch's numbers (another allocator, an older torch) gets qtrain's own measurement
    short = out_of_memory(2, torch.OutOfMemoryError("out of memory"), "PLAN", 3 * gib, None).args[0]
    assert "the allocator held 3.00 GiB reserved but unallocated" in short and "peak" not in short


def test_the_out_of_memory_report_names_the_graphs_pool_and_the_runs_own_switches():
    """Session 32's H100 message: 39.40 GiB free in a CUDA graphs' private pool. The report says how much of the free
    memory only the graphs could use and names the switches of what this run spends memory on (a bf16 run is not
    told about FP8 options it does not use)."""
    gib = 1 << 30
    oom = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 304.00 MiB. GPU 0 has a total capacity of 79.18 GiB of which 114.19 MiB "
        "is free. Including non-PyTorch memory, this process has 79.06 GiB memory in use. Of the allocated memory "
        "78.09 GiB is allocated by PyTorch, with 39.40 GiB allocated in private pools (e.g., CUDA Graphs), and 158.27 "
        "MiB is reserved by PyTorch but unallocated.")
    msg = out_of_memory(0, oom, "PLAN", int(0.16 * gib), None, peak=int(43.1 * gib), largest_free=int(9.27 * gib),
                        pool_free=int(39.4 * gib), switches=("--no-use-cuda-graphs",)).args[0]
    assert "39.40 GiB of the free memory sat in CUDA graphs' private pools" in msg
    assert "Use less: --no-use-cuda-graphs, more --lmhead-chunks" in msg and "fp8" not in msg.lower()
    bare = out_of_memory(0, oom, "PLAN", None, None).args[0]
    assert "Use less: more --lmhead-chunks" in bare and "private pools, which" not in bare
    # torch's message without the reserved-but-unallocated phrase: the fragments qtrain names leave the pool's bytes
    # out (expandable segments cannot give those back)
    plain = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
    msg = out_of_memory(0, plain, "PLAN", int(40 * gib), None, pool_free=int(39 * gib)).args[0]
    assert "held 1.00 GiB reserved but unallocated (fragments)" in msg and "39.00 GiB of the free memory sat" in msg
    gone = out_of_memory(0, plain, "PLAN", int(39 * gib), None, pool_free=int(39 * gib)).args[0]
    assert "expandable_segments" not in gone
