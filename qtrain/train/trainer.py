"""The trainer object: qtrain's Python API, and what `qtrain train` drives.

    trainer = Trainer(options)                 # builds weights, model, gradient manager, optimizer on this rank
    for step in range(steps):
        batches = [next_batch() for _ in range(options.grad_accumulation)]  # this rank's (inputs, targets)
        stats = trainer.step(batches, lr=schedule(step))                     # {'loss', 'norm', 'lr', 'skipped'}
    trainer.evaluate(eval_batches); trainer.export(out_dir)  # checkpoints: train/checkpointing.py

With --document-masking a batch is (inputs, targets, positions): the loader's position ids of the rows' documents
(`qtrain.data.documents`), which `micro_step` hands to the model on the host (the model makes the micro-batch's
document mask from them there: kernels/document_attention.py).

`step` is one whole optimizer step: it counts the valid targets of the step over all ranks (the loss
scale), runs the micro-steps and the update. Its parts are public for loops that need them apart:
`micro_step` queues the forward+backward of one micro-batch on the device and returns without waiting for
it (no host sync); `update` is the one place per step that waits (it needs the gradient norm on the host
for clipping and logging). Every rank calls the same methods in the same order.
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Iterable

import torch

from qtrain.data.hf_tokenizer import export_files, export_tokenizer
from qtrain.fsio import FileSystemError
from qtrain.kernels.cross_entropy import IGNORE_INDEX
from qtrain.model.hf_io import save_hf_model
from qtrain.model.lora import LoraAdapter
from qtrain.model.lora.checks import spec_from_options
from qtrain.model.lora.init import init_adapters
from qtrain.model.lora.peft_io import read_adapter
from qtrain.model.resolve import resolve_model
from qtrain.model.transformer import RunOptions, Transformer
from qtrain.model.weights import split_name
from qtrain.observe.absmax import AbsMaxRecorder, weight_abs_maxes
from qtrain.observe.startup import mark
from qtrain.options import Options, OptionsError
from qtrain.parallel.context import check_context_parallel, make_context_parallel
from qtrain.parallel.groups import make_shard_groups
from qtrain.parallel.dist import DistContext, init_distributed
from qtrain.parallel.experts import check_expert_parallel, make_expert_parallel
from qtrain.parallel.gradients import make_gradient_manager
from qtrain.parallel.layout import FlatLayout
from qtrain.parallel.optimizer import ZERO_COPY_CUDA, ShardedAdamW, clip_scale
from qtrain.parallel.weights import build_weights
from qtrain.plan.resolution import RunResolution, check_cuda_graphs, check_model_support, resolve_run
from qtrain.train.checkpoint_meta import lora_base_record
from qtrain.train.cuda_graphs import MicroStepGraphs
from qtrain.train.lora_export import export_lora
from qtrain.train.router_metrics import RouterMetrics

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

Batch = tuple[torch.Tensor, ...]  # (inputs, targets[, positions]): (B, T) int64


class ExportMemoryError(ValueError):
    """The export at the end of a run ran out of device or host memory (nothing of the run is lost: its final
    checkpoint comes first)."""


class Trainer:
    """This rank's part of a run: weights, model, gradient manager and optimizer, and the step over them."""

    def __init__(self, opts: Options, dist_ctx: DistContext | None = None, run: RunResolution | None = None):
        """`run`: the run's automatic choices as the preflight resolved them (plan/resolution.py); without it
        the Trainer resolves them itself, for its device and world."""
        self.opts = opts.validate()
        self.ctx = dist_ctx or init_distributed(opts.device)
        self.device = self.ctx.device
        if opts.use_zero_copy and self.device.type == "cuda":
            raise OptionsError(ZERO_COPY_CUDA)
        if run is None:
            check_cuda_graphs(opts, world=self.ctx.world, device_type=self.device.type)
        elif (run.device, run.world) != (self.device.type, self.ctx.world):
            raise ValueError(f"Trainer: a run resolved for {run.world} x {run.device} given to a rank of "
                             f"{self.ctx.world} x {self.device.type}")
        self.source = resolve_model(opts.model, from_scratch=opts.from_scratch, rope_scaling=opts.rope_scaling,
                                    seq_len=opts.seq_len)
        check_model_support(self.source.cfg, opts, device_type=self.device.type)
        # the tokenizer exports carry (None: unknown so far; the run loop may take it from the token files)
        self.tokenizer = export_tokenizer(explicit=opts.tokenizer, model_dir=self.source.tokenizer_dir)
        self.cfg = self.source.cfg
        if run is None:  # budget: the device's total memory on CUDA, none on CPU
            total = torch.cuda.get_device_properties(self.device).total_memory if self.device.type == "cuda" else None
            run = resolve_run(self.cfg, opts, world=self.ctx.world, device=self.device, gpu_memory=total)
        self.run = run
        self.dtype = DTYPES[opts.model_dtype]  # what the model computes with
        # the master weights, their gradient sums and what the optimizer updates: fp32 under a bf16 model with
        # --master-dtype fp32 (the model then reads a bf16 copy made once per step: parallel/weights/cast.py)
        self.master_dtype = DTYPES[run.master_dtype]
        # the ranks the state is sharded across: all (flat), or groups of --shard-group-size (parallel/groups.py)
        if opts.shard_group_size and opts.shard_group_size != self.ctx.world and opts.offload_gradients:
            raise OptionsError("--offload-gradients with --shard-group-size below the number of ranks is not "
                               "supported yet (the gradient shards are averaged across groups on the device)")
        self.groups = make_shard_groups(opts.shard_group_size, rank=self.ctx.rank, world=self.ctx.world,
                                        device=self.device)
        self.comm = self.groups.shard
        # --lora-rank: the base frozen, each layer's adapters a trainable group (model/lora/)
        self.lora = spec_from_options(vars(opts), self.cfg)
        # the identity of the base's files as the run reads them, which its checkpoints record (checkpoint_meta)
        self.lora_base = lora_base_record(self.source.weights_dir) if self.lora is not None else None
        # --expert-parallel: this rank's share of the experts and the groups that exchange tokens (parallel/experts.py)
        check_expert_parallel(opts.expert_parallel, num_experts=self.cfg.router.experts if self.cfg.router else None,
                              world=self.ctx.world, model_type=self.cfg.model_type)
        self.experts = make_expert_parallel(opts.expert_parallel, rank=self.ctx.rank, world=self.ctx.world,
                                            device=self.device)
        # --context-parallel N: each sequence split over N consecutive ranks (parallel/context.py)
        check_context_parallel(opts.context_parallel, world=self.ctx.world, seq_len=opts.seq_len)
        self.context = make_context_parallel(opts.context_parallel, rank=self.ctx.rank, world=self.ctx.world,
                                             mode=opts.context_parallel_mode)
        # one flat buffer per group (parallel/layout.py)
        self.layout = FlatLayout(self.cfg, self.comm.world, lora=self.lora, expert_parallel=opts.expert_parallel)
        # --matmul-dtype e4m3: which block linears run in FP8 for this micro-batch shape (--fp8-policy)
        self.fp8 = run.fp8
        # replicated weights: `params` are views into the full `param_buffers`; sharded weights
        # (--shard-weights / --zero-level 3): only this rank's shards, and both are None
        # --lora-base-dtype e4m3: the frozen base's block matrices held only as e4m3 (parallel/weights/e4m3_base.py)
        self.e4m3_base = self.lora is not None and self.lora.base_dtype == "e4m3"
        w = build_weights(self.layout, comm=self.comm, dtype=self.master_dtype, compute_dtype=self.dtype,
                          device=self.device, sharded=opts.weights_sharded, offload=opts.offload_master,
                          quantized=() if self.e4m3_base else run.persistent_quants, offload_quants=opts.offload_quants,
                          weights_dir=self.source.weights_dir, seed=opts.seed,
                          init_proj_to_zero=opts.init_proj_to_zero, adapters=self._adapter_init(opts),
                          e4m3_base=self.e4m3_base, experts=self.experts)
        self.weights, self.params, self.param_buffers, self.sharded_weights = w.source, w.params, w.buffers, w.sharded
        mark("weights")  # the start-up timeline (observe/startup.py): weights made (on CUDA: the context too)
        self.model = Transformer(self.cfg, self._run_options(opts, run))
        mark("blocks")  # the blocks' functions, compiled ones wrapped (torch.compile's own imports: seconds)
        if self.adapter is not None and self.lora.dropout:  # dropout keys name the layer (model/lora/adapter.py)
            if self.sharded_weights:  # the layers share two slots: the slot says which layer it holds
                self.adapter.bind_holder(self.weights.layer_holding)
            elif self.e4m3_base:  # its adapters are its params (block() may copy the base's codes in from the host)
                blocks: list[dict[str, torch.Tensor]] = [{} for _ in range(self.cfg.num_hidden_layers)]
                for name, p in self.params.items():
                    layer, short = split_name(name)
                    if layer is not None:
                        blocks[layer][short] = p
                self.adapter.bind_layers(blocks)
            else:
                self.adapter.bind_layers([self.weights.block(layer) for layer in range(self.cfg.num_hidden_layers)])
                self.weights.invalidate()
        self.grads = make_gradient_manager(run.gradients, self.layout, comm=self.comm,
                                           dtype=DTYPES[run.grad_accum_dtype], device=self.device, seed=opts.seed,
                                           offload=opts.offload_gradients, experts=self.experts)
        self.optimizer = ShardedAdamW(self.layout, **w.optimizer_weights(), comm=self.comm, device=self.device,
                                      m_dtype=opts.opt_m_dtype, v_dtype=opts.opt_v_dtype, seed=opts.seed,
                                      stochastic_rounding=opts.stochastic_rounding,
                                      offload_params=opts.offload_master, offload_m=opts.offload_opt_m,
                                      offload_v=opts.offload_opt_v, zero_copy=opts.use_zero_copy,
                                      experts=self.experts)
        # --use-cuda-graphs (train/cuda_graphs.py): micro-steps replayed from CUDA graphs, SR keys from a device table
        self.graphs = None
        if run.cuda_graphs:
            self.grads.use_key_table()
            self.graphs = MicroStepGraphs(self.device, (opts.batch_size, opts.seq_len),
                                          release_on_eager=opts.use_cuda_graphs is None)
        self.steps_done = 0  # completed optimizer steps (skipped updates included)
        self.micro = 0  # micro-steps done in the current step
        self._loss = torch.zeros((), dtype=torch.float32, device=self.device)
        # an MoE model: the step's router losses and tokens per expert, for the log (train/router_metrics.py)
        self.router_metrics = RouterMetrics(self.cfg.router, self.device) if self.cfg.router else None

    def _adapter_init(self, opts: Options):
        """What fills the LoRA adapters: peft's init, or the --lora-init-from adapter (None without LoRA)."""
        if self.lora is None:
            return None
        source = read_adapter(opts.lora_init_from, self.cfg, self.lora) if opts.lora_init_from else None
        return functools.partial(init_adapters, self.cfg, self.lora, seed=opts.seed, source=source)

    def _run_options(self, opts: Options, run: RunResolution) -> RunOptions:
        """How the model executes: the options as the run resolved them."""
        self.adapter = LoraAdapter(self.cfg, self.lora, seed=opts.seed, context=self.context) if self.lora is not None else None
        return RunOptions(
            lmhead_chunks=run.lmhead_chunks, attn_bwd_chunks=opts.attn_bwd_chunks, mlp_chunks=run.mlp_chunks,
            sdpa_backend=run.sdpa_backend,
            recompute=run.recompute, offload_residual=run.offload_residual, compile=run.compile,
            compile_tuning=opts.compile_tuning, compile_autotune_gemm=opts.compile_autotune_gemm,
            matmul_dtype=run.block_matmul_dtype, fp8_grad_dtype=run.fp8_grad_dtype,
            fp8_keep_transposes=run.fp8_keep_transposes, fp8_swiglu_onepass=run.fp8_swiglu_onepass,
            fp8_head_backward=run.fp8_head_backward, fp8_linears=run.fp8.fp8 if run.fp8 is not None else None,
            wrap_linear=self._abs_max_wrapper(opts), document_attention=opts.document_attention,
            adapter=self.adapter, frozen_e4m3=self.e4m3_base,
            expert_exchange=self.experts.exchange if self.experts is not None else None, context=self.context,
            fp8_experts=opts.fp8_experts, delta_rule_precision=run.delta_rule_precision,
            swiglu_epilogue=run.swiglu_epilogue)

    def _abs_max_wrapper(self, opts: Options):
        """--debug-log-abs-max: the recorder that wraps the block linears (None when off; with
        --recompute-block the linears run twice per step and are not instrumented)."""
        self.absmax = AbsMaxRecorder(self.cfg.num_hidden_layers)
        self.abs_maxes: dict[str, float] | None = None  # filled on --debug-log-abs-max steps
        return self.absmax.wrap if opts.debug_log_abs_max and not opts.recompute_block else None

    def _debug_step(self) -> bool:
        n = self.opts.debug_log_abs_max
        return bool(n) and self.steps_done % n == 0 and self.micro == 0

    def _saving(self):
        """Sharded weights: autograd keeps handles, not gathered buffers, of the weights it saves."""
        return self.weights.saving() if self.sharded_weights else contextlib.nullcontext()

    # ---- the training step ----
    def step(self, batches: Iterable[Batch], *, lr: float) -> dict[str, float]:
        """One whole optimizer step on this rank's `batches`: exactly `grad_accumulation` (inputs, targets)
        pairs of (B, T) int64 tensors (any device; on the host, counting their valid targets costs no
        device sync). Counts the valid targets of the step over all ranks (one all-reduce), weights every
        micro-batch's summed token loss by `loss_scale` of that count, runs the micro-steps and `update`.
        The update then follows the mean token loss of the global batch, however unevenly masked targets
        (-100) are spread over micro-batches and ranks. Returns `update`'s stats; `loss` is that mean."""
        batches = [self._local(b) for b in batches]
        ga = self.opts.grad_accumulation
        if self.micro:
            raise RuntimeError(f"step() after {self.micro} micro_step() calls of an unfinished step; "
                               f"finish it with update() first")
        if len(batches) != ga:
            raise ValueError(f"step() got {len(batches)} micro-batches; --grad-accumulation is {ga}")
        valid = float(sum(int((b[1] != IGNORE_INDEX).sum()) for b in batches))
        if self.ctx.world > 1:  # one process needs no device round trip (it would wait for the last update)
            valid = self.ctx.all_reduce_sum(torch.tensor([valid], dtype=torch.float64, device=self.device)).item()
        scale = self.loss_scale(valid)
        for inputs, targets, *positions in batches:
            self.micro_step(inputs, targets, *positions, loss_scale=scale)
        return self.update(lr=lr)

    def _local(self, batch: Batch) -> Batch:
        """This rank's part of each sequence of a batch (--context-parallel), the position ids of documents whole (the
        documents' mask needs every rank's); the batch itself without it."""
        if self.context is None:
            return batch
        return self.context.shard(batch[0]), self.context.shard(batch[1]), *batch[2:]

    def loss_scale(self, valid_targets: float) -> float:
        """The weight of a rank's summed token loss when the step's global batch (all micro-batches on all
        ranks) has `valid_targets` targets: world / valid_targets. The gradient managers average over
        ranks, so the gradient is that of the mean token loss over the global batch."""
        return self.ctx.world / max(float(valid_targets), 1.0)

    def micro_step(self, inputs: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None, *,
                   loss_scale: float | None = None) -> None:
        """Forward + backward of one micro-batch ((B, T) int64 tensors, any device; `positions` with
        --document-masking, best on the host); gradients go to the gradient manager. A building block of
        `step`, which passes the step's `loss_scale`: the weight of this rank's summed token loss. Alone, the default takes this micro-batch's valid targets as those
        of every micro-batch on every rank (`loss_scale` of their count x grad_accumulation x world): the
        mean over the global batch only when they all have the same count (always true without masks)."""
        ga = self.opts.grad_accumulation
        if self.micro >= ga:
            raise RuntimeError(f"micro_step called more than --grad-accumulation={ga} times before update()")
        if loss_scale is None:
            loss_scale = self.loss_scale(int((targets != IGNORE_INDEX).sum()) * ga * self.ctx.world)
        inputs = inputs.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        self.grads.start_micro_step(step=self.steps_done, micro_step=self.micro, num_micro_steps=ga)
        if self.adapter is not None:  # LoRA dropout's masks are those of this (step, micro-step)
            self.adapter.at(self.steps_done, self.micro)
        debug = self._debug_step()
        if debug:
            self.absmax.start()

        def forward_backward(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            # an MoE model's router losses: each micro-batch's weighted 1 / ga (their mean over the step)
            return self.model.forward_backward(self.weights, inputs, targets, grads=self.grads,
                                               loss_scale=loss_scale, z_loss=self.opts.z_loss,
                                               router_z_loss=self.opts.router_z_loss, router_loss_scale=1.0 / ga,
                                               positions=positions)

        if self.graphs is not None and positions is None:  # --document-masking refuses graphs (cuda_graph_blockers)
            self.weights.non_block()  # a per-step refresh of the weights (CastWeights) stays outside the graphs
            loss, replayed = self.graphs.run(forward_backward, inputs, targets, first=self.grads.first,
                                             last=self.grads.last, loss_scale=loss_scale)
            if replayed:
                self.grads.replayed()
        else:
            with self._saving(), (self.model.eager() if debug else contextlib.nullcontext()):
                loss = forward_backward(inputs, targets)
        if debug:
            self.abs_maxes = {**self.absmax.stop(), **weight_abs_maxes(self.full_params())}
        self.grads.end_micro_step()
        self._loss += loss
        if self.router_metrics is not None:
            self.router_metrics.add(self.model.router_losses, 1.0 / ga)
        self.micro += 1

    def update(self, *, lr: float) -> dict[str, float]:
        """Clip, AdamW-update this rank's shards, gather weights: the end of a step, after its
        grad_accumulation micro-steps. Returns loss (the sum of the step's scaled losses, averaged over
        ranks: with `step`'s scale, the mean token loss of the global batch), pre-clip gradient norm, the
        learning rate and whether the update was skipped (non-finite norm); an MoE model's router fields too
        (train/router_metrics.STEP_FIELDS)."""
        o = self.opts
        if self.micro != o.grad_accumulation:
            raise RuntimeError(f"update() after {self.micro} micro-steps; expected --grad-accumulation="
                               f"{o.grad_accumulation}")
        self.groups.reduce_replicas(self.layout, self.grads)  # hybrid sharding: average the shards across groups
        norm_t = self.optimizer.grad_norm(self.grads)
        loss_t = self.ctx.all_reduce_sum(self._loss.clone()) / self.ctx.world
        if self.router_metrics is not None:
            self.router_metrics.all_reduce(self.ctx)
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
        self.steps_done += 1
        self.micro = 0
        self._loss.zero_()
        router = self.router_metrics.read(self.ctx.world) if self.router_metrics is not None else {}
        return {"loss": loss, "norm": norm, "lr": lr, "skipped": float(skipped), **router}

    # ---- evaluation ----
    @torch.no_grad()
    def evaluate(self, batches: Iterable[Batch]) -> tuple[float, int]:
        """Mean token loss over the batches on all ranks, and the number of tokens it covers."""
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        if self.adapter is not None:
            self.adapter.training = False  # no LoRA dropout in evaluation
        try:
            for inputs, targets, *positions in map(self._local, batches):
                loss, n = self.model.loss_sum(self.weights, inputs.to(self.device), targets.to(self.device),
                                              *positions)
                total[0] += loss.double()
                total[1] += n.double()
        finally:
            if self.adapter is not None:
                self.adapter.training = True
        self.ctx.all_reduce_sum(total)
        n = int(total[1].item())
        return (float(total[0].item()) / max(n, 1)), n

    # ---- weights out ----
    def full_params(self, *, trainable_only: bool = False, keep: bool = True) -> dict[str, torch.Tensor]:
        """Full (master) parameters by internal name: detached views of the replicated weights, or, with sharded
        weights, gathered copies in host memory -- then a collective that every rank must call. `trainable_only`:
        the trainable groups' alone (a LoRA adapter's export gathers no frozen base); `keep` False: this rank only
        takes part in the sharded gather and gets {} (with expert parallelism every rank keeps its copy: the
        experts' gather over the token group reads it)."""
        groups = self.layout.trainable_groups() if trainable_only else None
        if self.sharded_weights:
            params = self.weights.gather_full(groups, keep=keep or self.experts is not None)
        else:
            params = self.params
        if self.experts is not None:  # each rank holds E/ep experts: gathered from the token group
            return self.experts.gather_experts(params, self.layout, groups)
        if self.sharded_weights:
            return params
        names = None if groups is None else {s.name for g in groups for s in g.segments}
        return {n: p.detach() for n, p in self.params.items() if names is None or n in names}

    def export(self, out_dir: str, *, owner: dict | None = None) -> None:
        """Write a HF model directory (config.json + safetensors + generation_config.json [+ the tokenizer files of
        `self.tokenizer`]); rank 0 writes. Every rank must call it (sharded weights are gathered on all ranks);
        every rank raises rank 0's error. `owner` (run id, step) goes into the export's manifest."""
        adapters_only = self.lora is not None and not self.opts.lora_merge  # the PEFT adapter needs no base
        params = (self.full_params(trainable_only=adapters_only, keep=self.ctx.is_main)
                  if (self.ctx.is_main or self.sharded_weights or self.experts) else None)
        err: Exception | None = None
        if self.ctx.is_main:
            try:
                if self.lora is not None:  # the PEFT adapter, or with --lora-merge the merged model
                    export_lora(out_dir, self.cfg, self.lora, params, merge=self.opts.lora_merge, base=self.opts.model,
                                dtype=self.master_dtype, tokenizer=self.tokenizer, owner=owner)
                else:
                    save_hf_model(out_dir, self.cfg, params, dtype=self.master_dtype,
                                  extra_files=export_files(self.tokenizer, self.cfg), owner=owner)
            except (ValueError, OSError) as e:
                err = e if isinstance(e, ValueError) else FileSystemError(f"export to {out_dir} failed: {e}")
            except (torch.OutOfMemoryError, MemoryError) as e:  # every rank gets it, none waits for rank 0 forever
                first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
                err = ExportMemoryError(f"export to {out_dir} ran out of memory ({first}): the run's final checkpoint "
                                        f"is written before its export; export it with `qtrain export "
                                        f"--checkpoint-dir ...` where more memory is free")
        err = self.ctx.broadcast_object(err)
        if err is not None:
            raise err

    # ---- checkpoint state (files written by train/checkpointing.py) ----
    def state_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """This rank's shards: weights and Adam moments, keyed by file stem then group key."""
        opt = self.optimizer.state_tensors()  # first: waits for copies to offloaded (host) state
        # the trainable groups (a frozen LoRA base is the --model's, loaded again on --continue)
        weights = {g.key: self.optimizer.param_shard(g.key) for g in self.layout.trainable_groups()}
        return {"weights": weights, **opt}

    @torch.no_grad()
    def load_state_tensors(self, state: dict[str, dict[str, torch.Tensor]], step: int) -> None:
        if self.sharded_weights:
            self.weights.wait_all()
        self.optimizer.synchronize()
        for g in self.layout.trainable_groups():
            src, dst = state["weights"][g.key], self.optimizer.param_shard(g.key)
            if src.shape != dst.shape:
                raise ValueError(f"checkpoint weights[{g.key}]: shape {tuple(src.shape)} != {tuple(dst.shape)}")
            dst.copy_(src)
            if self.sharded_weights:
                continue  # the shard is all this rank holds: the next gather reads it
            if self.groups.hybrid:
                self.comm.all_gather(self.param_buffers[g.key], dst.clone()).wait()
            elif self.experts is not None:  # an expert group: from the replicas holding the same experts
                self.experts.comm_of(g, self.comm).all_gather(self.param_buffers[g.key], dst.clone()).wait()
            elif self.ctx.distributed:
                self.ctx.all_gather_into_tensor(self.param_buffers[g.key], dst)
        self.weights.invalidate()
        self.optimizer.load_state_tensors({k: state[k] for k in ("adam.m", "adam.v")}, step)
        self.steps_done = step
