"""Bad input for the Mixture-of-Experts families (issue 44 item 6), through `qtrain train` in process
(`qtrain.cli.main.main`), as tests/reliability/test_bad_inputs.py does for the rest: each row gives one broken MoE
config.json, weights directory or option and asserts exit code 2, the one line `qtrain: error: ...` naming the file,
key, tensor or option, no traceback, and that nothing under the test's root changed (the refusal comes before the
model is built or anything is written).

The configs are written as JSON here (not through qtrain's config classes), so the rows run against any qtrain: on one
without the MoE families every row fails (an MoE model_type was an unknown one).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import pytest

from qtrain.cli.main import main
from tests.run_utils import make_run_root, snapshot, train_argv

MOE = {  # tiny valid configs of each MoE model type, as transformers writes them
    "qwen3_moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=96, hidden_size=32,
                      intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=64, rope_theta=10000.0,
                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[], router_aux_loss_coef=0.001, use_sliding_window=False, sliding_window=None,
                      max_window_layers=2, output_router_logits=False, bos_token_id=0, eos_token_id=0,
                      tie_word_embeddings=False, rms_norm_eps=1e-6),
    "olmoe": dict(model_type="olmoe", vocab_size=96, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, rope_theta=10000.0,
                  num_experts=8, num_experts_per_tok=2, clip_qkv=None, pad_token_id=1, eos_token_id=0),
    "mixtral": dict(model_type="mixtral", vocab_size=96, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0,
                    num_local_experts=4, num_experts_per_tok=2, sliding_window=None, bos_token_id=0, eos_token_id=0),
}


def with_(kind: str, **changes: Any) -> dict[str, Any]:
    """MOE[kind] with keys changed (None: removed)."""
    d = {**MOE[kind], **changes}
    return {k: v for k, v in d.items() if not (v is None and k in changes)}


CONFIG_CASES = [  # (name, config.json, the message's regex)
    ("top-k-over-experts", with_("qwen3_moe", num_experts_per_tok=9),
     r"config\.json: num_experts_per_tok=9 exceeds the number of experts \(8\)"),
    ("mixtral-top-k-over-experts", with_("mixtral", num_experts_per_tok=5),
     r"config\.json: num_experts_per_tok=5 exceeds the number of experts \(4\)"),
    ("zero-moe-intermediate", with_("qwen3_moe", moe_intermediate_size=0),
     r"config\.json: moe_intermediate_size must be a positive integer, got 0"),
    ("zero-expert-width-olmoe", with_("olmoe", intermediate_size=0),
     r"config\.json: intermediate_size must be a positive integer, got 0"),
    ("zero-experts", with_("qwen3_moe", num_experts=0), r"config\.json: num_experts must be a positive integer, got 0"),
    ("zero-top-k", with_("olmoe", num_experts_per_tok=0),
     r"config\.json: num_experts_per_tok must be a positive integer, got 0"),
    ("experts-disagree", with_("mixtral", num_experts=8),
     r"config\.json: num_local_experts=4 and num_experts=8 disagree"),
    ("string-top-k", with_("qwen3_moe", num_experts_per_tok="8"),
     r"config\.json: num_experts_per_tok must be an integer"),
    ("negative-aux-coef", with_("olmoe", router_aux_loss_coef=-0.01), r"router_aux_loss_coef must be >= 0"),
    # a router kind not implemented: qwen2_moe's shared expert is another model type, and its keys are refused by name
    ("qwen2-moe", with_("qwen3_moe", model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"]),
     r"config\.json: unknown model_type 'qwen2_moe'; supported: qwen2, llama, qwen3, qwen3_moe, olmoe, mixtral"),
    ("shared-expert-key", with_("qwen3_moe", shared_expert_intermediate_size=64),
     r"config\.json: unknown config key\(s\) \['shared_expert_intermediate_size'\]"),
    ("sliding-window", with_("mixtral", sliding_window=4096), r"config\.json: sliding_window=4096 is not supported"),
    ("qwen3-moe-sliding-window", with_("qwen3_moe", use_sliding_window=True),
     r"config\.json: use_sliding_window=true is not supported"),
    ("router-jitter", with_("mixtral", router_jitter_noise=0.01), r"config\.json: router_jitter_noise != 0"),
    ("attention-bias", with_("olmoe", attention_bias=True), r"config\.json: attention_bias=true is not supported"),
    ("mlp-only-layers-not-a-list", with_("qwen3_moe", mlp_only_layers="0"),
     r"config\.json: mlp_only_layers must be a list of layer indices"),
    ("sparse-step-0", with_("qwen3_moe", decoder_sparse_step=0),
     r"config\.json: decoder_sparse_step must be a positive integer, got 0"),
    ("olmoe-clip-negative", with_("olmoe", clip_qkv=-1.0), r"config\.json: clip_qkv must be a positive number"),
]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_run_root(tmp_path_factory.mktemp("moe_base"))


def refused(root: Path, argv: list[str], match: str, capsys) -> None:
    before = snapshot(root)
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("qtrain: error: ") and re.search(match, err), f"{match!r} not in {err!r}"
    assert snapshot(root) == before  # nothing written, nothing changed


def _root(base: Path, tmp_path: Path, config: dict[str, Any]) -> Path:
    import shutil
    root = tmp_path / "root"
    shutil.copytree(base, root)
    (root / "model" / "config.json").write_text(json.dumps(config))
    return root


@pytest.mark.parametrize("name,config,match", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_bad_moe_configs_are_refused_in_one_line(name, config, match, base, tmp_path, capsys):
    root = _root(base, tmp_path, config)
    refused(root, train_argv(root, steps=2), match, capsys)


OPTION_CASES: list[tuple[str, str, Callable[[Path], list[str]], str]] = [
    ("router-z-loss-negative", "mixtral", lambda r: ["--router-z-loss=-0.1"], r"--router-z-loss must be >= 0"),
    ("log-router-every-0", "mixtral", lambda r: ["--log-router-every", "0"], r"--log-router-every >= 1"),
    ("expert-parallel-0", "mixtral", lambda r: ["--expert-parallel", "0"], r"--expert-parallel must be >= 1"),
    ("expert-parallel-not-dividing-experts", "mixtral", lambda r: ["--expert-parallel", "3"],
     r"--expert-parallel 3 must divide the model's 4 experts"),
    ("expert-parallel-over-one-rank", "qwen3_moe", lambda r: ["--expert-parallel", "2"],
     r"--expert-parallel 2 must divide the number of ranks \(1\)"),
    ("lora-expert-targets-with-ep", "qwen3_moe", lambda r: ["--gpus", "2", "--expert-parallel", "2", "--lora-rank", "4"],
     r"--lora-rank with --expert-parallel 2: targets gate,up,down adapt the experts"),
    ("expert-parallel-not-dividing-gpus", "olmoe", lambda r: ["--gpus", "2", "--expert-parallel", "4"],
     r"--expert-parallel 4 must divide the number of ranks \(2\)"),
    ("expert-parallel-hybrid", "qwen3_moe", lambda r: ["--expert-parallel", "2", "--shard-group-size", "1"],
     r"--expert-parallel with --shard-group-size is not supported yet"),
    ("context-parallel", "qwen3_moe", lambda r: ["--gpus", "2", "--context-parallel", "2"],
     r"--context-parallel 2: model_type 'qwen3_moe' is not supported yet \(its attention across ranks is built for "
     r"the dense families"),
]


@pytest.mark.parametrize("name,model_type,flags,match", OPTION_CASES, ids=[c[0] for c in OPTION_CASES])
def test_options_an_moe_model_cannot_run_are_refused(name, model_type, flags, match, base, tmp_path, capsys):
    root = _root(base, tmp_path, MOE[model_type])
    refused(root, train_argv(root, steps=2, extra=tuple(flags(root))), match, capsys)


def test_expert_parallel_on_a_dense_model_is_refused(base, tmp_path, capsys):
    """--expert-parallel needs experts: the test root's dense model refuses it before anything is built."""
    import shutil
    root = tmp_path / "root"
    shutil.copytree(base, root)
    refused(root, train_argv(root, steps=2, extra=("--expert-parallel", "2")),
            r"--expert-parallel 2: \w+ model has no experts \(a dense model\); drop --expert-parallel", capsys)


