"""LoRA through `qtrain train` (in-process, CPU, fp32, a tiny random HF base): only the adapters train and are
checkpointed, --continue is bitwise, the exported adapter loads in peft, --lora-merge's model in transformers, both
with the same logits; the base sharded and offloaded to the host trains the same adapters; --lora-init-from starts a
run from an exported adapter's exact values; two gloo ranks (unsharded and sharded gradient managers) train the
adapters of one process with the same global batch.

Tolerance of the logits: the merged model computes (W + s B A) x where peft computes W x + s B (A x): fp32
reassociation, ~1e-6 relative (asserted 1e-4 of the logits' scale).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from qtrain.cli.main import main
from qtrain.observe.log import read_log
from tests.hf_fixtures import save_tiny_hf_model
from tests.run_utils import make_run_root, qtrain_run, train_argv

LORA = ("--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "q,v,o,gate,down", "--quiet")


def _argv(root: Path, name: str, *extra: str, steps: int = 4, **flags) -> list[str]:
    argv = train_argv(root, steps=steps, name=name, model=root / "base", extra=LORA + extra, **flags)
    argv.remove("--from-scratch")
    return argv


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = make_run_root(tmp_path_factory.mktemp("lora"))
    save_tiny_hf_model("qwen2", root / "base")
    return root


def test_adapters_train_resume_bitwise_and_load_in_peft(root):
    assert main(_argv(root, "a")) == 0
    out, ckpt = root / "out" / "a", root / "ckpt" / "a"
    assert sorted(p.name for p in out.iterdir() if p.suffix in (".json", ".safetensors")) == [
        "adapter_config.json", "adapter_model.safetensors", "generation_config.json", "qtrain-export.json"]
    first = (out / "adapter_model.safetensors").read_bytes()
    # the checkpoints hold the adapters only (weights and Adam state): the base is --model's
    for kind in ("weights", "adam.m", "adam.v"):
        keys = set(load_file(ckpt / "step_00000004" / f"{kind}.shard_000_of_001.safetensors"))
        assert keys == {"block.0.lora", "block.1.lora"}, (kind, keys)
    shutil.rmtree(ckpt / "step_00000004")
    assert main(_argv(root, "a", "--continue")) == 0
    assert (out / "adapter_model.safetensors").read_bytes() == first  # bitwise the uninterrupted run's

    assert main(_argv(root, "m", "--lora-merge")) == 0  # the same run, merged
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(root / "out" / "m", dtype=torch.float32).eval()
    inputs = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = base(inputs).logits
        pm = peft.PeftModel.from_pretrained(base, str(out)).eval()
        adapted, want = pm(inputs).logits, merged(inputs).logits
    assert (adapted - want).abs().max() <= 1e-4 * want.abs().max()
    assert (adapted - plain).abs().max() > 1e-4  # training moved the adapters off zero
    # the frozen base is what the merged model's untargeted matrices are: unchanged by training
    sd = load_file(root / "out" / "m" / "model.safetensors")
    ref = load_file(root / "base" / "model.safetensors")
    for k in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight", "model.norm.weight",
              "model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(sd[k], ref[k]), k


def test_a_sharded_base_offloaded_to_the_host_trains_the_same_adapters(root):
    """--zero-level 3 --offload-master (the frozen base's shards in host memory, one layer gathered at a time: a base
    larger than the GPU) through `qtrain train` in one process: the exported adapter is the replicated run's, bit for
    bit (a gather is an exact copy), and loads in peft."""
    assert main(_argv(root, "rep", steps=2)) == 0
    assert main(_argv(root, "z3", "--zero-level", "3", "--offload-master", steps=2)) == 0
    want, got = (load_file(root / "out" / n / "adapter_model.safetensors") for n in ("rep", "z3"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert any(k.endswith("lora_B.weight") and want[k].abs().max() > 0 for k in want)  # trained off zero
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32)
    peft.PeftModel.from_pretrained(base, str(root / "out" / "z3"))


def test_the_adapters_export_gathers_no_frozen_base(root, monkeypatch):
    """With sharded weights every rank gathers what the export needs into host memory: for the PEFT adapter only the
    adapters' groups (a 72B base would be ~145 GB per rank), for --lora-merge every group."""
    from qtrain.parallel.weights.sharded import ShardedWeights
    gathered: list[list[str]] = []
    real = ShardedWeights.gather_full

    def spy(self, groups=None, **kw):
        gathered.append([g.key for g in (self.layout.groups if groups is None else groups)])
        return real(self, groups, **kw)
    monkeypatch.setattr(ShardedWeights, "gather_full", spy)
    assert main(_argv(root, "gz", "--zero-level", "3", steps=1)) == 0
    assert gathered == [["block.0.lora", "block.1.lora"]]
    assert main(_argv(root, "gzm", "--zero-level", "3", "--lora-merge", steps=1)) == 0
    assert len(gathered) == 2 and {"block.0.lora", "block.1.lora"} < set(gathered[1]) and len(gathered[1]) > 4
    adapter = load_file(root / "out" / "gz" / "adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter)


def test_init_from_an_exported_adapter_starts_from_its_values(root):
    """--lora-init-from: a run started from another run's exported PEFT adapter begins with exactly its values: its
    loss before the first step (--eval-at-start, over the whole eval file) is bit for bit the source run's final
    evaluation (the same base, adapters and batches; adapters read back transposed, scaled, rounded or in another
    order would move it), and training had moved that loss off the base's (B = 0 at peft's init)."""
    whole_eval = ("--eval-at-start", "--eval-num-steps", "1000")  # more batches than the eval file holds
    assert main(_argv(root, "src", *whole_eval, steps=2)) == 0
    assert main(_argv(root, "from-src", *whole_eval, "--lora-init-from", str(root / "out" / "src"), steps=1)) == 0
    src, run = ({e["step"]: e["loss"] for e in read_log(root / "logs" / f"{n}.jsonl") if e["log"] == "eval"}
                for n in ("src", "from-src"))
    assert sorted(src) == [0, 2] and sorted(run) == [0, 1]
    assert run[0] == src[2] and src[2] != src[0]


@pytest.fixture(scope="module")
def random_adapter(root) -> Path:
    """A PEFT adapter of the base for LORA's targets with random A and B (peft's init_lora_weights=False), as peft
    writes it."""
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32)
    targets = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    torch.manual_seed(0)  # peft's random init draws from the global generator
    peft.get_peft_model(base, lora).save_pretrained(root / "random_adapter")
    return root / "random_adapter"


