"""Turn `--model` (empty, a tiny model's or a preset's name, a directory, or `org/name`) into a config and the
directory its weights and tokenizer come from, never downloading.

Training machines are often offline, and a silent download of gigabytes is never what a training run
should do. So `org/name` is only looked up in the local Hugging Face cache, and when it is not there
the error names every place that was searched, so the user knows where to put it.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from qtrain.model.config import ModelConfig
from qtrain.model.context_extension import extend_context
from qtrain.model.hf_io import load_model_config
from qtrain.model.llama import LlamaConfig
from qtrain.model.registry import PRESETS, preset

TINY_NAME = "qtrain-tiny"


class ModelNotFoundError(ValueError):
    """The spec is neither an existing directory nor a model in any local HF cache."""


def hf_cache_dirs() -> list[Path]:
    """HF hub cache folders to search, most specific first (the order huggingface_hub honours)."""
    dirs: list[Path] = []
    if os.environ.get("HF_HUB_CACHE"):
        dirs.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        dirs.append(Path(os.environ["HF_HOME"]) / "hub")
    if os.environ.get("XDG_CACHE_HOME"):
        dirs.append(Path(os.environ["XDG_CACHE_HOME"]) / "huggingface" / "hub")
    dirs.append(Path.home() / ".cache" / "huggingface" / "hub")
    unique: list[Path] = []
    for d in dirs:
        if d not in unique:
            unique.append(d)
    return unique


def _snapshot(repo_dir: Path) -> Path | None:
    """The snapshot folder of one cached repo: the one refs/main names, else the only one."""
    snaps = repo_dir / "snapshots"
    found = sorted(p for p in snaps.iterdir() if p.is_dir()) if snaps.is_dir() else []
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        named = snaps / ref.read_text(encoding="utf-8").strip()
        if named.is_dir():
            return named
    if len(found) == 1:
        return found[0]
    if not found:
        return None
    raise ModelNotFoundError(
        f"{repo_dir}: {len(found)} snapshots ({', '.join(p.name for p in found)}) and no refs/main naming "
        f"one of them; pass the snapshot directory you want explicitly")


def resolve_model_dir(spec: str) -> Path:
    """An existing directory as is; else `org/name` from the local HF cache; else ModelNotFoundError."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    searched = [f"{path} (as a directory)"]
    parts = spec.split("/")
    is_repo_id = len(parts) == 2 and all(parts) and not spec.startswith((".", "~"))
    if is_repo_id:
        folder = "models--" + spec.replace("/", "--")
        for cache in hf_cache_dirs():
            repo_dir = cache / folder
            snap = _snapshot(repo_dir) if repo_dir.is_dir() else None
            if snap is not None:
                return snap
            searched.append(f"{repo_dir}/snapshots/<snapshot>")
    hint = ("qtrain never downloads; fetch it first (e.g. `huggingface-cli download ORG/NAME`) or pass a local "
            "directory" if is_repo_id else "pass an existing directory or an ORG/NAME found in the local HF cache")
    raise ModelNotFoundError(f"model {spec!r} not found; searched:\n  " + "\n  ".join(searched) + f"\n{hint}")


# The embedded default model: small enough to train on a CPU in minutes, with the GPT-2 BPE vocabulary of
# the embedded corpus (50257 tokens, padded to a multiple of 64 for efficient GEMMs). Llama layout: transformers
# >= 5 loads the tokenizer of every qwen2-type model as its Qwen2Tokenizer, which swaps in Qwen's pre-tokenizer
# and would encode this GPT-2 data differently (digits, contractions); a llama-type export keeps its tokenizer.
TINY = LlamaConfig(model_type="llama", vocab_size=50304, hidden_size=128, intermediate_size=384,
                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                   rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False,
                   bos_token_id=50256, eos_token_id=50256)
# The tiny presets: that shape with the vocabulary of each tokenizer `qtrain tokenize` has built in, so its token
# files train a model in seconds a step on a laptop's CPU. gpt2: the embedded default itself. qwen2: Qwen2.5's
# 151665 tokens (data/tokenize.py, specials included) padded to a multiple of 64 (Qwen pads its embeddings too), a
# qwen2-type model (QKV bias) so that transformers pairs the export with Qwen's tokenizer; EOS as Qwen2.5's.
TINY_QWEN2 = dataclasses.replace(TINY, model_type="qwen2", vocab_size=151680, attention_bias=True,
                                 bos_token_id=151643, eos_token_id=151643)
# --model names of the tiny models: from scratch always (there are no weights to load, so no --from-scratch is
# needed), and with the small-model defaults (options.SMALL_MODEL_DEFAULTS) like the embedded default
TINY_MODELS = {TINY_NAME: TINY, "tiny-gpt2": TINY, "tiny-qwen2": TINY_QWEN2}


@dataclass
class ModelSource:
    cfg: ModelConfig
    weights_dir: str | None  # HF directory to load weights from (None: from scratch)
    tokenizer_dir: str | None  # where tokenizer files to copy along with exports live


def is_tiny(model: str) -> bool:
    """`--model` names the embedded default or a tiny preset (TINY_MODELS, case-insensitive), or is empty."""
    return not model or model.lower() in TINY_MODELS


def _is_preset(model: str) -> bool:
    """`--model` names a built-in preset (case-insensitive; an `org/` prefix is ignored, e.g. Qwen/Qwen2.5-7B)."""
    key = model.rsplit("/", 1)[-1].lower()
    return any(k.lower() == key for k in PRESETS)


def resolve_model(model: str, *, from_scratch: bool = False, rope_scaling: str = "", seq_len: int = 0
                  ) -> ModelSource:
    """`--model` as llm.q reads it: empty (or "qtrain-tiny") -> the embedded tiny model; a tiny preset (TINY_MODELS,
    with or without `from_scratch`); a preset name with `from_scratch`; else a directory or `org/name` in the local
    HF cache (never downloaded). `rope_scaling`, `seq_len`: --rope-scaling and --seq-len, which extend the model's
    context (`context_extension.extend_context`)."""
    source = _resolve(model, from_scratch)
    return dataclasses.replace(source, cfg=extend_context(source.cfg, rope_scaling, seq_len))


def _resolve(model: str, from_scratch: bool) -> ModelSource:
    if is_tiny(model):
        return ModelSource(TINY_MODELS[model.lower()] if model else TINY, None, None)
    if from_scratch and not os.path.isdir(model) and _is_preset(model):
        return ModelSource(preset(model), None, None)
    try:
        d = resolve_model_dir(model)
    except ModelNotFoundError as e:
        if not from_scratch and _is_preset(model):
            raise ModelNotFoundError(f"{e}\n{model!r} is also a built-in preset: add --from-scratch to train it from "
                                     f"random weights (presets have no weights to load)") from None
        raise
    cfg = load_model_config(d)
    return ModelSource(cfg, None if from_scratch else str(d), str(d))
