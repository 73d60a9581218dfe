"""The `hf-train` kind and the model shapes the issue 44-46 suites (moe, lora, qwen35) ask for, on the CPU: a cut or
shrunk qtrain config is the model transformers builds from it (same parameter count), the settings and LoRA
targets are checked before a run, every case of the new suites turns into a CPU dry run the kinds accept, and
hf-train trains a tiny model (in process, and in a child process per setting as on the GPU)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from bench import hf_train
from bench.case import check_params
from bench.kinds import KINDS, Skip
from bench.shapes import config_dir, shaped_config, tiny_config, with_layers
from bench.suite import REPO_ROOT, load
from tests.run_utils import subprocess_env

NEW_SUITES = ("moe", "moe-detail", "lora", "qwen35")
FAMILIES = ("Qwen2.5-7B", "OLMoE-1B-7B", "Qwen3-30B-A3B", "Qwen3.5-4B", "Qwen3.5-35B-A3B")


def hf_param_count(cfg) -> int:
    """Parameters of transformers' own model built from `cfg.to_hf_dict()` (on the meta device: no memory)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    d = cfg.to_hf_dict()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(CONFIG_MAPPING[d["model_type"]].from_dict(d))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("model", FAMILIES)
def test_tiny_and_cut_shapes_are_the_same_model_in_transformers(model):
    """The family's tiny shape validates in qtrain, keeps the family's kind of layers and experts, and transformers
    builds a model of exactly qtrain's parameter count from it; so does the preset cut to 3 layers (the suites'
    `layers`), whose per-layer lists are cut with it."""
    from qtrain.model.weights import num_params
    tiny = tiny_config(model)
    tiny.validate()
    assert tiny.hidden_size == 64 and tiny.num_hidden_layers == 2
    if getattr(tiny, "layer_types", None):
        assert set(tiny.layer_types) == {"linear_attention", "full_attention"}
    full = shaped_config(model)
    assert bool(getattr(tiny, "num_experts", 0)) == bool(getattr(full, "num_experts", 0))
    assert hf_param_count(tiny) == num_params(tiny)
    cut = shaped_config(model, 3)
    assert cut.num_hidden_layers == 3 and hf_param_count(cut) == num_params(cut)
    if getattr(full, "layer_types", None):
        assert cut.layer_types == full.layer_types[:3]


def test_layers_out_of_range_and_mlp_only_layers():
    cfg = shaped_config("Qwen3-30B-A3B")
    for bad in (0, 49, True, 2.0):
        with pytest.raises(ValueError, match="layers="):
            with_layers(cfg, bad)
    cut = with_layers(cfg.replace(mlp_only_layers=(1, 5)), 4)
    assert cut.mlp_only_layers == (1,) and cut.num_hidden_layers == 4


def test_config_dir_is_written_once_and_read_back():
    from bench.compat import model_config
    cfg = shaped_config("OLMoE-1B-7B", 2)
    d = config_dir(cfg)
    assert d == config_dir(cfg) and os.listdir(d) == ["config.json"]
    assert model_config(d).num_hidden_layers == 2 and model_config(d).num_experts == 64


