"""Tokenizer files for Hugging Face tools: what an export needs so that `AutoTokenizer`, lm-evaluation-harness,
vLLM and llama.cpp's converter can use it.

* `builtin_tokenizer_json(name)`: the built-in tiktoken tokenizers (`qwen2`, `gpt2`; `qtrain.data.tokenizers`)
  written as a `tokenizers` byte-level BPE that encodes exactly as they do: the same vocabulary (GPT-2's
  byte-to-unicode alphabet, id = tiktoken rank), merges recovered from the ranks (a token of rank r is the
  merge of the two parts that BPE with all lower ranks leaves of its bytes: the conversion transformers'
  `TikTokenConverter` does), the same pre-tokenizer regex (as a `Split` before a regex-free `ByteLevel`), NFC
  for Qwen2, and the special tokens at their ids. `ignore_merges` makes it look a whole pre-token up in the
  vocabulary first, as tiktoken does.
* `tokenizer_files(spec)`: every tokenizer file of an export for a tokenizer spec (`qwen2` | `gpt2` |
  a tokenizer.json | a model directory), as {file name: bytes}: a directory's own files are copied as they
  are; a built-in or a bare tokenizer.json gets a generated `tokenizer_config.json` and `special_tokens_map.json`.
* `export_tokenizer(...)`: which tokenizer an export carries: `--tokenizer` if given, else the model
  directory's files, else the one the token files record in their header (`qtrain tokenize` writes it), else
  the built-in their vocab field implies (llm.q's files: 151643 -> qwen2, 50257 -> gpt2, see
  `token_files.VOCAB_FAMILIES`); None when nothing says.
* `export_files(spec, cfg)`: the files an export adds beside config.json and the weights: the tokenizer's,
  and a minimal `generation_config.json` (bos / eos / pad ids) when the source had none.
* `transformers_caveat(spec, cfg)`: transformers >= 5 loads the tokenizer of every qwen2-type model as its
  `Qwen2Tokenizer`, which rebuilds the tokenizer with Qwen's pre-tokenizer whatever tokenizer.json says; for a
  qwen2 model with another tokenizer (a Qwen preset trained on GPT-2 data) that encodes differently, so the
  run says so and how to load the exact tokenizer.
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any, Sequence

from qtrain.data.token_files import TokenFileHeader, tokenizer_family
from qtrain.data.tokenizers import (BUILTIN_TOKENIZERS, QWEN2_PATTERN, TOKENIZER_JSON_MAX_BYTES, TiktokenTokenizer,
                                    TokenizeError, Tokenizer, builtin_unavailable, get_tokenizer)
from qtrain.fsio import read_bounded, shorten
from qtrain.model.config import ModelConfig
from qtrain.model.hf_io import GENERATION_CONFIG, TOKENIZER_FILES, check_export_complete


class TokenizerExportError(ValueError):
    """A tokenizer that cannot be written into an export (unknown spec, no tokenizer files)."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the alphabet of every byte-level BPE vocabulary)."""
    keep = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    table = {b: chr(b) for b in keep}
    table.update({b: chr(256 + k) for k, b in enumerate(b for b in range(256) if b not in table)})
    return table


