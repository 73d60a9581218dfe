"""The benchmark harness (bench/run.py) on the CPU: every suite in bench/suites parses; one tiny suite runs end to
end through the real subprocess path (--dry-run: real qtrain on a tiny model, real JSON lines, the table and
ratios) with a second checkout, a case that fails, one whose process dies, one that passes its timeout (its
subprocess group killed with it) beside another in the same round, and runs after them that still complete; bad suite files and options give
errors naming the file and the key."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path

import pytest

from bench import run as harness
from bench.kinds import KINDS
from bench.llmq import parse_summary as llmq_summary
from bench.pytest_run import parse_summary as pytest_summary
from bench.report import ratio_lines, table
from bench.suite import REPO_ROOT, Ratio, SuiteError, load, suite_names
from tests.run_utils import subprocess_env

REQUIRED = {"regress-1p5b", "sizes", "precision", "fidelity", "gemm-ceiling", "gpu-tests"}
BEFORE_RESTRUCTURE = "80533b6"  # the code regress-1p5b and start compare against (main before the family seam)


def test_every_suite_parses_and_names_known_kinds():
    names = suite_names()
    assert REQUIRED <= set(names), f"missing suites: {REQUIRED - set(names)}"
    for name in names:
        s = load(name)
        assert s.runs and s.description, name
        assert all(r.kind in KINDS and r.timeout > 0 for r in s.runs), name
        assert len({r.id for r in s.runs}) == len(s.runs), name


def test_cuda_graph_cases_pass_the_rules_a_cuda_run_checks_and_a_refused_one_fails_its_dry_run():
    """--use-cuda-graphs' blockers are checked only on a CUDA device, and the CPU dry run drops the flag: the dry
    run checks them first (`cli_train.check_cuda_rules`), so a suite case the GPU run would refuse fails here,
    not after a device start. Every suite's graph cases pass; graphs with --persistent-quants are refused."""
    from bench.cli_train import check_cuda_rules
    from qtrain.options import OptionsError

    checked = 0
    for name in suite_names():
        for r in load(name).runs:
            if r.kind == "cli" and "--use-cuda-graphs" in r.params.get("flags", []):
                check_cuda_rules(r.params)
                checked += 1
    assert checked, "no suite case asks for CUDA graphs: the check above checked nothing"
    bad = {"model": "Qwen2.5-1.5B", "batch": 4, "accum": 2,
           "flags": ["--matmul-dtype", "e4m3", "--persistent-quants", "--use-cuda-graphs"]}
    with pytest.raises(OptionsError, match="--use-cuda-graphs does not support --persistent-quants"):
        check_cuda_rules(bad)
    check_cuda_rules({**bad, "flags": ["--matmul-dtype", "e4m3", "--persistent-quants"]})  # no graphs: no check


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_module_imports_with_run_and_dry_run(kind):
    """A kind's module must import on the CPU (the harness imports it in every run's process, GPU kinds included)
    and offer the two entry points the harness calls."""
    import importlib
    module = importlib.import_module(KINDS[kind].module)
    assert callable(getattr(module, "run", None)) and callable(getattr(module, "dry_run", None)), kind


HIDE_TRITON = """
import importlib, importlib.abc, sys
class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "triton":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoTriton())
"""


