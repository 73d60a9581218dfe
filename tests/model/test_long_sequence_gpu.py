"""One long sequence on the GPU, as --fit-memory runs it (LM head in chunks, the block recomputed, compiled bf16
blocks): the training loss equals a reference computed in chunks in fp32. Marked gpu: run on the GPU machine.

The reference: the same bf16 weights cast to fp32, hidden states in fp32 (SDPA over the whole sequence), and the LM
head + loss in chunks of 4096 tokens, so no buffer holds the logits of all tokens. Tolerance: the bf16 run rounds
every activation to 8 significant bits (unit roundoff 2^-9 = 2e-3) through 4 blocks and a recomputation; the loss
is a mean over 65536 tokens whose rounding errors are not all of one sign, and the measured gap of the 2-layer fp32/
bf16 comparisons at 1k tokens (tests/model/test_transformer.py's GPU test) is below 1e-2 relative; 1.5e-2 relative
here leaves room for the longer softmax sums (65536 terms in bf16 inputs, fp32 accumulation).
"""
from __future__ import annotations

import pytest
import torch

from qtrain.model.init import init_params
from qtrain.model.llama import LlamaConfig
from qtrain.model.transformer import RunOptions, Transformer, allocate_params
from qtrain.parallel.weights.replicated import ParamWeights
from tests.model.test_transformer import Collect

T = 65536
CFG = LlamaConfig(model_type="llama", vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192, rope_theta=500000.0,
                  tie_word_embeddings=False, attention_bias=False,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compile_", [False, True])
def test_long_sequence_loss_equals_a_chunked_fp32_reference(compile_):
    dev = torch.device("cuda")
    assert CFG.context_length >= T
    params = allocate_params(CFG, dtype=torch.bfloat16, device=dev, requires_grad=False)
    init_params(CFG, params, seed=0)
    g = torch.Generator(device="cpu").manual_seed(1)
    inputs = torch.randint(0, CFG.vocab_size, (1, T), generator=g).to(dev)
    targets = torch.randint(0, CFG.vocab_size, (1, T), generator=g).to(dev)

    run = RunOptions(lmhead_chunks=4, recompute=frozenset({"block"}), compile=compile_)
    bf16 = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    sink = Collect()
    loss = Transformer(CFG, run).forward_backward(ParamWeights(CFG, bf16), inputs, targets, grads=sink,
                                                  loss_scale=1.0 / T).float().item()
    assert all(torch.isfinite(v).all() for v in sink.grads.values())

    fp32 = {k: v.float() for k, v in params.items()}
    ref_sum, n = Transformer(CFG, RunOptions(lmhead_chunks=16)).loss_sum(ParamWeights(CFG, fp32), inputs, targets)
    ref = (ref_sum / n).item()
    assert abs(loss - ref) <= 1.5e-2 * abs(ref), (loss, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mlp_slices_keep_the_numbers_and_lower_the_peak():
    """--mlp-chunks 8 on the same 65536-token step (compiled, block recomputed): the loss and gradients of the unsliced
    run, and a lower allocator peak, by at least half of what the plan says the slices save.

    Tolerance: each token's MLP is its own, but a slice's GEMMs have 1/8 of the rows, so cuBLAS may tile them
    otherwise and the bf16 outputs differ in the last bit here and there; the weight gradients add 8 bf16 partial sums
    (2^-9 each). So the loss within 1e-3 relative (a mean over 65536 tokens) and each gradient's cosine above 0.999
    (bf16 noise is ~1e-3 of a gradient's norm; a wrong slice, e.g. a rerun of other rows, gives cosines far lower)."""
    from qtrain.options import Options
    from qtrain.plan.resolution import plan_memory

    dev = torch.device("cuda")
    params = allocate_params(CFG, dtype=torch.bfloat16, device=dev, requires_grad=False)
    init_params(CFG, params, seed=0)
    g = torch.Generator(device="cpu").manual_seed(1)
    inputs = torch.randint(0, CFG.vocab_size, (1, T), generator=g).to(dev)
    targets = torch.randint(0, CFG.vocab_size, (1, T), generator=g).to(dev)
    out = {}
    for n in (1, 8):
        run = RunOptions(lmhead_chunks=16, recompute=frozenset({"block"}), compile=True, mlp_chunks=n)
        w = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        model, sink = Transformer(CFG, run), Collect()
        model.forward_backward(ParamWeights(CFG, w), inputs, targets, grads=Collect(), loss_scale=1.0 / T)  # compile
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = model.forward_backward(ParamWeights(CFG, w), inputs, targets, grads=sink, loss_scale=1.0 / T)
        torch.cuda.synchronize()
        out[n] = (loss.float().item(), sink.grads, torch.cuda.max_memory_allocated() - base)
        del w, model
    (l1, g1, p1), (l8, g8, p8) = out[1], out[8]
    assert abs(l8 - l1) <= 1e-3 * abs(l1), (l8, l1)
    for k in g1:
        c = torch.nn.functional.cosine_similarity(g1[k].flatten().float(), g8[k].flatten().float(), dim=0).item()
        assert c > 0.999, (k, c)
    planned = [plan_memory(CFG, Options(batch_size=1, seq_len=T, recompute_block=True, lmhead_chunks=16,
                                        mlp_chunks=n), gpu_memory=80 << 30).phases["block_backward"] for n in (1, 8)]
    assert p1 - p8 >= 0.5 * (planned[0] - planned[1]), (p1, p8, planned)
