"""Kernel categories for step profiles: one table for qtrain's (torch profiler or ncu) and llm.q's kernels (ncu),
so that the two systems' steps are summed the same way."""

CATEGORIES = [  # first match wins; names as CUDA kernels appear in the profiler
    # attention first: cuDNN's kernels are named "..._sdpa_sm90_flash_bprop_wgmma_f16_..." (before 2026-12-02
    # they matched "wgmma" and were counted as GEMMs)
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    # before the GEMMs: the one-pass SwiGLU FP8 kernels' names contain "fp8" (before 2026-12-03 they were counted
    # as FP8 GEMMs); cuBLAS's FP8 GEMMs are "nvjet_sm90_qqtst_..." (bf16: "nvjet_sm90_tst_...")
    ("swiglu", ("swiglu", "silu")),
    ("quantize", ("_quantize_kernel", "_abs_max_kernel")),
    ("rope", ("rope",)),
    ("gemm-fp8", ("qqtst", "f8f8", "e4m3")),
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