def test_every_kind_module_imports_without_triton():
    """The install may lack Triton (qtrain then runs every kernel's twin): every kind module still imports, a kind
    that times Triton kernels imports triton only when it runs. Checked in a child process where `import triton`
    fails, whether or not this machine has Triton."""
    code = HIDE_TRITON + """
from bench.kinds import KINDS
from qtrain.kernels import dispatch
assert not dispatch.HAS_TRITON
for kind in KINDS:
    module = importlib.import_module(KINDS[kind].module)
    assert callable(module.run) and callable(module.dry_run), kind
print("imported", len(KINDS))
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=subprocess_env(), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and f"imported {len(KINDS)}" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


def test_regress_suite_alternates_base_and_new():
    s = load("regress-1p5b")
    assert s.checkouts["base"].commit == BEFORE_RESTRUCTURE
    for case in ("bf16", "e4m3"):
        runs = [r for r in s.runs if r.case == case]
        assert [r.checkout for r in runs] == ["base", "new", "new", "base"]
        assert {r.params["model"] for r in runs} == {"Qwen2.5-1.5B"}
    assert {r.params.get("matmul_dtype") for r in s.runs} == {None, "e4m3"}


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


CASE = '[[case]]\nname = "a"\nkind = "train"\n'


@pytest.mark.parametrize("text, where", [
    ("[[case]\nname = 1", "not valid TOML"),
    ("cases = 1\n" + CASE, "top level: unknown key 'cases'"),
    ('description = "x"\n', "[[case]]"),
    ('[[case]]\nkind = "train"\n', "case[0] name"),
    ('[[case]]\nname = "a"\nkind = "nope"\n', "case 'a' kind: 'nope' is not a kind"),
    (CASE + "timeout = -1\n", "case 'a' timeout"),
    (CASE + "params = 3\n", "case 'a' params"),
    (CASE + 'checkout = "base"\n', "case 'a' checkout: 'base' is not declared"),
    (CASE + 'gpus = "x"\n', "case 'a' gpus"),
    (CASE + "speed = 1\n", "case[0]: unknown key 'speed'"),
    (CASE + CASE, "case 'a' name: used twice"),
    (CASE + 'round = "r"\n', "case 'a' gpus"),
    ("[defaults]\ncheckouts = 1\n" + CASE, "[defaults]: unknown key 'checkouts'"),
    ("[checkouts.base]\nurl = 'x'\n" + CASE, "[checkouts.base]: unknown key 'url'"),
    (CASE + '[[ratio]]\nnum = "zzz"\nden = "a"\n', "ratio[0] num: 'zzz' matches no run"),
    (CASE + '[[ratio]]\nnum = "a"\nden = "a"\nden_factor = 0\n', "ratio[0] den_factor"),
    (CASE + '[[ratio]]\nnum = "a"\nden = "a"\nbest = "yes"\n', "ratio[0] best: must be true or false"),
])
def test_bad_suite_names_file_and_key(tmp_path, text, where):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(SuiteError) as e:
        load(str(path))
    assert str(e.value).startswith(f"{path}: ") and where in str(e.value), str(e.value)


def test_bad_suite_and_options_exit_2_before_running(tmp_path, capsys):
    good = write(tmp_path / "good.toml", CASE + 'params = { model = "Qwen2.5-0.5B" }\n'
                 '[[case]]\nname = "b"\nkind = "train"\ncheckout = ["base", "new"]\n[checkouts.base]\npath = "nowhere"\n')
    out = tmp_path / "out"
    assert harness.main([str(tmp_path / "missing.toml"), "--out", str(out)]) == 2
    assert "missing.toml: no such suite file" in capsys.readouterr().err
    # a checkout that holds no qtrain: named, with the way to make it
    assert harness.main([str(good), "--only", "b*", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "checkout 'base'" in err and "git archive" in err and str(good) in err
    assert harness.main([str(good), "--only", "zzz", "--out", str(out)]) == 2
    assert "leave no run" in capsys.readouterr().err
    assert harness.main([str(good), "--checkout", "other=/tmp", "--out", str(out)]) == 2
    assert "--checkout other=/tmp" in capsys.readouterr().err
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert harness.main([str(good), "--only", "a", "--out", str(blocked / "sub")]) == 2
    assert "cannot write results under" in capsys.readouterr().err
    assert not out.exists()  # nothing ran, nothing was written


def test_deadline_skips_what_cannot_start(tmp_path, capsys):
    suite = write(tmp_path / "s.toml", CASE + 'params = { model = "Qwen2.5-0.5B" }\n')
    assert harness.main([str(suite), "--dry-run", "--deadline", "0", "--out", str(tmp_path)]) == 0
    row = json.loads((tmp_path / "s.dry.jsonl").read_text())
    assert row["status"] == "skipped" and "--deadline" in row["reason"]
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("a ")  # the table is last


def make_base(dest: Path) -> str:
    """A second checkout of qtrain: the code before the restructure when this clone has it (the old module
    layout regress-1p5b runs against), else a copy of this checkout's qtrain."""
    dest.mkdir()
    ok = subprocess.run(["git", "-C", str(REPO_ROOT), "cat-file", "-e", f"{BEFORE_RESTRUCTURE}^{{commit}}"],
                        capture_output=True).returncode == 0
    if ok:
        tar = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", BEFORE_RESTRUCTURE, "qtrain"],
                             capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=tar, check=True)
        (dest / ".commit").write_text(BEFORE_RESTRUCTURE + "\n")  # what the harness reads where git cannot tell
        return BEFORE_RESTRUCTURE
    shutil.copytree(REPO_ROOT / "qtrain", dest / "qtrain", ignore=shutil.ignore_patterns("__pycache__"))
    (dest / ".commit").write_text("copy\n")
    return "copy"


