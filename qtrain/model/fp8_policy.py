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

The GEMM size is not the whole story. FP8 also adds host work: every FP8 linear launches quantization and abs-max
kernels beside its GEMMs, and at small micro-batches the host, not the GPU, sets the step's pace (one H200, issue
21: Qwen2.5-1.5B at 4 x 1024 tokens spends 684 of 716 ms per step queueing work). There FP8 saves GPU time nobody
waits for and adds host time everybody waits for: e4m3 with all four linears in FP8 ran 0.67x bf16 at 1.5B b4 and
0.79x at 0.5B b8, although the same linears ran 1.09x (0.5B) and 1.23x (1.5B) at b32. What separates the layouts
that gain from those that lose is the GPU work one block does per micro-step, the *block GFLOP* `6 * M * sum(N * K)`
over the four linears (forward and the two backward GEMMs): the host's cost per block is about constant (its
launches), the GPU's grows with it. Measured on one H200 (all-FP8 e4m3 / bf16 tokens/s in the same call): 0.5B b4
366 GFLOP (0.59x), 0.5B b8 733 (0.79x), 1.5B b4 1150 (0.67x), 0.5B b16 1466 (0.90x), 1.5B b8 2300 (0.98x and 1.00x:
no gain), 0.5B b32 2931 (1.09x), 1.5B b16 4600 (1.22x), 1.5B b32 9200 (1.23x); 7B at b4 already does 5727 per block.
The threshold sits between the last layout that did not gain and the first that did.

`--fp8-policy auto` (the default) therefore puts a linear in FP8 when both hold:
  - the block's GFLOP per micro-step reach `--fp8-min-block-gflop` (default `DEFAULT_MIN_BLOCK_GFLOP`): the GPU,
    not the host, is the bottleneck, so a faster GEMM shortens the step; otherwise no linear is in FP8 and the
    run is the model-dtype run itself;
  - its GEMM size reaches `--fp8-min-size` (default `DEFAULT_MIN_SIZE`): its GEMM saves more than its
    quantization passes cost. At 0.5B b32 all four linears (sizes 442-800) gained together, so the default
    keeps only matrices smaller than any measured model's (tiny models) out of FP8.