@functools.lru_cache(maxsize=4)
def builtin_tokenizer_json(name: str) -> str:
    """The tokenizer.json (as text) of built-in tokenizer `name`; see the module docstring. Takes a few seconds
    for Qwen2's 151k merges (cached per process)."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTok

    tok = get_tokenizer(name)
    if not isinstance(tok, TiktokenTokenizer):
        raise TokenizerExportError(f"{name}: not a built-in tokenizer ({', '.join(BUILTIN_TOKENIZERS)})")
    enc = tok.encoding
    ranks: dict[bytes, int] = enc._mergeable_ranks  # tiktoken keeps the ranks it was built from
    alphabet = str.maketrans({chr(b): c for b, c in _bytes_to_unicode().items()})

    def unicode(b: bytes) -> str:
        return b.decode("latin-1").translate(alphabet)

    vocab = {unicode(b): r for b, r in ranks.items()}
    # tiktoken merges, at every step, the adjacent pair whose concatenation has the lowest rank: that is a
    # BPE whose merges are every split (x, y) of every token t, at t's priority. (A split whose parts are not
    # both older than t could never be adjacent before t is due, so it is left out.)
    merges = []
    for b, r in sorted(ranks.items(), key=lambda kv: kv[1]):
        merges.extend((unicode(b[:i]), unicode(b[i:])) for i in range(1, len(b))
                      if ranks.get(b[:i], r) < r and ranks.get(b[i:], r) < r)
    hf = HFTok(models.BPE(vocab=vocab, merges=merges, ignore_merges=True, fuse_unk=False, byte_fallback=False))
    if tok.nfc:
        hf.normalizer = normalizers.NFC()
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(enc._pat_str), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    hf.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = sorted(enc._special_tokens.items(), key=lambda kv: kv[1])
    hf.add_special_tokens([AddedToken(s, special=True, normalized=False) for s, _ in specials])
    got = {s: hf.token_to_id(s) for s, _ in specials}
    if got != dict(specials):
        raise TokenizerExportError(f"{name}: special token ids {got} differ from the built-in's {dict(specials)}")
    return hf.to_str()


def _added_tokens_decoder(tokenizer_json: str) -> dict[str, dict[str, Any]]:
    """tokenizer_config.json's `added_tokens_decoder` from a tokenizer.json's `added_tokens`."""
    added = json.loads(tokenizer_json).get("added_tokens", [])
    keys = ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
    return {str(a["id"]): {k: a[k] for k in keys if k in a} for a in added}


def tokenizer_config(tok: Tokenizer, tokenizer_json: str, *, model_max_length: int | None = None) -> dict[str, Any]:
    """A `tokenizer_config.json` for a tokenizer.json that came without one: the generic fast tokenizer class
    (it loads tokenizer.json as it is), EOS / BOS / PAD by name, no BOS added to inputs."""
    decoder = _added_tokens_decoder(tokenizer_json)
    names = {int(i): d["content"] for i, d in decoder.items()}
    eos = names.get(tok.eos_id) or tok.decode([tok.eos_id])
    bos = names.get(tok.bos_id) if tok.bos_id is not None else None
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": decoder,
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": eos,  # batching tools (lm-eval, generate with several prompts) need one; masks hide it
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
    }
    if model_max_length:
        cfg["model_max_length"] = int(model_max_length)
    return cfg


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def _read(path: Path) -> bytes:
    """A tokenizer file to copy into an export: a regular file of bounded size (a FIFO would block the export)."""
    return read_bounded(path, "", TOKENIZER_JSON_MAX_BYTES)


def _text(data: bytes, path: Path) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TokenizerExportError(f"{path}: not a tokenizer.json qtrain can read (not UTF-8: {e.reason} at byte "
                                   f"{e.start})") from None


def tokenizer_files(spec: str, *, model_max_length: int | None = None) -> dict[str, bytes]:
    """All tokenizer files for an export from a tokenizer spec (see the module docstring). A tokenizer.json is
    parsed (`get_tokenizer`) unless it is copied beside its own tokenizer_config.json."""
    if spec in BUILTIN_TOKENIZERS:
        text = builtin_tokenizer_json(spec)
        tok = get_tokenizer(spec)
        files = {"tokenizer.json": text.encode("utf-8")}
    else:
        path = Path(spec)
        if path.exists():  # an interrupted qtrain export's files may be of two exports
            check_export_complete(path if path.is_dir() else path.parent)
        if path.is_dir():
            files = {n: _read(path / n) for n in TOKENIZER_FILES if os.path.lexists(path / n)}
            if not files:
                raise TokenizerExportError(f"{path}: no tokenizer files ({', '.join(TOKENIZER_FILES[:4])}, ...)")
            if "tokenizer_config.json" in files or "tokenizer.json" not in files:
                return files
            text = _text(files["tokenizer.json"], path / "tokenizer.json")
        elif path.is_file():
            text = _text(_read(path), path)
            files = {"tokenizer.json": text.encode("utf-8")}
            if os.path.lexists(path.parent / "tokenizer_config.json"):
                return {**files, "tokenizer_config.json": _read(path.parent / "tokenizer_config.json")}
        else:
            raise TokenizerExportError(f"tokenizer {shorten(repr(spec))}: not a built-in "
                                       f"({', '.join(BUILTIN_TOKENIZERS)}), nor an existing tokenizer.json or "
                                       f"directory")
        tok = get_tokenizer(spec)
    cfg = tokenizer_config(tok, text, model_max_length=model_max_length)
    special = {k: cfg[k] for k in ("bos_token", "eos_token", "pad_token") if cfg[k] is not None}
    return {**files, "tokenizer_config.json": _json_bytes(cfg), "special_tokens_map.json": _json_bytes(special)}


def has_tokenizer_files(model_dir: str | None) -> bool:
    return model_dir is not None and any((Path(model_dir) / n).is_file() for n in TOKENIZER_FILES
                                         if n != GENERATION_CONFIG)


def recorded_tokenizer(headers: Sequence[TokenFileHeader]) -> str | None:
    """The tokenizer token files were made with: the one their headers record (when all agree and it still
    exists), else the built-in their vocab field implies."""
    tags = {h.tokenizer for h in headers}
    if len(tags) == 1 and (tag := tags.pop()) is not None and (tag in BUILTIN_TOKENIZERS or Path(tag).exists()):
        return tag
    families = {tokenizer_family(h.vocab_size) for h in headers}
    if len(families) == 1 and (family := families.pop()) in BUILTIN_TOKENIZERS:
        return family
    return None


def unavailable_reason(spec: str | None) -> str | None:
    """Why the export could not write `spec`'s files on this machine (a built-in whose package is not
    installed), else None: checked when a run starts, so a missing package costs the tokenizer files, not the
    run's export at its end."""
    return builtin_unavailable(spec) if spec in BUILTIN_TOKENIZERS else None


