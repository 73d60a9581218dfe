"""The embedded default corpus: English text every Python installation already carries offline.

``qtrain train`` without data arguments trains on this, so a first run needs no download and no
tokenize step. Documents, in a fixed order:

* the 79-odd help topics of ``pydoc_data.topics`` (the language reference behind ``help("if")`` etc.,
  ~460 KB of English prose), one document per topic, sorted by name;
* the docstrings (module, class, function) of the top-level standard-library modules, read with
  ``ast`` from their sources (nothing is imported, so no module side effects), one document per module.

Together that is ~1.3 MB of text, ~300k GPT-2 tokens: enough for a small model to visibly learn.
Whole documents worth ~5% of the tokens, spread along the corpus, are held out as the eval set.

Tokenizer: GPT-2 BPE (vocab 50257, built in, offline). A small vocabulary keeps the embedding and LM
head of the tiny default model small (151k Qwen ids would make the head dominate a small model's
parameters and step time), and GPT-2's ids are a well-known reference. Any other ``get_tokenizer``
spec works too.

Results are cached under ``out_dir/default-<tokenizer>-<hash>/`` where the hash covers the raw sources
(topic texts and stdlib file bytes), the tokenizer and ``CORPUS_VERSION``: a different Python
installation gets its own, still deterministic, dataset; a second call only hashes (~tens of ms).
"""

from __future__ import annotations

import ast
import hashlib
import os
import sysconfig
from pathlib import Path

import numpy as np

from qtrain.data.token_files import DataError, read_token_file_header, write_token_file
from qtrain.data.tokenize import HoldOut
from qtrain.data.tokenizers import get_tokenizer

CORPUS_VERSION = 2
EVAL_FRACTION = 0.05


def _topics() -> dict[str, str]:
    try:
        from pydoc_data.topics import topics  # absent from some minimal distro builds
    except ImportError:
        return {}
    return dict(topics)


def _stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.is_file())


def _docstrings(source: bytes) -> str:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    parts = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                parts.append(doc)
    return "\n\n".join(parts)


def _fingerprint(tokenizer: str, topics: dict[str, str], sources: list[Path]) -> str:
    h = hashlib.sha256(f"qtrain-corpus-v{CORPUS_VERSION}|{tokenizer}|".encode())
    for name in sorted(topics):
        h.update(name.encode() + b"\0" + topics[name].encode() + b"\0")
    for p in sources:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def default_documents() -> list[str]:
    """The corpus documents in their fixed order (topics by name, then stdlib modules by file name)."""
    topics = _topics()
    docs = [topics[k].strip() for k in sorted(topics)]
    docs += [d for p in _stdlib_sources() if (d := _docstrings(p.read_bytes()).strip())]
    return docs


def _valid(path: Path) -> bool:
    try:
        read_token_file_header(path)
        return True
    except DataError:
        return False


def ensure_default_dataset(out_dir: str | os.PathLike[str], tokenizer: str = "gpt2") -> tuple[str, str]:
    """Build (once) and return ``(train_path, eval_path)`` of the default corpus token files."""
    topics, sources = _topics(), _stdlib_sources()
    safe = "".join(c if c.isalnum() else "_" for c in tokenizer)[-40:]
    target = Path(out_dir) / f"default-{safe}-{_fingerprint(tokenizer, topics, sources)}"
    train, evals = target / "train.bin", target / "eval.bin"
    if _valid(train) and _valid(evals):
        return str(train), str(evals)

    tok = get_tokenizer(tokenizer)
    docs = default_documents()
    if not docs:
        raise DataError(f"{target}: this Python installation has neither pydoc_data nor stdlib sources to build a corpus")
    split: dict[bool, list[int]] = {False: [], True: []}
    hold_out = HoldOut(EVAL_FRACTION)
    for doc in docs:
        ids = [*tok.encode(doc), tok.eos_id]
        split[hold_out.is_eval(len(ids))].extend(ids)
    # write_token_file renames atomically, so concurrent builders (several ranks) at worst do it twice.
    write_token_file(evals, np.asarray(split[True], dtype=np.int32), vocab_size=tok.vocab_size)
    write_token_file(train, np.asarray(split[False], dtype=np.int32), vocab_size=tok.vocab_size)
    return str(train), str(evals)