@pytest.mark.slow  # ~30 s of CPU: four runs import torch, two train
def test_tiny_suite_end_to_end(tmp_path, capsys):
    base = tmp_path / "base"
    origin = make_base(base)
    pid_file = tmp_path / "sleeper.pid"
    (tmp_path / "tests_slow").mkdir()
    write(tmp_path / "tests_slow" / "test_sleep.py", f"""
          import os, time
          open({str(pid_file)!r}, "w").write(str(os.getpid()))
          time.sleep(300)  # at import: collecting this module (the dry run) never ends


          def test_nothing():
              pass
          """)
    suite = write(tmp_path / "tiny.toml", f"""
        description = "the harness on the CPU"
        [checkouts.base]
        path = "unused-default"
        [defaults]
        kind = "train"
        timeout = 240
        params = {{ model = "Qwen2.5-1.5B", batch = 32, accum = 2, steps = 6, lmhead_chunks = 4, opt_m_dtype = "bf16", opt_v_dtype = "bf16" }}
        [[case]]
        name = "bf16"
        checkout = ["base", "new"]
        [[case]]
        name = "bad-option"
        params = {{ lmhead_chunks = 5 }}
        [[case]]
        name = "dies"
        env = {{ PYTHONHOME = "{tmp_path}/no-python-here" }}
        [[case]]
        name = "sleeper"
        kind = "pytest"
        timeout = 10
        params = {{ args = ["{tmp_path}/tests_slow"] }}
        round = "side-by-side"
        gpus = "0"
        [[case]]
        name = "ceiling"
        kind = "gemm-ceiling"
        params = {{ model = "Qwen2.5-0.5B", tokens = 8192 }}
        round = "side-by-side"
        gpus = [1]
        [[case]]
        name = "llmq"
        kind = "llmq"
        params = {{ size = "0.5B", batch = 32, accum = 4 }}
        [[ratio]]
        label = "new / base"
        num = "bf16@new*"
        den = "bf16@base*"
        """)
    out = tmp_path / "out"
    rc = harness.main([str(suite), "--dry-run", "--baseline", str(base), "--out", str(out)])
    console = capsys.readouterr().out
    rows = {r["run"]: r for r in map(json.loads, (out / "tiny.dry.jsonl").read_text().splitlines())}
    assert rc == 1  # some runs failed
    assert list(rows) == ["bf16@base.1", "bf16@new.1", "bad-option", "dies", "sleeper", "ceiling", "llmq"]
    status = {k: r["status"] for k, r in rows.items()}
    assert status == {"bf16@base.1": "ok", "bf16@new.1": "ok", "bad-option": "failed", "dies": "failed",
                      "sleeper": "timeout", "ceiling": "ok", "llmq": "skipped"}, rows

    # each checkout's run imported its own qtrain and measured a real (tiny) training run
    old, new = rows["bf16@base.1"], rows["bf16@new.1"]
    assert Path(old["env"]["qtrain_file"]).is_relative_to(base), old["env"]
    assert Path(new["env"]["qtrain_file"]).is_relative_to(REPO_ROOT), new["env"]
    assert old["commit"] == origin  # read from .base/.commit (an archive is no git work tree)
    # every run's log is a file whose name the device machine sends back (no `@`)
    assert all(Path(r["log"]).is_file() and "@" not in Path(r["log"]).name for r in rows.values() if "log" in r)
    assert Path(old["log"]).name == "bf16_base.1.log"
    for r in (old, new):
        assert r["tps"] > 0 and r["step_ms"] > 0 and 5.0 < r["loss"] < 7.5 and r["params"]["batch"] == 32
    # errors name the suite file, the case and what is wrong
    assert str(suite) in rows["bad-option"]["error"] and "lmhead-chunks=5" in rows["bad-option"]["error"]
    assert "no result" in rows["dies"]["error"]
    assert "timeout" in rows["sleeper"]["error"]
    assert rows["ceiling"]["tokens"] == 64 and rows["ceiling"]["ceiling_tps"] > 0
    assert (rows["sleeper"]["gpus"], rows["ceiling"]["gpus"]) == ("0", "1")
    starts = [console.index(f"== start {r}") for r in ("sleeper", "ceiling")]
    assert console.index("== sleeper: timeout") > max(starts)  # one round: both started before either ended
    assert "bench_llmq.sh" in rows["llmq"]["reason"]
    # the timed-out run's own subprocess (pytest, in its own process group) went with it
    assert pid_file.is_file(), "the sleeper's pytest never started: the test proves nothing"
    pid = int(pid_file.read_text())
    for _ in range(100):
        if not _alive(pid):
            break
        time.sleep(0.1)
    assert not _alive(pid), "the sleeper's pytest survived its case"
    # every run's output is in its log; the console ends with the table and the ratio
    assert "Traceback" in Path(rows["bad-option"]["log"]).read_text()
    assert Path(rows["bad-option"]["log"]).is_relative_to(out / "tiny.dry")
    tail = console.rstrip().splitlines()
    assert tail[-1].startswith("new / base  ") and f"({new['tps']} / {old['tps']})" in tail[-1]
    header = next(i for i, x in enumerate(tail) if x.startswith("run "))
    assert [x.split()[0] for x in tail[header + 2:header + 9]] == list(rows)
    assert "tok/s" in tail[header] and "ceiling tok/s" in tail[header]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False


