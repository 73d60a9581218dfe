"""`qtrain plan`: the memory plan of the given options, and, for a device of --gpu-memory, each micro-batch
that fits with its cheapest recompute/offload settings, the fastest marked (`qtrain.plan`)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

from qtrain.cli.options import add_train_args, options_from_args
from qtrain.options import OptionsError


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The training options, and `qtrain plan`'s own arguments."""
    add_train_args(p)
    p.add_argument("--gpu-memory", dest="plan_gpu_memory", default=None,
                   help="device memory per GPU, e.g. 80GiB or 141GB (default: the first visible CUDA device)")
    p.add_argument("--max-batch", dest="plan_max_batch", type=int, default=64,
                   help="largest micro-batch the proposal tries (powers of two up to this)")
    p.add_argument("--reserve", dest="plan_reserve", default=None,
                   help="fixed device reserve for CUDA context and libraries (default 1GiB)")
    p.add_argument("--no-propose", dest="plan_propose", action="store_false",
                   help="only print the plan of the given options")
    p.add_argument("--json", dest="plan_json", action="store_true", help="print the plan(s) as JSON")
    g = p.add_argument_group("scale model (qtrain/plan/scale.py): with --nodes, predict tokens/s on 1, 2, 4 ... "
                             "K nodes of --gpus GPUs each, flat and hybrid sharding")
    g.add_argument("--nodes", dest="plan_nodes", type=int, default=None,
                   help="the most nodes to predict for (--gpus is then GPUs per node, default 8)")
    g.add_argument("--nvlink-bandwidth", dest="plan_nvlink_bw", default=None,
                   help="intra-node bytes/s per GPU each way as NCCL reaches it (default 360GB: NVLink 4)")
    g.add_argument("--nvlink-latency", dest="plan_nvlink_lat", type=float, default=None,
                   help="seconds per ring step inside a node (default 1e-05)")
    g.add_argument("--ib-bandwidth", dest="plan_ib_bw", default=None,
                   help="inter-node bytes/s per GPU each way (default 45GB: one 400 Gb/s NIC per GPU)")
    g.add_argument("--ib-latency", dest="plan_ib_lat", type=float, default=None,
                   help="seconds per ring step across nodes (default 2e-05)")


def run(ns: argparse.Namespace, argv: Sequence[str] = (), out=None) -> int:
    """`qtrain plan`: print the plan of the given options and the proposal for --gpu-memory."""
    from qtrain.model.resolve import TINY_NAME, resolve_model  # torch: not for `qtrain plan --help`
    from qtrain.plan.memory import _gib
    from qtrain.plan.propose import _sequences, propose, recommend
    from qtrain.plan.resolution import check_cuda_graphs, check_model_support, plan_memory
    out = out or sys.stdout
    opts = options_from_args(ns)
    cfg = resolve_model(opts.model, from_scratch=True, rope_scaling=opts.rope_scaling, seq_len=opts.seq_len).cfg
    name = opts.model or TINY_NAME
    check_model_support(cfg, opts, device_type="cuda")  # what `qtrain train` refuses for this model, refused here too
    if getattr(ns, "plan_nodes", None) is not None:
        return _scale(ns, opts, cfg, name, out)
    world = opts.gpus
    gpu_memory = getattr(ns, "plan_gpu_memory", None)
    if gpu_memory is not None:
        gpu_memory = _bytes("--gpu-memory", gpu_memory)
    else:
        import torch
        if not torch.cuda.is_available():
            raise OptionsError("qtrain plan: --gpu-memory is needed when no CUDA device is visible (e.g. 80GiB)")
        gpu_memory = torch.cuda.get_device_properties(0).total_memory
        world = world or torch.cuda.device_count()
    world = max(1, world)
    check_cuda_graphs(opts, world=world, device_type="cuda")  # what `qtrain train` refuses with graphs on a GPU
    reserve = getattr(ns, "plan_reserve", None)
    reserve = None if reserve is None else _bytes("--reserve", reserve)
    plan = plan_memory(cfg, opts, world=world, gpu_memory=gpu_memory, reserve=reserve, model_name=name)
    proposals = (propose(cfg, opts, gpu_memory, world, max_batch=getattr(ns, "plan_max_batch", 64), reserve=reserve,
                         model_name=name) if getattr(ns, "plan_propose", True) else [])
    best_i, costs = recommend(cfg, opts, proposals)
    if getattr(ns, "plan_json", False):
        json.dump({"plan": plan.to_dict(), "recommended": best_i,
                   "proposals": [{"changes": c, "plan": p.to_dict(), "estimate": e.to_dict()}
                                 for (c, p), e in zip(proposals, costs)]}, out, indent=1)
        out.write("\n")
        return 0 if plan.fits or proposals else 1
    out.write(plan.format() + "\n")
    if not getattr(ns, "plan_propose", True):
        return 0 if plan.fits else 1
    if not proposals:
        out.write(f"\n[Proposal] nothing fits {_gib(gpu_memory)} per device, even batch 1 with every "
                  f"recompute/offload/sharding option this version has.\n")
        return 1
    seqs = _sequences(opts, {})
    out.write(f"\n[Proposal] each micro-batch that fits, with its cheapest recompute/offload; => the fastest by the "
              f"step model\n  (est.: time per token against =>, at {seqs} sequences per optimizer step; "
              f"see plan/step_cost.py)\n")
    for i, ((changes, p), c) in enumerate(zip(proposals, costs)):
        flags = " ".join(_flag(k, v) for k, v in changes.items()) or "(as given)"
        mark = "=>" if i == best_i else "  "
        est = f"{100 * c.overhead(costs[best_i]):+.0f}%"
        n = _sequences(opts, changes)
        other = f"  ({n} sequences per step)" if n != seqs else ""
        out.write(f"  {mark} B={p.batch_size:<4d} {_gib(p.device_total):>11} device, {_gib(p.host_total):>10} host  "
                  f"est. {est:>5}  {flags}{other}\n")
    best = proposals[best_i][1]
    out.write("\n" + best.format() + "\n")
    return 0


