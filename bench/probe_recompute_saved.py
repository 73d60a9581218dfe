"""Kind `recompute-saved`: what a torch.compile'd block saves for backward on the GPU (inductor, the trainer's block function:
fused SwiGLU backward, the cuDNN attention op), per token, for the recompute switches that act inside a
block, against the memory plan's per-layer terms. `recompute.CheckpointSteps` tags the checkpointed steps
MUST_RECOMPUTE (a selective-checkpoint policy); `sac=False` rows swap in a plain non-reentrant checkpoint
(what it did before, when inductor's partitioner on CUDA kept the SwiGLU output).

Parameters: model (preset, 14B; one layer of its widths), B (2), T (512), matmul_dtype ("bf16"; "e4m3": the
block's FP8 linears and fused FP8 MLP, each linear quantizing its weight in the call, so the per-layer e4m3
weight copies count too). Result: `rows`, saved and planned bytes per token per (sac, flags) (the plan's
per-layer bytes spread over the B x T tokens).
"""
from __future__ import annotations

import dataclasses

import torch
from torch.utils.checkpoint import checkpoint

from bench.kinds import Skip
from qtrain.model import recompute as rc
from bench.compat import preset
from qtrain.model.layers import rope_tables
from qtrain.model.matmul import block_linear, block_mlp
from qtrain.model.recompute import block_steps, resolve_flags
from qtrain.model.transformer import make_block_fn
from qtrain.model.weights import block_shapes
from qtrain.model.activations import layer_activation_bytes


def plain_call(self, step, fn, *args):
    if step not in self.steps or not torch.is_grad_enabled():
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False)


def saved_per_token(cfg, flags, B=2, T=512, matmul_dtype="bf16") -> float:
    torch._dynamo.reset()
    fn = make_block_fn(cfg, block_linear(matmul_dtype), recompute=block_steps(flags), compiled=True,
                       fused_swiglu=True, sdpa_backend="cudnn", mlp=block_mlp(matmul_dtype))
    fn = torch.compile(fn, dynamic=False)
    g = torch.Generator(device="cuda").manual_seed(0)
    w = {n: (0.02 * torch.randn(s, generator=g, device="cuda")).bfloat16().requires_grad_()
         for n, s in block_shapes(cfg).items()}
    cos, sin = rope_tables(cfg, T, "cuda", torch.bfloat16)
    x = torch.randn(B, T, cfg.hidden_size, generator=g, device="cuda").bfloat16().requires_grad_()
    fn(x, w, cos, sin).sum().backward()
    skip = {t.untyped_storage().data_ptr() for t in (x, cos, sin, *w.values())}
    seen: dict[int, int] = {}

    def pack(t):
        p = t.untyped_storage().data_ptr()
        if p not in skip and t.dtype != torch.uint8 and t.is_cuda:
            seen[p] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(x, w, cos, sin)
    del y
    return sum(seen.values()) / (B * T)


def run(model: str = "Qwen2.5-14B", B: int = 2, T: int = 512, matmul_dtype: str = "bf16") -> dict:
    cfg = dataclasses.replace(preset(model), num_hidden_layers=1)
    sac_call = rc.CheckpointSteps.__call__
    rows = []
    for sac in (True, False):
        rc.CheckpointSteps.__call__ = sac_call if sac else plain_call
        for flags in [(), ("swiglu",), ("norm", "swiglu"), ("ffn",), ("att",)] if sac else [("norm", "swiglu")]:
            try:
                got = saved_per_token(cfg, flags, B=B, T=T, matmul_dtype=matmul_dtype)
            except Exception as e:  # noqa: BLE001 - one variant must not hide the others
                print(f"sac={sac} {flags}: {repr(e)[:300]}", flush=True)
                rows.append(dict(sac=sac, flags=list(flags), error=repr(e)[:300]))
                continue
            plan = layer_activation_bytes(cfg, B * T, model_dtype="bf16", matmul_dtype=matmul_dtype, compiled=True,
                                          recompute=resolve_flags(flags)) / (B * T)
            print(f"sac={sac} flags={flags}: saved {got:.0f} B/token, plan {plan:.0f} ({got / plan - 1:+.1%})", flush=True)
            rows.append(dict(sac=sac, flags=list(flags), saved=round(got), plan=round(plan), err=round(got / plan - 1, 4)))
    rc.CheckpointSteps.__call__ = sac_call
    return {"rows": rows, "summary": " ".join(f"{'+'.join(r['flags']) or 'none'}{'' if r['sac'] else '(plain)'} "
                                              + (f"{r['err']:+.1%}" if "err" in r else "failed") for r in rows)}


def dry_run(params: dict) -> dict:
    raise Skip("measures what inductor's CUDA partitioner saves: needs a CUDA GPU")
