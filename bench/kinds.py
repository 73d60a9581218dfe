"""The benchmark kinds a suite's cases can name: which module runs each, and the result columns the harness
table shows for it. Static on purpose: the harness reads it without importing torch or qtrain."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Kind:
    module: str
    """Module with `run(**params) -> dict` (one result per case) and `dry_run(params) -> dict` (the CPU-sized
    parameters for --dry-run, or raises bench.dry.Skip with the reason)."""
    doc: str
    columns: tuple[tuple[str, str], ...] = ()
    """(result key, table header) of the scalars worth a table column; every kind may also return `summary`."""


TRAIN_COLUMNS = (("tps", "tok/s"), ("step_ms", "step ms"), ("host_ms", "host ms"), ("mfu", "MFU"),
                 ("peak_gib", "peak GiB"), ("plan_gib", "plan GiB"), ("plan_err", "plan err"), ("fp8", "fp8 linears"))

KINDS: dict[str, Kind] = {
    "train": Kind("bench.bench_train", "qtrain's training throughput through the Trainer API, random tokens, one "
                  "device", TRAIN_COLUMNS),
    "cli": Kind("bench.cli_train", "`qtrain train` on a random-token file (1..N GPUs): median tokens/s of the "
                "steady steps from its JSON log", TRAIN_COLUMNS),
    "packing": Kind("bench.bench_packing", "packed documents through `qtrain tokenize` + `qtrain train` on a "
                    "synthetic chat set: --document-masking against the same rows without it, or --pack-to against "
                    "--pad-to in non-padding tokens/s",
                    (("ratio", "ratio"), ("tps", "tok/s"), ("base_tps", "base tok/s"), ("real_tps", "real tok/s"),
                     ("base_real_tps", "base real tok/s"), ("padding_pct", "pad %"))),
    "start": Kind("bench.start", "`qtrain train` from its launch to the end of its first step, cold or warm compile "
                  "cache", (("start_s", "start s"), ("first_step_s", "1st step s"), ("step_ms", "step ms"))),
    "llmq": Kind("bench.llmq", "llm.q's own trainer through .llmq/bench_llmq.sh (median tokens/s of steady steps)",
                 (("tps", "tok/s"), ("step_ms", "step ms"), ("sol", "SOL %"), ("peak_gib", "peak GiB"))),
    "torchtitan": Kind("bench.torchtitan", "torchtitan (PyTorch's trainer, from wheels) through .tt/run_tt.sh: llama3 "
                       "and qwen3 flavors (bench/tt), median tokens/s of its steps after the third",
                       (("tps", "tok/s"), ("step_ms", "step ms"), ("mfu", "MFU"), ("peak_gib", "peak GiB"),
                        ("ac", "AC"))),
    "hf": Kind("bench.hf", "HF transformers + torch AdamW (+ torch.compile) through .devshared/bench/hf_baseline.py",
               (("tps", "tok/s"), ("mfu", "MFU"), ("peak_gib", "peak GiB"))),
    "hf-train": Kind("bench.hf_train", "transformers' own model of any qtrain shape (+ peft LoRA) with torch AdamW, at "
                     "each listed setting (attention, compile, gradient checkpointing, experts): the fastest that ran",
                     (("tps", "tok/s"), ("step_ms", "step ms"), ("mfu", "MFU"), ("peak_gib", "peak GiB"),
                      ("best", "best setting"))),
    "pytest": Kind("bench.pytest_run", "a pytest run in the case's checkout (e.g. -m gpu tests/)",
                   (("passed", "passed"), ("failed", "failed"), ("skipped", "skipped"), ("collected", "collected"))),
    "gemm-ceiling": Kind("bench.gemm_ceiling", "tokens/s if a step were only its bf16 block + LM-head GEMMs",
                         (("tokens", "tokens"), ("gemm_ms", "GEMM ms"), ("tflops", "TFLOP/s"),
                          ("ceiling_tps", "ceiling tok/s"))),
    "attention": Kind("bench.bench_attention", "causal attention backends (flash, cuDNN, qtrain's op), eager and "
                      "compiled, against flash"),
    "cross-entropy": Kind("bench.bench_ce", "the fused cross-entropy kernel by launch shape (block, warps), "
                          "GB/s against the read+write floor"),
    "adamw": Kind("bench.bench_adamw", "qtrain's fused AdamW kernel against torch._fused_adamw_",
                  (("bf16_ms", "bf16 ms"), ("e4m3_ms", "e4m3-m ms"), ("bf16mix_ms", "bf16+fp32 m,v ms"),
                   ("fp32_ms", "fp32 ms"))),
    "fp8-gemm": Kind("bench.bench_fp8_gemm", "bf16 matmul vs FP8 scaled_mm for the block linears, per GEMM and per "
                     "layer (eager and CUDA graph)"),
    "fp8-experts": Kind("bench.bench_fp8_experts", "the MoE expert GEMMs at a preset's shape: bf16 grouped_mm against "
                        "e4m3, torch._scaled_grouped_mm against one row-wise _scaled_mm per expert, quantization and "
                        "the layer's forward + backward"),
    "offload-update": Kind("bench.bench_offload_update", "the offloaded AdamW update alone, by streaming variant, "
                           "against the PCIe ceiling"),
    "swiglu-fp8": Kind("bench.bench_swiglu_fp8", "the FP8-MLP Triton kernels and their tile variants"),
    "rope": Kind("bench.bench_rope", "the RoPE backward kernel (d(qkv) in one pass) against inductor's code and a "
                 "copy of its bytes"),
    "delta-rule": Kind("bench.bench_delta_rule", "the gated delta rule at a Qwen3.5 preset's linear-attention heads: "
                       "qtrain's chunked form through its Triton op pair (eager, compiled) against the chunked twin "
                       "and fla-core, forward and forward + backward"),
    "hopper-gemm": Kind("bench.bench_hopper_gemm", "quack-kernels' GEMMs with fused epilogues (CuTe-DSL, sm90: SwiGLU, "
                        "residual add, dSwiGLU, RMSNorm) against cuBLAS + qtrain's kernels at a Qwen2.5 size's MLP "
                        "shapes (issue 48)",
                        (("mlp_speedup", "MLP qtrain/quack"), ("chain_speedup", "norm chain qtrain/quack"),
                         ("compile_s", "quack 1st calls s"), ("import_s", "quack import s"),
                         ("max_rel_err", "max rel err"))),
    "profile": Kind("bench.profile_step", "GPU time per kernel category of one training step, top kernels, gaps",
                    (("wall_ms", "wall ms"), ("busy_ms", "busy ms"))),
    "llmq-profile": Kind("bench.llmq_profile", "llm.q's kernels of one optimizer step under Nsight Compute, by the "
                         "profile kind's categories", (("busy_ms", "busy ms"), ("kernels", "kernels"))),
    "fidelity": Kind("bench.fidelity", "a precision mode's training quality: Qwen2.5-0.5B from a shared init on real "
                     "text through `qtrain train`, eval losses (issue 21)",
                     (("final_eval", "final eval"), ("max_loss_after_warmup", "max loss after warmup"),
                      ("max_norm", "max norm"), ("tps", "tok/s"))),
}


class Skip(Exception):
    """Raised by a kind's `dry_run` when the kind cannot run on the CPU; the message says why."""
