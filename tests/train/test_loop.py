"""`qtrain train` end to end on the embedded corpus (real text, real GPT-2 BPE tokens), a tiny model, fp32.

- the loss goes down;
- the export loads in `transformers`, and the trainer's final eval loss equals the loss transformers
  computes on the export over the same eval file (fp32 on both sides, different kernels: 1e-5 relative);
- a run resumed from a checkpoint gives bit-identical losses and weights to an uninterrupted one (fp32 on
  CPU: same operations in the same order, and stochastic rounding is keyed by step, so equality is exact).
"""
from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qtrain.cli.main import main
from qtrain.data.loader import TokenLoader
from qtrain.data.tokenizers import get_tokenizer
from qtrain.observe.log import read_log

COMMON = ["--model-dtype", "fp32", "--batch-size", "4", "--seq-len", "64", "--grad-accumulation", "2",
          "--lr", "3e-3", "--warmup", "3", "--eval-every-n-steps", "1000", "--seed", "7"]


def steps_of(log_path: str) -> list[dict]:
    return [e for e in read_log(log_path) if e["log"] == "step"]


def embedded_data(eval_tokens: int = 0) -> tuple[str, str | None]:
    """The embedded corpus' train file (built here, in the cwd, as `qtrain train` would) and, with
    `eval_tokens`, an eval file of the first that many tokens of its eval split: the final evaluation covers the
    whole eval file, and the full split (115 batches of 4 x 64) costs more CPU time than the training itself."""
    from qtrain.data.corpus import ensure_default_dataset
    from qtrain.data.token_files import read_token_file, read_token_file_header, write_token_file
    from qtrain.train.preflight import DEFAULT_DATA_DIR
    train, evals = ensure_default_dataset(DEFAULT_DATA_DIR)
    if not eval_tokens:
        return train, None
    head = read_token_file_header(evals)
    tokens, _ = read_token_file(evals)
    return train, write_token_file("eval-head.bin", tokens[:eval_tokens], vocab_size=head.vocab_size,
                                   tokenizer=head.tokenizer)


def hf_eval_loss(model_dir: str, eval_file: str, seq_len: int, batch: int) -> float:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    total, n = 0.0, 0
    with torch.no_grad():
        for x, y in TokenLoader(eval_file, seq_len, shuffle=False).iterate_eval_batches(batch):
            logits = model(input_ids=x).logits.float()
            total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum",
                                                       ignore_index=-100).item()
            n += int((y != -100).sum())
    return total / n


