"""Bad LoRA input (issue 45 item 4): each row gives `qtrain train` one broken LoRA setting or adapter and asserts
the bad-input table's contract (tests/reliability/test_bad_inputs.py's `run_case`): exit code 2, one line
`qtrain: error: ...` naming the option or file, no traceback, nothing under the root changed or added (the
refusal comes before the model is built and before anything is written).

The tiny model (tests/run_utils.CFG, llama): hidden 32, q 32 x 32, k and v 16 x 32, o 32 x 32, gate/up 64 x 32,
down 32 x 64; so rank 17 exceeds k's and v's smaller dimension (16).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from qtrain.model.lora import LoraSpec
from qtrain.model.lora.peft_io import save_adapter
from qtrain.model.lora.tensors import adapter_specs
from qtrain.cli.main import main
from tests.reliability.test_bad_inputs import Case, cmd, run_case, train
from tests.run_utils import CFG, make_run_root, train_argv

ALL7 = ("q", "k", "v", "o", "gate", "up", "down")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """The tiny model's root with two finished 2-step runs: `lr` (LoRA) and `ff` (a full fine-tune)."""
    root = make_run_root(tmp_path_factory.mktemp("lora_base"))
    assert main(train_argv(root, steps=2, name="lr", extra=("--lora-rank", "4", "--quiet"))) == 0
    assert main(train_argv(root, steps=2, name="ff", extra=("--quiet",))) == 0
    return root


def other_model(root: Path) -> None:
    """root/other: a model directory of another config (hidden 48)."""
    (root / "other").mkdir()
    (root / "other" / "config.json").write_text(json.dumps(
        type(CFG)(**{**CFG.__dict__, "hidden_size": 48, "head_dim": 8}).to_hf_dict()))


def moe_model(root: Path) -> None:
    """root/moe: a tiny qwen3_moe config (layer 1 dense: mlp_only_layers), the vocabulary of the token files."""
    import transformers
    from tests.model.family_fixtures import MOE_BASE, MOE_CASES
    (root / "moe").mkdir()
    cfg = transformers.Qwen3MoeConfig(**{**MOE_BASE, "vocab_size": CFG.vocab_size}, **MOE_CASES["qwen3_moe"][1])
    (root / "moe" / "config.json").write_text(json.dumps(cfg.to_dict()))


def export(*extra: str):
    return cmd("export", "--out-dir", "{root}/x", *extra)


def adapter(rel: str, *, rank: int = 4, targets: tuple[str, ...] = ALL7, cfg=CFG, config: dict | None = None,
            weights: bytes | None = None, drop: str = ""):
    """A setup writing a PEFT adapter (qtrain's writer, random tensors) at root/rel, then broken as asked."""
    def setup(root: Path) -> None:
        spec = LoraSpec(rank, 8.0, targets=targets)
        t = {n: torch.randn(s.shape) for n, s in adapter_specs(cfg, spec).items()}
        d = root / rel
        save_adapter(d, cfg, spec, t, base="tiny", dtype=torch.float32)
        (d / "qtrain-export.json").unlink()
        if config is not None:
            c = json.loads((d / "adapter_config.json").read_text())
            c.update(config)
            (d / "adapter_config.json").write_text(json.dumps(c))
        if weights is not None:
            (d / "adapter_model.safetensors").write_bytes(weights)
        if drop:
            (d / drop).unlink()
    return setup


def interrupted_export(rel: str):
    """A setup writing a PEFT adapter at root/rel as an export does, then its manifest marked incomplete: what a
    kill between the export's renames leaves (its files may mix two exports)."""
    def setup(root: Path) -> None:
        spec = LoraSpec(4, 8.0, targets=ALL7)
        t = {n: torch.randn(s.shape) for n, s in adapter_specs(CFG, spec).items()}
        save_adapter(root / rel, CFG, spec, t, base="tiny", dtype=torch.float32, owner={"run_id": "r", "step": 2})
        man = root / rel / "qtrain-export.json"
        man.write_text(man.read_text().replace('"complete": true', '"complete": false'))
    return setup


def lora(*extra: str, **flags):
    return train(extra=("--lora-rank", "4", *extra), **flags)


