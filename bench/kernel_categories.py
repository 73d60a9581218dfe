"""Kernel categories for step profiles: one table for qtrain's (torch profiler or ncu) and llm.q's kernels (ncu),
so that the two systems' steps are summed the same way."""
from collections.abc import Callable

CATEGORIES = [  # first match wins; names as CUDA kernels appear in the profiler
    # attention first: cuDNN's kernels are named "..._sdpa_sm90_flash_bprop_wgmma_f16_..." (before 2026-12-02
    # they matched "wgmma" and were counted as GEMMs)
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    # before the GEMMs: the one-pass SwiGLU FP8 kernels' names contain "fp8" (before 2026-12-03 they were counted
    # as FP8 GEMMs); cuBLAS's FP8 GEMMs are "nvjet_sm90_qqtst_..." (bf16: "nvjet_sm90_tst_...")
    ("swiglu", ("swiglu", "silu")),
    ("quantize", ("_quantize_kernel", "_abs_max_kernel")),
    ("rope", ("rope",)),
    # MoE (issue 44's "where the step goes"): qtrain's token permutation kernels, the router's top-k and sort,
    # torch._grouped_mm's CUTLASS kernels (GroupProblemShape in their template names); before "gemm" and "cutlass"
    ("moe-permute", ("_permute_kernel", "_unpermute_kernel")),
    ("moe-routing", ("topk", "radixsort", "histogram", "bincount")),
    ("gemm-grouped", ("groupproblemshape", "grouped_mm", "grouped_gemm")),
    ("gemm-fp8", ("qqtst", "f8f8", "e4m3")),
    # Qwen3.5's linear attention, its Triton kernels (qtrain/kernels/delta_rule/; before 2026-12-06 "other"): the
    # gated delta rule's chunked forward and backward, and the causal conv before it; full names, theirs are generic
    ("delta-rule", ("_states_fwd_kernel", "_states_bwd_kernel", "_output_kernel", "_wu_kernel", "_kkt_kernel",
                    "_invert_kernel", "_bwd_dk_kernel", "_bwd_dw_kernel", "_bwd_dq_kernel", "_bwd_reads_kernel")),
    ("conv", ("_conv_fwd_kernel", "_conv_dpre_kernel", "_conv_bwd_kernel")),
    # the delta rule's plain-torch twin (Qwen3.5's linear attention until its Triton kernels exist): two batched
    # unit-triangular solves per chunk, cuBLAS's trsm kernels; before the GEMMs, whose keys "cublas" would take them
    ("triangular-solve", ("trsm", "trsv")),
    ("gemm", ("gemm", "nvjet", "sm90_xmma", "cutlass", "cublas", "wgmma")),
    ("cross-entropy", ("cross_entropy", "_ce_", "classifier")),  # llm.q: fused_classifier_kernel5
    ("adamw/sr", ("adamw", "_sr_", "stochastic", "sr_add", "sr_copy")),
    ("bias-grad", ("backward_bias",)),  # llm.q's matmul_backward_bias_kernel (qtrain's is inductor's)
    ("embedding", ("encoder_forward", "wte_backward", "embedding")),
    ("norm/reduce", ("reduce", "norm")),
    ("inductor-fused", ("triton_",)),
    ("copy/memset", ("memcpy", "memset", "copy", "cat")),
    ("elementwise", ("elementwise", "vectorized")),
]


def category(name: str) -> str:
    n = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in n for k in keys):
            return cat
    return "other"


def step_report(per_kernel: dict[str, tuple[float, int]], top: int, header: Callable[[float], str]) -> dict:
    """Print and return a step's GPU time by category and its `top` kernels, from each kernel name's (total ms,
    launches). `header(busy)` is printed first, busy being the step's total kernel time (ms)."""
    sums: dict[str, float] = {}
    for name, (ms, _) in per_kernel.items():
        sums[category(name)] = sums.get(category(name), 0.0) + ms
    busy = sum(sums.values())
    ranked = sorted(sums.items(), key=lambda kv: -kv[1])
    print(header(busy))
    for cat, ms in ranked:
        print(f"  {cat:16s} {ms:8.1f} ms  {100 * ms / max(busy, 1e-9):5.1f}%")
    tops = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:top]
    for name, (ms, count) in tops:
        print(f"  {ms:8.2f} ms {count:5d}x  {category(name):14s} {name[:170]}")
    return {"busy_ms": round(busy, 1), "categories": {k: round(v, 2) for k, v in ranked},
            "top": [dict(ms=round(ms, 3), count=count, category=category(n), kernel=n[:170])
                    for n, (ms, count) in tops],
            "summary": " ".join(f"{k} {v:.0f}" for k, v in ranked[:4]) + " ms"}
