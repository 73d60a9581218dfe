"""tensor_file: safetensors files with digests, written and read in one pass."""
import hashlib
import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qtrain.train import tensor_file


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(40, generator=g)
    return {"w": torch.randn(5, 7, generator=g), "b16": torch.randn(11, 3, generator=g).bfloat16(),
            "view": flat[8:24].view(4, 4), "e4m3": torch.randn(9, generator=g).to(torch.float8_e4m3fn),
            "i64": torch.arange(-3, 10) * 2**40, "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4),
            "flags": torch.tensor([True, False, True])}


def test_files_are_safetensors_both_ways(tmp_path):
    ts = tensors()
    digest = tensor_file.write(tmp_path / "a.safetensors", ts, {"name": "a"})
    assert tensor_file.is_digest(digest)
    with safe_open(str(tmp_path / "a.safetensors"), "pt") as f:  # safetensors reads ours
        assert f.metadata()["name"] == "a" and sorted(f.keys()) == sorted(ts)
        assert all(torch.equal(bits(f.get_tensor(k)), bits(t.contiguous())) for k, t in ts.items())
    read, header = tensor_file.read(tmp_path / "a.safetensors", digest)
    assert header.user_metadata() == {"name": "a"} and header.digest() == digest
    for k, t in ts.items():
        assert read[k].dtype == t.dtype and read[k].shape == t.shape and torch.equal(bits(read[k]), bits(t.contiguous()))
    save_file({k: t.contiguous() for k, t in ts.items()}, tmp_path / "b.safetensors")  # and we read theirs
    read, header = tensor_file.read(tmp_path / "b.safetensors")
    assert all(torch.equal(bits(read[k]), bits(t.contiguous())) for k, t in ts.items())
    # each tensor's digest is the SHA-256 of its bytes; the file's, of the header that lists them
    raw = (tmp_path / "a.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    meta = json.loads(raw[8:8 + n])["__metadata__"]
    assert meta["sha256.w"] == hashlib.sha256(bits(ts["w"]).numpy().tobytes()).hexdigest()
    assert digest == "sha256-tree:" + hashlib.sha256(raw[:8 + n]).hexdigest()


def test_a_changed_byte_names_its_tensor(tmp_path):
    path = tmp_path / "a.safetensors"
    digest = tensor_file.write(path, tensors())
    header = tensor_file.read_header(path)
    data = bytearray(path.read_bytes())
    data[header.data_start + header.tensors["i64"][2][0] + 5] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(tensor_file.DigestMismatch, match=r"tensor i64: its bytes differ") as e:
        tensor_file.read(path, digest)
    assert e.value.tensor == "i64"
    tensor_file.read(path)  # unverified, it reads (what a checkpoint from before digests does)


def test_broken_headers_and_sizes_are_refused(tmp_path):
    path = tmp_path / "a.safetensors"
    digest = tensor_file.write(path, tensors())
    good = path.read_bytes()
    path.write_bytes(good[:-3])
    with pytest.raises(tensor_file.TensorFileError, match="truncated or appended"):
        tensor_file.read(path, digest)
    path.write_bytes(struct.pack("<Q", 1 << 40) + good[8:])
    with pytest.raises(tensor_file.TensorFileError, match="header length 1099511627776 does not fit"):
        tensor_file.read_header(path)
    (n,) = struct.unpack("<Q", good[:8])
    path.write_bytes(good[:8] + good[8:8 + n].replace(b'"F32"', b'"I32"') + good[8 + n:])  # same sizes, valid
    with pytest.raises(tensor_file.DigestMismatch, match="its header differs"):
        tensor_file.read(path, digest)
