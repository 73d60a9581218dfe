"""Scale model: tokens/s and efficiency of data-parallel training on many GPUs and nodes (`qtrain plan --gpus G
--nodes K`), flat (every sharded state cut across all N = G x K ranks) or hybrid (cut within each node's G
ranks, replicated across the K nodes; `--shard-group-size`, docs/multi-node.md).

Why: only 1, 2 and 4 GPUs could be measured; what 8 to 512 would give has to be predicted, and the answer is
dominated by which collectives cross the slow inter-node link, which this makes explicit.

The model. A step of one GPU costs its compute (tokens per GPU / the single-GPU rate: measured where
a run exists, else `step_cost`'s FLOP model) plus the part of its communication not hidden behind the
compute: `exposed[mode] x communication`. Communication is the sum over the step's collectives, each a ring
over n ranks: (n-1)/n x bytes / bandwidth + (n-1) x latency per call (an all-reduce is twice that), with one
call per parameter group (qtrain reduces and gathers a block at a time) and the link of the slowest hop:
NVLink inside a node, InfiniBand across (each GPU with its own NIC, as on DGX/HGX nodes). Per mode
(`gradients.py`, `optimizer.py`, `weights/sharded.py`):

  zero1           reduce-scatter of every group on the last micro-step; all-gather of the updated weights
  reduce-scatter  blocks reduce-scattered every micro-step (non-block groups as zero1); weights all-gathered
  all-to-all      as reduce-scatter, the reduction an all-to-all plus the owner's fp32 sum
  zero3           as reduce-scatter, and every block's weights all-gathered twice per micro-step (fwd, bwd);
                  no all-gather after the update

Hybrid: the same collectives over the G ranks of a node, and once per step an all-reduce of the gradient
shard (1/G of the gradients) across the K nodes, one NIC per GPU in parallel.

Calibration (`calibrate`): `exposed[mode]` is fitted (least squares in step time) on the measured 2- and 4-GPU runs
(MEASURED: H200 runs, docs/benchmarks-history.md), one number per mode; `calibration_error` reports each run's
predicted against its measured tokens/s (in sample: mean 1.2%, worst 4.2%; `leave_one_out_error`, each run predicted
by a fit on the others: mean 1.4%, worst 4.3%). A fraction above 1 (all-to-all) means that mode's collectives cost
more than the ring estimate (its fp32 reduction, less overlap). The link parameters are not fitted (2-4 GPUs of one
node cannot tell bandwidth from latency, nor say anything about InfiniBand): they are the hardware's, `NVLINK` and
`IB_400G` below, and parameters of `predict`. Not modelled: stragglers, congestion of a fat-tree beyond one NIC per
GPU, NCCL's tree algorithms (lower latency than rings at large n), compute changes with the micro-batch; the fitted
overlap is assumed to hold across nodes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from qtrain.model.config import ModelConfig
from qtrain.model.resolve import resolve_model
from qtrain.parallel.layout import FlatLayout
from qtrain.plan.step_cost import MATMUL_RATE, model_forward_flops_per_token

MODES = ("zero1", "reduce-scatter", "all-to-all", "zero3")


@dataclass(frozen=True)
class Link:
    """A link class as a ring collective sees it: bytes/s per GPU each way, seconds per ring step."""
    bandwidth: float
    latency: float


NVLINK = Link(360e9, 10e-6)  # H100/H200 NVLink 4: 450 GB/s per direction, ~360 GB/s NCCL bus bandwidth
IB_400G = Link(45e9, 20e-6)  # one 400 Gb/s NIC per GPU (50 GB/s), ~90% of it in NCCL


@dataclass(frozen=True)
class Run:
    """One measured multi-GPU run and its single-GPU twin of the same call (docs/benchmarks-history.md)."""
    model: str
    matmul: str  # bf16 | e4m3
    batch: int
    accum: int
    gpus: int
    mode: str
    tokens_per_s: float
    single_gpu: float  # tokens/s of 1 GPU, same call
    source: str


MEASURED = (  # seq 1024; tokens/s of all GPUs
    Run("Qwen2.5-1.5B", "bf16", 16, 2, 4, "reduce-scatter", 220.6e3, 56.4e3, "9709a14"),
    Run("Qwen2.5-1.5B", "bf16", 16, 2, 4, "zero1", 222.2e3, 56.4e3, "9709a14"),
    Run("Qwen2.5-1.5B", "e4m3", 16, 2, 4, "zero1", 270.0e3, 70.3e3, "269d9a4"),
    Run("Qwen2.5-1.5B", "e4m3", 16, 2, 4, "reduce-scatter", 267.5e3, 70.3e3, "269d9a4"),
    Run("Qwen2.5-1.5B", "e4m3", 16, 2, 2, "reduce-scatter", 130.5e3, 69.3e3, "2eb5400"),
    Run("Qwen2.5-1.5B", "e4m3", 16, 2, 2, "all-to-all", 132.6e3, 69.3e3, "2eb5400"),
    Run("Qwen2.5-1.5B", "e4m3", 16, 2, 2, "zero1", 138.4e3, 69.3e3, "2eb5400"),
    Run("Qwen2.5-1.5B", "e4m3", 16, 2, 2, "zero3", 134.9e3, 69.3e3, "2eb5400"),
    Run("Qwen2.5-1.5B", "e4m3", 16, 2, 4, "all-to-all", 263.7e3, 69.07e3, "088350d"),
    Run("Qwen2.5-1.5B", "e4m3", 16, 2, 4, "zero3", 265.3e3, 69.07e3, "088350d"),
    Run("Qwen2.5-1.5B", "bf16", 16, 2, 4, "all-to-all", 207.0e3, 57.24e3, "088350d"),
    Run("Qwen2.5-1.5B", "bf16", 16, 2, 4, "zero3", 218.3e3, 57.24e3, "088350d"),
    Run("Qwen2.5-7B", "bf16", 8, 4, 2, "zero1", 26.75e3, 13.50e3, "3c75d6b"),
    Run("Qwen2.5-7B", "bf16", 8, 4, 2, "reduce-scatter", 26.32e3, 13.50e3, "3c75d6b"),
    Run("Qwen2.5-7B", "bf16", 8, 4, 2, "all-to-all", 24.92e3, 13.50e3, "3c75d6b"),
    Run("Qwen2.5-7B", "bf16", 8, 4, 2, "zero3", 25.57e3, 13.50e3, "3c75d6b"),
    Run("Qwen2.5-7B", "e4m3", 8, 4, 2, "zero1", 37.00e3, 18.66e3, "3c75d6b"),
)
SEQ = 1024


@dataclass(frozen=True)
class Topology:
    gpus_per_node: int
    nodes: int
    shard_group: int  # ranks a sharded state is cut across: gpus x nodes (flat) or gpus_per_node (hybrid)
    intra: Link = NVLINK
    inter: Link = IB_400G

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def replicas(self) -> int:
        return self.world // self.shard_group

    def link(self, ranks: int) -> Link:
        """The slowest link a ring over `ranks` consecutive ranks crosses."""
        return self.intra if ranks <= self.gpus_per_node else self.inter


def _ring(link: Link, n: int, nbytes: float, calls: int, factor: float = 1.0) -> float:
    """Seconds of `calls` ring collectives moving `nbytes` in total over n ranks (factor 2: all-reduce)."""
    if n <= 1:
        return 0.0
    return factor * ((n - 1) / n * nbytes / link.bandwidth + (n - 1) * link.latency * calls)


def comm_seconds(cfg: ModelConfig, mode: str, topo: Topology, micro_steps: int, dtype_bytes: int = 2) -> float:
    """Communication of one optimizer step per GPU, before overlap (module docstring)."""
    if mode not in MODES:
        raise ValueError(f"unknown sharding mode {mode!r} (one of {', '.join(MODES)})")
    layout = FlatLayout(cfg, 1)
    blocks = [g.padded_numel * dtype_bytes for g in layout.groups if g.layer is not None]
    rest = [g.padded_numel * dtype_bytes for g in layout.groups if g.layer is None]
    nb, nr, B, R = len(blocks), len(rest), sum(blocks), sum(rest)
    n = topo.shard_group
    link = topo.link(n)
    t = 0.0
    if mode == "zero1":
        t += _ring(link, n, B + R, nb + nr)  # reduce-scatter, last micro-step
    else:
        t += micro_steps * _ring(link, n, B, nb) + _ring(link, n, R, nr)
    if mode == "zero3":
        t += 2 * micro_steps * _ring(link, n, B, nb) + _ring(link, n, R, nr)  # gathers fwd + bwd; non-block once
    else:
        t += _ring(link, n, B + R, nb + nr)  # all-gather of the updated weights
    if topo.replicas > 1:  # hybrid: the gradient shards all-reduced across the replicas, once per step
        t += _ring(topo.link(topo.world), topo.replicas, (B + R) / n, nb + nr, factor=2.0)
    return t


def single_gpu_rate(cfg: ModelConfig, matmul: str, seq_len: int = SEQ) -> float:
    """Tokens/s of one GPU: `step_cost`'s FLOP model (its H200 rates), when nothing was measured."""
    return MATMUL_RATE.get(matmul, MATMUL_RATE["bf16"]) / (3 * model_forward_flops_per_token(cfg, seq_len))