def test_two_gloo_ranks_train_as_one_process_with_the_global_batch(root, random_adapter):
    """2 ranks, each 2 rows a step: the unsharded manager and --shard-gradients average the same fp32 adapter
    gradients, and train as one process reading the same 4 rows a step (rank r holds rows r::2 of them). All start
    from the same PEFT adapter with random A and B (--lora-init-from), so both matrices train from the first step
    and each tensor's update from that start is known. Tolerances: the ranks' runs differ from each other only in
    how the gradient average is formed (1e-6 absolute, as before); from the one process in the order of the sums
    (per-rank GEMMs and a cross-rank average against one GEMM over 4 rows, fp32 ~1e-7): losses to 2e-5 relative,
    each adapter tensor within 1e-3 of its update, ||w - w_ref|| <= 1e-3 ||w_ref - w0|| (Adam divides each element
    by its own gradient's RMS, so elements with tiny gradients move apart further than the gradients do; as
    tests/parallel/test_context_train.py; measured 2e-5 and 7e-8)."""
    init = ("--lora-init-from", str(random_adapter), "--ckpt-interval", "100")
    assert main(_argv(root, "g0", *init, steps=2, batch_size=4)) == 0
    outs = {"g0": load_file(root / "out" / "g0" / "adapter_model.safetensors")}
    for name, extra in (("g1", ()), ("g2", ("--shard-gradients",))):
        r = qtrain_run(_argv(root, name, "--gpus", "2", *init, *extra, steps=2), cwd=root, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        outs[name] = load_file(root / "out" / name / "adapter_model.safetensors")
    assert outs["g1"].keys() == outs["g2"].keys() == outs["g0"].keys()
    for k, v in outs["g1"].items():
        assert torch.allclose(v, outs["g2"][k], rtol=0, atol=1e-6), k
    start = load_file(random_adapter / "adapter_model.safetensors")
    assert start.keys() == outs["g0"].keys()
    for k, want in outs["g0"].items():
        err, update = float((outs["g1"][k] - want).norm()), float((want - start[k]).norm())
        assert update > 0 and err <= 1e-3 * update, f"{k}: ||w - w_ref|| = {err:.3g}, update {update:.3g}"
    (ref, got) = ([e for e in read_log(root / "logs" / f"{n}.jsonl") if e["log"] == "step"] for n in ("g0", "g1"))
    assert [e["step"] for e in got] == [e["step"] for e in ref] == [0, 1]
    for a, b in zip(got, ref):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-5), a["step"]


