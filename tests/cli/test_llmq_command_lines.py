"""llm.q's own command lines (its README and benchmark tables, reference/llmq.md §1.1 and §8) work with
`qtrain train`: every flag parses into the right option (or is one of llm.q's implementation switches, which
print what qtrain does instead), and the runs train at tiny scale on the CPU.

"Tiny scale" replaces only the sizes and paths (model -> a tiny config.json, data -> a small token file of
llm.q's format, sequence length, batch, accumulation, steps, GPU count, output paths) and keeps every other
flag exactly as llm.q's documentation writes it.
"""
from __future__ import annotations

import json
import shlex

import numpy as np
import pytest

from qtrain.cli.main import build_parser, main
from qtrain.cli.options import LLMQ_IMPLEMENTATION_FLAGS, options_from_args
from qtrain.model.llama import LlamaConfig
from qtrain.options import OptionsError
from tests.data.test_token_files import write_raw

# llm.q README "Training run"
QUICK_START = """--model=Qwen/Qwen2.5-0.5B --train-file=data/tiny-shakespeare-qwen/train.bin
  --eval-file=data/tiny-shakespeare-qwen/eval.bin --model-dtype=bf16 --opt-m-dtype=bf16 --opt-v-dtype=bf16
  --matmul-dtype=e4m3 --recompute-ffn --recompute-att --grad-accumulation=8 --steps=30 --learning-rate=1e-5
  --gpus=1 --batch-size=8"""
# llm.q README "A larger example" (4 x RTX 4090, 1.5B from scratch on ClimbMix)
LARGER = """--model=Qwen/Qwen2.5-1.5B --from-scratch "--train-file=data/climb-10b-qwen/train-*.bin"
  --eval-file=data/climb-10b-qwen/eval.bin --ckpt-interval=10000 --steps=33900 --eval-num-steps=40
  --learning-rate=0.0006 --final-lr-fraction=0.1 --warmup=150 --seq-len=2048 --batch-size=9 --model-dtype=bf16
  --matmul-dtype=e4m3 --opt-m-dtype=bf16 --opt-v-dtype=bf16 --gpus=4 --recompute-ffn --recompute-norm
  --shard-weights --persistent-quants --offload-quants --write-combined --memcpy-all-gather"""
# llm.q README speed tables: the common arguments and the RTX 4090 footnotes (^3, ^6, ^7)
BENCH = "--from-scratch --seq-length=1024 --model-dtype=bf16 --opt-m-dtype=bf16 --opt-v-dtype=bf16 --use-cuda-graphs"
RTX4090_7B_FP8_1GPU = (f"--model=Qwen2.5-7B {BENCH} --matmul-dtype=e4m3 --gpus=1 --batch-size=4 --offload-opt-m "
                       "--offload-opt-v --recompute-ffn --recompute-norm --recompute-att --offload-master --shard-weights "
                       "--persistent-quants --offload-quants")
RTX4090_7B_FP8_4GPU = (f"--model=Qwen2.5-7B {BENCH} --matmul-dtype=e4m3 --gpus=4 --batch-size=8 --offload-opt-m "
                       "--offload-opt-v --recompute-ffn --recompute-norm --recompute-att --offload-master --shard-weights "
                       "--memcpy-all-gather --shard-gradients --memcpy-send-recv --all-to-all-reduce --persistent-quants "
                       "--offload-quants")
RTX4090_14B_BF16_4GPU = (f"--model=Qwen2.5-14B {BENCH} --gpus=4 --batch-size=4 --offload-opt-m --offload-opt-v "
                         "--recompute-ffn --recompute-norm --recompute-att --offload-master --shard-weights "
                         "--memcpy-all-gather --shard-gradients --memcpy-send-recv --all-to-all-reduce")
# llm.q README (RTX PRO 6000 table, the run marked *) and the flags of its README text
PRO6000_7B = f"--model=Qwen2.5-7B {BENCH} --gpus=4 --batch-size=16 --shard-weights --memcpy-all-gather " \
             "--persistent-quants --offload-quants --matmul-dtype=e4m3"
