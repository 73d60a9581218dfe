"""Activation memory: which block intermediates are recomputed in backward, and where block inputs live.

llm.q's switches (reference/llmq.md §4.5), in one table each (`recompute_flags.py`, which imports no torch, so the
options and the CLI can name them):
- `IMPLIES`: --recompute-ffn => swiglu, --recompute-att => qkv, --recompute-block => att, ffn, norm.
- `STEPS`: the block steps each switch reruns in backward instead of keeping their results from forward
  (`norm`: LN1 and LN2; `att`: LN1 and the attention, like llm.q's cuDNN path). These names are the
  vocabulary every family's block function names its steps in (model/llama/block.py), so the switches mean
  the same for every family; `MLP_STEPS` are the ones a block's one-function MLP (`BlockOptions.mlp`) covers.
With --recompute-block the whole block is rerun from its stored input (the explicit loop in
`Transformer.forward_backward`), so no step inside it is recomputed a second time.

How a step is recomputed depends on how the block runs:
- eager: `Recomputer`, a `saved_tensors_hooks` policy. Tensors that a step saves for its own backward,
  and the step's result where a later op saves it (the QKV GEMM saves LN1, the down GEMM saves SwiGLU),
  are replaced by tokens; the first backward node that unpacks one reruns the step from its inputs (in
  the same order, so the values are bit-identical). A step whose input is another recomputed step's
  result asks that step for it, so `att` reruns LN1 -> QKV + RoPE -> attention without keeping LN1.
  Unlike `torch.utils.checkpoint` in eager mode, the consumer GEMM is not rerun: only the step is.
- torch.compile: `CheckpointSteps`, i.e. `torch.utils.checkpoint` (non-reentrant) with a selective-checkpoint
  policy that tags every op of the step MUST_RECOMPUTE, so the partitioner keeps only the step's inputs,
  consumers' needs included.

`ResidualStash` keeps the block inputs of --recompute-block, on the host with --offload-residual.
`count_saved_bytes` measures what a forward keeps for backward (tests, memory tables).
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from qtrain.host_memory import host_buffer
from qtrain.model.recompute_flags import (FLAGS, IMPLIES, MLP_STEPS, STEPS, block_steps, recompute_label,  # noqa: F401
                                          resolve_flags, splits_mlp)

# ---------------------------------------------------------------------------------------------------
# Measuring: bytes kept for backward
# ---------------------------------------------------------------------------------------------------
class SavedBytes:
    """Unique storages (by address) kept for backward while active, and their total size in bytes.
    Storages of `exclude` (the weights) are not activations and are not counted."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._skip = {t.untyped_storage().data_ptr() for t in exclude}
        self._seen: dict[int, int] = {}

    def add(self, t: torch.Tensor) -> None:
        s = t.untyped_storage()
        if s.data_ptr() not in self._skip:
            self._seen[s.data_ptr()] = s.nbytes()

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())


_COUNTERS: list[SavedBytes] = []


def observe_saved(t: torch.Tensor) -> None:
    """Report `t` to the active `count_saved_bytes` counters: for what is kept for backward outside autograd's saved
    tensors (a recomputed step's inputs, a checkpoint's, the stashed block inputs)."""
    for c in _COUNTERS:
        c.add(t)


@contextlib.contextmanager
def count_saved_bytes(exclude: Iterable[torch.Tensor] = ()) -> Iterator[SavedBytes]:
    """Count what autograd saves inside this context, plus what a `Recomputer` or `ResidualStash` keeps
    (their own hooks shadow this one, so they report to it). Read `.bytes` before backward frees things:
    addresses of freed storages may be reused, so counts taken after that are meaningless."""
    counter = SavedBytes(exclude)
    _COUNTERS.append(counter)

    def pack(t: torch.Tensor) -> torch.Tensor:
        counter.add(t)
        return t

    try:
        with saved_tensors_hooks(pack, lambda t: t):
            yield counter
    finally:
        _COUNTERS.remove(counter)


# ---------------------------------------------------------------------------------------------------
# Recomputing steps
# ---------------------------------------------------------------------------------------------------
StepFn = Callable[..., Any]


def run_step(step: str, fn: StepFn, *args: Any) -> Any:
    """The policy that recomputes nothing."""
    return fn(*args)


