"""Counter-based random bits for stochastic rounding: ``u32 = hash(key, element index)``.

No generator state: the random word of element ``i`` depends only on a 62-bit key and the 64-bit counter
``i``, so every rank, every rerun and a resumed run draw the same bits, and a rank that owns a slice of a
tensor reproduces the unsharded bits by passing the slice start as counter offset.

* ``rng_key(seed, *ids)`` folds a seed and small integers (step, layer, tensor index, stream) into a key
  with the SplitMix64 finaliser (Steele, Lea, Flood 2014), pure Python.
* ``random_u32(key, index)`` is MurmurHash3_x86_32 (Appleby, public domain) with seed 0 of the 16-byte
  message of little-endian 32-bit words ``(key_lo, key_hi, index_hi, index_lo)``. The key words, and the
  index's high word whenever a launch's counters share it (``kernel_key``), are absorbed on the host, so a
  kernel does one Murmur round and the finaliser per element: five 32-bit multiplies. llm.q uses
  SquirrelNoise5 of (index, seed) instead (``squirrel_noise.cuh``); Murmur takes the full 62-bit key and
  64-bit counter and its finaliser is a well-tested full-avalanche mix.
  Cost: the bf16 AdamW kernel is integer-bound on H200; absorbing the high word on the host took it from
  10.8 to 8.5 ms for 1.5e9 elements (bench/bench_adamw.py), when it drew three words per element (param, m,
  v; now two: bf16 m and v share one word, each taking 16 of its bits, ``qtrain.kernels.adamw``).

The twin does the 32-bit arithmetic on int64 tensors masked to 32 bits; a 32x32-bit multiply is split in
16-bit halves so no int64 product overflows. The Triton version works on uint32, where wrap-around is the
definition. Both give the same bits (tested, interpreter and GPU).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from qtrain.kernels.dispatch import jit, tl, use_triton

__all__ = ["KeySlot", "KeyTable", "kernel_key", "key_state", "launch_key", "random_u32", "random_u32_triton",
           "random_u32_twin", "random_u32_of_twin", "rng_key"]

_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF
# MurmurHash3_x86_32 constants
_C1, _C2 = 0xCC9E2D51, 0x1B873593
_N = 0xE6546B64
_F1, _F2 = 0x85EBCA6B, 0xC2B2AE35
_MSG_LEN = 16  # bytes hashed: key_lo, key_hi, index_lo, index_hi


# ------------------------------------------------------------------------------------------------ keys
def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def rng_key(seed: int, *ids: int) -> int:
    """Mix ``seed`` and ``ids`` (e.g. step, layer, tensor index) into a 62-bit key; deterministic.

    Order matters (``rng_key(s, 1, 2) != rng_key(s, 2, 1)``) and so does the number of ids. Negative ints
    are taken modulo 2**64.
    """
    return _absorb(_splitmix64(seed & _M64), ids) >> 2


def _absorb(h: int, ids: tuple[int, ...]) -> int:
    """``rng_key``'s 64-bit state after folding ``ids`` into state ``h``."""
    for i in ids:
        h = _splitmix64(h ^ (i & _M64))
    return h