`--fp8-policy all` puts all four block linears in FP8 whatever the layout (every --matmul-dtype e4m3 run before
this option did) and says at start which ones `auto` would keep in bf16. Both constants were measured on one
H200 with its host (a faster host moves the block threshold down): re-tune them from the `precision-1gpu`
suite's whole-step rows. The trainer logs the choice at start (`Fp8Choice.describe`).
"""
from __future__ import annotations

from dataclasses import dataclass

from qtrain.model.choices import FP8_MIN_BLOCK_GFLOP as DEFAULT_MIN_BLOCK_GFLOP
from qtrain.model.choices import FP8_MIN_SIZE as DEFAULT_MIN_SIZE
from qtrain.model.choices import FP8_POLICIES  # noqa: F401 (the policies' names, listed by the options)
from qtrain.model.config import ModelConfig
from qtrain.model.registry import family_of
from qtrain.model.weights import statements, sum_over_layers



def gemm_shapes(cfg: ModelConfig, tokens: int) -> dict[str, tuple[int, int, int]]:
    """(M, N, K) of the forward GEMM of each block linear that may run in FP8 (the family's `fp8_matrices`; of the
    first layer that has it) for `tokens` = micro-batch x seq: y (M, N) = x (M, K) W^T."""
    family, shapes = family_of(cfg), {}
    for layer in (layers[0] for layers in statements(cfg).kinds):
        for name, mm in family.matmuls(cfg, layer).items():
            if name in family.fp8_matrices and name not in shapes:
                shapes[name] = mm.shape(tokens)
        if len(shapes) == len(family.fp8_matrices):
            break
    return {n: shapes[n] for n in family.fp8_matrices if n in shapes}


def gemm_size(m: int, n: int, k: int) -> float:
    """M*N*K / (M*K + M*N + N*K): GEMM work per element the quantization passes move (module docstring)."""
    return m * n * k / (m * k + m * n + n * k)


def block_gflop(cfg: ModelConfig, tokens: int) -> float:
    """GFLOP of a block's FP8-capable linears per micro-step of `tokens` tokens (the mean over the layers): forward,
    input and weight gradients (6 * M * N * K each GEMM; attention's own matmuls are left out, the same in bf16 and
    FP8)."""
    family = family_of(cfg)
    total = sum_over_layers(cfg, lambda layer: sum(m.weights_per_token for n, m in family.matmuls(cfg, layer).items()
                                                   if n in family.fp8_matrices))
    return 6 * tokens * total / cfg.num_hidden_layers / 1e9


@dataclass(frozen=True)
class Fp8Choice:
    """The block linears in FP8 (`fp8`) and in the model dtype (`plain`) for one micro-batch shape."""
    fp8: tuple[str, ...]
    plain: tuple[str, ...]
    sizes: dict[str, float]  # gemm_size of each linear
    tokens: int
    policy: str
    min_size: int
    gflop: float = 0.0  # block_gflop of this micro-batch
    min_gflop: float = 0.0
    never: tuple[str, ...] = ()  # block matrices the family runs in the model dtype whatever the policy (an MoE
    # model's router and expert stacks: the families' `fp8_matrices` leave them out)

    @property
    def keeps_bf16(self) -> bool:
        """Some block linear runs (auto) or would run (all) in the model dtype: the start of the run warns."""
        return bool(self.plain) or self.gflop < self.min_gflop or any(v < self.min_size for v in self.sizes.values())

    def describe(self) -> str:
        """One line for the run's start: what runs in FP8 and why the others do not."""
        return self._describe() + (f"; {'/'.join(self.never)} always in the model dtype (not FP8-capable in this "
                                   f"family yet)" if self.never else "")

    def _describe(self) -> str:
        head = f"fp8 policy {self.policy}: e4m3 for {'/'.join(self.fp8) or 'none of the block linears'}"
        if self.policy == "all":
            if self.gflop < self.min_gflop:
                return head + (f" (--fp8-policy auto would run none in FP8: a block's linears do {self.gflop:.0f} "
                               f"GFLOP per micro-step, below --fp8-min-block-gflop {self.min_gflop:g})")
            low = [n for n in self.sizes if self.sizes[n] < self.min_size]
            return head + (f" (--fp8-policy auto would keep {'/'.join(low)} in bf16: GEMM size "
                           f"{', '.join(f'{self.sizes[n]:.0f}' for n in low)} < --fp8-min-size {self.min_size} "
                           f"at {self.tokens} tokens per micro-batch)" if low else "")
        if not self.plain:
            return head
        if self.gflop < self.min_gflop:
            return (head + f": a block's linears do {self.gflop:.0f} GFLOP per micro-step of {self.tokens} tokens, "
                    f"below --fp8-min-block-gflop {self.min_gflop:g}: the host, not the GPU, sets the pace there, "
                    f"so FP8's extra kernels would slow the step; the run is the model-dtype run")
        return (head + f"; bf16 for {'/'.join(self.plain)} because their GEMM size (MNK/(MK+MN+NK): "
                f"{', '.join(f'{self.sizes[n]:.0f}' for n in self.plain)}) is below --fp8-min-size "
                f"{self.min_size} at {self.tokens} tokens per micro-batch: quantizing would cost more than the "
                f"FP8 GEMM saves")


def choose_fp8(cfg: ModelConfig, tokens: int, policy: str = "auto", min_size: int = DEFAULT_MIN_SIZE,
               min_block_gflop: float = DEFAULT_MIN_BLOCK_GFLOP) -> Fp8Choice:
    """Which block linears run in FP8 under `policy` ('all' or 'auto', module docstring) for micro-batches of
    `tokens` tokens."""
    if policy not in FP8_POLICIES:
        raise ValueError(f"fp8 policy must be one of {', '.join(FP8_POLICIES)}, got {policy!r}")
    sizes = {n: gemm_size(*s) for n, s in gemm_shapes(cfg, tokens).items()}
    gflop = block_gflop(cfg, tokens)
    fp8 = tuple(n for n in sizes if policy == "all" or (gflop >= min_block_gflop and sizes[n] >= min_size))
    family = family_of(cfg)
    never = tuple(dict.fromkeys(n for layer in (layers[0] for layers in statements(cfg).kinds)
                                for n in family.matmuls(cfg, layer) if n not in family.fp8_matrices))
    return Fp8Choice(fp8=fp8, plain=tuple(n for n in sizes if n not in fp8), sizes=sizes, tokens=tokens,
                     policy=policy, min_size=min_size, gflop=gflop, min_gflop=min_block_gflop, never=never)