README_SPELLINGS = f"--model=Qwen2.5-0.5B {BENCH} --no-use-cuda-graphs --custom-matmul --use-write-combined " \
                   "--persist-quants --shard-weights --matmul-dtype=e4m3 --log-gpu-util=0 --debug-time-breakdown " \
                   "--debug-log-allocations=64 --use-zero-copy --offload-opt-m"
# llm.q's benchmarks/H100x1.md 0.5B bf16 and 1.5B bf16 rows (llmq.md §8.1)
H100_05B = f"--model=Qwen2.5-0.5B {BENCH} --gpus=1 --batch-size=32 --grad-accumulation=16"
H100_15B = f"--model=Qwen2.5-1.5B {BENCH} --gpus=1 --batch-size=32 --grad-accumulation=16 --lmhead-chunks=4"

ALL = {"quick-start": QUICK_START, "larger": LARGER, "4090-7b-fp8-1gpu": RTX4090_7B_FP8_1GPU,
       "4090-7b-fp8-4gpu": RTX4090_7B_FP8_4GPU, "4090-14b-bf16-4gpu": RTX4090_14B_BF16_4GPU, "pro6000-7b": PRO6000_7B,
       "readme-spellings": README_SPELLINGS, "h100-0.5b": H100_05B, "h100-1.5b": H100_15B}


def argv(cmd: str) -> list[str]:
    return shlex.split(cmd)


def graphs_flag(args: list[str]) -> bool | None:
    """--use-cuda-graphs as the command line leaves it: the last of --use-/--no-use-cuda-graphs, else unset."""
    given = [a == "--use-cuda-graphs" for a in args if a in ("--use-cuda-graphs", "--no-use-cuda-graphs")]
    return given[-1] if given else None


@pytest.mark.parametrize("name", ALL)
def test_every_flag_parses(name, capsys):
    ns = build_parser().parse_args(["train", *argv(ALL[name])])
    opts = options_from_args(ns)
    err = capsys.readouterr().err
    given = {a.split("=")[0].lstrip('"') for a in argv(ALL[name])}
    for flag, note in LLMQ_IMPLEMENTATION_FLAGS.items():
        aliases = {flag, "--use-write-combined"} if flag == "--write-combined" else {flag}
        assert (note in err) == bool(aliases & given), (flag, err)
    assert opts.use_cuda_graphs is graphs_flag(argv(ALL[name]))


def test_parsed_values():
    o = options_from_args(build_parser().parse_args(["train", *argv(LARGER)]))
    assert (o.model, o.from_scratch, o.train_file, o.steps, o.warmup, o.seq_len, o.batch_size) == \
        ("Qwen/Qwen2.5-1.5B", True, "data/climb-10b-qwen/train-*.bin", 33900, 150, 2048, 9)
    assert (o.learning_rate, o.final_lr_fraction, o.eval_num_steps, o.ckpt_interval, o.gpus) == \
        (6e-4, 0.1, 40, 10000, 4)
    assert o.effective_matmul_dtype == "e4m3" and o.recompute == {"ffn", "swiglu", "norm"}
    assert o.weights_sharded and o.persistent_quants and o.offload_quants
    o = options_from_args(build_parser().parse_args(["train", *argv(README_SPELLINGS)]))
    assert o.persistent_quants and not o.use_cuda_graphs  # --persist-quants; --no-use-cuda-graphs comes last
    assert (o.log_gpu_util, o.debug_time_breakdown, o.debug_log_allocations) == (0, True, 64)


def test_offload_residual_without_recompute_block_is_refused_clearly():
    # llm.q's H100 7B fp8 row offloads the FFN residual with --recompute-ffn/--recompute-norm; qtrain offloads
    # only the block inputs that --recompute-block keeps, so it says what to add instead of ignoring the flag
    cmd = f"--model=Qwen2.5-7B {BENCH} --matmul-dtype=e4m3 --lmhead-chunks=4 --attn-bwd-chunks=4 --recompute-ffn " \
          "--recompute-norm --offload-residual"
    with pytest.raises(OptionsError, match="--offload-residual needs --recompute-block"):
        options_from_args(build_parser().parse_args(["train", *argv(cmd)]))


def test_use_cuda_graphs_is_refused_on_an_explicit_cpu_device():
    with pytest.raises(OptionsError, match="--use-cuda-graphs needs a CUDA device"):
        options_from_args(build_parser().parse_args(["train", "--use-cuda-graphs", "--device", "cpu"]))