def _must_recompute(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE


# a checkpoint's context_fn under torch.compile: every op of the region recomputed (`CheckpointSteps` says why)
must_recompute_context = functools.partial(create_selective_checkpoint_contexts, _must_recompute)


class CheckpointSteps:
    """The policy for a torch.compile'd block: recomputed steps become non-reentrant checkpoints whose ops
    are all tagged MUST_RECOMPUTE. A plain checkpoint only tags them PREFER_RECOMPUTE, and inductor's
    partitioner on CUDA then kept the SwiGLU output anyway (the down GEMM's saved input: +27 KB per token
    and layer at 14B, `bench/probe_recompute_saved.py`); on CPU both keep what the plan says."""

    def __init__(self, steps: frozenset[str]):
        self.steps = steps

    def __call__(self, step: str, fn: StepFn, *args: Any) -> Any:
        if step not in self.steps or not torch.is_grad_enabled():
            return fn(*args)
        return checkpoint(fn, *args, use_reentrant=False, context_fn=must_recompute_context)


def _geometry(t: torch.Tensor) -> tuple:
    return t.size(), t.stride(), t.storage_offset()


class _Ref:
    """A dropped tensor: key `i` (int) is the i-th tensor step `region` saved internally; ("out", j) is (a
    view with geometry `view` of) its j-th result."""

    __slots__ = ("region", "key", "view")

    def __init__(self, region: "_Region", key: Any, view: tuple | None):
        self.region, self.key, self.view = region, key, view
        region.pending[key] = region.pending.get(key, 0) + 1

    def get(self) -> torch.Tensor:
        return self.region.take(self.key, self.view)


class _Region:
    """One recomputed step of one block call: the function, its inputs (tensors the block keeps, or
    `_Ref`s to another step's result), what it saved in forward (shapes, to check the rerun) and, during
    backward, the rerun's tensors until their last unpack."""

    def __init__(self, step: str, fn: StepFn, args: list[Any], grad_flags: list[bool]):
        self.step, self.fn, self.args, self.grad_flags = step, fn, args, grad_flags
        self.saved_meta: list[tuple[torch.Size, torch.dtype]] = []
        self.outputs: list[tuple[weakref.ref, int]] = []  # (result, address of its storage)
        self.out_meta: list[tuple] = []  # (shape, stride, storage offset) of each result
        self.pending: dict[Any, int] = {}  # key -> unpacks still to come
        self.cache: dict[Any, torch.Tensor] = {}

    def output_index(self, t: torch.Tensor) -> int | None:
        """Which result `t` is a view of, if any. A live result pins its storage, so an address match
        cannot be a later tensor reusing freed memory."""
        ptr = t.untyped_storage().data_ptr()
        for j, (ref, p) in enumerate(self.outputs):
            if p == ptr and ref() is not None:
                return j
        return None

    def take(self, key: Any, view: tuple | None) -> torch.Tensor:
        if key not in self.cache:
            self._rerun()
        t = self.cache[key]
        self.pending[key] -= 1
        if self.pending[key] == 0:
            del self.cache[key]
        return t.as_strided(*view) if view is not None else t

    def _rerun(self) -> None:
        args = [a.get() if isinstance(a, _Ref) else a for a in self.args]
        args = [a.detach().requires_grad_(g) if isinstance(a, torch.Tensor) else a
                for a, g in zip(args, self.grad_flags)]
        saved: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> int:
            saved.append(t.detach())
            return len(saved) - 1

        with torch.enable_grad(), saved_tensors_hooks(pack, lambda i: saved[i]):
            out = self.fn(*args)
        outs = out if isinstance(out, tuple) else (out,)
        got = [(t.shape, t.dtype) for t in saved]
        if got != self.saved_meta or [_geometry(t) for t in outs] != self.out_meta:
            raise RuntimeError(f"recomputing block step {self.step!r} saved different tensors or laid out its "
                               f"results differently than its forward ({got} vs {self.saved_meta}); steps must be "
                               "deterministic")
        for key, n in self.pending.items():
            if n > 0:
                self.cache[key] = saved[key] if isinstance(key, int) else outs[key[1]].detach()


class Recomputer:
    """Eager recompute policy for one block call: `rc(step, fn, *args)` runs fn(*args) and, when `step` is
    recomputed, drops what it would keep for backward (module docstring). Use as a context manager around
    the whole block, so that later ops saving a step's result are seen too.

    Contract: steps are deterministic and nothing modifies a step's inputs or results in place."""

    def __init__(self, steps: frozenset[str]):
        self.steps = steps
        self._regions: list[_Region] = []
        self._inside: _Region | None = None
        self._hooks: saved_tensors_hooks | None = None

    def __enter__(self) -> "Recomputer":
        self._hooks = saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None  # it holds our bound methods: keeping it would be a cycle that only gc breaks, and
        # the kept step inputs would outlive the backward that frees the graph

    def __call__(self, step: str, fn: StepFn, *args: Any) -> Any:
        if step not in self.steps or not torch.is_grad_enabled():
            return fn(*args)
        assert self._inside is None, "recomputed steps do not nest"
        kept: list[Any] = []
        for a in args:
            ref = self._result_ref(a) if isinstance(a, torch.Tensor) else None
            if ref is None and isinstance(a, torch.Tensor):
                observe_saved(a)
            kept.append(ref or a)
        region = _Region(step, fn, kept, [isinstance(a, torch.Tensor) and a.requires_grad for a in args])
        self._inside = region
        try:
            out = fn(*args)
        finally:
            self._inside = None
        outs = out if isinstance(out, tuple) else (out,)
        region.outputs = [(weakref.ref(t), t.untyped_storage().data_ptr()) for t in outs]
        region.out_meta = [_geometry(t) for t in outs]  # views of results are rebuilt on the rerun's storage
        self._regions.append(region)
        return out

    def _result_ref(self, t: torch.Tensor) -> _Ref | None:
        for r in reversed(self._regions):
            j = r.output_index(t)
            if j is not None:
                return _Ref(r, ("out", j), _geometry(t))
        return None

    def _pack(self, t: torch.Tensor) -> Any:
        r = self._inside
        if r is not None:
            r.saved_meta.append((t.shape, t.dtype))
            return _Ref(r, len(r.saved_meta) - 1, None)
        ref = self._result_ref(t)
        if ref is None:
            observe_saved(t)
            return t
        return ref

    @staticmethod
    def _unpack(p: Any) -> torch.Tensor:
        return p.get() if isinstance(p, _Ref) else p


# ---------------------------------------------------------------------------------------------------
# Block inputs between forward and backward
# ---------------------------------------------------------------------------------------------------
class ResidualStash:
    """The block inputs that --recompute-block keeps between forward and backward.

    offload=False: they stay where they are. offload=True (--offload-residual): they live in host memory,
    so device activation memory no longer grows with depth. On CUDA each layer has a pinned host buffer
    (allocated on first use, reused every micro-step); `store` copies device->host on a side stream after
    that stream waits for the compute stream (no host sync), `prefetch(l)` starts the host->device copy of
    layer l's input on the same stream, so it overlaps the backward of block l+1, and `load(l)` makes the
    compute stream wait on the copy's event. One in-order side stream also orders a micro-step's host
    reads before the next micro-step's host writes. Elsewhere the copies are plain synchronous copies
    through the same methods, so CPU tests run this code.
    """

    def __init__(self, offload: bool):
        self.offload = offload
        self._kept: dict[int, torch.Tensor] = {}
        self._host: dict[int, torch.Tensor] = {}
        self._device: dict[int, torch.device] = {}
        self._incoming: dict[int, tuple[torch.Tensor, Any]] = {}
        self._streams: dict[torch.device, Any] = {}

    def _side_stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def store(self, layer: int, x: torch.Tensor) -> None:
        """Keep block `layer`'s input `x` (a (B, T, C) activation) until `load(layer)`."""
        self._incoming.pop(layer, None)  # a prefetch left over from an aborted backward is stale
        if not self.offload:
            observe_saved(x)
            self._kept[layer] = x
            return
        x = x.detach()
        host = self._host.get(layer)
        if host is None or host.shape != x.shape or host.dtype != x.dtype:
            host = self._host[layer] = host_buffer(x.shape, x.dtype, pin=x.is_cuda, zero=False)
        self._device[layer] = x.device
        if x.is_cuda:
            side = self._side_stream(x.device)
            side.wait_stream(torch.cuda.current_stream(x.device))  # x is written by queued compute work
            with torch.cuda.stream(side):
                host.copy_(x, non_blocking=True)
            x.record_stream(side)  # the allocator must not hand x's memory out before the copy has read it
        else:
            host.copy_(x)

    def prefetch(self, layer: int) -> None:
        """Start bringing block `layer`'s input back (no-op without offload or for layer < 0)."""
        if not self.offload or layer < 0 or layer in self._incoming:
            return
        host = self._host[layer]
        dev = torch.empty(host.shape, dtype=host.dtype, device=self._device[layer])
        if dev.is_cuda:
            side = self._side_stream(dev.device)
            side.wait_stream(torch.cuda.current_stream(dev.device))  # dev may reuse memory queued work reads
            with torch.cuda.stream(side):
                dev.copy_(host, non_blocking=True)
                done = torch.cuda.Event()
                done.record(side)
            self._incoming[layer] = (dev, done)
        else:
            dev.copy_(host)
            self._incoming[layer] = (dev, None)

    def load(self, layer: int) -> torch.Tensor:
        """Block `layer`'s input on the compute device, ordered before the compute stream's next work."""
        if not self.offload:
            return self._kept.pop(layer)
        self.prefetch(layer)
        dev, done = self._incoming.pop(layer)
        if done is not None:
            torch.cuda.current_stream(dev.device).wait_event(done)
        return dev
