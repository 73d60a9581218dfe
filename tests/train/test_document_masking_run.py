"""--document-masking end to end: examples packed by `qtrain tokenize --pack-to`'s packer into a token file, served
by the loader with their document structure, through the model, `qtrain train` and `qtrain eval`.

* Exactness (fp32, CPU, every dense family): the summed loss and every weight gradient over the batches of a packed
  file equal those of its examples, each run alone as its own sequence (prompt tokens not trained, an over-long one
  cut as the packer cuts it). The same for a pretraining-style file split at its EOS tokens. Tolerance as in
  tests/model/test_document_masking.py (same sums in other groupings: fp32 rounding only, relative 1e-5).
* `qtrain train --document-masking` with gradient accumulation and recompute resumes bitwise from a checkpoint
  (the loader's position is (epoch, file, chunk) as without the option; each chunk's documents follow from it).
* e4m3 linears take the document-masked micro-step as any other; CUDA graphs are refused in one line.
* `qtrain eval --document-masking` scores a packed file as the mean loss of its examples alone.
"""
from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from qtrain.cli.main import main
from qtrain.data.loader import TokenLoader
from qtrain.data.packing import Packer, cut_to
from qtrain.data.token_files import IGNORE_INDEX, TokenFileWriter, write_token_file
from qtrain.model.hf_io import save_hf_model
from qtrain.model.transformer import RunOptions, Transformer
from qtrain.model.weights import param_shapes
from qtrain.options import Options, OptionsError
from qtrain.parallel.weights.replicated import ParamWeights
from qtrain.plan.resolution import check_cuda_graphs, cuda_graphs_on
from tests.model.test_document_masking import assert_same, params_of
from tests.model.test_transformer import Collect, tiny_cfg
from tests.run_utils import CFG, make_run_root, train_argv

N = 32  # the row length (--pack-to, --seq-len)
EOS = 1


def make_examples(vocab: int, n: int = 14, seed: int = 0, eos: int = EOS) -> list[tuple[np.ndarray, np.ndarray]]:
    """SFT examples: a prompt (mask 0) and a response ending in EOS (mask 1), of spread lengths; one longer than N;
    some without a prompt (their first token a target in the file: only the document boundary keeps the example
    before from predicting it)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt, response = rng.randint(0, 8) if i % 3 else 0, rng.randint(2, 14) if i != 3 else 40
        ids = np.array([rng.randrange(2, vocab) for _ in range(prompt + response - 1)] + [eos], dtype=np.int32)
        out.append((ids, np.r_[np.zeros(prompt, bool), np.ones(response, bool)]))
    return out


def pack(path, examples, vocab: int, eos: int = EOS) -> str:
    """The examples packed into rows of N as `qtrain tokenize --pack-to N` packs them, and the file's tail token."""
    w = TokenFileWriter(path, vocab_size=vocab, with_masks=True, with_documents=True)
    packer = Packer(w, N, pad_id=eos)
    for tokens, mask in examples:
        packer.write(tokens, mask)
    packer.flush()
    w.write(np.array([eos], np.int32), np.zeros(1, bool), np.zeros(1, np.int64))  # ShardedWriter's tail
    w.close()
    return str(path)


