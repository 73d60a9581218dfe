"""Kind `delta-rule`: times the gated delta rule at a Qwen3.5 preset's linear-attention heads on the GPU, forward and
forward + backward, bf16 inputs: qtrain's chunked form through its Triton op pair (what the model runs on CUDA),
eager and torch.compile'd, against the chunked twin (its Python loop over chunks) and, when it imports,
fla-core's `chunk_gated_delta_rule`; each checked against the twin in fp32 on the same values (relative error of the
output and of dq, in norm).

Parameters: model (a Qwen3.5 preset: its key/value head counts and dims; Qwen3.5-4B), B, T (1 x 4096), documents
(mark a document start every ~700 tokens: the resets path), launches (a list of {bv, num_warps, prec}: the
Triton launchers' tunings to time besides the model's, `gated_delta_rule_triton.Launch`, on the prepared chunks:
`chunk_core_triton` forward, `chunk_core_backward_triton`, their errors against the fp32 twins). Prints one line
per variant; the result has them as `rows`.
"""
from __future__ import annotations

import torch

from bench.kinds import Skip


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _launches(launches: list[dict], q, k, v, g, beta, resets) -> list[dict]:
    """Each tuning of the Triton launchers on the prepared chunks (module docstring), against the fp32 twins."""
    import triton

    from qtrain.kernels.delta_rule.gated_delta_rule import chunk_core, chunked_form
    from qtrain.kernels.delta_rule.gated_delta_rule_backward import chunk_core_backward
    from qtrain.kernels.delta_rule.gated_delta_rule_triton import TUNED, Launch, chunk_core_triton
    from qtrain.kernels.delta_rule.gated_delta_rule_triton_backward import chunk_core_backward_triton
    chunks = {}

    def keep(*a):  # the chunked form's core: records the chunks the model would hand the op
        chunks["args"] = a
        return chunk_core(*a)

    chunked_form(*(t.detach() for t in (q, k, v, g, beta)), keep, resets=resets)
    qc, kc, vc, gch, bc, d, S0 = chunks["args"]
    doc = torch.randn(vc.shape, device=vc.device, generator=torch.Generator(device=vc.device).manual_seed(1))
    dSf = torch.zeros(*vc.shape[:2], kc.shape[-1], vc.shape[-1], device=vc.device)
    o_ref = chunk_core(qc, kc, vc, gch, bc, d, S0)[0]
    dq_ref = chunk_core_backward(qc, kc, vc, gch, bc, d, S0, doc, dSf)[0]
    rows = []
    for spec in [{}, *launches]:
        tune = Launch(**spec) if spec else TUNED
        name = f"launch bv {tune.bv} warps {tune.num_warps} {tune.prec}" + ("" if spec else " (TUNED)")
        try:
            o = chunk_core_triton(qc, kc, vc, gch, bc, d, S0, tune)[0]
            dq = chunk_core_backward_triton(qc, kc, vc, gch, bc, d, S0, doc, dSf, tune)[0]
            fwd = triton.testing.do_bench(lambda: chunk_core_triton(qc, kc, vc, gch, bc, d, S0, tune), warmup=5, rep=50)
            bwd = triton.testing.do_bench(lambda: chunk_core_backward_triton(qc, kc, vc, gch, bc, d, S0, doc, dSf, tune),
                                          warmup=5, rep=50)
        except Exception as e:  # a tuning past the shared memory or the registers: reported, the sweep goes on
            print(f"{name:44s} failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
            rows.append(dict(variant=name, error=f"{type(e).__name__}: {str(e)[:160]}"))
            continue
        row = dict(variant=name, fwd_ms=round(fwd, 3), bwd_ms=round(bwd, 3), o_err=_rel(o, o_ref),
                   dq_err=_rel(dq, dq_ref))
        print(f"{name:44s} core fwd {fwd:8.3f} ms  core bwd {bwd:8.3f} ms  o err {row['o_err']:.1e}  "
              f"dq err {row['dq_err']:.1e}", flush=True)
        rows.append(row)
    return rows


def run(model: str = "Qwen3.5-4B", B: int = 1, T: int = 4096, documents: bool = False,
        launches: list[dict] = ()) -> dict:
    import triton

    from bench.compat import preset
    from qtrain.kernels import dispatch
    from qtrain.kernels.delta_rule import gated_delta_rule
    cfg = preset(model)
    Hk, H = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    q, k, v = randn(B, T, Hk, dk), randn(B, T, Hk, dk), randn(B, T, H, dv)
    g = -torch.nn.functional.softplus(randn(B, T, H))  # the model's gate: -exp(A) softplus(a + dt_bias) <= 0
    beta = torch.sigmoid(randn(B, T, H))
    args = [t.bfloat16().requires_grad_(True) for t in (q, k, v, g, beta)]
    resets = None
    if documents:
        resets = torch.zeros(B, T, dtype=torch.bool, device="cuda")
        resets[:, ::700] = True
    do = randn(B, T, H, dv).bfloat16()
    with dispatch.backend("twin"):
        ref = [a.detach().float().requires_grad_(True) for a in args]
        o_ref = gated_delta_rule(*ref, resets)
        dq_ref = torch.autograd.grad(o_ref, ref[0], do.float())[0]

    def ours(*a):
        return gated_delta_rule(*a, resets)  # on CUDA: the chunked form through the Triton op pair

    variants = {"qtrain (Triton)": ours, "qtrain, torch.compile": torch.compile(ours)}

    def twin(*a):
        with dispatch.backend("twin"):
            return gated_delta_rule(*a, resets)

    variants["chunked twin (loop over chunks)"] = twin
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        print("fla-core not installed: its kernels are not timed", flush=True)
    else:
        if resets is None:  # (fla's documents are varlen rows: not compared here)
            def fla(q_, k_, v_, g_, b_):
                r = H // Hk  # fla takes q and k at the value heads' count
                return chunk_gated_delta_rule(q_.repeat_interleave(r, 2), k_.repeat_interleave(r, 2), v_, g_.float(),
                                              b_, use_qk_l2norm_in_kernel=True)[0]

            variants["fla-core chunk_gated_delta_rule"] = fla
    rows = []
    for name, fn in variants.items():
        o = fn(*args)
        dq = torch.autograd.grad(o, args[0], do)[0]
        fwd = triton.testing.do_bench(lambda: fn(*args), warmup=5, rep=50)
        both = triton.testing.do_bench(lambda: torch.autograd.grad(fn(*args), args, do), warmup=5, rep=50)
        row = dict(variant=name, fwd_ms=round(fwd, 3), fwd_bwd_ms=round(both, 3), o_err=_rel(o, o_ref),
                   dq_err=_rel(dq, dq_ref))
        print(f"{name:36s} fwd {fwd:8.3f} ms  fwd+bwd {both:8.3f} ms  o err {row['o_err']:.1e}  "
              f"dq err {row['dq_err']:.1e}", flush=True)
        rows.append(row)
    if launches:
        rows += _launches(list(launches), *args, resets)
    return {"rows": rows, "summary": f"{len(rows)} variants timed at B={B} T={T} H={H} dk={dk} dv={dv}"}


def dry_run(params: dict) -> dict:
    raise Skip("times Triton kernels on the GPU (the CPU has only its interpreter): needs a CUDA GPU")
