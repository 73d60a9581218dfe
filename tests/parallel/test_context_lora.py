"""LoRA under context parallelism: `qtrain train --gpus 2 --context-parallel 2 --lora-rank R` (gloo, CPU, fp32) trains
the adapters one process trains on the same rows, with and without --lora-dropout, with --document-masking once, and
its PEFT export loads in peft.

Each rank holds half of every row; the adapters' gradients go through the gradient managers as every trainable
group's (summed over the context group, averaged over replicas: `Trainer.loss_scale` counts the step's tokens on all
ranks). Dropout: a rank draws the whole row's mask from the counter-based key and keeps its positions' rows
(model/lora/adapter.py), so every token gets the mask one process draws for it. Drawn per rank from a rank-local
(B, T/2, in) shape instead, the masks differ and the adapters after the first update with them part by O(1) of
their update: the dropout test fails.

Tolerances: the split changes only reduction orders (attention's softmax over gathered or ring-merged keys, the
adapter gradients summed over two ranks), fp32 ~1e-6 relative, as tests/parallel/test_context_train.py: the loss
to 1e-5 relative, the gradient norm to 1e-4, and each adapter tensor after 4 AdamW steps within 1e-4 of its own
update, ||a - a_ref|| <= 1e-4 ||a_ref - a0|| (a0: peft's init, A kaiming-uniform from the seed, B zero).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from qtrain.cli.main import main
from qtrain.data.token_files import write_token_file
from qtrain.model.hf_io import save_hf_model
from qtrain.model.init import _tensor_seed
from qtrain.model.weights import param_shapes
from qtrain.observe.log import read_log
from tests.run_utils import CFG, qtrain_run, train_argv

STEPS, SEED = 4, 3
LORA = ("--lora-rank", "4", "--lora-targets", "q,k,v,o,gate,up,down", "--quiet")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A random fp32 base of tests/run_utils.CFG and token files whose EOS (id 0) ends a document every ~6 tokens."""
    root = tmp_path_factory.mktemp("cplora")
    g = torch.Generator().manual_seed(4)
    save_hf_model(root / "base", CFG, {n: torch.randn(s, generator=g) * 0.3 for n, s in param_shapes(CFG).items()},
                  dtype=torch.float32)
    rng = np.random.default_rng(5)
    for name, n in (("train.bin", 3000), ("eval.bin", 600)):
        tokens = rng.integers(1, CFG.vocab_size, n, dtype=np.int32)
        tokens[rng.random(n) < 1 / 6] = CFG.eos_token_id
        write_token_file(root / name, tokens, vocab_size=CFG.vocab_size)
    return root


def _argv(root: Path, name: str, *extra: str) -> list[str]:
    argv = train_argv(root, steps=STEPS, name=name, model=root / "base", seq_len=32, lr=3e-3, seed=SEED,
                      eval_every_n_steps=2, eval_num_steps=1, extra=LORA + extra)
    argv.remove("--from-scratch")
    return argv


def _pair(root: Path, name: str, *extra: str, mode: str = "allgather") -> None:
    """One process in-process, then the same run on 2 ranks split by --context-parallel 2 (a subprocess)."""
    assert main(_argv(root, f"{name}-one", *extra)) == 0
    r = qtrain_run(_argv(root, f"{name}-cp", "--gpus", "2", "--context-parallel", "2", "--context-parallel-mode",
                         mode, *extra), cwd=root, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]


