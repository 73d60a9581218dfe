"""A training loop of your own on qtrain's Python API (docs/python-api.md walks through it).

What `qtrain train` does, cut down to its core and spelled out: the embedded corpus, the tiny default model
from scratch in fp32, a warmup + cosine schedule, gradient accumulation, a JSON Lines run log, an
evaluation before and after, a checkpoint of the trainer's state that a fresh Trainer restores, and a
Hugging Face export that `transformers` loads. Its training steps are `qtrain train`'s: on the same token
files with the same settings it logs the same losses, to the last bit
(tests/train/test_custom_loop_example.py checks it on files with masked targets).

    python examples/custom_loop.py                 # 20 steps, ~20 s on a laptop CPU
    python examples/custom_loop.py --steps 200 --seq-len 256 --device cuda
    python examples/custom_loop.py --train-file my/train.bin --eval-file my/eval.bin   # your own token files

Everything is written under the current directory: data/qtrain-default/ (the corpus, built on first use),
logs/custom-loop.jsonl, ckpt/custom-loop/step_00000020/ (a checkpoint) and output/custom-loop/ (the
export).
"""
from __future__ import annotations

import argparse
import os
import time

from qtrain.model.weights import num_params
from qtrain.train import checkpointing
from qtrain.data.corpus import ensure_default_dataset
from qtrain.data.loader import TokenLoader
from qtrain.observe.log import QUIET, RunLogger
from qtrain.options import Options
from qtrain.train.schedule import LRSchedule
from qtrain.train.trainer import Trainer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--grad-accumulation", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    p.add_argument("--train-file", help="token file(s) to train on (a glob); default: the embedded corpus")
    p.add_argument("--eval-file", help="token file(s) to evaluate on; default: the embedded corpus's eval split")
    p.add_argument("--data-dir", default=os.path.join("data", "qtrain-default"), help="where the corpus is built")
    p.add_argument("--ckpt-dir", default=os.path.join("ckpt", "custom-loop"))
    p.add_argument("--out-dir", default=os.path.join("output", "custom-loop"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    B, T, GA = args.batch_size, args.seq_len, args.grad_accumulation

    # 1) data: your token files, or the embedded corpus (GPT-2 tokens of Python's own docs), built on first use
    train_path, eval_path = args.train_file, args.eval_file
    if not (train_path and eval_path):
        corpus_train, corpus_eval = ensure_default_dataset(args.data_dir)
        train_path, eval_path = train_path or corpus_train, eval_path or corpus_eval

    # 2) the trainer: model="" is the embedded tiny model (4 layers, 128 wide) initialised from scratch.
    #    Options is the same dataclass `qtrain train` fills from its flags; Trainer reads what it needs.
    opts = Options(model="", model_dtype="fp32", device=args.device, batch_size=B, seq_len=T, grad_accumulation=GA,
                   learning_rate=args.lr, warmup=3, final_lr_fraction=0.1, seed=7, name="custom-loop",
                   train_file=train_path, eval_file=eval_path)
    trainer = Trainer(opts)
    vocab = trainer.cfg.vocab_size
    print(f"model: {num_params(trainer.cfg) / 1e6:.1f}M parameters on {trainer.device}")

    train = TokenLoader(train_path, T, seed=opts.train_seed, model_vocab_size=vocab)
    evals = TokenLoader(eval_path, T, shuffle=False, model_vocab_size=vocab)
    schedule = LRSchedule(peak_lr=opts.learning_rate, total_steps=args.steps, warmup=opts.warmup,
                          final_lr_fraction=opts.final_lr_fraction, kind="cosine")

    def evaluate() -> tuple[float, int]:
        # the first `eval_batches` batches of the eval file, unshuffled: the same tokens every time
        return trainer.evaluate(evals.iterate_eval_batches(B, args.eval_batches))

    # 3) the run log: the same JSON Lines file `qtrain train` writes (qtrain plot / export-wandb read it)
    os.makedirs("logs", exist_ok=True)
    with RunLogger(os.path.join("logs", "custom-loop.jsonl"), total_steps=args.steps, verbosity=QUIET) as log:
        log.log_options(opts.to_dict())
        t0 = time.perf_counter()
        loss, n = evaluate()
        log.log_eval(0, loss=loss, eval_tokens=n, duration_ms=1000 * (time.perf_counter() - t0))
        first_eval = loss

        # 4) the loop: one optimizer step on grad_accumulation micro-batches per iteration. Trainer.step
        #    weights each valid target's loss by 1 / (valid targets of the whole step, on all ranks), runs
        #    forward + backward per micro-batch, clips and applies AdamW: {'loss', 'norm', 'lr', 'skipped'}
        for step in range(args.steps):
            t0 = time.perf_counter()
            batches = [train.next_batch(B) for _ in range(GA)]  # (inputs, targets): (B, T) int64 CPU tensors
            stats = trainer.step(batches, lr=schedule(step))
            dt_ms = 1000 * (time.perf_counter() - t0)
            log.log_step(step, step_tokens=B * T * GA, duration_ms=dt_ms, norm=stats["norm"], loss=stats["loss"],
                         lr=stats["lr"], epoch=train.progress)
            print(f"step {step:3d} | loss {stats['loss']:.4f} | norm {stats['norm']:.3f} | lr {stats['lr']:.2e} "
                  f"| {dt_ms:.0f} ms")

        t0 = time.perf_counter()
        last_eval, n = evaluate()
        log.log_eval(args.steps, loss=last_eval, eval_tokens=n, duration_ms=1000 * (time.perf_counter() - t0))
        print(f"eval loss {first_eval:.4f} -> {last_eval:.4f} over {n} tokens")

        # 5) checkpoint in qtrain's own format (what `qtrain train --continue` and `qtrain export` read):
        #    weights + Adam moments (Trainer.state_tensors), the loader position and the logger state.
        #    A fresh Trainer restored from it evaluates exactly the same.
        path = checkpointing.save(args.ckpt_dir, trainer, train, log)
    restored = Trainer(opts)
    step = checkpointing.load(path, restored, train_loader=None, logger=None)
    again, _ = restored.evaluate(evals.iterate_eval_batches(B, args.eval_batches))
    assert step == args.steps and again == last_eval, (step, again, last_eval)
    print(f"restored {path} (step {step}): eval loss {again:.4f}")

    # 6) export a Hugging Face model directory (config.json + model.safetensors)
    trainer.export(args.out_dir)
    print(f"exported to {args.out_dir}")
    return {"first_eval": first_eval, "last_eval": last_eval, "out_dir": args.out_dir, "eval_path": eval_path}


if __name__ == "__main__":
    main()