def test_table_and_ratios():
    rows = [dict(run="a@base.1", kind="train", status="ok", tps=100, step_ms=10.0),
            dict(run="a@new.1", kind="train", status="ok", tps=104, step_ms=9.6),
            dict(run="a@new.2", kind="train", status="failed", error="OutOfMemoryError: CUDA out of memory"),
            dict(run="g", kind="gemm-ceiling", status="ok", tokens=8192, ceiling_tps=400)]
    lines = table(rows).splitlines()
    assert lines[0].split() == ["run", "status", "tok/s", "step", "ms", "tokens", "ceiling", "tok/s", "note"]
    assert lines[0].index("tok/s") + len("tok/s") == lines[2].index("100") + len("100")  # numbers right-aligned
    assert lines[4].startswith("a@new.2") and lines[4].endswith("OutOfMemoryError: CUDA out of memory")
    got = ratio_lines(rows, [Ratio("new / base", "a@new*", "a@base*"),
                             Ratio("vs ceiling", "a@new*", "g", den_metric="ceiling_tps", den_factor=0.5),
                             Ratio("nothing", "zzz", "g")])
    assert got[0].split()[3] == "1.040" and got[1].split()[2] == "0.520"
    assert "no ok run" in got[2]


def test_ratio_of_the_best_cases():
    """`best`: each side is its best case's mean (a tool at its fastest micro-batch), not the mean of all runs the
    pattern matches; without it, the mean of all (the 4 x 4 and 8 x 2 runs together)."""
    rows = [dict(run="q@new.1", case="q", status="ok", tps=100), dict(run="q@new.2", case="q", status="ok", tps=110),
            dict(run="q-8x2", case="q-8x2", status="ok", tps=120), dict(run="q-16x1", case="q-16x1", status="oom"),
            dict(run="hf", case="hf", status="ok", tps=60)]
    best, mean = ratio_lines(rows, [Ratio("best", "q*", "hf", best=True), Ratio("mean", "q*", "hf")])
    assert best.split()[1] == "2.000" and "(q-8x2: 120 / hf: 60)" in best
    assert mean.split()[1] == "1.833"


