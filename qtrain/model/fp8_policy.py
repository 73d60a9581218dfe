"""Which block linears run in FP8 (`--matmul-dtype e4m3 --fp8-policy auto|all`): FP8 where it can pay, bf16
where it cannot.

An FP8 linear saves GEMM time (the H200's e4m3 tensor cores run at twice the bf16 rate) and pays for it with
quantization passes: the input (M x K), the output gradient (M x N) and the weight (N x K) are read in bf16 and
written in e4m3, and a transposed copy made for the weight gradient. Those passes are memory-bound, so per
linear

    GEMM time saved     ~ M * N * K            (forward, input gradient and weight gradient alike)
    quantization cost   ~ M * K + M * N + N * K

and FP8 pays when their ratio, the GEMM's *size* `M*N*K / (M*K + M*N + N*K)` (a harmonic mean of the three
dimensions over three; the arithmetic intensity of the GEMM in elements), is large enough. M is the tokens of
a micro-batch (batch x seq), N and K the linear's output and input features. Once M is much larger than N and
K the size depends on N and K only: small models' matrices (hidden 896 at Qwen2.5-0.5B) stay below the
threshold however long the micro-batch, and a tiny micro-batch pulls every size down.

`--fp8-policy all` (the default: every --matmul-dtype e4m3 run before this option) puts all four block linears
in FP8; `auto` only those whose size reaches `--fp8-min-size` (default `DEFAULT_MIN_SIZE`), the others in the
model dtype. The default threshold is set from the measurements of issue 21 (BENCHMARKS.md, `precision` suite):
at M = 16384, e4m3 was 27% slower than bf16 at Qwen2.5-0.5B (sizes 436-781) and 22% faster at 1.5B
(735-1303). It is a cost model with one constant: re-tune it from the suite's per-linear GEMM rows
(`fp8-gemm` cases) and its whole-step rows. The trainer logs the choice at start (`Fp8Choice.describe`).
"""
from __future__ import annotations

from dataclasses import dataclass

from qtrain.model.config import ModelConfig

FP8_POLICIES = ("all", "auto")
DEFAULT_MIN_SIZE = 800
LINEARS = ("qkv", "o", "up", "down")  # = transformer.FP8_MATRICES (kept here so this module imports no model code)


def gemm_shapes(cfg: ModelConfig, tokens: int) -> dict[str, tuple[int, int, int]]:
    """(M, N, K) of each block linear's forward GEMM for `tokens` = micro-batch x seq: y (M, N) = x (M, K) W^T."""
    C, F = cfg.hidden_size, cfg.intermediate_size
    return {"qkv": (tokens, cfg.qkv_dim, C), "o": (tokens, C, cfg.q_dim), "up": (tokens, 2 * F, C),
            "down": (tokens, C, F)}


def gemm_size(m: int, n: int, k: int) -> float:
    """M*N*K / (M*K + M*N + N*K): GEMM work per element the quantization passes move (module docstring)."""
    return m * n * k / (m * k + m * n + n * k)


@dataclass(frozen=True)
class Fp8Choice:
    """The block linears in FP8 (`fp8`) and in the model dtype (`plain`) for one micro-batch shape."""
    fp8: tuple[str, ...]
    plain: tuple[str, ...]
    sizes: dict[str, float]  # gemm_size of each linear
    tokens: int
    policy: str
    min_size: int

    def describe(self) -> str:
        """One line for the run's start: what runs in FP8 and why the others do not."""
        head = f"fp8 policy {self.policy}: e4m3 for {'/'.join(self.fp8) or 'none of the block linears'}"
        if self.policy == "all":
            low = [n for n in LINEARS if self.sizes[n] < self.min_size]
            return head + (f" (--fp8-policy auto would keep {'/'.join(low)} in bf16: GEMM size "
                           f"{', '.join(f'{self.sizes[n]:.0f}' for n in low)} < --fp8-min-size {self.min_size} "
                           f"at {self.tokens} tokens per micro-batch)" if low else "")
        if not self.plain:
            return head
        return (head + f"; bf16 for {'/'.join(self.plain)} because their GEMM size (MNK/(MK+MN+NK): "
                f"{', '.join(f'{self.sizes[n]:.0f}' for n in self.plain)}) is below --fp8-min-size "
                f"{self.min_size} at {self.tokens} tokens per micro-batch: quantizing would cost more than the "
                f"FP8 GEMM saves")


def choose_fp8(cfg: ModelConfig, tokens: int, policy: str = "all", min_size: int = DEFAULT_MIN_SIZE) -> Fp8Choice:
    """Which block linears run in FP8 under `policy` ('all' or 'auto', module docstring) for micro-batches of
    `tokens` tokens."""
    if policy not in FP8_POLICIES:
        raise ValueError(f"fp8 policy must be one of {', '.join(FP8_POLICIES)}, got {policy!r}")
    sizes = {n: gemm_size(*s) for n, s in gemm_shapes(cfg, tokens).items()}
    fp8 = tuple(n for n in LINEARS if policy == "all" or sizes[n] >= min_size)
    return Fp8Choice(fp8=fp8, plain=tuple(n for n in LINEARS if n not in fp8), sizes=sizes, tokens=tokens,
                     policy=policy, min_size=min_size)
