"""qtrain's additions to the torchtitan peer baseline (.tt, a copy of ../shared/anchor/torchtitan, is not edited).

torchtitan 0.2.2 imports this module through `--experimental.custom_import tt_qtrain` (bench/torchtitan.py puts
bench/tt on PYTHONPATH and passes the flag after run_tt.sh's own, so it wins). It
- registers the anchor's llama3 flavors (tt_flavors: 1B, Q0.5B, Q1.5B, Q7B, tiny) as run_tt.sh would;
- registers qwen3 flavors into `qwen3_args` (the dict torchtitan's qwen3 TrainSpec holds by reference):
  `Q30B-A3B-L10`, torchtitan's own Qwen3-30B-A3B with its first 10 of 48 layers (the `moe` suite's shape), and
  `Qtiny-moe` (2 layers, 8 experts, top-2, small dims) for the CPU check;
- lets torchtitan's FP8 grouped-GEMM converter (`quantize.grouped_mm.float8`, the MoE experts) find its config
  class: torchtitan 0.2.2 imports `MoETrainingConfig` from torchao's moe_training, which torchao 0.17.0 renamed
  `Float8TrainingOpConfig` (its default is the same FP8 rowwise recipe);
- with TT_CPU_CHECK=1 only (run_tt.sh's CPU smoke test): the MoE token permutation on torchtitan's CPU code
  instead of its Triton kernel, and the router's token counts (torch.histc of int64) in float: both GPU-only.

The vocabulary of every flavor is the model's own (151936 for Qwen3); the tokenizer in .tt is a 32k BPE, so the
token ids are < 32000 but the embedding and LM head are full size (the same FLOPs as the real model).
"""
from __future__ import annotations

import copy
import dataclasses
import os

from torchtitan.models.qwen3 import qwen3_args

try:  # the anchor's llama3 flavors, as run_tt.sh's own --experimental.custom_import would have loaded them
    import tt_flavors  # noqa: F401
except ImportError:
    pass


def _qwen3(base: str, **changes):
    """A copy of torchtitan's qwen3 flavor `base` with `changes`; moe_args copied too (torchtitan writes into it)."""
    args = copy.deepcopy(qwen3_args[base])
    moe = changes.pop("moe", None)
    if moe:
        args.moe_args = dataclasses.replace(args.moe_args, **moe)
    return dataclasses.replace(args, **changes)


QWEN3_FLAVORS = {
    # Qwen3-30B-A3B (dim 2048, 32/4 heads of 128, 128 experts of 768, top-8, softmax router with normalised top-k,
    # untied, vocab 151936) cut to its first 10 layers: the `moe` suite's shape for qtrain and transformers
    "Q30B-A3B-L10": _qwen3("30B-A3B", n_layers=10),
    # CPU check only: the same MoE block at toy size (a 32k vocab: the bundled tokenizer's)
    "Qtiny-moe": _qwen3("30B-A3B", dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=256,
                        vocab_size=32000, max_seq_len=4096, moe_inter_dim=64, moe={"num_experts": 8, "top_k": 2}),
}
for _name, _args in QWEN3_FLAVORS.items():
    qwen3_args.setdefault(_name, _args)


def _torchao_moe_config_alias() -> None:
    try:
        from torchao.prototype.moe_training import conversion_utils
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    except ImportError:
        return
    if not hasattr(conversion_utils, "MoETrainingConfig"):
        conversion_utils.MoETrainingConfig = Float8TrainingOpConfig


def _cpu_moe() -> None:
    """What the MoE layer needs on a CPU: generate_permute_indices fills its index vector with a Triton kernel (its
    `use_cpu` path is the same computation on the host), and the router counts tokens per expert with torch.histc
    of the int64 expert ids, which torch implements for CUDA only (on the CPU: the same counts, from float ids, back
    in int64 as CUDA returns them)."""
    import functools

    import torch
    from torchtitan.models.moe import utils as moe_utils

    moe_utils.generate_permute_indices = functools.partial(moe_utils.generate_permute_indices, use_cpu=True)
    histc = torch.histc

    def histc_any_dtype(input, *args, **kwargs):
        if input.device.type == "cpu" and not input.is_floating_point():
            return histc(input.float(), *args, **kwargs).to(input.dtype)
        return histc(input, *args, **kwargs)
    torch.histc = histc_any_dtype


_torchao_moe_config_alias()
if os.environ.get("TT_CPU_CHECK") == "1":
    _cpu_moe()
