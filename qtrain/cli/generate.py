"""`qtrain generate --model DIR --prompt TEXT`: sample text from an export or any Hugging Face model directory
(`qtrain.model.generate`), with the directory's tokenizer (or --tokenizer)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Sequence


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF model directory (an export), or ORG/NAME in the local HF cache")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample only from the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample only from the most likely tokens whose probability reaches p (1 = all)")
    p.add_argument("--num-samples", type=int, default=1, help="independent samples to draw")
    p.add_argument("--seed", type=int, default=1337, help="seed of the sampling generator")
    p.add_argument("--tokenizer", default=None,
                   help="qwen2 | gpt2 | tokenizer.json | directory (default: the model directory's tokenizer.json)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    p.add_argument("--dtype", choices=("auto", "fp32", "bf16", "fp16"), default="auto",
                   help="weights / activations dtype (auto: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--rope-scaling", default="", metavar="TYPE:FACTOR",
                   help="run the model with RoPE scaling (linear, dynamic, yarn, llama3) by FACTOR, as `qtrain train "
                        "--rope-scaling` extends a model without it (its context: FACTOR x its positions)")
    p.add_argument("--json", action="store_true", help="print each sample as a JSON object (prompt, ids, text)")


def run(ns: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    from qtrain.data.tokenizers import get_tokenizer
    from qtrain.model.context_extension import extend_context, parse_rope_scaling
    from qtrain.model.generate import Sampling, SamplingError, generate
    from qtrain.model.hf_io import load_hf_weights, load_model_config, stop_token_ids
    from qtrain.model.resolve import resolve_model_dir
    from qtrain.model.transformer import Transformer
    from qtrain.parallel.weights.replicated import ParamWeights
    from qtrain.train.evaluate import resolve_device, resolve_dtype

    s = Sampling(max_new_tokens=ns.max_new_tokens, temperature=ns.temperature, top_k=ns.top_k, top_p=ns.top_p,
                 seed=ns.seed).validate()
    if ns.num_samples < 1:
        raise SamplingError(f"--num-samples must be >= 1, got {ns.num_samples}")
    if ns.rope_scaling and parse_rope_scaling(ns.rope_scaling)[1] is None:
        raise SamplingError(f"--rope-scaling {ns.rope_scaling}: give the factor (TYPE:FACTOR): generation has no "
                            f"--seq-len to take it from")
    d = resolve_model_dir(ns.model)
    spec = ns.tokenizer or str(d)
    if ns.tokenizer is None and not (Path(d) / "tokenizer.json").is_file():
        raise SamplingError(f"{d}: no tokenizer.json; pass --tokenizer (qwen2, gpt2, a tokenizer.json or a "
                            f"model directory that has one)")
    tok = get_tokenizer(spec)
    cfg = extend_context(load_model_config(d), ns.rope_scaling, 0)
    dev = resolve_device(ns.device)
    params = load_hf_weights(d, cfg, dtype=resolve_dtype(ns.dtype, dev), device=dev)
    model, weights = Transformer(cfg), ParamWeights(cfg, params)
    prompt = tok.encode_prompt(ns.prompt)
    stops = stop_token_ids(d, cfg) or [tok.eos_id]
    for i in range(ns.num_samples):
        ids = list(generate(model, weights, prompt, dataclasses.replace(s, seed=s.seed + i), stop_ids=stops,
                            device=dev))
        text = tok.decode([t for t in ids if t not in stops])
        if ns.json:
            print(json.dumps({"prompt": ns.prompt, "prompt_ids": prompt, "ids": ids, "text": text}))
        else:
            sys.stdout.write(("" if i == 0 else "\n---------------\n") + ns.prompt + text + "\n")
    return 0