def test_summary_lines_of_llmq_and_pytest():
    ok = llmq_summary("LLMQ size=0.5B mm=bf16 batch=32 accum=4 gpus=1 steps=8 tok/s=153512 peak_tok/s=154020 "
                      "ms/step=854 sol=45.2% peak_mem=30.1GiB loss=7.1234 steps_logged=8/8 steady=5 wall=95s status=ok")
    assert (ok["tps"], ok["step_ms"], ok["sol"], ok["peak_gib"], ok["llmq_status"]) == (153512, 854.0, 45.2, 30.1, "ok")
    bad = llmq_summary("LLMQ size=0.5B mm=e4m3 batch=32 accum=4 gpus=1 steps=8 tok/s=NA steps_logged=0/8 steady=0 "
                       "wall=12s status=FAILED(rc=1: Thread 0 exited with uncaught exception)")
    assert "tps" not in bad and bad["llmq_status"].startswith("FAILED(rc=1: Thread 0")
    assert pytest_summary(["..", "== 1 failed, 73 passed, 2 skipped, 5 deselected in 100.1s =="]) == dict(
        failed=1, passed=73, skipped=2, deselected=5, summary="1 failed, 73 passed, 2 skipped, 5 deselected in 100.1s")
    assert pytest_summary(["5/300 tests collected (295 deselected) in 3.0s"])["collected"] == 5


def test_gemm_ceiling_e4m3_block_linears_use_cuda_legal_layouts():
    """The e4m3 ceiling times the block GEMMs through qtrain's `scaled_mm`, whose checks are CUDA's layout rules
    (row-major x column-major, multiples of 16), so a layout the GPU would reject fails here; the LM head stays
    bf16. A bad matmul_dtype is refused by name."""
    from bench import gemm_ceiling
    from bench.dry import tiny_model_dir
    model = tiny_model_dir("Qwen2.5-0.5B")
    out = gemm_ceiling.run(model, tokens=64, lmhead_chunks=2, samples=1, device="cpu", matmul_dtype="e4m3")
    assert out["tokens"] == 64 and out["gemm_ms"] > 0 and out["ceiling_tps"] > 0
    assert set(out["rows"][0]["parts"]) == {"qkv", "o", "up", "down"}
    with pytest.raises(ValueError, match="matmul_dtype"):
        gemm_ceiling.run(model, tokens=64, samples=1, device="cpu", matmul_dtype="e5m2")


def test_gemm_ceiling_times_an_moe_block_by_its_family_matmuls():
    """An MoE model's ceiling times its router and expert stacks (grouped GEMMs over balanced rows: each expert k / E
    of the tokens) beside the attention projections; the layer cut (`layers`) is honoured; on the CPU no MFU (no
    known peak)."""
    from bench import gemm_ceiling
    from bench.dry import tiny_model_dir
    from qtrain.model.moe_block import EXPERTS_DOWN, EXPERTS_UP_GATE, ROUTER
    model = tiny_model_dir("OLMoE-1B-7B")
    out = gemm_ceiling.run(model, tokens=64, lmhead_chunks=2, samples=1, device="cpu", layers=1)
    assert set(out["rows"][0]["parts"]) == {"qkv", "o", ROUTER, EXPERTS_UP_GATE, EXPERTS_DOWN}
    assert out["ceiling_tps"] > 0 and out["mfu"] is None
    x, w, dy, offs = gemm_ceiling.expert_operands(rows=3, count=4, K=8, N=16, dev="cpu")
    assert x.shape == (12, 8) and w.shape == (4, 16, 8) and dy.shape == (12, 16) and offs.tolist() == [3, 6, 9, 12]