def test_settings_and_lora_targets_are_checked():
    names = [s["name"] for s in hf_train.check_settings([{}, {"compile": True, "grad_ckpt": True},
                                                        {"experts": "grouped_mm", "name": "g"},
                                                        {"batch": 8, "accum": 2}])]
    assert names == ["sdpa", "sdpa+compile+ckpt", "g", "sdpa+batch=8+accum=2"]
    for bad, match in (([{"compiled": True}], "unknown key 'compiled'"), ([{"compile": "yes"}], "want a bool"),
                       ([{"batch": 0}], "batch: want a positive int"), ([{"accum": True}], "accum: want a positive"),
                       ([{}, {"attn": "sdpa"}], "named alike"), (["sdpa"], "want a table")):
        with pytest.raises(ValueError, match=match):
            hf_train.check_settings(bad)
    spec = hf_train.lora_spec(16, 0, "q,k,v,o,gate,up,down", 0.0)
    assert spec["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert spec["lora_alpha"] == 32 and hf_train.lora_spec(0, 0, None, 0.0) is None
    assert hf_train.lora_spec(8, 4, ["q", "w_in"], 0.0)["target_modules"] == ["q_proj", "w_in"]


@pytest.mark.parametrize("suite", NEW_SUITES)
def test_new_suites_dry_run_parameters(suite):
    """Every case of the new suites: its parameters bind to its kind's run(), its dry run's too (or it says why it
    needs a GPU), and the options are those a CUDA run takes (each dry_run validates them, layers included); the
    GPU run's qtrain cases leave --compile-tuning off and every hf-train case runs in a process per setting."""
    import importlib
    s = load(suite)
    assert "Estimate" in s.description and "H100" in s.description
    for r in s.runs:
        mod = importlib.import_module(KINDS[r.kind].module)
        check_params(mod.run, r.params, r.kind)
        if r.kind in ("train", "profile"):
            assert r.params.get("compile_tuning") is False, r.id
        if r.kind == "hf-train":
            assert r.params.get("isolate", True) and r.params["batch"] and r.params.get("settings"), r.id
        try:
            dry = mod.dry_run(dict(r.params))
        except Skip:
            continue
        check_params(mod.run, dry, r.kind)
        assert dry["device"] == "cpu" and dry.get("layers") is None, r.id


def test_hf_train_cases_outlast_their_settings():
    """The harness kills a run at its timeout and keeps nothing of it: an hf-train case must outlast all its
    settings' own timeouts, so a setting that hangs is a row, not the loss of the case."""
    for suite in NEW_SUITES:
        for r in load(suite).runs:
            if r.kind == "hf-train" and r.params.get("setting_timeout"):
                assert r.timeout > len(r.params["settings"]) * r.params["setting_timeout"], r.id


def test_same_batch_and_seq_for_each_comparison():
    """The suites compare tools on one global batch and sequence: within each model (and seq), every case and every
    hf-train setting has the same batch x accum (a tool may run it at its fastest micro-batch: lora's 8 x 2)."""
    for suite in NEW_SUITES:
        groups: dict[tuple, set] = {}
        for r in load(suite).runs:
            p = r.params
            key = (p["model"], p.get("layers"), p.get("seq", 1024))
            for s in (p.get("settings") or [{}]) if r.kind == "hf-train" else [{}]:
                groups.setdefault(key, set()).add(s.get("batch", p["batch"]) * s.get("accum", p.get("accum", 1)))
        assert all(len(v) == 1 for v in groups.values()), (suite, groups)


def test_hf_train_tiny_in_process():
    """A tiny OLMoE (fp32, CPU) through the kind's dry-run parameters: both settings train; on a tiny Qwen2.5 the
    first setting that ran stops the fallbacks with first_ok, and peft's wrapper leaves only the adapters of the
    seven targets trainable."""
    params = hf_train.dry_run(dict(model="OLMoE-1B-7B", batch=4, accum=2, settings=[
        {"name": "a"}, {"name": "b", "grad_ckpt": True}]))
    res = hf_train.run(**params)
    assert [r["status"] for r in res["rows"]] == ["ok", "ok"] and res["tps"] > 0 and res["system"] == "hf"
    assert res["rows"][0]["loss"] == res["rows"][1]["loss"]  # checkpointing changes no number
    dense = hf_train.dry_run({**params, "model": "Qwen2.5-7B", "lora_rank": 4, "first_ok": True})
    lora = hf_train.run(**dense)
    assert [r["status"] for r in lora["rows"]] == ["ok", "skipped"] and lora["system"] == "hf+peft"
    # a setting's own micro-batch and accumulation (the dry run keeps them at most 2): its row says which ran
    mb = hf_train.run(**hf_train.dry_run({**params, "accum": 4, "settings": [{"name": "1x4", "batch": 1},
                                                                           {"name": "2x1", "accum": 1}]}))
    assert [(r["batch"], r["accum"], r["status"]) for r in mb["rows"]] == [(1, 2, "ok"), (2, 1, "ok")]
    assert (mb["batch"], mb["accum"]) == next((r["batch"], r["accum"]) for r in mb["rows"] if r["tps"] == mb["tps"])
    H, q, kv, F = 64, 4 * 16, 2 * 16, 128  # the tiny shape: r x (in + out) for each of the seven targets, 2 layers
    assert lora["trainable"] == 2 * 4 * ((H + q) * 2 + (H + kv) * 2 + (H + F) * 3)


@pytest.mark.slow  # ~25 s of CPU: two child processes import torch and transformers
def test_hf_train_smoke_through_child_processes():
    """As on the GPU: each setting in its own process (`python -m bench.hf_train`), a tiny Qwen2.5-7B-family model
    with LoRA, fp32 on the CPU; a setting that fails (an unknown attention implementation) is its row, the other
    still ran and is the result."""
    from bench.dry import tiny_model_dir
    code = f"""
import json
from bench import hf_train
r = hf_train.run(model={tiny_model_dir("Qwen2.5-7B")!r}, batch=2, seq=32, steps=2, warmup=1, device="cpu",
                 dtype="fp32", lora_rank=4, settings=[{{"name": "bad", "attn": "no-such-attention"}}, {{}}])
print("RESULT", json.dumps(r))
"""
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=subprocess_env(), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    res = json.loads(next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))[7:])
    bad, ok = res["rows"]
    assert bad["status"] == "failed" and "no-such-attention" in bad["error"]
    assert ok["status"] == "ok" and res["best"] == "sdpa" and res["tps"] == ok["tps"] > 0


def test_profile_categories_of_moe_and_delta_rule_kernels():
    """Names as the kernels are called (qtrain's Triton kernels by their function names; cuBLAS's and CUTLASS's by
    their library's patterns): each lands in its own category, the dense GEMMs and inductor's kernels stay where
    they were."""
    from bench.kernel_categories import category
    names = {
        "void trsm_left_kernel<float, 256, 4, false, false, true, false, false>": "triangular-solve",
        "_permute_kernel": "moe-permute", "_unpermute_kernel": "moe-permute",
        "void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>": "moe-routing",
        "void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<...>": "moe-routing",
        "cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::GemmUniversal"
        "<cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int> >, ...> > >": "gemm-grouped",
        "nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT": "gemm",
        "triton_poi_fused_permute_view_3": "inductor-fused",
    }
    assert {n: category(n) for n in names} == names
