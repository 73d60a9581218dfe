"""Counter-based RNG (qtrain/kernels/rng.py): key mixing, Murmur3 reference bits, statistics, twin == Triton.

Triton-vs-twin on CPU runs in Triton's interpreter, which must be switched on before triton.jit decorates
the kernels: ``test_interpreter_subprocess`` re-runs this file's ``test_interp_*`` tests in a child
process with TRITON_INTERPRET=1 (they skip in the parent).
"""

import struct

import pytest
import torch

from tests.triton_interp import interp_only, interpreter_subprocess_test, needs_cuda
from qtrain.kernels import dispatch, rng
from qtrain.kernels.rng import random_u32, random_u32_triton, random_u32_twin, rng_key



test_interpreter_subprocess = interpreter_subprocess_test(__file__)


# --------------------------------------------------------------------------------------------- keys
def test_rng_key_deterministic_62_bit_and_sensitive_to_every_id():
    k = rng_key(1234, 7, 3, 2)
    assert k == rng_key(1234, 7, 3, 2)
    assert 0 <= k < 1 << 62
    variants = [
        rng_key(1235, 7, 3, 2), rng_key(1234, 8, 3, 2), rng_key(1234, 7, 3, 3),
        rng_key(1234, 3, 7, 2), rng_key(1234, 7, 3), rng_key(1234, 7, 3, 2, 0), rng_key(1234),
    ]
    assert len(set(variants + [k])) == len(variants) + 1
    keys = {rng_key(0, step, layer) for step in range(200) for layer in range(50)}
    assert len(keys) == 200 * 50  # no collisions among a realistic grid of (step, layer)
    assert rng_key(-1, -5) == rng_key(2**64 - 1, 2**64 - 5)  # ints taken modulo 2**64


# ----------------------------------------------------------------------------- Murmur3 reference bits
def _murmur3_x86_32(data: bytes, seed: int = 0) -> int:
    """Straight transcription of MurmurHash3_x86_32 (Appleby), independent of qtrain's code."""
    M = 0xFFFFFFFF

    def rotl(x, r):
        return ((x << r) | (x >> (32 - r))) & M

    h, n = seed, len(data)
    for i in range(0, n - n % 4, 4):
        k = struct.unpack_from("<I", data, i)[0]
        k = rotl((k * 0xCC9E2D51) & M, 15) * 0x1B873593 & M
        h = (rotl(h ^ k, 13) * 5 + 0xE6546B64) & M
    k = int.from_bytes(data[n - n % 4:], "little")
    if n % 4:
        h ^= rotl((k * 0xCC9E2D51) & M, 15) * 0x1B873593 & M
    h ^= n
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M
    return h ^ (h >> 16)


def test_reference_murmur_matches_published_vectors():
    # Published MurmurHash3_x86_32 test vectors (SMHasher / Wikipedia).
    assert _murmur3_x86_32(b"", 0) == 0
    assert _murmur3_x86_32(b"", 1) == 0x514E28B7
    assert _murmur3_x86_32(b"\0\0\0\0", 0) == 0x2362F9DE
    assert _murmur3_x86_32(b"The quick brown fox jumps over the lazy dog", 0) == 0x2E4FF723


def test_twin_is_murmur3_of_key_and_index():
    key = rng_key(42, 1, 2)
    idx = torch.tensor([0, 1, 2, 12345, 2**31, 2**32 - 1, 2**32, 2**32 + 5, 2**47 + 3, 2**62 + 11])
    want = [_murmur3_x86_32(struct.pack("<QII", key, int(i) >> 32, int(i) & 0xFFFFFFFF)) for i in idx]
    assert random_u32_twin(key, idx).tolist() == want
    assert random_u32(key, idx).tolist() == want  # CPU dispatch -> twin


def test_twin_keeps_shape_and_rejects_non_int64():
    idx = torch.arange(12).view(3, 4)
    out = random_u32_twin(5, idx)
    assert out.shape == (3, 4) and out.dtype == torch.int64
    assert torch.equal(out.flatten(), random_u32_twin(5, torch.arange(12)))
    with pytest.raises(TypeError, match="int64"):
        random_u32_twin(5, idx.int())


# ---------------------------------------------------------------------------------------- statistics
def test_bits_are_balanced_and_streams_unrelated():
    n = 1 << 16
    u = random_u32_twin(rng_key(3), torch.arange(n))
    assert u.min() >= 0 and u.max() < 2**32
    # each bit is Bernoulli(1/2): 5 sigma of a Binomial(n, 1/2) mean is 5 * 0.5 / sqrt(n) ~ 0.0098
    bits = (u[:, None] >> torch.arange(32)) & 1
    assert (bits.float().mean(0) - 0.5).abs().max() < 5 * 0.5 / n**0.5
    # low 16 bits (the SR threshold) uniform: chi-square over 64 buckets, 63 dof, mean 63, sd ~11.2
    counts = torch.bincount((u & 0xFFFF) >> 10, minlength=64).float()
    chi2 = ((counts - n / 64) ** 2 / (n / 64)).sum()
    assert chi2 < 63 + 6 * 11.3
    # neighbouring keys and counters 2**32 apart are different streams (collision chance 2**-32 each)
    assert (u == random_u32_twin(rng_key(4), torch.arange(n))).sum() <= 2
    assert (u == random_u32_twin(rng_key(3), torch.arange(n) + 2**32)).sum() <= 2


# ------------------------------------------------------------------------------------- twin == Triton
def _indices(device):
    return torch.cat([
        torch.arange(5003, device=device),
        torch.tensor([2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40 + 17, 2**62 + 5], device=device),
    ])


@interp_only
def test_interp_triton_matches_twin():
    for key in (0, 1, rng_key(9), rng_key(9, 1), (1 << 62) - 1):
        idx = _indices("cpu")
        assert torch.equal(random_u32_triton(key, idx), random_u32_twin(key, idx)), key
    with dispatch.backend("triton"):
        assert torch.equal(random_u32(7, torch.arange(10)), random_u32_twin(7, torch.arange(10)))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("key", [0, rng_key(9), (1 << 62) - 1])
def test_gpu_triton_matches_twin(key):
    idx = torch.cat([_indices("cuda"), torch.randint(0, 2**62, (1 << 20,), device="cuda")])
    assert torch.equal(random_u32(key, idx), random_u32_twin(key, idx))  # dispatch picks Triton on CUDA
    assert torch.equal(random_u32(key, idx).cpu(), random_u32_twin(key, idx.cpu()))


def test_key_state_rejects_out_of_range():
    with pytest.raises(ValueError):
        rng.key_state(-1)


def test_mul32_wraps_like_the_exact_split_product():
    """The twin's `_mul32` relies on torch's int64 multiply wrapping mod 2**64 (products reach 2**64 - 2**33):
    on this machine it must give the overflow-free split product's low 32 bits for every constant it is used
    with, at the extremes and on random values."""
    from qtrain.kernels import rng
    a = torch.cat([torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1], dtype=torch.int64),
                   torch.randint(0, 2**32, (100_000,), generator=torch.Generator().manual_seed(3), dtype=torch.int64)])
    for c in (rng._C1, rng._C2, rng._F1, rng._F2, 5, 2**32 - 1):
        got, want = rng._mul32(a, c), rng._mul32_split(a, c)
        assert torch.equal(got, want), c
        assert int(got.min()) >= 0 and int(got.max()) < 2**32
