"""`qtrain train --gpus 2 --context-parallel 2` from the command line (gloo, CPU, fp32) on a file packed by `qtrain
tokenize --pack-to`, with --document-masking: each rank holds half of every row, its queries attend inside their
documents over both ranks' keys (all-gather and ring modes), and the run trains as one process on the same rows,
with every gradient manager, sharded weights and the offload modes too; a run resumed from its own checkpoint (either
mode) is bitwise the run it continues.

The ranks of a context group read the sequences one process reads (one data-parallel replica), so every step's loss
and gradient norm, the evaluations and the exported weights match the single process. Tolerances: the split
changes only reduction orders (a masked softmax row over the gathered keys, or the ring's log-sum-exp merge,
instead of one masked call; the gradients summed across ranks), so fp32 agrees to ~1e-6: 1e-5 relative on losses,
1e-4 on the gradient norm, and the weights after 4 AdamW steps per tensor within 1e-4 of the update itself,
||w - w_ref|| <= 1e-4 ||w_ref - w0|| (Adam divides each element by its own gradient's RMS, so an element with a tiny
gradient moves further apart than the gradients do; measured below 3e-5). Resuming is bitwise: the loader's position, the
weights and the Adam state are restored exactly and both modes compute in a fixed order.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from qtrain.cli.main import main
from qtrain.model.hf_io import save_hf_model
from qtrain.model.llama import LlamaConfig
from qtrain.model.weights import param_shapes
from qtrain.observe.log import read_log
from tests.data.test_packing import write_examples
from tests.run_utils import qtrain_run, train_argv

N = 32  # --pack-to and --seq-len: 2 x 2 chunks of 8 tokens under --context-parallel 2
STEPS = 4
# gpt2's vocabulary (what `qtrain tokenize --tokenizer gpt2` writes), a tiny model otherwise
CFG = LlamaConfig(model_type="llama", vocab_size=50257, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0,
                  tie_word_embeddings=True, attention_bias=False, bos_token_id=50256, eos_token_id=50256)


def _argv(root, name: str, *extra: str, batch: int = 2, **flags) -> list[str]:
    argv = train_argv(root, steps=STEPS, name=name, model=root / "weights", seq_len=N, batch_size=batch, lr=3e-3,
                      seed=3, eval_every_n_steps=2, eval_num_steps=1,
                      extra=("--document-masking", "--ckpt-keep-n", "-1", *extra), **flags)
    argv.remove("--from-scratch")
    return argv


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("cpdocs")
    g = torch.Generator().manual_seed(4)
    save_hf_model(root / "weights", CFG, {n: torch.randn(s, generator=g) * 0.3 for n, s in param_shapes(CFG).items()},
                  dtype=torch.float32)
    assert main(["tokenize", write_examples(root / "qa.jsonl", n=80, seed=5), "--out-dir", str(root / "tok"),
                 "--tokenizer", "gpt2", "--prompt-field", "q", "--response-field", "a", "--pack-to", str(N),
                 "--eval-fraction", "0.1", "--no-progress", "--workers", "1"]) == 0
    (root / "train.bin").symlink_to(root / "tok" / "train.bin")
    (root / "eval.bin").symlink_to(root / "tok" / "eval.bin")
    assert main(_argv(root, "one")) == 0
    return root


def _log(root, name):
    entries = read_log(root / "logs" / f"{name}.jsonl")
    return ([e for e in entries if e["log"] == "step"], [e for e in entries if e["log"] == "eval"])


def _assert_trains_as(root, name, ref):
    (steps, evals), (ref_steps, ref_evals) = _log(root, name), _log(root, ref)
    assert [e["step"] for e in steps] == [e["step"] for e in ref_steps] == list(range(STEPS))
    for a, b in zip(steps, ref_steps):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]) and abs(a["norm"] - b["norm"]) <= 1e-4 * b["norm"]
    assert len({round(e["loss"], 4) for e in ref_steps}) == STEPS  # real updates
    assert len(evals) == len(ref_evals) >= 2
    for a, b in zip(evals, ref_evals):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"])
    _assert_weights_near(root, name, ref)


def _assert_weights_near(root, name, ref, tol: float = 1e-4):
    """Per tensor, the difference against the update itself: ||w - w_ref|| <= tol ||w_ref - w0||."""
    got, want, start = (load_file(p) for p in (root / "out" / name / "model.safetensors",
                                                root / "out" / ref / "model.safetensors",
                                                root / "weights" / "model.safetensors"))
    assert got.keys() == want.keys() == start.keys()
    for k in want:
        err, update = float((got[k] - want[k]).norm()), float((want[k] - start[k]).norm())
        assert update > 0 and err <= tol * update, f"{k}: ||w - w_ref|| = {err:.3g}, update {update:.3g}"


@pytest.fixture(scope="module", params=["allgather", "ring"])
def cp_run(packed, request) -> str:
    """The --context-parallel 2 run of each mode (its name, the mode's), made once for the tests that read it."""
    mode = request.param
    r = qtrain_run(_argv(packed, mode, "--gpus", "2", "--context-parallel", "2", "--context-parallel-mode", mode),
                   cwd=packed, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    return mode


def test_context_parallel_documents_train_as_one_process(packed, cp_run):
    _assert_trains_as(packed, cp_run, "one")


def test_context_parallel_resumes_bitwise(packed, cp_run):
    mode = cp_run
    r = qtrain_run(_argv(packed, f"{mode}-resumed", "--gpus", "2", "--context-parallel", "2", "--context-parallel-mode",
                         mode, "--continue", "2", checkpoint_dir=packed / "ckpt" / mode), cwd=packed, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    full = {e["step"]: e for e in _log(packed, mode)[0]}
    resumed = {e["step"]: e for e in _log(packed, f"{mode}-resumed")[0]}
    assert sorted(resumed) == [2, 3]
    assert all((resumed[k]["loss"], resumed[k]["norm"]) == (full[k]["loss"], full[k]["norm"]) for k in resumed)
    a, b = (load_file(packed / "out" / n / "model.safetensors") for n in (mode, f"{mode}-resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow  # 4 ranks
def test_two_replicas_of_context_parallel_2_train_as_one_process(packed):
    """--gpus 4 --context-parallel 2: 2 data-parallel replicas, each a context group of 2; replica r reads chunks
    order[r::2], one process with twice the batch reads order[0:4] for the same step: the same rows. Tolerances as
    tests/train/test_document_masking_ranks.py's (per-rank GEMMs and a cross-rank average vs one GEMM): losses to
    2e-5 relative, weights ||w - w_ref|| <= 1e-3 ||w_ref - w0||."""
    assert main(_argv(packed, "one-b4", batch=4)) == 0
    r = qtrain_run(_argv(packed, "cp2dp2", "--gpus", "4", "--context-parallel", "2", "--context-parallel-mode",
                         "ring"), cwd=packed, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (steps, _), (ref, _) = _log(packed, "cp2dp2"), _log(packed, "one-b4")
    assert [e["step"] for e in steps] == [e["step"] for e in ref] == list(range(STEPS))
    for a, b in zip(steps, ref):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-5), a["step"]
    _assert_weights_near(packed, "cp2dp2", "one-b4", tol=1e-3)


@pytest.mark.slow  # inductor's C++ compile of the blocks on 2 ranks
@pytest.mark.parametrize("mode", ["allgather", "ring"])
def test_compiled_context_parallel_with_recompute_trains_as_one_process(packed, mode):
    """`--compile on --recompute-att` under --context-parallel 2 (the collectives as opaque ops in the compiled block,
    parallel/context_ops.py; the attention's forward rerun in backward): the single process's steps, evaluations
    (compiled blocks without gradients) and exported weights, with the tolerances above."""
    name = f"{mode}-compiled"
    r = qtrain_run(_argv(packed, name, "--gpus", "2", "--context-parallel", "2", "--context-parallel-mode", mode,
                         "--recompute-att", compile="on"), cwd=packed, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    _assert_trains_as(packed, name, "one")


OFFLOAD = ("--offload-opt-m", "--offload-opt-v", "--offload-residual", "--recompute-block")
STATE = [  # CI runs the first, every manager and offload mode in one run (each gloo run is ~20 s on 2 cores)
    pytest.param("all", ("--zero-level", "3", "--all-to-all-reduce", "--offload-master", "--offload-gradients",
                         *OFFLOAD), id="zero3-all-to-all-offload-everything"),
    pytest.param("offload", OFFLOAD, id="offload-moments-residuals", marks=pytest.mark.slow),
    pytest.param("reduce-scatter", ("--shard-gradients",), id="reduce-scatter", marks=pytest.mark.slow),
    pytest.param("all-to-all", ("--shard-gradients", "--all-to-all-reduce"), id="all-to-all", marks=pytest.mark.slow),
    pytest.param("zero3", ("--zero-level", "3"), id="zero3", marks=pytest.mark.slow),
    pytest.param("zero3-offload-master", ("--zero-level", "3", "--offload-master"), id="zero3-offload-master",
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("name,flags", STATE)
def test_context_parallel_with_sharded_and_offloaded_state_trains_as_one_process(packed, name, flags):
    """--context-parallel composes with the gradient managers (--shard-gradients: reduce-scatter, or
    --all-to-all-reduce), sharded weights (--zero-level 3, the master shards offloaded to the host with
    --offload-master) and the offload modes: the Adam moments (`--offload-opt-m`, `--offload-opt-v`, streamed
    through staging buffers per step), the gradient shards (`--offload-gradients`) and the residual stream of each
    block (`--offload-residual` with `--recompute-block`, this rank's half of every row). The gradients are summed
    over both ranks of the context group however they are reduced, and the rest changes where bytes live, not what
    is computed: the single process's steps, evaluations and exported weights, with the tolerances above."""
    r = qtrain_run(_argv(packed, f"cp-{name}", "--gpus", "2", "--context-parallel", "2", *flags), cwd=packed,
                   timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    _assert_trains_as(packed, f"cp-{name}", "one")