@dataclass(frozen=True)
class Prediction:
    world: int
    nodes: int
    shard_group: int
    mode: str
    tokens_per_s: float
    efficiency: float  # against world x the single-GPU rate
    compute_s: float
    comm_s: float  # before overlap
    exposed_s: float


def predict(cfg: ModelConfig, mode: str, topo: Topology, *, batch: int, accum: int, seq_len: int = SEQ,
            single_gpu: float, exposed: dict[str, float]) -> Prediction:
    """Tokens/s of all GPUs and efficiency, `batch` x `accum` sequences of `seq_len` per GPU and step."""
    tokens = batch * accum * seq_len
    compute = tokens / single_gpu
    comm = comm_seconds(cfg, mode, topo, accum)
    hidden = exposed[mode] * comm
    step = compute + hidden
    return Prediction(topo.world, topo.nodes, topo.shard_group, mode, topo.world * tokens / step, compute / step,
                      compute, comm, hidden)


def mode_of(opts: Any) -> str:
    """The scale model's mode of training options: zero3 with sharded weights, else the gradient manager."""
    if opts.weights_sharded:
        return "zero3"
    kind = opts.gradient_manager_kind
    return "zero1" if kind == "unsharded" else kind


def _cfg(name: str) -> ModelConfig:
    return resolve_model(name, from_scratch=True).cfg


