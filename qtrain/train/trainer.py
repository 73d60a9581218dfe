"""The trainer object: qtrain's Python API, and what `qtrain train` drives.

    trainer = Trainer(options)                 # builds model, gradient manager, optimizer on this rank
    for step in range(steps):
        for inputs, targets in micro_batches:  # grad_accumulation of them
            trainer.micro_step(inputs, targets, loss_scale=...)
        stats = trainer.update(lr=schedule(step))   # {'loss', 'norm', 'lr', ...}
    trainer.evaluate(batches); trainer.save_checkpoint(dir); trainer.export(out_dir)

`micro_step` queues work on the device and returns without waiting for it (no host sync); `update` is
the one place per step that waits (it needs the gradient norm on the host for clipping and logging).
Every rank calls the same methods in the same order.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterable

import torch

from qtrain.fsio import FileSystemError
from qtrain.model.hf_io import load_hf_weights, save_hf_model
from qtrain.model.init import init_params
from qtrain.model.layers import resolve_sdpa_backend
from qtrain.model.resolve import resolve_model
from qtrain.model.transformer import FP8_MATRICES, RunOptions, Transformer
from qtrain.observe.absmax import AbsMaxRecorder, weight_abs_maxes
from qtrain.options import Options, OptionsError
from qtrain.parallel.comm import Communicator
from qtrain.parallel.dist import DistContext, init_distributed
from qtrain.parallel.gradients import make_gradient_manager
from qtrain.parallel.layout import FlatLayout
from qtrain.parallel.optimizer import ZERO_COPY_CUDA, ShardedAdamW, clip_scale
from qtrain.parallel.weights.quantized import QuantizedWeights
from qtrain.parallel.weights.replicated import ParamWeights
from qtrain.parallel.weights.sharded import ShardedWeights

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

class Trainer:
    def __init__(self, opts: Options, dist_ctx: DistContext | None = None):
        self.opts = opts.validate()
        self.ctx = dist_ctx or init_distributed(opts.device)
        self.device = self.ctx.device
        self.source = resolve_model(opts.model, from_scratch=opts.from_scratch)
        cfg = self.cfg = self.source.cfg
        self.dtype = DTYPES[opts.model_dtype]
        self.layout = FlatLayout(cfg, self.ctx.world)
        if opts.use_zero_copy and self.device.type == "cuda":
            raise OptionsError(ZERO_COPY_CUDA)
        self.comm = Communicator(device=self.device) if self.ctx.distributed else Communicator.solo(self.device)

        # weights: one flat buffer per group (see parallel/layout.py). Replicated: full buffers, parameters are
        # views into them. Sharded (--shard-weights / --zero-level 3): only this rank's shard of each buffer;
        # `ShardedWeights` gathers blocks just in time and there is no `params` / `param_buffers`.
        self.sharded_weights = opts.weights_sharded
        self.param_buffers: dict[str, torch.Tensor] | None = None
        self.params: dict[str, torch.Tensor] | None = None
        if self.sharded_weights:
            # --persistent-quants: e4m3 shards of the four block matrices, made once per step, gathered as FP8
            self.weights: ParamWeights | ShardedWeights | QuantizedWeights = ShardedWeights(
                self.layout, comm=self.comm, dtype=self.dtype, device=self.device, offload=opts.offload_master,
                quantized=FP8_MATRICES if opts.persistent_quants else (), offload_quants=opts.offload_quants)
        else:
            self.param_buffers = self.layout.allocate(dtype=self.dtype, device=self.device)
            self.params = {n: v.requires_grad_(True) for n, v in self.layout.views(self.param_buffers).items()}
            self.weights = ParamWeights(cfg, self.params)
            if opts.persistent_quants and not opts.debug_log_abs_max:
                self.weights = QuantizedWeights(self.weights)  # FP8 copies once per step, not per micro-step
        self._init_weights()

        use_compile = opts.compile == "on" or (opts.compile == "auto" and self.device.type == "cuda")
        self.model = Transformer(cfg, RunOptions(
            lmhead_chunks=opts.lmhead_chunks, attn_bwd_chunks=opts.attn_bwd_chunks,
            sdpa_backend=resolve_sdpa_backend(opts.sdpa_backend, self.device, self.dtype),
            recompute=opts.recompute,
            offload_residual=opts.offload_residual, compile=use_compile, compile_tuning=opts.compile_tuning,
            matmul_dtype=opts.effective_matmul_dtype, fp8_grad_dtype=opts.gradient_dtype or "e4m3",
            wrap_linear=self._abs_max_wrapper(opts)))
        self.grads = make_gradient_manager(opts.gradient_manager_kind, self.layout, comm=self.comm,
                                           dtype=self.dtype, device=self.device, seed=opts.seed,
                                           offload=opts.offload_gradients)
        weights = dict(shards=self.weights.shards) if self.sharded_weights else dict(params=self.param_buffers)
        self.optimizer = ShardedAdamW(self.layout, **weights, rank=self.ctx.rank, device=self.device,
                                      comm=self.ctx if self.ctx.distributed else None,
                                      m_dtype=opts.opt_m_dtype, v_dtype=opts.opt_v_dtype, seed=opts.seed,
                                      stochastic_rounding=opts.stochastic_rounding,
                                      offload_params=opts.offload_master, offload_m=opts.offload_opt_m,
                                      offload_v=opts.offload_opt_v, zero_copy=opts.use_zero_copy)
        self.step = 0  # completed optimizer steps
        self.micro = 0  # micro-steps done in the current step
        self._loss = torch.zeros((), dtype=torch.float32, device=self.device)

    @torch.no_grad()
    def _init_weights(self) -> None:
        """Group by group: fill a full group buffer (from-scratch init or the HF weights) and, with sharded
        weights, keep this rank's slice. Initialisation is keyed by tensor name, so the values do not
        depend on the world size or on the weights being sharded."""
        loaded = None
        if self.source.weights_dir is not None:
            loaded = load_hf_weights(self.source.weights_dir, self.cfg, dtype=self.dtype, device="cpu")
        for g in self.layout.groups:
            if self.sharded_weights:
                full = torch.zeros(g.padded_numel, dtype=self.dtype, device=self.device)  # padding stays zero
            else:
                full = self.param_buffers[g.key]
            views = {s.name: full[s.start:s.start + s.numel].view(s.shape) for s in g.segments}
            if loaded is None:
                init_params(self.cfg, views, seed=self.opts.seed, init_proj_to_zero=self.opts.init_proj_to_zero)
            else:
                for name, t in views.items():
                    t.copy_(loaded.pop(name))
            if self.sharded_weights:
                lo, hi = g.shard_range(self.ctx.rank, self.ctx.world)
                self.weights.shards[g.key].copy_(full[lo:hi])

    def _abs_max_wrapper(self, opts: Options):
        """--debug-log-abs-max: the recorder that wraps the block linears (None when off; with
        --recompute-block the linears run twice per step and are not instrumented)."""
        self.absmax = AbsMaxRecorder(self.cfg.num_hidden_layers)
        self.abs_maxes: dict[str, float] | None = None  # filled on --debug-log-abs-max steps
        return self.absmax.wrap if opts.debug_log_abs_max and not opts.recompute_block else None

    def _debug_step(self) -> bool:
        n = self.opts.debug_log_abs_max
        return bool(n) and self.step % n == 0 and self.micro == 0

    def _saving(self):
        """Sharded weights: autograd keeps handles, not gathered buffers, of the weights it saves."""
        return self.weights.saving() if self.sharded_weights else contextlib.nullcontext()

    # ---- the training step ----
    def micro_step(self, inputs: torch.Tensor, targets: torch.Tensor, *, loss_scale: float | None = None) -> None:
        """Forward + backward of one micro-batch ((B, T) int64 tensors, any device); gradients go to the
        gradient manager. `loss_scale` weights this rank's summed token loss; the default,
        1 / (valid targets in this micro-batch x grad_accumulation), gives the mean over the global
        batch when every micro-batch has the same number of valid targets (always true without masks)."""
        ga = self.opts.grad_accumulation
        if self.micro >= ga:
            raise RuntimeError(f"micro_step called more than --grad-accumulation={ga} times before update()")
        if loss_scale is None:
            loss_scale = 1.0 / max(1, int((targets != -100).sum()) * ga)
        inputs = inputs.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        self.grads.start_micro_step(step=self.step, micro_step=self.micro, num_micro_steps=ga)
        debug = self._debug_step()
        if debug:
            self.absmax.start()
        with self._saving(), (self.model.eager() if debug else contextlib.nullcontext()):
            loss = self.model.forward_backward(self.weights, inputs, targets, grads=self.grads,
                                               loss_scale=loss_scale, z_loss=self.opts.z_loss)
        if debug:
            self.abs_maxes = {**self.absmax.stop(), **weight_abs_maxes(self.full_params())}
        self.grads.end_micro_step()
        self._loss += loss
        self.micro += 1

    def update(self, *, lr: float) -> dict[str, float]:
        """Clip, AdamW-update this rank's shards, gather weights. Returns loss (mean over ranks of the
        scaled losses of this step), pre-clip gradient norm and the learning rate."""
        o = self.opts
        if self.micro != o.grad_accumulation:
            raise RuntimeError(f"update() after {self.micro} micro-steps; expected --grad-accumulation="
                               f"{o.grad_accumulation}")
        norm_t = self.optimizer.grad_norm(self.grads)
        loss_t = self.ctx.all_reduce_sum(self._loss.clone()) / self.ctx.world
        # The update is queued before the host reads the norm: clipping factor and the skip on a non-finite
        # norm are decided on the device, so the GPU never idles while the host waits for the norm and then
        # queues the update (measured: 29 of 243 ms per Qwen2.5-0.5B step were such gaps).
        if self.sharded_weights:
            self.weights.wait_all()  # gathers in flight may still read the shards the update writes
        self.optimizer.step(self.grads, lr=lr, beta1=o.beta_1, beta2=o.beta_2, eps=o.adam_epsilon,
                            weight_decay=o.weight_decay, grad_scale=clip_scale(norm_t, o.grad_clip))
        self.weights.invalidate()  # sharded: and prefetch what the next forward needs first
        norm, loss = float(norm_t), float(loss_t)  # the step's one host sync, with the update already queued
        skipped = not math.isfinite(norm)
        if skipped:
            self.optimizer.unstep()
        self.step += 1
        self.micro = 0
        self._loss.zero_()
        return {"loss": loss, "norm": norm, "lr": lr, "skipped": float(skipped)}

    # ---- evaluation ----
    @torch.no_grad()
    def evaluate(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, int]:
        """Mean token loss over the batches on all ranks, and the number of tokens it covers."""
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        for inputs, targets in batches:
            loss, n = self.model.loss_sum(self.weights, inputs.to(self.device), targets.to(self.device))
            total[0] += loss.double()
            total[1] += n.double()
        self.ctx.all_reduce_sum(total)
        n = int(total[1].item())
        return (float(total[0].item()) / max(n, 1)), n

    # ---- weights out ----
    def full_params(self) -> dict[str, torch.Tensor]:
        """Full parameters by internal name: detached views of the replicated weights, or, with sharded
        weights, gathered copies in host memory -- then a collective that every rank must call."""
        if self.sharded_weights:
            return self.weights.gather_full()
        return {n: p.detach() for n, p in self.params.items()}

    def export(self, out_dir: str, *, owner: dict | None = None) -> None:
        """Write a HF model directory (config.json + safetensors [+ tokenizer files]); rank 0 writes. Every
        rank must call it (sharded weights are gathered on all ranks); every rank raises rank 0's error.
        `owner` (run id, step) goes into the export's manifest."""
        params = self.full_params() if (self.ctx.is_main or self.sharded_weights) else None
        err: Exception | None = None
        if self.ctx.is_main:
            try:
                save_hf_model(out_dir, self.cfg, params, dtype=self.dtype, tokenizer_src=self.source.tokenizer_dir,
                              owner=owner)
            except (ValueError, OSError) as e:
                err = e if isinstance(e, ValueError) else FileSystemError(f"export to {out_dir} failed: {e}")
        err = self.ctx.broadcast_object(err)
        if err is not None:
            raise err

    # ---- checkpoint state (files written by train/checkpointing.py) ----
    def state_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """This rank's shards: weights and Adam moments, keyed by file stem then group key."""
        opt = self.optimizer.state_tensors()  # first: waits for copies to offloaded (host) state
        weights = {g.key: self.optimizer.param_shard(g.key) for g in self.layout.groups}
        return {"weights": weights, **opt}

    @torch.no_grad()
    def load_state_tensors(self, state: dict[str, dict[str, torch.Tensor]], step: int) -> None:
        if self.sharded_weights:
            self.weights.wait_all()
        self.optimizer.synchronize()
        for g in self.layout.groups:
            src, dst = state["weights"][g.key], self.optimizer.param_shard(g.key)
            if src.shape != dst.shape:
                raise ValueError(f"checkpoint weights[{g.key}]: shape {tuple(src.shape)} != {tuple(dst.shape)}")
            dst.copy_(src)
            if self.ctx.distributed and not self.sharded_weights:
                self.ctx.all_gather_into_tensor(self.param_buffers[g.key], dst)
        self.weights.invalidate()
        self.optimizer.load_state_tensors({k: state[k] for k in ("adam.m", "adam.v")}, step)
        self.step = step
