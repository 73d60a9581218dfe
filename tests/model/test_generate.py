"""`qtrain.model.generate`: greedy decoding with qtrain's model code gives exactly the tokens of transformers'
`generate` on every supported model type (fp32, random weights: logit gaps are far above the kernel
differences), and the sampling filters keep exactly the tokens they promise.
"""
from __future__ import annotations

import pytest
import torch

from qtrain.model.generate import Sampling, SamplingError, generate, next_token_distribution
from qtrain.model.hf_io import load_hf_weights, load_model_config
from qtrain.model.transformer import Transformer
from qtrain.parallel.weights.replicated import ParamWeights

transformers = pytest.importorskip("transformers")
from tests.hf_fixtures import TINY_KINDS, tiny_hf_model  # noqa: E402


@pytest.mark.parametrize("kind", list(TINY_KINDS))
def test_greedy_equals_transformers_generate(kind, tmp_path):
    hf = tiny_hf_model(kind, seed=3)
    hf.save_pretrained(tmp_path)
    cfg = load_model_config(tmp_path)
    model, weights = Transformer(cfg), ParamWeights(cfg, load_hf_weights(tmp_path, cfg))
    prompt = [5, 17, 99, 3, 42, 7]
    ours = list(generate(model, weights, prompt, Sampling(max_new_tokens=20, temperature=0), stop_ids=[2]))
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=2,
                      pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == ref


def test_sampling_is_seeded_and_top_k_1_is_greedy(tmp_path):
    hf = tiny_hf_model("qwen2", seed=1)
    hf.save_pretrained(tmp_path)
    cfg = load_model_config(tmp_path)
    model, weights = Transformer(cfg), ParamWeights(cfg, load_hf_weights(tmp_path, cfg))

    def run(**kw):
        return list(generate(model, weights, [1, 2, 3], Sampling(max_new_tokens=10, **kw)))
    greedy = run(temperature=0)
    assert run(temperature=1.5, top_k=1) == greedy
    assert run(temperature=1.0, top_p=1e-6) == greedy  # only the most likely token survives a tiny nucleus
    a, b = run(temperature=2.0, seed=5), run(temperature=2.0, seed=5)
    assert a == b and a != run(temperature=2.0, seed=6)


def test_filters_keep_exactly_the_promised_tokens():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0])  # order: 1, 3, 2, 0, 4
    p = next_token_distribution(logits, Sampling(temperature=1.0, top_k=2))
    assert (p > 0).tolist() == [False, True, False, True, False]
    torch.testing.assert_close(p[[1, 3]], torch.softmax(torch.tensor([3.0, 2.0]), 0))
    full = torch.softmax(logits, 0)  # p(1) = 0.64, p(3) = 0.24, p(2) = 0.09
    keep = next_token_distribution(logits, Sampling(temperature=1.0, top_p=0.8))  # 0.64 < 0.8 <= 0.88
    assert (keep > 0).tolist() == [False, True, False, True, False]
    torch.testing.assert_close(keep.sum(), torch.tensor(1.0))
    torch.testing.assert_close(keep[1] / keep[3], full[1] / full[3])
    hot = next_token_distribution(logits, Sampling(temperature=0.5))
    torch.testing.assert_close(hot, torch.softmax(logits / 0.5, 0))


@pytest.mark.parametrize("kw,match", [
    ({"temperature": -1}, "--temperature"), ({"top_k": -2}, "--top-k"), ({"top_p": 0}, "--top-p"),
    ({"top_p": 1.5}, "--top-p"), ({"max_new_tokens": 0}, "--max-new-tokens"),
])
def test_bad_settings_name_the_flag(kw, match):
    with pytest.raises(SamplingError, match=match):
        Sampling(**kw).validate()


def test_empty_prompt_is_an_error():
    with pytest.raises(SamplingError, match="prompt is empty"):
        next(generate(None, None, [], Sampling()))  # type: ignore[arg-type]
