"""--document-masking on several ranks: `qtrain train --gpus 2` (gloo, CPU, fp32) on a packed file trains like one
process on the same global batch, and resumes bitwise from its own checkpoint on 2 ranks.

The loader gives rank r of W the chunks order[r::W] of a file's chunk order, one process takes order[0:W B] for the
same step: the same rows, each with the documents (position ids, targets cut at document ends) the chunk has
whatever rank serves it. The step's loss scale counts the valid targets over all ranks (`Trainer.step`), which
differ from rank to rank here (prompt tokens and document ends are not targets).

Tolerances: tests/train/test_trainer_distributed.py's for fp32 (the same sums in another order: per-rank GEMMs and
a cross-rank average vs one GEMM over the global batch): losses to 2e-5 relative, and the weights per tensor in
norm against the update itself, ||w - w_ref|| <= 1e-3 ||w_ref - w0|| (Adam divides each element by its own
gradient's RMS, so an elementwise bound would have to allow a whole step). Resuming is bitwise: the loader's
position, the weights and the Adam state are restored exactly.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from qtrain.cli.main import main
from qtrain.model.hf_io import save_hf_model
from qtrain.model.weights import param_shapes
from tests.run_utils import CFG, qtrain_run, train_argv
from tests.train.test_document_masking_run import N, pack, make_examples, packed_root, steps_of

STEPS = 4


def _argv(root, name: str, batch: int, *extra: str, **flags) -> list[str]:
    argv = train_argv(root, steps=STEPS, name=name, model=root / "weights", batch_size=batch, seq_len=N,
                      ckpt_interval=2, seed=3, lr=3e-3, extra=("--document-masking", "--ckpt-keep-n", "-1", *extra),
                      **flags)
    argv.remove("--from-scratch")
    return argv


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = packed_root(tmp_path_factory.mktemp("docranks"))
    pack(root / "train.bin", make_examples(CFG.vocab_size, n=90, seed=1, eos=0), CFG.vocab_size, eos=0)
    g = torch.Generator().manual_seed(4)
    w0 = {n: torch.randn(s, generator=g) * 0.3 for n, s in param_shapes(CFG).items()}
    save_hf_model(root / "weights", CFG, w0, dtype=torch.float32)
    assert main(_argv(root, "solo", 4)) == 0
    for name, extra in (("pair", ()), ("resumed", ("--continue", "2"))):
        r = qtrain_run(_argv(root, name, 2, "--gpus", "2", *extra, checkpoint_dir=root / "ckpt" / "pair"), cwd=root,
                       timeout=400)
        assert r.returncode == 0, r.stderr[-3000:]
    return root


def _weights(root, name):
    return load_file(root / "out" / name / "model.safetensors")


def test_two_ranks_train_like_one_process_on_the_global_batch(runs):
    root = runs
    solo, pair = steps_of(root / "logs" / "solo.jsonl"), steps_of(root / "logs" / "pair.jsonl")
    assert [s["step"] for s in solo] == [s["step"] for s in pair] == list(range(STEPS))
    for a, b in zip(pair, solo):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-5), a["step"]
    assert len({round(s["loss"], 5) for s in solo}) == STEPS  # real updates
    got, want, start = _weights(root, "pair"), _weights(root, "solo"), load_file(root / "weights" / "model.safetensors")
    assert got.keys() == want.keys() == start.keys()
    for k in want:
        err, upd = float((got[k] - want[k]).norm()), float((want[k] - start[k]).norm())
        assert upd > 0 and err <= 1e-3 * upd, f"{k}: ||w - w_ref|| = {err:.3g}, update {upd:.3g}"


def test_two_ranks_resume_bitwise(runs):
    root = runs
    pair = {s["step"]: s for s in steps_of(root / "logs" / "pair.jsonl")}
    resumed = {s["step"]: s for s in steps_of(root / "logs" / "resumed.jsonl")}
    assert sorted(resumed) == [2, 3]
    for k, s in resumed.items():
        assert (s["loss"], s["norm"]) == (pair[k]["loss"], pair[k]["norm"]), k
    a, b = _weights(root, "pair"), _weights(root, "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
