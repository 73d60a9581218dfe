"""A rough model of what recomputation and host offload cost per optimizer step: what `qtrain plan` uses to
choose among configurations that fit.

Why: the plan fits a batch by switching on recomputation or offload, and the two are paid in different currencies.
Recomputation adds FLOPs to every micro-step (at Qwen2.5-14B, --recompute-ffn reruns the MLP-up GEMM: +17% of the
step's matmul FLOPs; --recompute-block a whole block forward: about a third); offloading the Adam moments or the
master weights adds PCIe traffic once per optimizer step (14B m and v: 29.5 GB each, both ways: about 1.2 s). Which
is cheaper depends on the tokens per optimizer step. Measured on one H200: 14B at 256 sequences per step, B=8 with
offloaded moments 6.80k tokens/s; B=4 with SwiGLU and norm recomputed 6.71k (64 per step); B=32 with the block
recomputed 5.45k; B=2 with nothing 6.20k (32 per step).

The model: time per step = micro-steps x (matmul and attention FLOPs / MATMUL_RATE + gradient accumulation,
3 passes over the device gradients at HBM_RATE, 2 on the first micro-step) + the per-update transfers
(offloaded state, both directions at once, PCIE_RATE) + the offloaded weight shards that block gathers copy in
on the compute stream (forward and backward: twice per micro-step, PCIE_ONE_WAY; the FP8 shards instead with
--persistent-quants) + the other per-micro-step transfers (offloaded gradients, residuals) where they exceed
the compute they overlap + with FP8 linears, the quantization of their weights (abs-max, e4m3 copy and its
transpose: in every micro-step, or once per step with --persistent-quants, FP8_WEIGHT_QUANT_RATE, measured at
7B). The other rates are what a 14B step reaches on an H200 (model FLOPs per second, not peak) and
the pinned copy rate measured there; another GPU has other rates, but the ranking depends mostly on their
ratios. Elementwise work, the update's own kernels and the LM head's memory traffic are the same for every
candidate and left out: `overhead` compares candidates, it does not predict tokens/s.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qtrain.model.config import ModelConfig
from qtrain.model.recompute import MLP_STEPS, block_steps, resolve_flags
from qtrain.model.registry import family_of
from qtrain.model.weights import sum_over_layers
from qtrain.options import Options
from qtrain.plan.resolution import fp8_choice

MATMUL_RATE = {"bf16": 560e12, "fp16": 560e12, "fp32": 50e12, "e4m3": 770e12}  # model FLOP/s of a 14B step, H200
PCIE_RATE = 48e9  # bytes/s each way with both directions busy (pinned, H200)
PCIE_ONE_WAY = 55e9  # bytes/s of one direction alone (pinned, H200)
HBM_RATE = 3.1e12  # bytes/s of the stochastic-rounding gradient accumulation pass (H200)
# FP8 block-matrix parameters per second that a micro-step's weight quantization gets through (abs-max, e4m3
# copy, transposed copy), H200: Qwen2.5-7B e4m3 at 8 x 8 ran 3346.7 ms per step, 3278.6 with --persistent-quants
# 68.1 ms for 7 of 8 quantizations of 6.53e9 parameters, 9.7 ms each.
FP8_WEIGHT_QUANT_RATE = 6.7e11


@dataclass(frozen=True)
class StepCost:
    """Seconds per optimizer step by cause; `tokens` per step."""
    tokens: int
    compute_s: float  # the plain step's matmuls and attention
    recompute_s: float  # the forward work recomputation adds
    accumulate_s: float  # gradient accumulation passes (per micro-step)
    transfer_s: float  # host <-> device traffic not hidden behind compute
    quantize_s: float = 0.0  # FP8 weight quantization: every micro-step, or once per step (--persistent-quants)

    @property
    def total_s(self) -> float:
        return self.compute_s + self.recompute_s + self.accumulate_s + self.transfer_s + self.quantize_s

    @property
    def seconds_per_token(self) -> float:
        return self.total_s / self.tokens

    def overhead(self, reference: "StepCost") -> float:
        """Relative time per token against `reference` (e.g. +0.05: 5% slower)."""
        return self.seconds_per_token / reference.seconds_per_token - 1

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "compute_s": self.compute_s, "recompute_s": self.recompute_s,
                "accumulate_s": self.accumulate_s, "transfer_s": self.transfer_s, "quantize_s": self.quantize_s,
                "total_s": self.total_s}


def forward_flops_per_token(cfg: ModelConfig, seq_len: int, layer: int = 0) -> tuple[dict[str, float], float]:
    """Forward FLOPs per token of block `layer`, by part (its family's matrices, e.g. qkv, o, up, down, and the
    attention: causal attention sees seq_len/2 keys on average), and of the LM head."""
    family = family_of(cfg)
    parts = {n: 2 * m.weights_per_token for n, m in family.matmuls(cfg, layer).items()}
    parts["attention"] = family.attention_flops(cfg, layer, seq_len)
    return parts, 2 * cfg.hidden_size * cfg.vocab_size


def model_forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of the whole model: every block and the LM head."""
    blocks = sum_over_layers(cfg, lambda layer: sum(forward_flops_per_token(cfg, seq_len, layer)[0].values()))
    return blocks + 2 * cfg.hidden_size * cfg.vocab_size