# ------------------------------------------------------------------------- scalar Murmur (host side)
def _rotl32(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & _M32


def _murmur_round_int(h: int, k: int) -> int:
    k = (k * _C1) & _M32
    k = _rotl32(k, 15)
    k = (k * _C2) & _M32
    h = _rotl32(h ^ k, 13)
    return (h * 5 + _N) & _M32


def key_state(key: int) -> int:
    """Murmur state after absorbing the two key words (seed 0); what kernels receive instead of the key."""
    if not 0 <= key < 1 << 64:
        raise ValueError(f"rng key must be in [0, 2**64), got {key}")
    return _murmur_round_int(_murmur_round_int(0, key & _M32), key >> 32)


def _as_i32(x: int) -> int:
    """A uint32 as the signed int32 with the same bits, so Triton always sees an i32 argument."""
    return x - (1 << 32) if x >= 1 << 31 else x


def _hi_absorbed(offset: int, n: int) -> bool:
    """Whether every counter of ``[offset, offset + n)`` has the same high 32-bit word."""
    return n == 0 or offset >> 32 == (offset + n - 1) >> 32


def kernel_key(key: int, offset: int, n: int) -> tuple[int, bool]:
    """Kernel arguments for counters ``[offset, offset + n)``: (state as int32 bits, HI_ABSORBED).

    When every counter has the same high 32-bit word (any launch that does not straddle a multiple of
    2**32) that word is absorbed here and the kernel hashes only the low word.
    """
    ks = key_state(key)
    if _hi_absorbed(offset, n):
        return _as_i32(_murmur_round_int(ks, offset >> 32)), True
    return _as_i32(ks), False


# ------------------------------------------------------------------------------ keys in a device table
class KeySlot(NamedTuple):
    """A key that a kernel reads from ``table[index]`` (int32 kernel states, see ``KeyTable``) when it runs,
    instead of a scalar argument baked into the launch: what a kernel replayed from a CUDA graph needs."""
    table: torch.Tensor
    index: int


class KeyTable:
    """The kernel key states of a fixed set of launches, in a device int32 table the host refills.

    A CUDA graph bakes scalar kernel arguments in, so a stochastic-rounding launch replayed at another
    (step, micro-step) would reuse the random bits of the capture. Launches that take a ``KeySlot`` read
    their state from this table instead. Every launch is known up front as a recipe ``(ids, offset, n)``:
    its key is ``rng_key(seed, *prefix, *ids)`` for the ``prefix`` given to ``fill`` (e.g. step and
    micro-step), its counters ``[offset, offset + n)``; the table entry is ``kernel_key(key, offset, n)[0]``,
    so a table launch draws the same bits as the scalar launch with that key (HI_ABSORBED depends only on
    offset and n and stays a launch constant).

    ``fill`` computes the states on the host and queues ONE stream-ordered copy into the table (from pinned
    memory on CUDA; torch's caching host allocator keeps that buffer until the copy has run), so every
    kernel queued after it, eagerly or by a graph replay, reads the new keys and none queued before does.
    """

    def __init__(self, recipes: list[tuple[tuple[int, ...], int, int]], *, device: torch.device | str):
        self.recipes = list(recipes)
        self._index = {r: i for i, r in enumerate(self.recipes)}
        if len(self._index) != len(self.recipes):
            raise ValueError("KeyTable: a launch recipe (ids, offset, n) is listed twice")
        self.table = torch.zeros(max(len(self.recipes), 1), dtype=torch.int32, device=device)

    @staticmethod
    def nbytes(n_recipes: int) -> int:
        """Device bytes of a table of `n_recipes` launches (what the constructor allocates)."""
        return 4 * max(n_recipes, 1)

    def slot(self, ids: tuple[int, ...], offset: int, n: int) -> KeySlot:
        """The slot of launch ``(ids, offset, n)``, which must be one of the recipes given at construction."""
        i = self._index.get((tuple(ids), offset, n))
        if i is None:
            raise KeyError(f"KeyTable: no slot for launch ids={ids} offset={offset} n={n}; the table lists every "
                           f"launch up front ({len(self.recipes)} recipes)")
        return KeySlot(self.table, i)

    def states(self, seed: int, *prefix: int) -> list[int]:
        """The table's contents for ``prefix``: one int32 kernel state per recipe."""
        h = _absorb(_splitmix64(seed & _M64), prefix)  # rng_key(seed, *prefix, *ids), the prefix folded once
        return [kernel_key(_absorb(h, ids) >> 2, offset, n)[0] for ids, offset, n in self.recipes]

    def fill(self, seed: int, *prefix: int) -> None:
        """Queue the table's refill for keys ``rng_key(seed, *prefix, *ids)``; does not block the host."""
        if not self.recipes:
            return
        host = torch.tensor(self.states(seed, *prefix), dtype=torch.int32)
        if self.table.is_cuda:
            self.table.copy_(host.pin_memory(), non_blocking=True)
        else:
            self.table.copy_(host)


def launch_key(key: int | KeySlot, offset: int, n: int) -> tuple[int, torch.Tensor | None, bool]:
    """Kernel arguments for ``key`` over counters ``[offset, offset + n)``: (kstate or table index, the
    table or None, HI_ABSORBED). A kernel given a table loads its state from ``table[index]``."""
    if isinstance(key, KeySlot):
        return key.index, key.table, _hi_absorbed(offset, n)
    kstate, hi_absorbed = kernel_key(key, offset, n)
    return kstate, None, hi_absorbed


# ---------------------------------------------------------------------------------------------- twin
def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2**32 for 0 <= a, c < 2**32 in int64. The product can pass 2**63: torch's int64 multiply
    wraps mod 2**64 (two's complement, as the hardware does), which keeps the low 32 bits exact; the test
    `test_mul32_wraps_like_the_exact_split_product` checks it against the overflow-free split product on
    this machine. 3x faster than the split product, and these hashes were most of a bf16 CPU step."""
    return a.mul(c).bitwise_and_(_M32)


def _mul32_split(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2**32 without int64 overflow (products < 2**48): what `_mul32` must equal."""
    lo = a * (c & 0xFFFF)
    hi = ((a * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _rotl32_t(x: torch.Tensor, r: int) -> torch.Tensor:
    return (x << r).bitwise_and_(_M32).bitwise_or_(x >> (32 - r))


def _murmur_round_t(h: torch.Tensor | int, k: torch.Tensor) -> torch.Tensor:
    # in-place where the tensor is this function's own: the twin runs over whole parameter tensors on the CPU,
    # where every fresh int64 temporary costs page faults
    k = _rotl32_t(_mul32(k, _C1), 15)
    k.mul_(_C2).bitwise_and_(_M32).bitwise_xor_(h)
    return _rotl32_t(k, 13).mul_(5).add_(_N).bitwise_and_(_M32)


def random_u32_twin(key: int, index: torch.Tensor) -> torch.Tensor:
    """Twin (specification): uint32 hash of (key, index), as int64 in [0, 2**32), same shape as ``index``."""
    if index.dtype != torch.int64:
        raise TypeError(f"random_u32: index must be int64, got {index.dtype}")
    return _hash_twin(key_state(key), False, index)


def random_u32_of_twin(key: int | KeySlot, index: torch.Tensor, offset: int, n: int) -> torch.Tensor:
    """Twin of a kernel's ``hash_u32`` for a launch over counters ``[offset, offset + n)`` with ``key``, scalar
    or a ``KeySlot`` (whose state is read from the table, as the kernel does): ``random_u32_twin(key, index)``
    for a scalar key, and for a slot filled by ``KeyTable.fill`` the same bits."""
    kstate, table, hi_absorbed = launch_key(key, offset, n)
    if table is not None:
        kstate = int(table[kstate])
    return _hash_twin(kstate & _M32, hi_absorbed, index)


def _hash_twin(kstate: int, hi_absorbed: bool, index: torch.Tensor) -> torch.Tensor:
    """``hash_u32`` in int64 arithmetic: ``kstate`` has absorbed the key (and the high word if ``hi_absorbed``)."""
    i_lo = index & _M32
    h = kstate if hi_absorbed else _murmur_round_t(kstate, (index >> 32) & _M32)
    h = _murmur_round_t(h, i_lo).bitwise_xor_(_MSG_LEN)
    # fmix32 (h is this function's own tensor: in place)
    h.bitwise_xor_(h >> 16).mul_(_F1).bitwise_and_(_M32)
    h.bitwise_xor_(h >> 13).mul_(_F2).bitwise_and_(_M32)
    return h.bitwise_xor_(h >> 16)


# -------------------------------------------------------------------------------------------- triton
@jit
def _murmur_round(h, k):
    k = k * 0xCC9E2D51
    k = (k << 15) | (k >> 17)
    k = k * 0x1B873593
    h = h ^ k
    h = (h << 13) | (h >> 19)
    return h * 5 + 0xE6546B64


@jit
def hash_u32(kstate, idx, HI_ABSORBED: tl.constexpr):
    """Triton: uint32 random word of counter ``idx`` (int64 tensor) for ``kstate, HI_ABSORBED = kernel_key(...)``.

    Same bits as ``random_u32_twin``. Used inside the stochastic-rounding and AdamW kernels.
    """
    h = kstate.to(tl.uint32, bitcast=True)
    if not HI_ABSORBED:
        h = _murmur_round(h, (idx >> 32).to(tl.uint32))
    h = _murmur_round(h, idx.to(tl.uint32))  # int64 -> uint32 keeps the low word
    h = h ^ 16
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@jit(do_not_specialize=["kstate"])
def _random_u32_kernel(idx_ptr, out_ptr, n, kstate, BLOCK: tl.constexpr):
    """out[i] = hash(key, idx[i]) as int32 bits; all integer arithmetic in uint32."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    idx = tl.load(idx_ptr + offs, mask=mask, other=0)
    h = hash_u32(kstate, idx, False)  # arbitrary indices: hash both words
    tl.store(out_ptr + offs, h.to(tl.int32, bitcast=True), mask=mask)


def random_u32_triton(key: int, index: torch.Tensor) -> torch.Tensor:
    """Triton launcher; same contract as ``random_u32_twin``."""
    if index.dtype != torch.int64 or not index.is_contiguous():
        raise TypeError(f"random_u32: index must be contiguous int64, got {index.dtype}")
    out = torch.empty(index.shape, dtype=torch.int32, device=index.device)
    n = index.numel()
    block = 1024
    if n:
        _random_u32_kernel[(triton_cdiv(n, block),)](index, out, n, _as_i32(key_state(key)), BLOCK=block)
    return out.to(torch.int64) & _M32


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------------- public
def random_u32(key: int, index: torch.Tensor) -> torch.Tensor:
    """Counter-based hash of (key, element index) -> uint32 values stored in int64."""
    if use_triton(index):
        return random_u32_triton(key, index)
    return random_u32_twin(key, index)