def export_tokenizer(*, explicit: str = "", model_dir: str | None = None,
                     token_files: Sequence[TokenFileHeader] = ()) -> str | None:
    """The tokenizer spec an export carries (see the module docstring): a built-in's name or an absolute path
    (it is recorded in checkpoints, which `qtrain export` may read from another directory). An explicit spec
    must exist."""
    if explicit:
        if explicit in BUILTIN_TOKENIZERS:
            return explicit
        if not Path(explicit).exists():
            raise TokenizerExportError(f"--tokenizer {explicit!r}: not a built-in ({', '.join(BUILTIN_TOKENIZERS)}) "
                                       f"and no such file or directory")
        return str(Path(explicit).resolve())
    if has_tokenizer_files(model_dir):
        return str(Path(str(model_dir)).resolve())
    return recorded_tokenizer(token_files) if token_files else None


def check_export_tokenizer(spec: str | None, cfg: ModelConfig) -> None:
    """Make the files the export of a run will carry (`export_files`) now, before the model is built: a
    tokenizer file that cannot be read fails the preflight instead of the export after the last step. The
    built-ins are qtrain's own (a missing package only costs the files: `unavailable_reason`)."""
    if spec is not None and spec not in BUILTIN_TOKENIZERS:
        export_files(spec, cfg)


def export_files(spec: str | None, cfg: ModelConfig) -> dict[str, bytes]:
    """{file name: bytes} an export adds: the tokenizer files of `spec` (none if None) and, unless they include
    one, a generation_config.json with the tokenizer's EOS (else the model config's bos / eos / pad ids)."""
    files = tokenizer_files(spec, model_max_length=cfg.max_position_embeddings) if spec else {}
    if GENERATION_CONFIG not in files:
        eos, pad = cfg.eos_token_id, cfg.pad_token_id
        if spec in BUILTIN_TOKENIZERS or "tokenizer.json" in files:
            eos = get_tokenizer(spec).eos_id  # the data's EOS, also when the config was made for another tokenizer
            pad = eos if pad is None else pad
        d: dict[str, Any] = {"bos_token_id": cfg.bos_token_id, "eos_token_id": eos}
        if pad is not None:
            d["pad_token_id"] = pad
        files[GENERATION_CONFIG] = _json_bytes(d)
    return files


def _regexes(node: Any) -> list[str]:
    """Every Split regex in a tokenizer.json pre-tokenizer tree."""
    if isinstance(node, dict):
        pattern = node.get("pattern")
        own = [pattern["Regex"]] if isinstance(pattern, dict) and "Regex" in pattern else []
        return own + [r for v in node.values() for r in _regexes(v)]
    if isinstance(node, list):
        return [r for v in node for r in _regexes(v)]
    return []


def transformers_caveat(spec: str | None, cfg: ModelConfig) -> str | None:
    """A warning for exports that transformers >= 5 tokenizes differently from training (see the module docstring)."""
    if spec is None or cfg.model_type != "qwen2" or spec == "qwen2":
        return None
    if spec not in BUILTIN_TOKENIZERS:
        text = tokenizer_files(spec).get("tokenizer.json")
        if text is None or QWEN2_PATTERN in _regexes(json.loads(text).get("pre_tokenizer")):
            return None
    return (f"transformers >= 5 loads the tokenizer of a qwen2-type model as Qwen2Tokenizer, which uses Qwen's "
            f"pre-tokenizer instead of this export's ({spec}): digits and some whitespace then encode differently "
            f"from training. Load it exactly with transformers.PreTrainedTokenizerFast.from_pretrained(DIR) (or "
            f"tokenizers.Tokenizer.from_file(DIR/tokenizer.json)); transformers < 5 loads it as it is")