CASES = [
    Case("options-without-rank", train(extra=("--lora-alpha", "8")), r"--lora-alpha needs --lora-rank"),
    Case("rank-0-with-targets", train(extra=("--lora-rank", "0", "--lora-targets", "q")),
         r"--lora-targets needs --lora-rank"),
    Case("negative-rank", train(extra=("--lora-rank", "-1")), r"--lora-rank must be >= 1"),
    Case("rank-above-dims", train(extra=("--lora-rank", "17")),
         r"--lora-rank 17 is larger than target k's dimensions \(16 x 32\)"),
    Case("unknown-target", lora("--lora-targets", "q,qq"), r"--lora-targets: unknown target 'qq'"),
    Case("dropout-range", lora("--lora-dropout", "1.5"), r"--lora-dropout must be in \[0, 1\)"),
    Case("sharded-weights-e4m3-base", lora("--zero-level", "3", "--lora-base-dtype", "e4m3"),
         r"--zero-level 3 is not supported for this run: --lora-base-dtype e4m3 holds the frozen base as e4m3"),
    Case("expert-parallel-dense", lora("--expert-parallel", "2"), r"--expert-parallel 2: llama model has no experts"),
    Case("merge-e4m3", lora("--lora-merge", "--lora-base-dtype", "e4m3"),
         r"--lora-merge with --lora-base-dtype e4m3"),
    Case("base-dtype-value", lora("--lora-base-dtype", "e5m2"), r"--lora-base-dtype='e5m2'"),
    Case("e4m3-base-persistent-quants", lora("--lora-base-dtype", "e4m3", "--matmul-dtype", "e4m3",
                                             "--model-dtype", "bf16", "--persistent-quants"),
         r"--persistent-quants with --lora-base-dtype e4m3: the base is already held as e4m3 codes"),
    Case("offloaded-base-without-recompute", lora("--lora-base-dtype", "e4m3", "--offload-quants"),
         r"--offload-quants with --lora-base-dtype e4m3 needs --recompute-block"),
    Case("base-e4m3-master-fp32", lora("--lora-base-dtype", "e4m3", "--model-dtype", "bf16", "--master-dtype", "fp32"),
         r"--lora-base-dtype e4m3 with --master-dtype fp32 is not supported"),
    Case("init-from-missing", lora("--lora-init-from", "{root}/nope"), r"--lora-init-from .*nope: not a directory"),
    Case("init-from-other-rank", lora("--lora-init-from", "{root}/a"), r"adapter_config\.json: r=8, this run's "
         r"--lora-rank is 4", setup=adapter("a", rank=8)),
    Case("init-from-other-targets", lora("--lora-init-from", "{root}/a", "--lora-targets", "q,v"),
         r"adapter_config\.json: target_modules .* differ", setup=adapter("a")),
    Case("init-from-other-base", lora("--lora-init-from", "{root}/a"),
         r"adapter_model\.safetensors: tensor .*q_proj\.lora_A\.weight is F32 \[4, 48\], this base model and rank "
         r"need a float tensor of shape \[4, 32\]",
         setup=adapter("a", cfg=type(CFG)(**{**CFG.__dict__, "hidden_size": 48, "head_dim": 8}))),
    Case("init-from-corrupt-weights", lora("--lora-init-from", "{root}/a"),
         r"adapter_model\.safetensors: not a readable safetensors file", setup=adapter("a", weights=b"\x10garbage")),
    Case("init-from-no-weights", lora("--lora-init-from", "{root}/a"), r"adapter_model\.safetensors: file not found",
         setup=adapter("a", drop="adapter_model.safetensors")),
    Case("init-from-config-not-json", lora("--lora-init-from", "{root}/a"), r"adapter_config\.json",
         setup=lambda root: (adapter("a")(root), (root / "a" / "adapter_config.json").write_text("{nope"))),
    Case("init-from-dora", lora("--lora-init-from", "{root}/a"), r"adapter_config\.json: use_dora=True is not "
         r"supported", setup=adapter("a", config={"use_dora": True})),
    Case("export-merge-full-finetune", export("--checkpoint-dir", "{root}/ckpt/ff", "--lora-merge"),
         r"--lora-merge needs a LoRA run's checkpoint"),
    Case("export-base-model-without-merge", export("--checkpoint-dir", "{root}/ckpt/lr", "--base-model",
                                                   "{root}/model"),
         r"--base-model needs --lora-merge"),
    Case("export-merge-base-missing", export("--checkpoint-dir", "{root}/ckpt/lr", "--lora-merge", "--base-model",
                                             "{root}/nope"), r"--base-model .*nope: .*not found"),
    Case("export-merge-other-base", export("--checkpoint-dir", "{root}/ckpt/lr", "--lora-merge", "--base-model",
                                           "{root}/other"),
         r"--base-model .*other: its config\.json is not the checkpoint's model", setup=other_model),
    Case("moe-base-e4m3", lora("--lora-base-dtype", "e4m3", "--model-dtype", "bf16", model="{root}/moe"),
         r"--lora-base-dtype e4m3 is not supported for model type 'qwen3_moe' \(the qwen3_moe family\): the block "
         r"multiplies its router, experts_up_gate, experts_down itself", setup=moe_model),
    Case("init-from-interrupted-export", lora("--lora-init-from", "{root}/a"),
         r"--lora-init-from .*a: an interrupted export \(qtrain-export\.json says it is incomplete",
         setup=interrupted_export("a")),
    # keep-n and --start-over remove a checkpoint folder whole: an export there went with it at the next checkpoint
    Case("export-into-checkpoint", cmd("export", "--checkpoint-dir", "{root}/ckpt/lr", "--out-dir",
                                       "{root}/ckpt/lr/step_00000002"),
         r"--out-dir .*step_00000002: is a checkpoint directory; the export needs its own folder"),
    Case("export-inside-checkpoint", cmd("export", "--checkpoint-dir", "{root}/ckpt/ff", "--out-dir",
                                         "{root}/ckpt/lr/step_00000002/x"),
         r"--out-dir .*step_00000002/x: lies inside the checkpoint directory .*step_00000002"),
    # the run `lr` made its base from scratch (its seed's init): the adapters trained on that, not on these weights
    Case("export-merge-from-scratch-run-onto-weights", export("--checkpoint-dir", "{root}/ckpt/lr", "--lora-merge",
                                                              "--base-model", "{root}/w"),
         r"--base-model .*/w: the run made its LoRA base from scratch \(--seed 42\)",
         setup=lambda root: base_weights(root / "w", 1)),
    Case("init-from-alpha-differs", lora("--lora-init-from", "{root}/a", "--lora-alpha", "3"),
         r"lora_alpha 8 differs from --lora-alpha 3", setup=adapter("a")),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_lora_input(case: Case, base: Path, tmp_path: Path, capsys) -> None:
    run_case(case, base, tmp_path, capsys)



# ---- the base a LoRA run trains on: its checkpoints hold the adapters only, so the base is read again from --model
# by `--continue` and `qtrain export --lora-merge`; weights changed there since (another revision downloaded into the
# same folder, a re-export) would silently train or merge the adapters on another base

def base_weights(d: Path, seed: int) -> None:
    """d: the tiny model's weights (random of `seed`), in place of whatever was there."""
    from qtrain.model.hf_io import save_hf_model
    from qtrain.model.weights import param_shapes
    shutil.rmtree(d, ignore_errors=True)
    g = torch.Generator().manual_seed(seed)
    save_hf_model(d, CFG, {n: torch.randn(s, generator=g) * 0.02 for n, s in param_shapes(CFG).items()},
                  dtype=torch.float32)


def lora_on_weights(root: Path, steps: int, *extra: str) -> list[str]:
    argv = train_argv(root, steps=steps, name="lb", model=root / "w", extra=("--lora-rank", "4", *extra))
    return [a for a in argv if a != "--from-scratch"]


@pytest.fixture(scope="module")
def weighted(tmp_path_factory) -> Path:
    """A finished 2-step LoRA run `lb` on the weights root/w."""
    root = make_run_root(tmp_path_factory.mktemp("lora_weighted"))
    base_weights(root / "w", 1)
    assert main(lora_on_weights(root, 2, "--quiet")) == 0
    return root


BASE_CHANGED = r"the LoRA base .*/w/model\.safetensors was (changed|rewritten|replaced)"
BASE_CASES = [
    Case("continue-base-changed", lambda root: lora_on_weights(root, 4, "--continue"), BASE_CHANGED,
         setup=lambda root: base_weights(root / "w", 2)),
    Case("export-merge-base-changed", export("--checkpoint-dir", "{root}/ckpt/lb", "--lora-merge", "--base-model",
                                             "{root}/w"), BASE_CHANGED, setup=lambda root: base_weights(root / "w", 2)),
    Case("export-merge-other-base-model", export("--checkpoint-dir", "{root}/ckpt/lb", "--lora-merge",
                                                 "--base-model", "{root}/w2"),
         r"the LoRA base .*w2/model\.safetensors .*changed", setup=lambda root: base_weights(root / "w2", 2)),
]


@pytest.mark.parametrize("case", BASE_CASES, ids=[c.name for c in BASE_CASES])
def test_lora_base_changed(case: Case, weighted: Path, tmp_path: Path, capsys) -> None:
    run_case(case, weighted, tmp_path, capsys)


def test_lora_base_moved_merges(weighted: Path, tmp_path: Path) -> None:
    """The same base bytes elsewhere (--base-model) are the run's base: the merge goes ahead."""
    root = tmp_path / "root"
    shutil.copytree(weighted, root)
    shutil.copytree(root / "w", root / "moved")
    assert main(["export", "--checkpoint-dir", str(root / "ckpt" / "lb"), "--lora-merge", "--base-model",
                 str(root / "moved"), "--out-dir", str(root / "x")]) == 0
    assert (root / "x" / "model.safetensors").is_file()


def test_lora_run_checkpoints_after_its_base_is_gone(tmp_path: Path, monkeypatch) -> None:
    """The base's record is taken when the run reads the base: a base folder removed mid-run (the weights are in
    memory) never stops a checkpoint, and the checkpoint still names the base the adapters trained on."""
    from qtrain.train import checkpointing
    root = make_run_root(tmp_path)
    base_weights(root / "w", 1)
    save = checkpointing.save

    def save_without_base(*args, **kwargs):
        shutil.rmtree(root / "w", ignore_errors=True)
        return save(*args, **kwargs)
    monkeypatch.setattr(checkpointing, "save", save_without_base)
    assert main(lora_on_weights(root, 2, "--quiet")) == 0
    meta = json.loads((root / "ckpt" / "lb" / "step_00000002" / "checkpoint.json").read_text())
    assert [Path(f["path"]).name for f in meta["lora_base"]["files"]] == ["model.safetensors"]
