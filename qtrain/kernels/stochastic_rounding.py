"""Stochastic rounding (SR) fp32 -> bf16 (and -> e4m3 for the FP8 Adam m), with counter-based bits.

Element ``i`` of a call uses ``random_u32(key, offset + i)`` (``qtrain.kernels.rng``), so results are
deterministic per key and a slice updated with ``offset = slice start`` matches the unsharded call bit
for bit.

fp32 -> bf16 rule (bits ``b``, ``t = rand & 0xFFFF``): ``bf16 = (b + t) >> 16``. Adding ``t`` to the bit
pattern carries into bit 16 exactly when ``t >= 2**16 - r`` (``r`` = the low 16 bits), i.e. with
probability ``r / 2**16``; the result moves one bf16 ulp away from zero (the pattern is sign-magnitude)
and the expectation is the fp32 value: ``lo + (r / 2**16) * ulp``. This is also right across a binade
edge (the carry into the exponent lands on the next power of two, which is ``lo + ulp(lo)``) and for
subnormals (linear spacing). llm.q's ``r > (rand & 0xFFFF)`` then round-to-nearest (squirrel_noise.cuh)
has the same distribution up to which random values trigger; the add form is one integer add.
Special values:
* inf and values already bf16 (``r == 0``) are unchanged; NaN becomes the canonical bf16 NaN 0x7FC0 as in
  torch's own conversion (truncating a NaN's pattern could produce inf otherwise);
* in the top binade slot ``|x| in [bf16 max, fp32 max]`` (hi bits 0x7F7F) rounding up would give inf, so
  there we use round-to-nearest-even: SR never overflows to inf unless RN would. As 0x7F7F is odd, RNE there
  is ``(b + 0x8000) >> 16``: the same add with ``t = 0x8000``, so the code selects that addend for
  ``|b| >= 0x7F7F0000`` (one compare and a select instead of a second rounding of every element; inf, whose
  low bits are 0, stays inf with any addend, and NaN is replaced after).

fp32 -> e4m3 (``t = rand & 0xFFFFF``, after the caller scaled into +-448): for ``|x| >= 2**-6`` (e4m3
normals) the same add-and-truncate on the low 20 bits, then rebias the exponent (``code = (a + t) >> 20
- 960``). For ``|x| < 2**-6`` (e4m3 subnormals, spacing 2**-9) we add ``2**-6`` in fp32 first, which maps
the subnormal grid onto the mantissa of ``[2**-6, 2**-5)``, and apply the same rule (``- 968``); that
fp32 add drops bits below 2**-29, a bias of < 2**-20 of one e4m3 step. llm.q uses RN there instead.
Results above 448 saturate to 448 (0x7E, like ``cvt.satfinite``), inf too; NaN gives 0x7F.

Keys: an int, or a ``KeySlot`` (``qtrain.kernels.rng.KeyTable``) whose kernel state the kernel loads from a device
table when it runs, so a launch replayed from a CUDA graph draws the bits of the key the host put in the table
for this replay; with the same key, both give the same bits (tested against the twin).

Kernels store bf16 as int16 and e4m3 as uint8 bit patterns and load them the same way (Triton's
interpreter does not convert those dtypes reliably); all arithmetic is fp32, bit work is uint32.
"""

from __future__ import annotations

import struct

import torch

from qtrain.kernels.dispatch import jit, tl, use_triton
from qtrain.kernels.rng import KeySlot, hash_u32, launch_key, random_u32_of_twin, random_u32_twin, triton_cdiv

__all__ = [
    "round_to_bf16_sr",
    "sr_add_",
    "sr_copy_",
    "sr_sum_",
    "sr_add_twin",
    "sr_sum_twin",
    "sr_copy_twin",
    "sr_bf16_bits_twin",
    "sr_e4m3_bits_twin",
    "e4m3_bits_to_f32_twin",
    "bf16_bits_to_f32_twin",
    "f32_bits_twin",
    "fp32",
]

