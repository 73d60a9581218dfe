"""`qtrain eval --model DIR --eval-file F`: the mean token loss (and perplexity) of any Hugging Face model
directory on a token file, computed with qtrain's own model code.

The batches are exactly the ones a training run evaluates on (`TokenLoader.iterate_eval_batches`: the
files in order, unshuffled, non-overlapping chunks of `seq_len` tokens, targets shifted by one, masked
targets ignored, a smaller last batch), so `qtrain eval` on a run's export reproduces that run's final eval
loss, and any other model (a downloaded checkpoint, another trainer's export) can be scored on the same
data. The loss is the sum of per-token cross-entropies (fp32 log-sum-exp) over all valid targets divided by
their number: every token counts the same, however the batches are cut. With `document_masking` (--document-masking)
each row's documents are scored as training scores them (`qtrain.data.documents`: attention inside each document,
positions from 0 at each, no target across a boundary): a file packed by `qtrain tokenize --pack-to` scores the
sum of its examples' losses, each as if alone.
"""
from __future__ import annotations

import math
import os
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported when a model is evaluated, so `qtrain --help` stays fast
    import torch

__all__ = ["evaluate_model", "resolve_device", "resolve_dtype"]

DTYPE_NAMES = ("fp32", "bf16", "fp16")


def resolve_dtype(dtype: "torch.dtype | str | None", device: "torch.device | None" = None) -> "torch.dtype":
    """None -> fp32; "auto" -> bf16 on CUDA, fp32 elsewhere; a name in DTYPE_NAMES; or a torch dtype."""
    import torch
    if dtype is None:
        return torch.float32
    if dtype == "auto":
        return torch.bfloat16 if device is not None and device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    return dtype


def resolve_device(device: "str | torch.device") -> "torch.device":
    """"auto" -> CUDA when available, else the CPU; a device that is not there is a DeviceError."""
    import torch

    from qtrain.cpu_threads import start_thread_pool
    from qtrain.parallel.dist import DeviceError
    start_thread_pool()  # an eval or generate process, before its first op (cpu_threads.py says why)
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise DeviceError(f"--device {device}: not a device (auto, cpu, cuda or cuda:N)") from None
    if dev.type not in ("cpu", "cuda"):
        raise DeviceError(f"--device {device}: only cpu and cuda are supported")
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        raise DeviceError(f"--device {device}: no such CUDA device is visible ({torch.cuda.device_count()} are)")
    return dev


def evaluate_model(model_dir: str | os.PathLike, eval_file: str | os.PathLike | list, *, seq_len: int,
                   batch_size: int, device: "str | torch.device" = "cpu", dtype: "torch.dtype | str | None" = None,
                   max_batches: int | None = None, lmhead_chunks: int = 1, document_masking: bool = False,
                   document_attention: str = "auto", delta_rule_precision: str = "auto",
                   rope_scaling: str = "") -> dict[str, Any]:
    """Loss of the HF model in `model_dir` (a directory, or `org/name` in the local HF cache) on the token
    file(s) `eval_file` (a path, a glob or a list), weights and activations in `dtype` (default
    torch.float32; also "fp32" / "bf16" / "fp16"), a Gated DeltaNet model's delta rule on CUDA at
    `delta_rule_precision` (auto: what training uses by default), its context extended by `rope_scaling`
    (--rope-scaling: model/context_extension.py). Returns {"loss": mean token loss, "ppl": exp(loss),
    "tokens": number of targets scored, "batches": batches run, "duration_ms": time}."""
    import torch

    with torch.no_grad():
        return _evaluate(model_dir, eval_file, seq_len=seq_len, batch_size=batch_size, device=device,
                         dtype=resolve_dtype(dtype), max_batches=max_batches, lmhead_chunks=lmhead_chunks,
                         document_masking=document_masking, document_attention=document_attention,
                         delta_rule_precision=delta_rule_precision, rope_scaling=rope_scaling)


def _evaluate(model_dir, eval_file, *, seq_len, batch_size, device, dtype, max_batches, lmhead_chunks,
              document_masking=False, document_attention="auto", delta_rule_precision="auto", rope_scaling=""):
    import torch

    from qtrain.data.loader import TokenLoader
    from qtrain.model.context_extension import extend_context
    from qtrain.model.hf_io import load_hf_weights, load_model_config
    from qtrain.model.resolve import resolve_model_dir
    from qtrain.model.transformer import RunOptions, Transformer
    from qtrain.options import OptionsError
    from qtrain.parallel.weights.replicated import ParamWeights
    from qtrain.plan.resolution import check_delta_rule_precision, resolve_delta_rule_precision
    from qtrain.train.preflight import check_seq_len

    if seq_len <= 0 or batch_size <= 0 or (max_batches is not None and max_batches <= 0):
        raise OptionsError(f"qtrain eval: --seq-len, --batch-size and --max-batches must be positive, got "
                           f"{seq_len}, {batch_size}, {max_batches}")
    if lmhead_chunks < 1:  # the LM head's own check would come only after the weights load, as a traceback
        raise OptionsError(f"qtrain eval: --lmhead-chunks must be >= 1, got {lmhead_chunks}")
    dev = resolve_device(device)
    d = resolve_model_dir(os.fspath(model_dir))
    cfg = extend_context(load_model_config(d), rope_scaling, seq_len)
    check_delta_rule_precision(delta_rule_precision, cfg)
    check_seq_len(seq_len, cfg, "qtrain eval: ")
    # the data first: a file it cannot use (or score with document masks) is refused before the weights load
    loader = TokenLoader(eval_file, seq_len, shuffle=False, model_vocab_size=cfg.vocab_size,
                         document_masking=document_masking,
                         eos_ids=cfg.end_of_document_ids)
    params = load_hf_weights(d, cfg, dtype=dtype, device=dev)
    model = Transformer(cfg, RunOptions(lmhead_chunks=lmhead_chunks, document_attention=document_attention,
                                        delta_rule_precision=resolve_delta_rule_precision(delta_rule_precision)))
    weights = ParamWeights(cfg, params)

    t0 = time.perf_counter()
    total = torch.zeros((), dtype=torch.float64, device=dev)
    count = torch.zeros((), dtype=torch.int64, device=dev)
    batches = 0
    for inputs, targets, *positions in loader.iterate_eval_batches(batch_size, max_batches):
        loss, n = model.loss_sum(weights, inputs.to(dev), targets.to(dev), *positions)
        total += loss.double()
        count += n
        batches += 1
    n = int(count.item())
    loss = float(total.item()) / n if n else math.nan
    return {"loss": loss, "ppl": math.exp(loss) if loss < 700 else math.inf, "tokens": n, "batches": batches,
            "duration_ms": 1000 * (time.perf_counter() - t0)}
