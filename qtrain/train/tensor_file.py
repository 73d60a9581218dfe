"""One safetensors file of a checkpoint, written and read in a single pass that also computes its digests.

The format is safetensors' own (an 8-byte little-endian header length, a JSON header naming each tensor's
dtype, shape and byte range, then the tensors' bytes back to back), so `safetensors.safe_open` and any other
reader open these files. qtrain writes them itself instead of through `safetensors.torch.save_file` for the
digests: hashing the bytes on their way to the file costs no second read and no second copy in memory.

Two levels, so that a mismatch names the tensor and a piecewise read can be verified without reading the
whole file: the SHA-256 of every tensor's bytes goes into the header's metadata (`sha256.<tensor>`), and the
file's digest (`digest`, recorded in checkpoint.json) is the SHA-256 of the header, which holds those, the
names, dtypes, shapes, byte ranges (and so the file's size) and the writer's own metadata. It is written
`sha256-tree:<hex>` (a hash tree of depth one; `sha256sum` of the file gives another number). Reading a
whole file (`read`) hashes each tensor as its bytes arrive into one buffer; the tensors are views into it.

SHA-256 because it is the fastest strong hash on the CPUs qtrain runs on: on the CI machine (a shared 2-core
Xeon with SHA-NI) hashlib's SHA-256 ran at ~0.7 GB/s (`openssl speed`: 1.4 GB/s), BLAKE2b at ~0.39 GB/s (0.76).
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping

import torch

ALGORITHM = "sha256"
FILE_DIGEST = "sha256-tree"  # the label of a file's digest: SHA-256 of a header that holds each tensor's SHA-256
TENSOR_DIGEST = "sha256."  # header metadata key prefix of a tensor's digest
MAX_HEADER = 100 << 20  # bytes; safetensors' own limit
_CHUNK = 64 << 20  # bytes per read: large enough that hashing, not the call, is the cost
# tensors are hashed on this many threads at once (hashlib releases the GIL): one SHA-256 stream runs on one core
HASH_THREADS = max(1, min(8, (os.cpu_count() or 1)))

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
          "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
_CODES = {v: k for k, v in DTYPES.items()}


class TensorFileError(ValueError):
    """A tensor file that cannot be written or read as asked; the message starts with its path."""


class DigestMismatch(TensorFileError):
    """A file whose header or tensor no longer has the digest recorded when it was written."""

    def __init__(self, message: str, tensor: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor  # the tensor whose bytes differ (None: the header)


class Header:
    """A file's header: tensor name -> (dtype, shape, (begin, end) in the data), the metadata, where the data
    starts and its size, and the header's raw bytes (what the file's digest covers)."""

    def __init__(self, tensors: dict[str, tuple[torch.dtype, tuple[int, ...], tuple[int, int]]],
                 metadata: dict[str, str], raw: bytes, data_bytes: int) -> None:
        self.tensors, self.metadata, self.raw, self.data_bytes = tensors, metadata, raw, data_bytes

    @property
    def data_start(self) -> int:
        return len(self.raw)

    def digest(self) -> str:
        """The file's digest: what `write` returned for it, if nothing in the header changed since."""
        return f"{FILE_DIGEST}:{hashlib.new(ALGORITHM, self.raw).hexdigest()}"

    def dtypes_shapes(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return {k: (d, s) for k, (d, s, _) in self.tensors.items()}

    def user_metadata(self) -> dict[str, str]:
        """The writer's metadata, without the tensor digests."""
        return {k: v for k, v in self.metadata.items() if not k.startswith(TENSOR_DIGEST)}

    def verify(self, path: Path, digest: str) -> None:
        """DigestMismatch unless this header is the one written with `digest`, and holds every tensor's digest."""
        if self.digest() != digest:
            raise DigestMismatch(f"{path}: its header differs from the one recorded when it was written (the "
                                 f"file changed since: edited, replaced, or swapped with another file)")
        if missing := [k for k in self.tensors if TENSOR_DIGEST + k not in self.metadata]:
            raise DigestMismatch(f"{path}: its header records no digest of tensor {missing[0][:80]}", missing[0])

    def check_tensor(self, path: Path, key: str, data: Any) -> None:
        """DigestMismatch unless `data` (the bytes of tensor `key`, or a hash object fed with them) has the
        digest the (verified) header records."""
        h = data if hasattr(data, "hexdigest") else hashlib.new(ALGORITHM, data)
        if h.hexdigest() != self.metadata.get(TENSOR_DIGEST + key):
            raise DigestMismatch(f"{path}: tensor {key}: its bytes differ from the digest recorded when it was "
                                 f"written (corrupted since)", key)


def is_digest(value: Any, label: str = FILE_DIGEST) -> bool:
    """Whether `value` is a digest with `label` (default: a file's as `write` returns it): `<label>:` and 64
    lower-case hex digits."""
    prefix = label + ":"
    return (isinstance(value, str) and value.startswith(prefix) and len(value) == len(prefix) + 64
            and all(c in "0123456789abcdef" for c in value[len(prefix):]))


# ---- writing ----

def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def write(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
          ) -> str:
    """Write `tensors` (copied to CPU where they are not there) as a safetensors file at `path`, fsynced;
    returns its digest. Tensors are laid out like safetensors does (by element size, largest first, then
    name), so every tensor starts aligned to its element size."""
    ts = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    for k, t in ts.items():
        if t.dtype not in _CODES:
            raise TensorFileError(f"{path}: tensor {k!r} has dtype {t.dtype}, which a checkpoint cannot hold")
    order = sorted(ts, key=lambda k: (-ts[k].element_size(), k))
    meta = dict(metadata or {})
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        hexes = pool.map(lambda k: hashlib.new(ALGORITHM, _bytes(ts[k])).hexdigest(), order)
        meta.update({TENSOR_DIGEST + k: h for k, h in zip(order, hexes)})
    header: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for k in order:
        n = ts[k].numel() * ts[k].element_size()
        header[k] = {"dtype": _CODES[ts[k].dtype], "shape": list(ts[k].shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    head += b" " * (-len(head) % 8)
    raw = struct.pack("<Q", len(head)) + head
    with open(path, "wb") as f:
        for part in (raw, *(_bytes(ts[k]) for k in order)):
            f.write(part)
        f.flush()
        os.fsync(f.fileno())
    return f"{FILE_DIGEST}:{hashlib.new(ALGORITHM, raw).hexdigest()}"


# ---- reading ----

def _parse_header(path: Path, f: Any, size: int) -> Header:
    """The header, validated: every byte range inside the file, the ranges back to back to its end."""
    raw_len = f.read(8)
    if len(raw_len) < 8:
        raise TensorFileError(f"{path}: {size} bytes, shorter than a safetensors header")
    (n,) = struct.unpack("<Q", raw_len)
    if n > min(MAX_HEADER, size - 8):
        raise TensorFileError(f"{path}: header length {n} does not fit the file's {size} bytes")
    raw = f.read(n)
    try:
        obj = json.loads(raw)
    except ValueError as e:
        raise TensorFileError(f"{path}: header is not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise TensorFileError(f"{path}: header is not a JSON object")
    meta = obj.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise TensorFileError(f"{path}: header __metadata__ is not a map of strings")
    tensors, ranges = {}, []
    for k, e in obj.items():
        ok = (isinstance(e, dict) and e.get("dtype") in DTYPES and isinstance(e.get("shape"), list)
              and all(type(d) is int and d >= 0 for d in e["shape"]) and isinstance(e.get("data_offsets"), list)
              and len(e["data_offsets"]) == 2 and all(type(o) is int for o in e["data_offsets"]))
        if not ok:
            raise TensorFileError(f"{path}: header entry of tensor {k[:80]!r} is malformed")
        dtype, shape, (b, end) = DTYPES[e["dtype"]], tuple(e["shape"]), e["data_offsets"]
        numel = 1
        for d in shape:
            numel *= d
        if end - b != numel * dtype.itemsize or b < 0:
            raise TensorFileError(f"{path}: tensor {k[:80]!r}: byte range {b}..{end} does not hold its "
                                  f"{e['dtype']} {list(shape)}")
        tensors[k] = (dtype, shape, (b, end))
        ranges.append((b, end))
    pos = 0
    for b, end in sorted(ranges):
        if b != pos:
            raise TensorFileError(f"{path}: tensor byte ranges overlap or leave a gap at byte {pos}")
        pos = end
    if 8 + n + pos != size:
        raise TensorFileError(f"{path}: the header describes {8 + n + pos} bytes, the file has {size} "
                              f"(truncated or appended to?)")
    return Header(tensors, {str(k): v for k, v in meta.items()}, raw_len + raw, pos)


def read_header(path: str | os.PathLike) -> Header:
    """The header alone (a few kilobytes read): names, dtypes, shapes, metadata; the file size checked."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return _parse_header(path, f, os.fstat(f.fileno()).st_size)
    except OSError as e:
        raise TensorFileError(f"{path}: cannot be read ({e.strerror or e})") from None


def read(path: str | os.PathLike, digest: str | None = None) -> tuple[dict[str, torch.Tensor], Header]:
    """(tensors, header) of the file at `path`, read once into one buffer (the tensors are views into it).
    With `digest`, the header must be the one written with it and each tensor is hashed as its bytes arrive:
    DigestMismatch naming the first that differs, before any tensor is returned."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            header = _parse_header(path, f, os.fstat(f.fileno()).st_size)
            if digest is not None:
                header.verify(path, digest)
            buf = torch.empty(header.data_bytes, dtype=torch.uint8)
            view = memoryview(buf.numpy()) if header.data_bytes else memoryview(bytearray())
            with ThreadPoolExecutor(HASH_THREADS) as pool:  # each tensor hashed while the next one is read
                hashed = {}
                for key, (_, _, (begin, end)) in sorted(header.tensors.items(), key=lambda kv: kv[1][2]):
                    pos = begin
                    while pos < end:
                        got = f.readinto(view[pos:min(end, pos + _CHUNK)])
                        if not got:
                            raise TensorFileError(f"{path}: ended after {header.data_start + pos} bytes while being "
                                                  f"read")
                        pos += got
                    if digest is not None:
                        hashed[key] = pool.submit(hashlib.new, ALGORITHM, view[begin:end])
                for key, h in hashed.items():
                    header.check_tensor(path, key, h.result())
    except OSError as e:
        raise TensorFileError(f"{path}: cannot be read ({e.strerror or e})") from None
    return {k: _view(buf, d, s, b, e) for k, (d, s, (b, e)) in header.tensors.items()}, header


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a (CPU) tensor as a file holds them: what `Header.check_tensor` hashes."""
    return _bytes(t.contiguous())


def _view(buf: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], begin: int, end: int) -> torch.Tensor:
    part = buf[begin:end]
    if begin % dtype.itemsize:  # a foreign writer's unaligned layout: copy rather than view
        part = part.clone()
    return part.view(dtype).reshape(shape)