def calibrate(runs: Iterable[Run] = MEASURED) -> dict[str, float]:
    """Per mode, the fraction of communication left exposed that fits the measured runs best (least squares in
    step time: sum over runs of (compute + x * comm - measured step)^2, x >= 0)."""
    num: dict[str, float] = {m: 0.0 for m in MODES}
    den: dict[str, float] = {m: 0.0 for m in MODES}
    for r in runs:
        tokens = r.batch * r.accum * SEQ
        compute = tokens / r.single_gpu
        measured = r.gpus * tokens / r.tokens_per_s
        comm = comm_seconds(_cfg(r.model), r.mode, Topology(r.gpus, 1, r.gpus), r.accum)
        num[r.mode] += comm * (measured - compute)
        den[r.mode] += comm * comm
    return {m: max(0.0, num[m] / den[m]) if den[m] else 0.0 for m in MODES}


def calibration_error(exposed: dict[str, float], runs: Iterable[Run] = MEASURED) -> list[tuple[Run, float, float]]:
    """(run, predicted tokens/s, relative error) for each measured run."""
    out = []
    for r in runs:
        p = predict(_cfg(r.model), r.mode, Topology(r.gpus, 1, r.gpus), batch=r.batch, accum=r.accum,
                    single_gpu=r.single_gpu, exposed=exposed)
        out.append((r, p.tokens_per_s, p.tokens_per_s / r.tokens_per_s - 1))
    return out