def test_dropout_resume_is_bitwise(root):
    """--lora-dropout: each micro-step's masks come from a key of (seed, step, micro-step, layer, target), so
    --continue from a checkpoint ends on the bits of the uninterrupted run (2 micro-steps per step)."""
    def argv(name, *extra):
        a = train_argv(root, steps=4, name=name, model=root / "base", grad_accumulation=2,
                       extra=LORA + ("--lora-dropout", "0.2") + extra)
        a.remove("--from-scratch")
        return a

    assert main(argv("d")) == 0
    out, ckpt = root / "out" / "d", root / "ckpt" / "d"
    first = (out / "adapter_model.safetensors").read_bytes()
    shutil.rmtree(ckpt / "step_00000004")
    assert main(argv("d", "--continue")) == 0
    assert (out / "adapter_model.safetensors").read_bytes() == first
    assert main(argv("d0", "--lora-dropout", "0")) == 0  # the masks do something
    assert (root / "out" / "d0" / "adapter_model.safetensors").read_bytes() != first


def test_export_lora_merge_from_checkpoint(root):
    """`qtrain export --checkpoint-dir ... --lora-merge`: the checkpoint's adapters folded into the run's --model base
    (read again), bitwise the model the run's own --lora-merge wrote; transformers loads it with the logits of peft
    over the base with the checkpoint's adapter export (tolerance: the module docstring's)."""
    assert main(_argv(root, "x", "--lora-merge", steps=2)) == 0
    ckpt, out = root / "ckpt" / "x", root / "out"
    assert main(["export", "--checkpoint-dir", str(ckpt), "--out-dir", str(out / "xm"), "--lora-merge"]) == 0
    assert main(["export", "--checkpoint-dir", str(ckpt), "--out-dir", str(out / "xa")]) == 0
    assert (out / "xm" / "model.safetensors").read_bytes() == (out / "x" / "model.safetensors").read_bytes()
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(out / "xm", dtype=torch.float32).eval()
    inputs = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = merged(inputs).logits
        adapted = peft.PeftModel.from_pretrained(base, str(out / "xa")).eval()(inputs).logits
    assert (adapted - want).abs().max() <= 1e-4 * want.abs().max()


def test_a_finished_run_continued_with_lora_merge_writes_the_merged_model(root):
    """A finished LoRA run holds its adapter export; `--continue --lora-merge` asks for the merged model, which is not
    there: it is written (the run's own --lora-merge's bits), not "nothing to do"; continued again, it is done."""
    assert main(_argv(root, "fm", steps=2)) == 0
    out = root / "out" / "fm"
    assert (out / "adapter_config.json").is_file() and not (out / "model.safetensors").exists()
    assert main(_argv(root, "fm", "--continue", "--lora-merge", steps=2)) == 0
    assert (out / "model.safetensors").is_file() and not (out / "adapter_config.json").exists()
    assert main(_argv(root, "fmm", "--lora-merge", steps=2)) == 0  # the same run merged from the start
    assert (out / "model.safetensors").read_bytes() == (root / "out" / "fmm" / "model.safetensors").read_bytes()
    before = (out / "model.safetensors").stat().st_mtime_ns
    assert main(_argv(root, "fm", "--continue", "--lora-merge", steps=2)) == 0  # finished: nothing to do
    assert (out / "model.safetensors").stat().st_mtime_ns == before


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_moe_and_hybrid_families_train_adapters_only(family, tmp_path):
    """`qtrain train --lora-rank` on an MoE model (qwen3_moe: attention targets; its experts and routers frozen) and on
    Qwen3.5's MoE (linear-attention and full-attention layers): the checkpoints hold the adapters only."""
    import numpy as np
    from qtrain.data.token_files import write_token_file
    from tests.model.family_fixtures import moe_hf_model, qwen35_cfg, qwen35_hf_model
    root = make_run_root(tmp_path)
    model = (moe_hf_model("qwen3_moe") if family == "qwen3_moe" else qwen35_hf_model(qwen35_cfg(moe=True))).float()
    model.save_pretrained(root / "base")
    rng = np.random.default_rng(1)
    for name, n in (("train.bin", 2000), ("eval.bin", 300)):
        write_token_file(root / name, rng.integers(0, model.config.vocab_size, n, dtype=np.int32),
                         vocab_size=model.config.vocab_size)
    # Qwen3.5: its linear-attention layers' projections and its full-attention layer's q, o (a layer without any
    # of the targets has no adapters)
    targets = ("--lora-targets", "in_proj_qkv,out,q,o") if family == "qwen3_5_moe" else ()
    argv = train_argv(root, steps=2, name="f", model=root / "base", extra=("--lora-rank", "2", "--quiet") + targets)
    argv.remove("--from-scratch")
    assert main(argv) == 0
    keys = set(load_file(root / "ckpt" / "f" / "step_00000002" / "weights.shard_000_of_001.safetensors"))
    assert keys == {f"block.{i}.lora" for i in range(model.config.num_hidden_layers)}