def alone(tokens: np.ndarray, mask: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) (1, L) of one example run alone: each token predicts the next one the mask keeps; the last
    predicts nothing. Longer than N: cut as the packer cuts (`packing.cut_to`, tested in tests/data/test_sft.py)."""
    if tokens.size > N:
        tokens, mask = cut_to(tokens, mask, N)
    x = torch.from_numpy(tokens.astype(np.int64))
    y = torch.full_like(x, IGNORE_INDEX)
    y[:-1] = torch.where(torch.from_numpy(mask[1:]), x[1:], IGNORE_INDEX)
    return x[None], y[None]


def through_loader(cfg, params, path, run: RunOptions, *, batch: int = 3, eos_ids=()):
    """Summed loss and gradients over every batch the loader serves (in file order) with document masking."""
    model, loss, grads = Transformer(cfg, run), torch.zeros(()), {}
    loader = TokenLoader(path, N, shuffle=False, model_vocab_size=cfg.vocab_size, document_masking=True,
                         eos_ids=eos_ids)
    for x, y, p in loader.iterate_eval_batches(batch):
        sink = Collect()
        loss += model.forward_backward(ParamWeights(cfg, params), x, y, grads=sink, loss_scale=1.0, positions=p)
        for k, g in sink.grads.items():
            grads[k] = grads[k] + g if k in grads else g.clone()
    return loss, grads


def each_alone(cfg, params, docs):
    model, loss, grads = Transformer(cfg, RunOptions()), torch.zeros(()), {}
    for x, y in docs:
        sink = Collect()
        loss += model.forward_backward(ParamWeights(cfg, params), x, y, grads=sink, loss_scale=1.0)
        for k, g in sink.grads.items():
            grads[k] = grads[k] + g if k in grads else g.clone()
    return loss, grads


@pytest.mark.parametrize("model_type,kind", [("llama", "masked"), ("qwen2", "varlen"), ("qwen3", "masked")])
def test_packed_file_equals_its_examples_alone(model_type, kind, tmp_path):
    cfg = tiny_cfg(model_type, tied=model_type != "llama")
    params = params_of(cfg)
    examples = make_examples(cfg.vocab_size)
    path = pack(tmp_path / "packed.bin", examples, cfg.vocab_size)
    packed = through_loader(cfg, params, path, RunOptions(document_attention=kind))
    assert_same(packed, each_alone(cfg, params, [alone(t, m) for t, m in examples]))


def test_eos_split_file_equals_its_documents_alone(tmp_path):
    """A pretraining file without recorded documents: split after each EOS (the model's id). Documents tile the rows
    here, so each is whole in one row; every token but a document's last is a target."""
    cfg = tiny_cfg("llama", tied=False)
    params = params_of(cfg)
    rng = np.random.default_rng(3)
    docs, tokens = [], []
    for lengths in ([5, 11, 16], [32], [7, 7, 7, 11]):
        for n in lengths:
            ids = np.r_[rng.integers(2, cfg.vocab_size, n - 1), EOS].astype(np.int32)
            tokens.append(ids)
            docs.append(alone(ids, np.ones(n, bool)))
    write_token_file(tmp_path / "plain.bin", np.concatenate(tokens + [np.array([7], np.int32)]),
                     vocab_size=cfg.vocab_size)
    packed = through_loader(cfg, params, str(tmp_path / "plain.bin"), RunOptions(), batch=2, eos_ids=(EOS,))
    assert_same(packed, each_alone(cfg, params, docs))


# ---------------------------------------------------------------------------------------------- qtrain train / eval

def packed_root(tmp_path):
    """The tiny run root (CFG: vocab 96, EOS 0) with train.bin and eval.bin packed from SFT examples."""
    root = make_run_root(tmp_path)
    pack(root / "train.bin", make_examples(CFG.vocab_size, n=60, seed=1, eos=0), CFG.vocab_size, eos=0)
    pack(root / "eval.bin", make_examples(CFG.vocab_size, n=10, seed=2, eos=0), CFG.vocab_size, eos=0)
    return root


def steps_of(path):
    import json
    return [e for e in map(json.loads, open(path)) if e.get("log") == "step"]


def test_train_resumes_bitwise_with_accumulation_and_recompute(tmp_path):
    root = packed_root(tmp_path)
    opts = dict(seq_len=N, grad_accumulation=2, eval_num_steps=1)
    extra = ("--document-masking", "--recompute-att", "--recompute-ffn", "--ckpt-keep-n", "-1")
    assert main(train_argv(root, steps=4, name="full", extra=extra, **opts)) == 0
    assert main(train_argv(root, steps=4, name="resumed", checkpoint_dir=root / "ckpt" / "full",
                           extra=(*extra, "--continue", "2"), **opts)) == 0
    full = {s["step"]: s for s in steps_of(root / "logs" / "full.jsonl")}
    resumed = {s["step"]: s for s in steps_of(root / "logs" / "resumed.jsonl")}
    assert sorted(resumed) == [2, 3]
    assert all(resumed[k]["loss"] == full[k]["loss"] and resumed[k]["norm"] == full[k]["norm"] for k in resumed)
    from safetensors.torch import load_file
    a = load_file(root / "out" / "full" / "model.safetensors")
    b = load_file(root / "out" / "resumed" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the option reaches the model: without it the rows' documents see each other and the losses differ
    assert main(train_argv(root, steps=1, name="plain", **opts)) == 0
    assert steps_of(root / "logs" / "plain.jsonl")[0]["loss"] != full[0]["loss"]


def test_eval_scores_a_packed_file_as_its_examples_alone(tmp_path, capsys):
    import json
    root = packed_root(tmp_path)
    params = {n: torch.randn(s, generator=torch.Generator().manual_seed(1)) * 0.5 for n, s in param_shapes(CFG).items()}
    save_hf_model(root / "weights", CFG, params, dtype=torch.float32)
    capsys.readouterr()
    assert main(["eval", "--model", str(root / "weights"), "--eval-file", str(root / "eval.bin"), "--seq-len", str(N),
                 "--batch-size", "2", "--device", "cpu", "--document-masking", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    model, w = Transformer(CFG, RunOptions()), ParamWeights(CFG, params)
    total, count = 0.0, 0
    for x, y in (alone(t, m) for t, m in make_examples(CFG.vocab_size, n=10, seed=2, eos=0)):
        loss, n = model.loss_sum(w, x, y)
        total, count = total + loss.item(), count + n.item()
    assert got["tokens"] == count
    assert abs(got["loss"] - total / count) <= 1e-5 * total / count


def test_e4m3_linears_take_document_masks(tmp_path):
    """The FP8 path does not look at documents: with e4m3 linears (emulated on the CPU) a document-masked step runs
    and lands near the bf16 one (e4m3's rounding), farther from the step without the masks."""
    from qtrain.train.trainer import Trainer
    from tests.dist_utils import write_model_dir
    root = packed_root(tmp_path)
    model_dir = write_model_dir(tmp_path, CFG)
    loader = TokenLoader(str(root / "train.bin"), N, shuffle=False, document_masking=True)
    batches = [next(iter(loader.iterate_eval_batches(2)))]

    def loss(**kw):
        tr = Trainer(Options(model=model_dir, from_scratch=True, batch_size=2, seq_len=N, device="cpu", compile="off",
                             grad_accumulation=1, model_dtype="bf16", seed=5, **kw))
        return tr.step(batches if kw.get("document_masking") else [b[:2] for b in batches], lr=1e-3)["loss"]

    fp8, bf16 = loss(matmul_dtype="e4m3", fp8_policy="all", document_masking=True), loss(document_masking=True)
    plain = loss(matmul_dtype="e4m3", fp8_policy="all")
    assert np.isfinite(fp8) and abs(fp8 - bf16) < 0.5 * abs(plain - bf16), (fp8, bf16, plain)


def test_cuda_graphs_are_refused_in_one_line():
    opts = Options(document_masking=True, use_cuda_graphs=True)
    with pytest.raises(OptionsError, match=r"--use-cuda-graphs does not support --document-masking") as e:
        check_cuda_graphs(opts, world=1, device_type="cuda")
    assert "\n" not in str(e.value)
    assert not cuda_graphs_on(CFG, Options(document_masking=True), world=1, device_type="cuda")  # auto: off


def test_memory_plan_states_what_document_masking_adds():
    """varlen (bf16 on CUDA): the documents' offsets only; masked: the (B, 1, T, T) mask and, with GQA (CFG: 4 heads,
    2 key/value heads), each layer's expanded key/value heads."""
    from qtrain.plan.resolution import plan_memory
    B, T, L, E = 2, 16, CFG.num_hidden_layers, 4
    base = dict(batch_size=B, seq_len=T, document_masking=True)
    varlen = plan_memory(CFG, Options(model_dtype="bf16", **base), device="cuda").item("document masks")
    assert varlen.device == 4 * (B * T + 1) and "offsets only" in varlen.detail
    masked = plan_memory(CFG, Options(model_dtype="fp32", **base), device="cuda")
    assert masked.item("document masks").device == B * T * T + L * 2 * B * T * 4 * (CFG.hidden_size // 4) * E
    assert "document masks" not in [i.name for i in plan_memory(CFG, Options(), device="cuda").items]