def leave_one_out_error(runs: Iterable[Run] = MEASURED) -> list[float]:
    """|relative error| of each run predicted by a fit on the others: the error to expect on a new run."""
    runs = list(runs)
    out = []
    for i, r in enumerate(runs):
        exposed = calibrate(runs[:i] + runs[i + 1:])
        out.append(abs(calibration_error(exposed, [r])[0][2]))
    return out


def scale_table(cfg: ModelConfig, *, matmul: str, batch: int, accum: int, gpus_per_node: int, max_nodes: int,
                modes: Iterable[str] = MODES, seq_len: int = SEQ, single_gpu: float | None = None,
                exposed: dict[str, float] | None = None, intra: Link = NVLINK,
                inter: Link = IB_400G) -> list[tuple[Prediction, Prediction]]:
    """(flat, hybrid) predictions for 1, 2, 4, ... max_nodes nodes of `gpus_per_node` GPUs, per mode."""
    exposed = exposed if exposed is not None else calibrate()
    rate = single_gpu or single_gpu_rate(cfg, matmul, seq_len)
    rows = []
    k = 1
    while k <= max_nodes:
        for mode in modes:
            pair = tuple(predict(cfg, mode, Topology(gpus_per_node, k, g, intra, inter), batch=batch, accum=accum,
                                 seq_len=seq_len, single_gpu=rate, exposed=exposed)
                         for g in (gpus_per_node * k, gpus_per_node))
            rows.append(pair)
        k *= 2
    return rows


def format_calibration(exposed: dict[str, float]) -> str:
    errs = calibration_error(exposed)
    lines = ["calibration on the measured runs (exposed fraction of communication per mode: "
             + ", ".join(f"{m} {exposed[m]:.2f}" for m in MODES) + ")",
             f"  {'model':<13} {'matmul':<6} {'gpus':>4} {'mode':<15} {'measured':>10} {'predicted':>10} {'error':>7}"]
    for r, pred, e in errs:
        lines.append(f"  {r.model:<13} {r.matmul:<6} {r.gpus:>4} {r.mode:<15} {r.tokens_per_s / 1e3:>9.1f}k "
                     f"{pred / 1e3:>9.1f}k {100 * e:>+6.1f}%")
    worst = max(abs(e) for _, _, e in errs)
    mean = sum(abs(e) for _, _, e in errs) / len(errs)
    loo = leave_one_out_error()
    lines.append(f"  error: mean |{100 * mean:.1f}%|, worst |{100 * worst:.1f}%| over {len(errs)} runs; each run "
                 f"predicted from a fit on the others: mean {100 * sum(loo) / len(loo):.1f}%, worst "
                 f"{100 * max(loo):.1f}%")
    return "\n".join(lines)


def format_table(rows: list[tuple[Prediction, Prediction]]) -> str:
    lines = [f"  {'GPUs':>5} {'nodes':>5} {'mode':<15} {'flat tok/s':>11} {'eff':>5}   "
             f"{'hybrid tok/s':>12} {'eff':>5}  (hybrid: shard group of one node)"]
    for flat, hyb in rows:
        lines.append(f"  {flat.world:>5} {flat.nodes:>5} {flat.mode:<15} {_k(flat.tokens_per_s):>11} "
                     f"{flat.efficiency:>5.2f}   {_k(hyb.tokens_per_s):>12} {hyb.efficiency:>5.2f}")
    return "\n".join(lines)


def _k(x: float) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k"