def test_profile_categories_of_the_step_kernels():
    """The profile suite sorts kernels by name (first match wins); these are the names the H200 profiles show. The
    one-pass SwiGLU kernels' names contain "fp8" and were counted as FP8 GEMMs until 2026-12-03; cuDNN's attention
    kernels contain "wgmma" and were counted as GEMMs until 2026-12-02."""
    from bench.kernel_categories import category
    names = {
        "_swiglu_bwd_fp8_kernel": "swiglu", "_swiglu_fwd_fp8_kernel": "swiglu",
        "nvjet_sm90_qqtst_128x160_128x5_2x1_v_bz_coopA_algo2_TNT": "gemm-fp8",
        "nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT": "gemm",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128": "attention",
        "_quantize_kernel": "quantize", "_abs_max_kernel": "quantize", "_rope_qkv_bwd_kernel": "rope",
        "_ce_fwd_bwd_kernel": "cross-entropy", "_adamw_kernel": "adamw/sr",
        "triton_red_fused__to_copy_add_div_expand_linalg_vector_norm_mul_pow_sum_view_2": "norm/reduce",
        "triton_poi_fused_add_view_8": "inductor-fused",
    }
    assert {n: category(n) for n in names} == names


def test_profile_categories_of_qwen3_5_kernels():
    """Every Triton kernel of the gated delta rule and the causal conv (qtrain/kernels/delta_rule/) has its category
    (they were "other" until 2026-12-06), and no other kernel of qtrain's takes one of theirs."""
    import ast
    from pathlib import Path

    from bench.kernel_categories import category
    root = Path(__file__).resolve().parents[2] / "qtrain" / "kernels"
    kernels = {p.stem: [n.name for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.FunctionDef)
                        and n.name.endswith("_kernel")] for p in root.rglob("*.py")}
    conv = set(kernels["causal_conv1d"])
    delta = {n for stem, names in kernels.items() if stem.startswith("gated_delta_rule") for n in names}
    assert len(delta) == 10 and conv == {"_conv_fwd_kernel", "_conv_dpre_kernel", "_conv_bwd_kernel"}
    assert {n: category(n) for n in delta} == dict.fromkeys(delta, "delta-rule")
    assert {n: category(n) for n in conv} == dict.fromkeys(conv, "conv")
    others = {n for names in kernels.values() for n in names} - delta - conv
    assert not {n for n in others if category(n) in ("delta-rule", "conv")}


def test_pytest_kind_runs_the_parts_asked_and_refuses_unknown_ones(monkeypatch):
    """`parts` of the pytest kind: the main run leaves every isolated file out, each isolated file runs alone with the
    marks, and a suite that splits the GPU tests over two calls (gpu-tests-1 and -2) runs each piece once."""
    from bench import pytest_run
    calls = []
    monkeypatch.setattr(pytest_run, "_pytest",
                        lambda args, collect_only: (calls.append(args) or ({"passed": 1}, [], 0)))
    iso = ["tests/a.py", "tests/b.py"]
    pytest_run.run(["-m", "gpu", "tests/"], iso)
    assert calls == [["-m", "gpu", "tests/", "--ignore=tests/a.py", "--ignore=tests/b.py"], ["-m", "gpu", "tests/a.py"],
                     ["-m", "gpu", "tests/b.py"]]
    whole, calls[:] = list(calls), []
    assert pytest_run.run(["-m", "gpu", "tests/"], iso, parts=["main", "tests/a.py"])["passed"] == 2
    pytest_run.run(["-m", "gpu", "tests/"], iso, parts=["tests/b.py"])
    assert calls == whole
    with pytest.raises(ValueError, match=r"parts \['tests/c.py'\]"):
        pytest_run.run(["-m", "gpu", "tests/"], iso, parts=["tests/c.py"])
    suite = tomllib.loads((REPO_ROOT / "bench/suites/gpu-tests.toml").read_text())
    cases = {c["name"]: c["params"] for c in suite["case"]}
    assert set(cases) == {"gpu-tests-1", "gpu-tests-2", "gpu-tests-3"}  # the split lives in the defaults: its parts
    assert not {"args", "isolate"} & set().union(*map(set, cases.values()))
    parts = [p for c in cases.values() for p in c["parts"]]
    assert sorted(parts) == sorted(["main", *suite["defaults"]["params"]["isolate"]])  # each part once, none left out
    assert len(set(parts)) == len(parts)