def test_a_checkpoint_missing_an_expert_is_refused_naming_it(base, tmp_path, capsys):
    """Weights whose config says 8 experts but whose file holds 7 (per-expert names, what save_pretrained writes):
    refused by the header check, naming the first missing expert tensor."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file
    root = _root(base, tmp_path, MOE["qwen3_moe"])
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**MOE["qwen3_moe"]))
    model.save_pretrained(root / "model")
    tensors = {k: v for k, v in load_file(str(root / "model" / "model.safetensors")).items() if ".experts.7." not in k}
    save_file(tensors, str(root / "model" / "model.safetensors"))
    argv = [a for a in train_argv(root, steps=2) if a != "--from-scratch"]
    refused(root, argv, r"tensor 'model\.layers\.0\.mlp\.experts\.7\.up_proj\.weight' missing", capsys)


def test_cuda_graphs_refuse_an_moe_step():
    """--use-cuda-graphs on a CUDA device cannot capture an MoE step (its GEMM shapes follow the routing): refused
    with the reason (the preflight and the Trainer call this before building anything); unset, the graphs stay off."""
    from qtrain.model.registry import config_from_hf_dict
    from qtrain.options import Options, OptionsError
    from qtrain.plan.resolution import check_model_support, cuda_graphs_on
    cfg = config_from_hf_dict(MOE["olmoe"])
    with pytest.raises(OptionsError, match=r"--use-cuda-graphs cannot capture a step of olmoe \(a Mixture-of-Experts "
                                           r"model\): the number of tokens each expert gets"):
        check_model_support(cfg, Options(model="m", use_cuda_graphs=True), device_type="cuda")
    check_model_support(cfg, Options(model="m"), device_type="cuda")  # unset: no error, and auto keeps them off
    assert not cuda_graphs_on(cfg, Options(model="m", batch_size=1, seq_len=16), world=1, device_type="cuda")