def test_train_export_and_eval_match_transformers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, eval_bin = embedded_data(eval_tokens=16 * 4 * 65)  # 16 eval batches
    rc = main(["train", *COMMON, "--eval-file", eval_bin, "--steps", "40", "--out-dir", "out", "--checkpoint-dir",
               "ckpt", "--log-file", "log.jsonl"])
    assert rc == 0
    steps = steps_of("log.jsonl")
    assert len(steps) == 40
    first = sum(s["loss"] for s in steps[:3]) / 3
    last = sum(s["loss"] for s in steps[-5:]) / 5
    assert last < first - 2.0, f"loss did not go down enough: {first:.3f} -> {last:.3f}"

    final_eval = [e for e in read_log("log.jsonl") if e["log"] == "eval"][-1]
    eval_file = [e for e in read_log("log.jsonl") if e["log"] == "dataset" and e["split"] == "eval"]
    assert eval_file
    ref = hf_eval_loss("out", eval_bin, 64, 4)
    assert abs(final_eval["loss"] - ref) <= 1e-5 * ref, (final_eval["loss"], ref)
    # `qtrain eval` on the export gives the trainer's final eval loss (same model code, fp32)
    from qtrain.train.evaluate import evaluate_model
    ours = evaluate_model("out", eval_bin, seq_len=64, batch_size=4)["loss"]
    assert abs(ours - final_eval["loss"]) <= 1e-6 * ref, (ours, final_eval["loss"])
    # a final checkpoint exists and the export command reproduces the final export
    rc = main(["export", "--checkpoint-dir", "ckpt", "--out-dir", "out2"])
    assert rc == 0
    from safetensors.torch import load_file
    a, b = load_file("out/model.safetensors"), load_file("out2/model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # both carry the tokenizer the embedded corpus was made with (GPT-2: its files' vocab field says so)
    tok = transformers.AutoTokenizer.from_pretrained("out")
    text = "Return the number of items in a container."
    assert tok(text)["input_ids"] == get_tokenizer("gpt2").encode(text) and tok.eos_token_id == 50256
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert open(f"out/{name}", "rb").read() == open(f"out2/{name}", "rb").read(), name


# plain fp32 is slow: bf16 and the fp32 master cover its path (CI time)
@pytest.mark.parametrize("dtype", [pytest.param("fp32", marks=pytest.mark.slow), "bf16", "fp32-master"])
def test_resume_is_bitwise_equal(tmp_path, monkeypatch, dtype):
    monkeypatch.chdir(tmp_path)
    model_dtype = "bf16" if dtype == "fp32-master" else dtype
    train_bin, _ = embedded_data()  # and no eval file: no final evaluation, which this test does not look at
    opts = [*COMMON[2:], "--model-dtype", model_dtype, "--train-file", train_bin, "--steps", "4", "--ckpt-interval",
            "2", "--no-save-training-state"]
    if dtype == "bf16":
        opts += ["--opt-m-dtype", "bf16", "--opt-v-dtype", "bf16"]
    if dtype == "fp32-master":  # the checkpoint holds the fp32 master; the bf16 copy is remade from it
        opts += ["--master-dtype", "fp32"]
    assert main(["train", *opts, "--out-dir", "full", "--checkpoint-dir", "ckpt", "--log-file", "full.jsonl"]) == 0
    assert os.path.isdir("ckpt/step_00000002")
    assert main(["train", *opts, "--out-dir", "resumed", "--checkpoint-dir", "ckpt", "--log-file", "resumed.jsonl",
                 "--continue", "2"]) == 0
    full = {s["step"]: s for s in steps_of("full.jsonl")}
    resumed = {s["step"]: s for s in steps_of("resumed.jsonl")}
    assert sorted(resumed) == [2, 3]
    for k in resumed:
        assert resumed[k]["loss"] == full[k]["loss"] and resumed[k]["norm"] == full[k]["norm"], k
    from safetensors.torch import load_file
    a, b = load_file("full/model.safetensors"), load_file("resumed/model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(t.dtype == (torch.bfloat16 if dtype == "bf16" else torch.float32) for t in a.values())


def test_plain_continue_with_no_checkpoint_starts_fresh_and_says_so(tmp_path, capsys):
    """llm.q's behaviour: `--continue` with nothing to resume is a fresh start, with a warning; the run id,
    the marker, each checkpoint's meta and the log's first line all name the same run."""
    import json

    from tests.run_utils import make_run_root, train_argv
    root = make_run_root(tmp_path)
    assert main(train_argv(root, steps=2) + ["--continue"]) == 0
    out = capsys.readouterr().out
    assert f"--continue: no checkpoint in {root / 'ckpt' / 'run'} yet; starting from scratch" in out
    run_id = json.loads((root / "ckpt" / "run" / "qtrain-run.json").read_text())["run_id"]
    meta = json.loads((root / "ckpt" / "run" / "step_00000002" / "checkpoint.json").read_text())
    assert meta["run"] == {"id": run_id, "name": "run"} and meta["nonfinite_streak"] == 0
    assert read_log(root / "logs" / "run.jsonl")[0] == {**read_log(root / "logs" / "run.jsonl")[0], "log": "run",
                                                         "run_id": run_id}
    assert json.loads((root / "out" / "run" / "qtrain-export.json").read_text())["run_id"] == run_id
    # the same command again resumes that run at its end: with its export complete there is nothing to do
    capsys.readouterr()
    assert main(train_argv(root, steps=2) + ["--continue"]) == 0
    assert f"finished at step 2; its export is in {root / 'out' / 'run'}; nothing to do" in capsys.readouterr().out
    assert [e["run_id"] for e in read_log(root / "logs" / "run.jsonl") if e["log"] == "run"] == [run_id]


def test_console_levels_and_eval_at_start(tmp_path, capsys):
    """The ~90-line options dump goes to the run log only, and to the console with --verbose; --quiet prints the
    warnings, the evaluations and where the results are; --eval-at-start evaluates before step 0, logged as step
    0's eval. Every level writes the same log objects."""
    from tests.run_utils import make_run_root, train_argv
    root = make_run_root(tmp_path)
    runs = {"default": (), "verbose": ("--verbose",), "quiet": ("--quiet", "--eval-at-start")}
    out = {}
    for name, extra in runs.items():
        capsys.readouterr()
        assert main(train_argv(root, steps=2, name=name, eval_num_steps=2, extra=extra)) == 0
        out[name] = capsys.readouterr().out
        logged = read_log(root / "logs" / f"{name}.jsonl")
        assert [e["options"]["name"] for e in logged if e["log"] == "options"] == [name]
    assert "[Options]" not in out["default"] and "[T] step" in out["default"] and "[Memory plan]" in out["default"]
    assert "[Options]" in out["verbose"] and "  learning_rate" in out["verbose"] and "[I] " in out["verbose"]
    warnings = [line for line in out["quiet"].splitlines() if line.startswith("[!] ")]
    assert warnings and "no tokenizer is known for the export" in warnings[0]  # the data records none
    quiet = [line for line in out["quiet"].splitlines() if line not in warnings]
    assert [line[:3] for line in quiet] == ["[V]", "[V]", "[Do"], quiet  # step 0's eval, the final one, the end
    assert quiet[0].startswith("[V] step     0 [  0.0%]") and "train avg        -" in quiet[0]
    logged = read_log(root / "logs" / "quiet.jsonl")
    order = [(e["log"], e["step"]) for e in logged if e["log"] in ("eval", "step")]
    assert order == [("eval", 0), ("step", 0), ("step", 1), ("eval", 2)]
    assert [e["log"] for e in read_log(root / "logs" / "default.jsonl") if e["log"] == "eval"] == ["eval"]
