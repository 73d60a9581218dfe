"""Token sets: the files one `qtrain tokenize` writes into its out-dir, published as a whole, and how readers
tell a whole set from part of one.

A set is its shards (`train.bin` or `train-000.bin`, `train-001.bin`, ...; the same for `eval`) and its index
`qtrain-tokenize.json`: the set id, and per shard its split, "i of n", token count, size, the sha256 of its tokens
and masks and a sampled digest (`token_scan.file_fingerprint`). Each shard's header also carries the set id and
its "i of n" (`token_files.TokenSetTag`, in bytes llm.q's reader ignores). The set id is a digest of the
shards' contents (`content_id`): the same input gives the same files, a different output another id.

Writing (`TokenSetWriter`), the export's rule (`model/hf_io.py`) for token files:
  1. claim the out-dir: an exclusive `flock` on it (a second tokenize into it is refused), sweep what killed
     tokenizes left (temp files whose writer is dead), refuse a file with an output name that no index lists
     (the user's own `train.bin`: never overwritten), and refuse an earlier complete output unless `overwrite`;
  2. the caller stages every shard under a temp name, fsynced (`TokenFileWriter.finish`);
  3. publish: stamp the set's tag into each staged header; write the index saying `"complete": false`, listing
     the old files and the new; rename each shard onto its name (a rename replaces the old file of that name, so
     nothing is unlinked before its successor exists); write the index saying `"complete": true` (the commit
     point); unlink the old files the new set no longer has; drop them from the index.
A kill at any moment leaves a state readers recognise: temp names nobody reads, or an index that says
incomplete, or old shards whose set id is not the index's.

Reading (`check_token_sets`, run by the TokenLoader on every file it is given, so by the preflight and the run):
a file that is a set's shard (its header says so, or its folder's index lists it) is accepted only when that
index says complete, names its set, lists it, and its size, token count, "i of n" and sampled digest match.
Without an index, the files given must hold every shard of each split they draw from (by their headers).
Files that are no set's shards (llm.q's, `write_token_file`'s) are read as before.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from qtrain.data.token_files import (DataError, TokenFileHeader, TokenFileWriter, TokenSetTag, read_token_file_header,
                                     stamp_token_set)
from qtrain.data.token_scan import file_fingerprint
from qtrain.fsio import (InputError, atomic_write_json, fault_point, fsync_path, is_stale, owner_tag, read_bounded,
                         shorten, sweep_temp_files)

INDEX = "qtrain-tokenize.json"
WRITER = "qtrain tokenize"
MAX_INDEX_BYTES = 64 << 20  # an index of 100k shards is ~30 MB
SPLITS = ("train", "eval")
# names a tokenize writes: what a later one may replace (if an index lists it) or must not (if none does)
OUTPUT_NAME = re.compile(r"^(train|eval)(-\d{3,})?\.bin$")
# what qtrain versions before token sets left of killed tokenizes: `.train-part000.bin.tmp.PID` and, renamed
# from it, `.train-part000.bin`
_LEGACY_PART = re.compile(r"^\.(train|eval)-part\d{3,}\.bin(\.tmp\.(?P<pid>\d+))?$")


class TokenSetError(DataError):
    """A token set that cannot be written as asked, or read as given; the message names the file or folder."""


def shard_names(split: str, count: int) -> list[str]:
    """`train.bin` for one shard, else `train-000.bin`, `train-001.bin`, ..."""
    return [f"{split}.bin"] if count == 1 else [f"{split}-{i:03d}.bin" for i in range(count)]


# ---------------------------------------------------------------------------------------------- the index

@dataclass
class Index:
    """A parsed `qtrain-tokenize.json`."""
    path: Path
    set_id: str
    complete: bool
    files: set[str]  # every name the set's writer owns there (the set's shards, and old ones not yet removed)
    shards: dict[str, dict[str, Any]]  # name -> its record
    eos_id: int | None = None  # the EOS id the tokenizer appended after every document (--document-masking reads it)

    def describe(self) -> str:
        return f"{self.path} (token set {self.set_id}{'' if self.complete else ', incomplete'})"


def read_index(directory: str | os.PathLike) -> Index | None:
    """The index in `directory`, None when there is none; a TokenSetError when one is there but is not an index
    qtrain tokenize wrote."""
    path = Path(directory) / INDEX
    if not os.path.lexists(path):
        return None
    try:
        man = json.loads(read_bounded(path, "token set index", MAX_INDEX_BYTES))
    except (InputError, ValueError, RecursionError) as e:
        why = str(e) if isinstance(e, InputError) else f"{path}: not JSON ({shorten(str(e), 100)})"
        raise TokenSetError(f"{why}; it is not the index of a qtrain tokenize") from None
    ok = (isinstance(man, dict) and man.get("writer") == WRITER and isinstance(man.get("set"), str)
          and isinstance(man.get("files"), list) and isinstance(man.get("shards"), list)
          and all(isinstance(r, dict) and isinstance(r.get("name"), str) for r in man["shards"]))
    if not ok:
        raise TokenSetError(f"{path}: not the index of a qtrain tokenize (writer, set, files or shards missing)")
    eos = man.get("eos_id")
    return Index(path, man["set"], man.get("complete") is True,
                 {n for n in man["files"] if isinstance(n, str) and OUTPUT_NAME.match(n)},
                 {r["name"]: r for r in man["shards"]}, eos if type(eos) is int and eos >= 0 else None)


# ---------------------------------------------------------------------------------------------- writing

def content_id(shards: Mapping[str, Sequence[TokenFileWriter]], info: Mapping[str, Any]) -> str:
    """A set's id: a digest of `info` (tokenizer, vocabulary), its layout and every shard's tokens and masks, so
    the same input and settings give the same files (tokenize is deterministic), and any other output another id."""
    h = hashlib.sha256(b"qtrain-token-set-v1" + json.dumps(dict(info), sort_keys=True, default=str).encode())
    for split, parts in sorted(shards.items()):
        for i, w in enumerate(parts):
            h.update(f"|{split} {i} {len(parts)} {w.num_tokens} {w.sha256}".encode())
    return h.hexdigest()[:16]


class TokenSetWriter:
    """Claims an out-dir for one `qtrain tokenize` (step 1 of the module docstring), then publishes the staged
    shards as one set (step 3). `close()` releases the claim; use as a context manager."""

    def __init__(self, out_dir: str | os.PathLike, *, overwrite: bool = False) -> None:
        self.out = Path(out_dir)
        if self.out.exists() and not self.out.is_dir():
            raise TokenSetError(f"--out-dir {self.out}: exists and is not a directory")
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TokenSetError(f"--out-dir {self.out}: cannot be created ({e.strerror})") from None
        if not os.access(self.out, os.W_OK):  # a read-only folder or file system: refused before any work
            raise TokenSetError(f"--out-dir {self.out}: is not writable")
        self._lock = os.open(self.out, os.O_RDONLY)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            raise TokenSetError(f"--out-dir {self.out}: another qtrain tokenize is writing into it (it holds the "
                                f"folder's lock); wait for it or choose another folder") from None
        try:
            self.swept = self._sweep()
            self.old = self._check_claim(overwrite)
        except BaseException:
            self.close()
            raise

    def _sweep(self) -> list[Path]:
        """Remove what killed tokenizes left: temp files of dead writers (`.NAME.tmp-HOST-PID`) and the hidden
        part files of older qtrain versions (under this folder's lock, no live tokenize of ours uses them)."""
        removed = sweep_temp_files(self.out)
        for p in self.out.iterdir():
            m = _LEGACY_PART.match(p.name)
            if m and p.is_file() and not p.is_symlink():
                pid = m.group("pid")
                if pid is None or is_stale(f"{owner_tag().rsplit('-', 1)[0]}-{pid}"):
                    p.unlink(missing_ok=True)
                    removed.append(p)
        return sorted(removed)

    def _check_claim(self, overwrite: bool) -> set[str]:
        """The names of the earlier output this set replaces; refuses the user's files and, without `overwrite`,
        an earlier complete output."""
        index = read_index(self.out)
        ours = index.files if index else set()
        foreign = sorted(p.name for p in self.out.iterdir() if OUTPUT_NAME.match(p.name) and p.name not in ours)
        if foreign:
            raise TokenSetError(f"--out-dir {self.out}: {', '.join(foreign[:4])}{' ...' if len(foreign) > 4 else ''} "
                                f"exist(s) and no qtrain tokenize wrote them (its index {INDEX} does not list them); "
                                f"qtrain does not overwrite them: choose another folder or move them away")
        present = sorted(n for n in ours if (self.out / n).exists())
        if index and index.complete and present and not overwrite:
            raise TokenSetError(f"--out-dir {self.out}: holds the output of an earlier qtrain tokenize (token set "
                                f"{index.set_id}: {', '.join(present[:4])}{' ...' if len(present) > 4 else ''}); "
                                f"--overwrite replaces it")
        return ours  # an incomplete index: an interrupted tokenize's files, replaced without --overwrite

    def publish(self, shards: Mapping[str, Sequence[TokenFileWriter]], **info: Any) -> dict[str, list[str]]:
        """Publish finished, staged shards ({split: writers in order}) as one set; `info` (tokenizer, vocab size)
        goes into the index. Returns {split: published paths}."""
        set_id = content_id(shards, info)
        records, temps = [], {}
        for split, parts in shards.items():
            for i, (w, name) in enumerate(zip(parts, shard_names(split, len(parts)))):
                stamp_token_set(w.temp, TokenSetTag(set_id, split, i, len(parts)))
                fp = file_fingerprint(w.temp)
                records.append({"name": name, "split": split, "index": i, "count": len(parts), "tokens": w.num_tokens,
                                "size": fp["size"], "sha256": w.sha256, "digest": fp["digest"]})
                temps[name] = w.temp
        fault_point("tokenize.staged")
        new = set(temps)
        head = {"format": 1, "writer": WRITER, "set": set_id, **info}

        def write_index(complete: bool, files: set[str]) -> None:
            atomic_write_json(self.out / INDEX, {**head, "complete": complete, "files": sorted(files),
                                                 "shards": records}, point="tokenize.index")

        write_index(False, self.old | new)
        for name, temp in temps.items():
            os.replace(temp, self.out / name)
            fault_point("tokenize.rename")
        fsync_path(self.out)
        leftover = self.old - new
        write_index(True, new | leftover)  # the commit point
        for name in sorted(leftover):
            (self.out / name).unlink(missing_ok=True)
            fault_point("tokenize.unlink")
        if leftover:
            write_index(True, new)
        return {split: [str(self.out / n) for n in shard_names(split, len(parts))] if parts else []
                for split, parts in shards.items()}

    def close(self) -> None:
        if self._lock is not None:
            os.close(self._lock)  # releases the flock
            self._lock = None

    def __enter__(self) -> "TokenSetWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------- reading

def check_token_sets(files: Sequence[str]) -> list[str]:
    """`files` as they are, once every file that is a token set's shard passed the checks of the module docstring;
    a TokenSetError naming the file, the set and what is wrong otherwise."""
    indexes: dict[str, Index | None] = {}
    unindexed: dict[tuple[str, str, str], list[tuple[str, TokenSetTag]]] = {}
    for f in files:
        header = read_token_file_header(f)
        folder, name = os.path.split(os.path.realpath(f))
        if folder not in indexes:
            try:
                indexes[folder] = read_index(folder)
            except TokenSetError as e:
                if header.token_set is not None:
                    raise TokenSetError(f"{f}: {header.token_set}, but its folder's index is unusable: {e}") from None
                indexes[folder] = None
        index, tag = indexes[folder], header.token_set
        if tag is None and (index is None or name not in index.files):
            continue  # not a set's shard: llm.q's file, or one written by write_token_file
        if index is None:
            unindexed.setdefault((folder, tag.set_id, tag.split), []).append((f, tag))
            continue
        _check_shard(f, name, header, index)
    for (folder, set_id, split), got in unindexed.items():
        count = got[0][1].count
        have = {t.index for _, t in got if t.count == count}
        if len(have) != count or len(got) != count:
            missing = [n for i, n in enumerate(shard_names(split, count)) if i not in have]
            raise TokenSetError(f"{got[0][0]}: the files given hold {len(have)} of the {count} {split} shards of "
                                f"token set {set_id} (missing: {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''})"
                                f" and its index {os.path.join(folder, INDEX)} is missing: give the whole set, or "
                                f"run qtrain tokenize again")
    return list(files)


def _check_shard(f: str, name: str, header: TokenFileHeader, index: Index) -> None:
    tag = header.token_set
    what = f"{f}: {tag}" if tag else f"{f}: listed by {index.path}"
    if not index.complete:
        earlier = "" if tag and tag.set_id == index.set_id else " (this file is left over from an earlier output)"
        raise TokenSetError(f"{what}, but its folder's index {index.path} says token set {index.set_id} is "
                            f"incomplete{earlier}: a qtrain tokenize into {index.path.parent} was interrupted (or is "
                            f"still running); run it again")
    if tag is None or tag.set_id != index.set_id or name not in index.shards:
        raise TokenSetError(f"{what}, but the index {index.describe()} does not list it as one of its shards: it is "
                            f"left over from an earlier qtrain tokenize there; run qtrain tokenize again")
    rec = index.shards[name]
    fp = file_fingerprint(f)
    want = {"split": rec.get("split"), "i of n": (rec.get("index"), rec.get("count")), "tokens": rec.get("tokens"),
            "size": rec.get("size"), "sampled digest": rec.get("digest")}
    got = {"split": tag.split, "i of n": (tag.index, tag.count), "tokens": header.num_tokens, "size": fp["size"],
           "sampled digest": fp["digest"]}
    wrong = [k for k in want if want[k] != got[k]]
    if wrong:
        k = wrong[0]
        raise TokenSetError(f"{what}, but it does not match its index {index.describe()}: {k} "
                            f"{shorten(got[k], 80)} where the index says {shorten(want[k], 80)}; the file changed "
                            f"after qtrain tokenize wrote it: run qtrain tokenize again")