def recompute_flops_per_token(cfg: ModelConfig, seq_len: int, flags: set[str] | frozenset[str],
                              mlp_chunks: int = 1) -> float:
    """Forward FLOPs per token that the recompute switches rerun in backward (elementwise switches: none): the
    GEMMs of the recomputed steps (`MatmulSpec.step`) and, with the attention step, the attention; with --mlp-chunks
    the MLP's GEMMs ('up', 'down') once more, whatever else reruns (a block rerun runs the slices' forward too)."""
    flags = resolve_flags(flags)
    steps, family = block_steps(flags), family_of(cfg)

    def rerun(layer: int) -> float:
        parts, _ = forward_flops_per_token(cfg, seq_len, layer)
        sliced = sum(parts.get(n, 0) for n in ("up", "down")) if mlp_chunks > 1 else 0
        if "block" in flags:
            return sum(parts.values()) + sliced
        rerun_steps = steps if mlp_chunks == 1 else steps - MLP_STEPS  # a slice's rerun covers the MLP's steps
        return (sum(parts[n] for n, m in family.matmuls(cfg, layer).items() if m.step in rerun_steps)
                + (parts["attention"] if "attention" in steps else 0) + sliced)
    return sum_over_layers(cfg, rerun)


def step_cost(cfg: ModelConfig, opts: Options, plan: Any, *, sequences_per_step: int | None = None) -> StepCost:
    """Cost of one optimizer step of `sequences_per_step` sequences (default: batch x grad-accumulation) with
    `opts`, whose memory plan is `plan` (its host-resident rows say what travels over PCIe)."""
    B, T = opts.batch_size, opts.seq_len
    seqs = sequences_per_step or B * opts.grad_accumulation
    micro = max(1, -(-seqs // B))
    tokens = micro * B * T
    rate = MATMUL_RATE.get(opts.effective_matmul_dtype, MATMUL_RATE["bf16"])
    fwd = model_forward_flops_per_token(cfg, T)
    compute = 3 * fwd * tokens / rate
    recompute = recompute_flops_per_token(cfg, T, opts.recompute, opts.mlp_chunks) * tokens / rate
    grads = plan.item("gradients")
    accumulate = (3 * micro - 1) * grads.device / HBM_RATE  # the first micro-step copies (2 passes), others add

    host = {i.name.split(" (")[0]: i.host for i in plan.items if i.host}
    # both ways, overlapped; a LoRA run's host weights are its frozen base (the adapters are a rounding error): the
    # update leaves them alone, the gathers below bring them in every micro-step
    updated = ("adam m", "adam v") if opts.lora_rank else ("adam m", "adam v", "weights")
    per_update = sum(v for k, v in host.items() if k in updated)
    per_update += host.get("gradients", 0)  # read once by the update
    gathered = host.get("fp8 weights", 0) if opts.weights_quantized_once else host.get("weights", 0)
    overlapped = host.get("gradients", 0) + 2 * host.get("activations", 0)
    micro_compute = (compute + recompute) / micro
    transfer = (per_update / PCIE_RATE + micro * 2 * gathered / PCIE_ONE_WAY
                + micro * max(0.0, overlapped / PCIE_RATE - micro_compute))
    quantizations = 1 if opts.weights_quantized_once else micro
    quantize = quantizations * fp8_weight_params(cfg, opts) / FP8_WEIGHT_QUANT_RATE
    return StepCost(tokens, compute, recompute, accumulate, transfer, quantize)


def fp8_weight_params(cfg: ModelConfig, opts: Options) -> int:
    """Parameters of the block matrices that run in FP8 at these options (the linears --fp8-policy picks), all
    layers: what each quantization of the weights reads. (With sharded weights and --persistent-quants a rank
    quantizes only its shard once per step but transposes the gathered copies in every backward; the model
    counts them as replicated ones, and `propose` adds the option only to replicated weights.) None for an e4m3 LoRA
    base: its codes are made once, at load."""
    fp8 = fp8_choice(cfg, opts)
    if fp8 is None or (opts.lora_rank and opts.lora_base_dtype):
        return 0
    family = family_of(cfg)
    return sum_over_layers(cfg, lambda layer: sum(m.n * m.k * m.count for name, m in family.matmuls(cfg, layer).items()
                                                  if name in fp8.fp8))