_M32 = 0xFFFFFFFF
# load_f32 / round_f32 / store_f32's KIND of each floating dtype (the kernels' one table of it)
KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def fp32(x: float) -> float:
    """``x`` rounded to the nearest fp32, as a Python float: the value a kernel scalar argument gets."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


# ----------------------------------------------------------------------------------- twin bit helpers
def f32_bits_twin(x: torch.Tensor) -> torch.Tensor:
    """fp32 tensor -> its bit patterns as int64 in [0, 2**32)."""
    return x.view(torch.int32).to(torch.int64) & _M32


def bf16_bits_to_f32_twin(h: torch.Tensor) -> torch.Tensor:
    """int64 bf16 patterns in [0, 2**16) -> bf16 tensor (bit-exact, no conversion arithmetic)."""
    return (h - ((h >> 15) << 16)).to(torch.int16).view(torch.bfloat16)


def sr_bf16_bits_twin(x: torch.Tensor, rand: torch.Tensor) -> torch.Tensor:
    """SR of fp32 ``x`` to bf16 with random words ``rand`` (int64 u32); returns bf16 patterns as int64."""
    b = f32_bits_twin(x)
    a = b & 0x7FFFFFFF
    # top slot: round to nearest even, which there (0x7F7F is odd) is the same add with t = 0x8000; inf (low bits
    # 0) stays inf with any t, NaN is replaced below
    t = torch.where(a >= 0x7F7F0000, 0x8000, rand & 0xFFFF)
    out = t.add_(b).bitwise_right_shift_(16)  # in place on a fresh temporary: fewer page faults
    return torch.where(a > 0x7F800000, 0x7FC0, out).bitwise_and_(0xFFFF)


def sr_e4m3_bits_twin(x: torch.Tensor, rand: torch.Tensor) -> torch.Tensor:
    """SR of fp32 ``x`` to e4m3fn (saturating) with random words ``rand``; returns codes as int64."""
    b = f32_bits_twin(x)
    a = b & 0x7FFFFFFF
    t = rand & 0xFFFFF
    normal = ((a + t) >> 20) - (120 << 3)
    z = f32_bits_twin(x.abs() + 2.0**-6)  # subnormal grid k * 2**-9 -> mantissa of [2**-6, 2**-5)
    sub = ((z + t) >> 20) - (121 << 3)
    code = torch.where(a >= 0x3C800000, normal, sub).clamp_max(0x7E)
    code = torch.where(a > 0x7F800000, 0x7F, code)
    return code | ((b >> 24) & 0x80)


def e4m3_bits_to_f32_twin(c: torch.Tensor) -> torch.Tensor:
    """e4m3fn codes (int64 in [0, 256)) -> fp32 values, by bit manipulation (matches torch's cast)."""
    c = c & 0xFF
    sign = (c & 0x80) << 24
    normal = ((c & 0x7F) << 20) + (120 << 23)
    sub = f32_bits_twin((c & 7).to(torch.float32) * 2.0**-9)
    bits = torch.where((c & 0x78) == 0, sub, normal) | sign
    bits = torch.where((c & 0x7F) == 0x7F, 0x7FC00000, bits)
    return (bits - ((bits >> 31) << 32)).to(torch.int32).view(torch.float32)


def _load_f32_twin(t: torch.Tensor) -> torch.Tensor:
    """Flat fp32 view/copy of a float tensor (exact for fp32, bf16, fp16)."""
    return t.reshape(-1).to(torch.float32)


def _check(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"{name}: unsupported dtypes. Got dst={dst.dtype}, src={src.dtype}; dst must be fp32 or bf16")
    if src.dtype not in KINDS:
        raise TypeError(f"{name}: unsupported dtypes. Got dst={dst.dtype}, src={src.dtype}; src must be fp32/bf16/fp16")
    if dst.numel() != src.numel():
        raise ValueError(f"{name}: dst has {dst.numel()} elements, src {src.numel()}")
    if not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError(f"{name}: dst and src must be contiguous (no hidden copies)")
    if dst.device != src.device:
        raise ValueError(f"{name}: dst on {dst.device}, src on {src.device}")


# ---------------------------------------------------------------------------------------------- twin
Key = int | KeySlot  # a scalar key, or a slot of a device key table (see the module docstring)


def _sr_twin(dst: torch.Tensor, src: torch.Tensor, key: Key, scale: float, offset: int, add: bool) -> torch.Tensor:
    y = _load_f32_twin(src) * fp32(scale)
    if add:
        y = _load_f32_twin(dst) + y
    flat = dst.view(-1)
    if dst.dtype == torch.bfloat16:
        idx = torch.arange(offset, offset + flat.numel(), dtype=torch.int64, device=dst.device)
        rand = (random_u32_of_twin(key, idx, offset, flat.numel()) if isinstance(key, KeySlot)
                else random_u32_twin(key, idx))
        flat.copy_(bf16_bits_to_f32_twin(sr_bf16_bits_twin(y, rand)))
    else:
        flat.copy_(y)
    return dst


def sr_add_twin(dst, src, *, key: Key, scale: float = 1.0, offset: int = 0) -> torch.Tensor:
    """Twin (specification) of ``sr_add_``."""
    _check(dst, src, "sr_add_")
    return _sr_twin(dst, src, key, scale, offset, add=True)


def sr_copy_twin(dst, src, *, key: Key, scale: float = 1.0, offset: int = 0) -> torch.Tensor:
    """Twin (specification) of ``sr_copy_``."""
    _check(dst, src, "sr_copy_")
    return _sr_twin(dst, src, key, scale, offset, add=False)


def _check_sum(dst: torch.Tensor, parts: torch.Tensor) -> None:
    if parts.dim() != 2 or parts.shape[0] < 1 or (parts.shape[1] > 1 and parts.stride(1) != 1):
        raise ValueError(f"sr_sum_: parts must be (W, m) with contiguous rows, got shape {tuple(parts.shape)} "
                         f"strides {parts.stride()}")
    _check(dst, parts[0], "sr_sum_")


def sr_sum_twin(dst, parts, *, key: Key, scale: float = 1.0, offset: int = 0, add: bool = False) -> torch.Tensor:
    """Twin (specification) of ``sr_sum_``: the fp32 sum in the fixed order (dst,) parts[0], ..., parts[W-1],
    one fp32 rounding per add, then ``sr_copy_``'s scale-and-round."""
    _check_sum(dst, parts)
    acc = _load_f32_twin(dst) + _load_f32_twin(parts[0]) if add else parts[0].to(torch.float32, copy=True)
    for j in range(1, parts.shape[0]):
        acc += _load_f32_twin(parts[j])
    return _sr_twin(dst, acc, key, scale, offset, add=False)


# -------------------------------------------------------------------------------- triton bit helpers
@jit
def _load(ptr, mask, other, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(ptr)
    return tl.load(ptr, mask=mask, other=other)


@jit
def _store(ptr, x, mask, EVEN: tl.constexpr):
    if EVEN:
        tl.store(ptr, x)
    else:
        tl.store(ptr, x, mask=mask)


@jit
def load_f32(ptr, mask, KIND: tl.constexpr, EVEN: tl.constexpr = False):
    """Load as fp32. KIND 0: fp32, or any dtype converted natively; 1: bf16 given as an int16 pointer (widened by a
    shift); 2: fp16. EVEN: the tile lies inside the tensor, so the load is unmasked (fewer instructions in kernels
    bound by them; the mask is then ignored)."""
    if KIND == 1:
        h = _load(ptr, mask, 0, EVEN).to(tl.uint16, bitcast=True).to(tl.uint32)
        return (h << 16).to(tl.float32, bitcast=True)
    else:
        return _load(ptr, mask, 0.0, EVEN).to(tl.float32)


@jit
def store_f32(ptr, x, mask, KIND: tl.constexpr, EVEN: tl.constexpr = False):
    """Store fp32 ``x`` as KIND (0 as the pointer's dtype, through Triton's conversion, round to nearest even; 1 bf16
    through an int16 pointer, round to nearest even on the bit pattern, NaN -> 0x7FC0, which is torch's
    ``.to(torch.bfloat16)`` and runs the same under Triton's interpreter; 2 fp16). EVEN: unmasked, as `load_f32`."""
    if KIND == 1:
        b = x.to(tl.uint32, bitcast=True)
        rn = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        rn = tl.where((b & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, rn)
        _store(ptr, rn.to(tl.uint16).to(tl.int16, bitcast=True), mask, EVEN)
    elif KIND == 2:
        _store(ptr, x.to(tl.float16), mask, EVEN)
    else:
        _store(ptr, x, mask, EVEN)


@jit
def round_f32(x, KIND: tl.constexpr, NATIVE: tl.constexpr = False):
    """fp32 ``x`` rounded to KIND exactly as ``store_f32`` stores it, returned as fp32: the value a later
    load sees, e.g. for the abs-max of a tensor a kernel writes (an FP8 scale must cover the stored values).
    NATIVE: bf16 through the hardware conversion instead of the bit pattern (the same value for every finite x; on
    the GPU fewer instructions, under the interpreter not the GPU's rounding)."""
    if NATIVE and KIND == 1:
        return x.to(tl.bfloat16).to(tl.float32)
    if KIND == 1:
        b = x.to(tl.uint32, bitcast=True)
        rn = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
        rn = tl.where((b & 0x7FFFFFFF) > 0x7F800000, 0x7FC00000, rn)
        return rn.to(tl.float32, bitcast=True)
    elif KIND == 2:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@jit
def sr_bf16_bits(x, rand):
    """fp32 -> bf16 pattern as int16 (see module docstring); ``rand`` uint32."""
    b = x.to(tl.uint32, bitcast=True)
    a = b & 0x7FFFFFFF
    t = tl.where(a >= 0x7F7F0000, 0x8000, rand & 0xFFFF)  # top slot: RNE; inf stays, NaN next (module docstring)
    out = (b + t) >> 16
    out = tl.where(a > 0x7F800000, 0x7FC0, out)
    return out.to(tl.uint16).to(tl.int16, bitcast=True)


@jit
def sr_e4m3_bits(x, rand):
    """fp32 -> e4m3fn code as uint8, saturating (see module docstring); ``rand`` uint32."""
    b = x.to(tl.uint32, bitcast=True)
    a = b & 0x7FFFFFFF
    t = rand & 0xFFFFF
    normal = ((a + t) >> 20) - 960
    z = (tl.abs(x) + 0.015625).to(tl.uint32, bitcast=True)
    sub = ((z + t) >> 20) - 968
    code = tl.minimum(tl.where(a >= 0x3C800000, normal, sub), 0x7E)
    code = tl.where(a > 0x7F800000, 0x7F, code)
    return (code | ((b >> 24) & 0x80)).to(tl.uint8)


@jit
def e4m3_bits_to_f32(c):
    """e4m3fn codes (uint8) -> fp32, by bit manipulation."""
    c = c.to(tl.uint32)
    sign = (c & 0x80) << 24
    normal = ((c & 0x7F) << 20) + 0x3C000000
    sub = ((c & 7).to(tl.float32) * 0.001953125).to(tl.uint32, bitcast=True)
    bits = tl.where((c & 0x78) == 0, sub, normal) | sign
    bits = tl.where((c & 0x7F) == 0x7F, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


# -------------------------------------------------------------------------------------------- triton
@jit(do_not_specialize=["offset", "kstate"])
def _sr_kernel(dst_ptr, src_ptr, n, offset, kstate, key_ptr, scale,
               ADD: tl.constexpr, DST_KIND: tl.constexpr, SRC_KIND: tl.constexpr, HI_ABSORBED: tl.constexpr,
               KEY_IN_TABLE: tl.constexpr, BLOCK: tl.constexpr):
    """dst[i] = round(dst[i] * ADD + scale * src[i]); SR with counter offset + i when dst is bf16.

    DST_KIND / SRC_KIND as in ``load_f32`` (dst: 0 fp32, 1 bf16 as int16). KEY_IN_TABLE: ``kstate`` is an
    index into the int32 table ``key_ptr`` (a ``KeySlot``), loaded when the kernel runs.

    fp32 throughout: y = scale * src (one rounding), then y = dst + y (one rounding); no FMA (the
    launcher turns fp fusion off so the bits match the twin, which runs the two ops separately).
    """
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    y = load_f32(src_ptr + offs, mask, SRC_KIND) * scale
    if ADD:
        y = load_f32(dst_ptr + offs, mask, DST_KIND) + y
    if DST_KIND == 1:
        if KEY_IN_TABLE:
            kstate = tl.load(key_ptr + kstate)
        rand = hash_u32(kstate, offset + offs, HI_ABSORBED)
        tl.store(dst_ptr + offs, sr_bf16_bits(y, rand), mask=mask)
    else:
        tl.store(dst_ptr + offs, y, mask=mask)


@jit(do_not_specialize=["offset", "kstate", "part_stride"])
def _sr_sum_kernel(dst_ptr, parts_ptr, n, part_stride, offset, kstate, key_ptr, scale,
                   W: tl.constexpr, ADD: tl.constexpr, DST_KIND: tl.constexpr, SRC_KIND: tl.constexpr,
                   HI_ABSORBED: tl.constexpr, KEY_IN_TABLE: tl.constexpr, BLOCK: tl.constexpr):
    """dst[i] = round(scale * (dst[i] * ADD + parts[0][i] + ... + parts[W-1][i])), fp32 adds in that order
    (no FMA: see ``_sr_kernel``); part j starts part_stride elements after part j-1."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    ptrs = parts_ptr + offs
    acc = load_f32(ptrs, mask, SRC_KIND)
    if ADD:
        acc = load_f32(dst_ptr + offs, mask, DST_KIND) + acc
    for _ in tl.static_range(1, W):
        ptrs += part_stride
        acc = acc + load_f32(ptrs, mask, SRC_KIND)
    y = acc * scale
    if DST_KIND == 1:
        if KEY_IN_TABLE:
            kstate = tl.load(key_ptr + kstate)
        rand = hash_u32(kstate, offset + offs, HI_ABSORBED)
        tl.store(dst_ptr + offs, sr_bf16_bits(y, rand), mask=mask)
    else:
        tl.store(dst_ptr + offs, y, mask=mask)


_BLOCK = 4096


def _bits(t: torch.Tensor) -> torch.Tensor:
    """What a kernel gets for ``t``: bf16 as its int16 bit patterns (see the module docstring), else ``t``."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _sr_triton(dst: torch.Tensor, src: torch.Tensor, key: Key, scale: float, offset: int, add: bool) -> torch.Tensor:
    n = dst.numel()
    if n:
        kstate, table, hi_absorbed = launch_key(key, offset, n)
        _sr_kernel[(triton_cdiv(n, _BLOCK),)](
            _bits(dst), _bits(src), n, offset, kstate, table, fp32(scale),
            ADD=add, DST_KIND=int(dst.dtype == torch.bfloat16), SRC_KIND=KINDS[src.dtype],
            HI_ABSORBED=hi_absorbed, KEY_IN_TABLE=table is not None, BLOCK=_BLOCK, num_warps=8,
            enable_fp_fusion=False,
        )
    return dst


def _sr_sum_triton(dst: torch.Tensor, parts: torch.Tensor, key: Key, scale: float, offset: int, add: bool
                   ) -> torch.Tensor:
    n = dst.numel()
    if n:
        kstate, table, hi_absorbed = launch_key(key, offset, n)
        _sr_sum_kernel[(triton_cdiv(n, _BLOCK),)](
            _bits(dst), _bits(parts), n, parts.stride(0), offset, kstate, table, fp32(scale),
            W=parts.shape[0], ADD=add, DST_KIND=int(dst.dtype == torch.bfloat16), SRC_KIND=KINDS[parts.dtype],
            HI_ABSORBED=hi_absorbed, KEY_IN_TABLE=table is not None, BLOCK=_BLOCK, num_warps=8,
            enable_fp_fusion=False,
        )
    return dst


# ---------------------------------------------------------------------------------------------- public
def sr_add_(dst: torch.Tensor, src: torch.Tensor, *, key: Key, scale: float = 1.0, offset: int = 0) -> torch.Tensor:
    """dst <- round(dst + scale*src), computed in fp32; stochastic when dst is bf16, exact fp32 add when fp32.

    In place, returns dst. dst and src: same numel, contiguous; src fp32, bf16 or fp16.
    """
    _check(dst, src, "sr_add_")
    if use_triton(dst):
        return _sr_triton(dst, src, key, scale, offset, add=True)
    return _sr_twin(dst, src, key, scale, offset, add=True)


def sr_copy_(dst: torch.Tensor, src: torch.Tensor, *, key: Key, scale: float = 1.0, offset: int = 0) -> torch.Tensor:
    """dst <- round(scale*src); stochastic when dst is bf16. In place, returns dst."""
    _check(dst, src, "sr_copy_")
    if use_triton(dst):
        return _sr_triton(dst, src, key, scale, offset, add=False)
    return _sr_twin(dst, src, key, scale, offset, add=False)


def sr_sum_(dst: torch.Tensor, parts: torch.Tensor, *, key: Key, scale: float = 1.0, offset: int = 0,
            add: bool = False) -> torch.Tensor:
    """dst <- round(scale * ((dst if add) + parts[0] + ... + parts[W-1])), the sum in fp32 in that fixed order
    (bit-reproducible); stochastic when dst is bf16. One pass over the W parts instead of an fp32 buffer
    built by W passes: the all-to-all gradient manager's reduction of what it received.

    parts: (W, m) with contiguous rows at any row stride (a column slice of a (W, shard) receive buffer);
    dst: m contiguous elements. In place, returns dst."""
    _check_sum(dst, parts)
    if use_triton(dst):
        return _sr_sum_triton(dst, parts, key, scale, offset, add)
    return sr_sum_twin(dst, parts, key=key, scale=scale, offset=offset, add=add)


def round_to_bf16_sr(x: torch.Tensor, *, key: int, offset: int = 0) -> torch.Tensor:
    """fp32 -> new bf16 tensor of the same shape, stochastically rounded; element i uses counter offset + i."""
    if x.dtype != torch.float32:
        raise TypeError(f"round_to_bf16_sr: x must be fp32, got {x.dtype}")
    return sr_copy_(torch.empty_like(x, dtype=torch.bfloat16), x, key=key, offset=offset)