def _initial(key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """peft's init of an exported adapter tensor as qtrain draws it (model/lora/init.py): B zero, A kaiming-uniform."""
    if ".lora_B." in key:
        return torch.zeros(shape)
    bound = 1.0 / math.sqrt(shape[1])
    return torch.empty(shape).uniform_(-bound, bound, generator=torch.Generator().manual_seed(_tensor_seed(SEED, key)))


def _assert_trains_as(root: Path, name: str, ref: str) -> None:
    logs = {n: read_log(root / "logs" / f"{n}.jsonl") for n in (name, ref)}
    (steps, ref_steps), (evals, ref_evals) = ([[e for e in logs[n] if e["log"] == kind] for n in (name, ref)]
                                              for kind in ("step", "eval"))
    assert [e["step"] for e in steps] == [e["step"] for e in ref_steps] == list(range(STEPS))
    for a, b in zip(steps, ref_steps):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a, b)
        assert abs(a["norm"] - b["norm"]) <= 1e-4 * b["norm"], (a, b)
    assert len({round(e["loss"], 4) for e in ref_steps}) == STEPS  # the adapters train
    assert len(evals) == len(ref_evals) >= 2
    for a, b in zip(evals, ref_evals):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a, b)
    got, want = (load_file(root / "out" / n / "adapter_model.safetensors") for n in (name, ref))
    assert got.keys() == want.keys() and len(want) == 2 * 2 * 7  # A and B of 7 targets in 2 layers, exported once
    for k, w in want.items():
        err, update = float((got[k] - w).norm()), float((w - _initial(k, tuple(w.shape))).norm())
        assert update > 0 and err <= 1e-4 * update, f"{k}: ||a - a_ref|| = {err:.3g}, update {update:.3g}"


def test_context_parallel_lora_dropout_documents_trains_as_one_process_and_loads_in_peft(root):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    _pair(root, "drop", "--lora-dropout", "0.3", "--document-masking", mode="ring")
    _assert_trains_as(root, "drop-cp", "drop-one")

    base = transformers.AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32).eval()
    inputs = torch.randint(1, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = base(inputs).logits
        got = peft.PeftModel.from_pretrained(base, str(root / "out" / "drop-cp")).eval()(inputs).logits
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32).eval()
    with torch.no_grad():
        want = peft.PeftModel.from_pretrained(base, str(root / "out" / "drop-one")).eval()(inputs).logits
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()  # the adapters agree to 1e-4 of their update
    assert (got - plain).abs().max() > 1e-3  # the adapters moved the model


def test_context_parallel_lora_trains_as_one_process(root):
    _pair(root, "plain")
    _assert_trains_as(root, "plain-cp", "plain-one")


def test_context_parallel_lora_dropout_resumes_bitwise(root):
    """The CP run's checkpoints hold the adapters only, and --continue from step 2 is bitwise the run it continues
    (the dropout keys name the step, and each rank draws the whole rows' masks)."""
    if not (root / "out" / "drop-cp" / "adapter_model.safetensors").exists():
        pytest.skip("needs the run of test_context_parallel_lora_dropout_documents_trains_as_one_process_...")
    ckpt = root / "ckpt" / "drop-cp" / "step_00000002"
    for rank in range(2):
        keys = set(load_file(ckpt / f"weights.shard_{rank:03d}_of_002.safetensors"))
        assert keys == {"block.0.lora", "block.1.lora"}, keys
    argv = _argv(root, "drop-cp-resumed", "--gpus", "2", "--context-parallel", "2", "--context-parallel-mode", "ring",
                 "--lora-dropout", "0.3", "--document-masking", "--continue", "2")
    argv[argv.index("--checkpoint-dir") + 1] = str(root / "ckpt" / "drop-cp")
    r = qtrain_run(argv, cwd=root, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    full = {e["step"]: e for e in read_log(root / "logs" / "drop-cp.jsonl") if e["log"] == "step"}
    resumed = {e["step"]: e for e in read_log(root / "logs" / "drop-cp-resumed.jsonl") if e["log"] == "step"}
    assert sorted(resumed) == [2, 3]
    assert all((resumed[k]["loss"], resumed[k]["norm"]) == (full[k]["loss"], full[k]["norm"]) for k in resumed)
    a, b = (load_file(root / "out" / n / "adapter_model.safetensors") for n in ("drop-cp", "drop-cp-resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