def _scale(ns: argparse.Namespace, opts: Any, cfg: Any, name: str, out) -> int:
    """`qtrain plan --gpus G --nodes K`: the scale model's predictions for this configuration."""
    from qtrain.plan import scale
    nodes, per_node = ns.plan_nodes, opts.gpus or 8
    if nodes < 1 or per_node < 1:
        raise OptionsError(f"--nodes {nodes} --gpus {per_node}: both must be at least 1")
    links = {}
    for which, default, bw, lat in (("intra", scale.NVLINK, "nvlink_bw", "nvlink_lat"),
                                    ("inter", scale.IB_400G, "ib_bw", "ib_lat")):
        flag = "--" + bw.split("_")[0]
        b, t = getattr(ns, "plan_" + bw, None), getattr(ns, "plan_" + lat, None)
        if t is not None and not t >= 0:
            raise OptionsError(f"{flag}-latency {t}: must be >= 0 seconds")
        bandwidth = _bytes(f"{flag}-bandwidth", b) if b else default.bandwidth
        if bandwidth <= 0:
            raise OptionsError(f"{flag}-bandwidth {b}: must be more than 0 bytes/s")
        links[which] = scale.Link(bandwidth, default.latency if t is None else t)
    mode = scale.mode_of(opts)
    exposed = scale.calibrate()
    rows = scale.scale_table(cfg, matmul=opts.effective_matmul_dtype, batch=opts.batch_size,
                             accum=opts.grad_accumulation, seq_len=opts.seq_len, gpus_per_node=per_node,
                             max_nodes=nodes, modes=[mode], exposed=exposed, **links)
    if getattr(ns, "plan_json", False):
        json.dump({"model": name, "mode": mode, "exposed": exposed,
                   "rows": [{"flat": vars(f), "hybrid": vars(h)} for f, h in rows]}, out, indent=1)
        out.write("\n")
        return 0
    out.write(f"[Scale model] {name}, {opts.effective_matmul_dtype} matmuls, {mode}, batch {opts.batch_size} x "
              f"grad-accumulation {opts.grad_accumulation} x seq {opts.seq_len} per GPU; {per_node} GPUs per node "
              f"(NVLink {links['intra'].bandwidth / 1e9:.0f} GB/s), nodes over "
              f"{links['inter'].bandwidth / 1e9:.0f} GB/s per GPU\n")
    out.write(scale.format_table(rows) + "\n\n" + scale.format_calibration(exposed) + "\n")
    return 0


def _bytes(opt: str, s: str) -> int:
    from qtrain.plan.memory import parse_bytes
    try:
        return parse_bytes(s)
    except ValueError as e:
        raise OptionsError(f"{opt}: {e}") from None


def _flag(k: str, v: Any) -> str:
    f = "--" + k.replace("_", "-")
    if v is True:
        return f
    if v is False:
        return "--no-" + k.replace("_", "-")
    return f"{f} {v}"