# ---- running them at tiny scale ----------------------------------------------------------------------------
TINY = LlamaConfig(model_type="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0,
                   tie_word_embeddings=True, attention_bias=True, bos_token_id=0, eos_token_id=1)
SIZES = {"--model": None, "--train-file": None, "--eval-file": None, "--seq-len": "16", "--seq-length": "16",
         "--batch-size": "2", "--grad-accumulation": "2", "--steps": "2", "--gpus": "1", "--ckpt-interval": "1",
         "--eval-num-steps": "1", "--warmup": "1", "--lmhead-chunks": "2", "--attn-bwd-chunks": "2"}


def tiny(cmd: str, tmp_path, gpus: int = 1) -> list[str]:
    """llm.q's command line with sizes and paths replaced (see the module docstring), plus CPU outputs."""
    model = tmp_path / "model"
    if not model.is_dir():
        model.mkdir()
        (model / "config.json").write_text(json.dumps(TINY.to_hf_dict()))
        rng = np.random.default_rng(0)
        for name, n in (("train-000.bin", 600), ("train-001.bin", 600), ("eval.bin", 100)):
            write_raw(tmp_path / name, rng.integers(0, 500, n), vocab=500, filler=b"*")  # llm.q's file format
    values = {**SIZES, "--model": str(model), "--train-file": str(tmp_path / "train-*.bin"),
              "--eval-file": str(tmp_path / "eval.bin"), "--gpus": str(gpus)}
    out = []
    for a in argv(cmd):
        flag = a.split("=")[0]
        out.append(f"{flag}={values[flag]}" if flag in values and "=" in a else a)
    if "--from-scratch" not in out:
        out.append("--from-scratch")  # the tiny model has no weights to load
    flags = {a.split("=")[0] for a in out}
    for spellings in (("--seq-len", "--seq-length"), ("--batch-size",), ("--grad-accumulation",), ("--steps",),
                      ("--train-file",)):
        if not flags & set(spellings):  # llm.q's default for it is not tiny
            out.append(f"{spellings[0]}={values[spellings[0]]}")
    if any(a.startswith("--matmul-dtype") and "e4m3" in a for a in out):
        out.append("--fp8-policy=all")  # the tiny matrices would stay bf16 under auto: keep the FP8 path llm.q runs
    # no --device: auto (the CPU here); an explicit --device cpu would refuse --use-cuda-graphs
    return ["train", *out, "--compile", "off", "--out-dir", str(tmp_path / "out"),
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--log-file", str(tmp_path / "log.jsonl")]


def logged(tmp_path, kind: str) -> list[dict]:
    from qtrain.observe.log import read_log
    return [e for e in read_log(tmp_path / "log.jsonl") if e["log"] == kind]


@pytest.mark.parametrize("name", ["quick-start", "4090-7b-fp8-1gpu", "readme-spellings", "h100-1.5b"])
def test_runs_at_tiny_scale(name, tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.chdir(tmp_path)
    args = tiny(ALL[name], tmp_path)
    assert main(args) == 0
    steps = logged(tmp_path, "step")
    assert [s["step"] for s in steps] == [0, 1] and all(np.isfinite(s["loss"]) for s in steps)
    assert (tmp_path / "out" / "model.safetensors").is_file()
    options = logged(tmp_path, "options")[0]["options"]
    assert options["use_cuda_graphs"] is graphs_flag(argv(ALL[name]))
    messages = [m["message"] for m in logged(tmp_path, "message")]  # no CUDA here: the run says graphs are off
    assert any("--use-cuda-graphs: no CUDA device" in m for m in messages) == (options["use_cuda_graphs"] is True)
    if name == "readme-spellings":  # --debug-time-breakdown acts: one breakdown per step
        assert [t["step"] for t in logged(tmp_path, "time-breakdown")] == [0, 1]


@pytest.mark.parametrize("name", ["larger", "4090-7b-fp8-4gpu"])
def test_multi_gpu_lines_run_on_two_cpu_workers(name, tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(tiny(ALL[name], tmp_path, gpus=2)) == 0
    assert [s["step"] for s in logged(tmp_path, "step")] == [0, 1]
    assert logged(tmp_path, "gpu-model")[0]["world"] == 2
