"""Fused AdamW step: one pass reads param, grad, m, v and writes param, m, v, plus the abs-max of the new param.

Per element, all in fp32, one rounding per line and in this order (the twin and the kernel agree bit for
bit because the kernel runs with fp fusion off, i.e. no FMA contraction, and uses IEEE div/sqrt)::

    g    = grad * grad_scale
    m    = beta1 * m + one_minus_beta1 * g
    v    = beta2 * v + one_minus_beta2 * (g * g)
    mhat = m * inv_bias_corr1
    vhat = v * inv_bias_corr2
    upd  = mhat / (sqrt(vhat) + eps) + weight_decay * p
    p    = p - lr * upd

This is llm.q's ``adamw.cu`` (decoupled, lr-scaled weight decay; reference/llmq.md §3.4); the scalars are
prepared by ``qtrain.numerics.adamw`` (which owns the update rule) and reach the kernel as fp32.
``grad_scale`` may instead be a 0-dim fp32 tensor on the device (the clipping factor computed there, so the
host need not read the gradient norm before queuing the update); a NaN there means "skip this step": the
kernel then writes nothing (and reports abs-max 0).

The kernel is issue-bound, not bandwidth-bound, on H100/H200, so the spec keeps per-element work low:

* Bias corrections: the caller passes ``bias_corr = 1 - beta**t`` (float64); ``bias_reciprocals`` (used by
  the twin and the launcher alike) makes ``inv_bias_corr = fp32(1 / bias_corr)``, the reciprocal in float64
  rounded to fp32 once, and each element multiplies by it instead of dividing (an IEEE division on the GPU is
  a reciprocal, Newton steps, a range check and a branch around a slow path). Still one rounding each, so
  mhat and vhat are within about an ulp of the quotients, though not always the same bits. The one division
  left, ``mhat / (sqrt(vhat) + eps)``, and the sqrt stay IEEE (``tl.div_rn``, ``tl.sqrt_rn``). llm.q divides
  per element (``m / beta1_correction``: IEEE, it builds without fast math), takes the corrections as
  ``1 - powf(beta, t)`` in fp32 and contracts into FMAs; we do not.
* Random words: every bf16/e4m3 write is stochastically rounded at counter ``offset + i`` with a word
  ``hash(key, i)`` (``qtrain.kernels.rng``), of which a bf16 rounding uses 16 bits and an e4m3 one 20:
  param ``hash(key_param, i)``; m ``hash(key_m, i)`` (low 16 or 20 bits); v, when m is bf16, the HIGH half
  ``hash(key_m, i) >> 16`` of m's word, else (m fp32, or e4m3 with its 20 bits) ``hash(key_v, i)``. So
  ``key_v`` is unused when m and v are both bf16 (the signature keeps it for the other dtypes), and that
  kernel hashes twice per element, not three times (a hash of a counter already mixed for another key is
  ~11 integer instructions on sm_90, 3 of them multiplies). The param cannot join: three bf16 roundings
  need 48 bits.

  Why the two halves of one word are independent: for a fixed key, ``hash`` is a bijection of the low 32-bit
  counter word (Murmur's round and its finaliser ``fmix32`` are each invertible: multiplies by odd constants,
  rotations, xor-shifts), so over the 2**32 counters that share a high word the word takes every value once
  and its two halves are exactly uniform and independent; for a fixed counter the word is likewise a
  bijection of the 32-bit key state, which the SplitMix64-derived key makes close to uniform from step to
  step. ``fmix32``'s full avalanche (each input bit flips each output bit with probability ~1/2) makes the
  words of nearby counters and keys unrelated. So each rounding stays unbiased and m's and v's rounding
  errors uncorrelated (tested). llm.q draws one word per element for param and v, v's being the word
  rotated by 20 bits, so v's 16 bits overlap 4 of the param's; its m uses a fixed seed (reference/llmq.md
  §3.3).

With both, the sm_90 build of the bf16 param/grad/m/v kernel has ~107 SASS instructions per element on its
fast path, down from ~149 (the bf16 rounding's cheaper top slot, ``stochastic_rounding``, is 8 of the 42).

Storage dtypes (each a constexpr kind in the kernel, loaded/stored as bit patterns):
param fp32|bf16, grad fp32|bf16|fp16, m fp32|bf16|e4m3 (e4m3 with one fp32 scale per 128 elements of
this call: ``m = code * m_scales[i // 128]``; on write the block's abs-max maps to 448, llm.q style),
v fp32|bf16. The returned abs-max is of the param as stored (after rounding), taken as an integer max of
``bits & 0x7FFFFFFF`` (exact, order-free, NaN wins over inf).

The kernel works on [ROWS, 128] tiles so the e4m3 block max is a row reduction; any length works (masked
tail). The abs-max is one int32 ``atomic_max`` per program.
"""

from __future__ import annotations

import torch

from qtrain.kernels.dispatch import jit, tl, use_triton
from qtrain.kernels.rng import hash_u32, kernel_key, random_u32_twin, triton_cdiv
from qtrain.kernels.stochastic_rounding import (
    bf16_bits_to_f32_twin,
    e4m3_bits_to_f32,
    e4m3_bits_to_f32_twin,
    f32_bits_twin,
    fp32,
    load_f32,
    sr_bf16_bits,
    sr_bf16_bits_twin,
    sr_e4m3_bits,
    sr_e4m3_bits_twin,
)

__all__ = ["M_BLOCK", "adamw_step", "adamw_step_triton", "adamw_step_twin", "bias_reciprocals", "sqrt_rn_twin"]

M_BLOCK = 128  # elements per fp32 scale of an e4m3 m
E4M3_MAX = 448.0
_TINY_BITS = 0x0D800000  # 2**-100: floor for an e4m3 block abs-max so 448/absmax stays finite
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3}
# Launch shape: ROWS*128 elements per program (`adamw_step_triton` takes others as parameters). On the H200 at
# 1.5e9 elements, ROWS=8, 4 warps is within 7% of the best shape for fp32, bf16-SR and e4m3-m states; ROWS>=16
# slows the integer-bound SR variants by 20-80% (bf16: 8.6 ms at 8 rows, 10.6 at 16, 15.4 at 32). Measured with
# three hashes and three divisions per element: the kernels suite's adamw case (sweep) re-measures the shapes.
ROWS = 8
NUM_WARPS = 4


def bias_reciprocals(bias_corr1: float, bias_corr2: float) -> tuple[float, float]:
    """``fp32(1 / bias_corr)`` of both bias corrections (reciprocal in float64, one rounding to fp32): the kernel
    multiplies by these instead of dividing every element (module docstring). Twin and launcher both use this."""
    return fp32(1.0 / bias_corr1), fp32(1.0 / bias_corr2)


# ---------------------------------------------------------------------------------------------- twin
def _load(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).to(torch.float32)


def _div(a: torch.Tensor | float, b: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """IEEE fp32 a / b. Never divide by a Python scalar (CUDA multiplies by its reciprocal) nor divide a
    Python scalar by a tensor (``Tensor.__rtruediv__`` is reciprocal-then-multiply): two roundings."""
    if not isinstance(a, torch.Tensor):
        a = torch.full_like(like, fp32(a))
    if not isinstance(b, torch.Tensor):
        b = torch.tensor(fp32(b), dtype=torch.float32, device=like.device)
    return torch.div(a, b)


def sqrt_rn_twin(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 sqrt, as ``tl.sqrt_rn`` and CUDA ``sqrtf``.

    torch's CPU sqrt is not: 11,865 of 2M random fp32 inputs came out 1 ulp off (torch 2.13, AVX512), and
    its fp64 sqrt is not exact either. So: fp64 sqrt rounded to fp32 (within 1 ulp), then fixed against the
    exact midpoints to the neighbours (a 25-bit midpoint squares exactly in fp64; x cannot equal it).
    """
    s = torch.sqrt(x.double()).float()
    up = torch.nextafter(s, torch.full_like(s, float("inf")))
    dn = torch.nextafter(s, torch.zeros_like(s))
    xd, sd = x.double(), s.double()
    hi, lo = (sd + up.double()) * 0.5, (sd + dn.double()) * 0.5
    return torch.where(xd > hi * hi, up, torch.where(xd < lo * lo, dn, s))


def adamw_step_twin(
    param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, m_scales: torch.Tensor | None, *,
    lr: float, beta1: float, one_minus_beta1: float, beta2: float, one_minus_beta2: float,
    bias_corr1: float, bias_corr2: float, eps: float, weight_decay: float, grad_scale: float | torch.Tensor,
    key_param: int, key_m: int, key_v: int, offset: int,
) -> torch.Tensor:
    """Twin (specification) of the fused AdamW kernel; arguments already validated by the caller."""
    n = param.numel()
    dev = param.device
    if isinstance(grad_scale, torch.Tensor):
        gs = grad_scale.to(device=dev, dtype=torch.float32).reshape(())
        if torch.isnan(gs):  # the skip signal (a host read: fine for the specification)
            return torch.zeros((), dtype=torch.float32, device=dev)
    else:
        gs = fp32(grad_scale)
    idx = torch.arange(offset, offset + n, dtype=torch.int64, device=dev)
    p = _load(param)
    g = _load(grad) * gs
    if m.dtype == torch.float8_e4m3fn:
        codes = m.reshape(-1).view(torch.uint8).to(torch.int64)
        m_old = e4m3_bits_to_f32_twin(codes) * m_scales.repeat_interleave(M_BLOCK)[:n]
    else:
        m_old = _load(m)
    m_new = fp32(beta1) * m_old + fp32(one_minus_beta1) * g
    v_new = fp32(beta2) * _load(v) + fp32(one_minus_beta2) * (g * g)
    inv_bc1, inv_bc2 = bias_reciprocals(bias_corr1, bias_corr2)
    mhat = m_new * inv_bc1  # fp32 x fp32-exact scalar: one fp32 rounding (as on the GPU)
    vhat = v_new * inv_bc2
    upd = _div(mhat, sqrt_rn_twin(vhat) + fp32(eps), p) + fp32(weight_decay) * p
    p_new = p - fp32(lr) * upd

    if param.dtype == torch.bfloat16:
        p_bits = sr_bf16_bits_twin(p_new, random_u32_twin(key_param, idx))
        param.view(-1).copy_(bf16_bits_to_f32_twin(p_bits))
        absmax_bits = (p_bits << 16) & 0x7FFFFFFF
    else:
        param.view(-1).copy_(p_new)
        absmax_bits = f32_bits_twin(p_new) & 0x7FFFFFFF

    rand_m = random_u32_twin(key_m, idx) if m.dtype in (torch.bfloat16, torch.float8_e4m3fn) else None
    if m.dtype == torch.bfloat16:
        m.view(-1).copy_(bf16_bits_to_f32_twin(sr_bf16_bits_twin(m_new, rand_m)))
    elif m.dtype == torch.float8_e4m3fn:
        nblk = m_scales.numel()
        padded = torch.zeros(nblk * M_BLOCK, dtype=torch.float32, device=dev)
        padded[:n] = m_new
        blk_bits = (f32_bits_twin(padded).view(nblk, M_BLOCK) & 0x7FFFFFFF).amax(dim=1).clamp_min(_TINY_BITS)
        blk_max = (blk_bits - ((blk_bits >> 31) << 32)).to(torch.int32).view(torch.float32)
        scale = _div(E4M3_MAX, blk_max, blk_max)
        m_scales.copy_(_div(blk_max, E4M3_MAX, blk_max))
        y = m_new * scale.repeat_interleave(M_BLOCK)[:n]
        codes = sr_e4m3_bits_twin(y, rand_m)
        m.view(-1).view(torch.uint8).copy_(codes.to(torch.uint8))
    else:
        m.view(-1).copy_(m_new)

    if v.dtype == torch.bfloat16:
        # the high half of m's word when m is bf16 (it uses the low half), else v's own stream (module docstring)
        rand_v = rand_m >> 16 if m.dtype == torch.bfloat16 else random_u32_twin(key_v, idx)
        v.view(-1).copy_(bf16_bits_to_f32_twin(sr_bf16_bits_twin(v_new, rand_v)))
    else:
        v.view(-1).copy_(v_new)

    amax = absmax_bits.max() if n else torch.zeros((), dtype=torch.int64, device=dev)
    return amax.to(torch.int32).view(torch.float32)


# -------------------------------------------------------------------------------------------- triton
@jit(do_not_specialize=["offset", "ks_p", "ks_m", "ks_v"])
def _adamw_kernel(
    p_ptr, g_ptr, m_ptr, v_ptr, ms_ptr, amax_ptr, n, offset, ks_p, ks_m, ks_v,
    lr, beta1, omb1, beta2, omb2, ibc1, ibc2, eps, wd, grad_scale, gs_ptr,
    P_KIND: tl.constexpr, G_KIND: tl.constexpr, M_KIND: tl.constexpr, V_KIND: tl.constexpr,
    HI_ABSORBED: tl.constexpr, ROWS: tl.constexpr, GS_PTR: tl.constexpr,
):
    """One [ROWS, 128] tile of the fused AdamW step (math in the module docstring; fp32 throughout).

    Kinds: 0 fp32, 1 bf16 (int16 pointer), 2 fp16 (grad only), 3 e4m3 (m only, uint8 pointer + ms_ptr).
    Writes the tile's max of (new stored param bits & 0x7FFFFFFF) into amax_ptr (int32) by atomic_max.
    GS_PTR: grad_scale is read from gs_ptr (device fp32 scalar); NaN there masks every load and store.
    """
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]  # [ROWS, 1]
    if GS_PTR:
        grad_scale = tl.load(gs_ptr)
        rows = tl.where(grad_scale == grad_scale, rows, n)  # NaN: every row out of range (skip the step)
    offs = rows * 128 + tl.arange(0, 128)[None, :]  # [ROWS, 128] element index in this call
    mask = offs < n
    idx = offset + offs  # RNG counter

    p = load_f32(p_ptr + offs, mask, P_KIND)
    g = load_f32(g_ptr + offs, mask, G_KIND) * grad_scale
    if M_KIND == 3:
        row_mask = rows * 128 < n
        codes = tl.load(m_ptr + offs, mask=mask, other=0)
        m = e4m3_bits_to_f32(codes) * tl.load(ms_ptr + rows, mask=row_mask, other=0.0)
    else:
        m = load_f32(m_ptr + offs, mask, M_KIND)
    v = load_f32(v_ptr + offs, mask, V_KIND)

    m = beta1 * m + omb1 * g
    v = beta2 * v + omb2 * (g * g)
    mhat = m * ibc1  # ibc = fp32(1 / bias_corr): a multiply, not a division (module docstring)
    vhat = v * ibc2
    upd = tl.div_rn(mhat, tl.sqrt_rn(vhat) + eps) + wd * p
    p = p - lr * upd

    if P_KIND == 1:
        pb = sr_bf16_bits(p, hash_u32(ks_p, idx, HI_ABSORBED))
        tl.store(p_ptr + offs, pb, mask=mask)
        # max of the 15 magnitude bits, shifted to fp32's place once per program (x << 16 is monotone on them)
        abs_max = tl.max(tl.where(mask, pb.to(tl.int32) & 0x7FFF, 0)) << 16
    else:
        tl.store(p_ptr + offs, p, mask=mask)
        abs_max = tl.max(tl.where(mask, p.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0))
    tl.atomic_max(amax_ptr, abs_max)

    if M_KIND == 1 or M_KIND == 3:
        rand_m = hash_u32(ks_m, idx, HI_ABSORBED)
    if M_KIND == 1:
        tl.store(m_ptr + offs, sr_bf16_bits(m, rand_m), mask=mask)
    elif M_KIND == 3:
        m_bits = tl.where(mask, m.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)
        blk_max = tl.maximum(tl.max(m_bits, axis=1), 0x0D800000).to(tl.float32, bitcast=True)[:, None]
        scale = tl.div_rn(448.0, blk_max)
        tl.store(ms_ptr + rows, tl.div_rn(blk_max, 448.0), mask=row_mask)
        tl.store(m_ptr + offs, sr_e4m3_bits(m * scale, rand_m), mask=mask)
    else:
        tl.store(m_ptr + offs, m, mask=mask)

    if V_KIND == 1:
        if M_KIND == 1:
            rand_v = rand_m >> 16  # the half of m's word that m's bf16 rounding leaves unused
        else:
            rand_v = hash_u32(ks_v, idx, HI_ABSORBED)
        tl.store(v_ptr + offs, sr_bf16_bits(v, rand_v), mask=mask)
    else:
        tl.store(v_ptr + offs, v, mask=mask)


def _bits_view(t: torch.Tensor) -> torch.Tensor:
    """What the kernel's pointer sees: bf16 as int16, e4m3 as uint8, others as they are."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)
    return t


def adamw_step_triton(
    param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, m_scales: torch.Tensor | None, *,
    lr: float, beta1: float, one_minus_beta1: float, beta2: float, one_minus_beta2: float,
    bias_corr1: float, bias_corr2: float, eps: float, weight_decay: float, grad_scale: float | torch.Tensor,
    key_param: int, key_m: int, key_v: int, offset: int, rows: int = ROWS, num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """Triton launcher; same contract as ``adamw_step_twin``. The launch shape (`rows` x 128 elements per program,
    `num_warps`) changes no bit: each element's random bits come from its own index."""
    n = param.numel()
    amax = torch.zeros((), dtype=torch.int32, device=param.device)
    if n:
        ms = m_scales if m_scales is not None else amax  # unused pointer when m is not e4m3
        (ks_p, hi_absorbed), (ks_m, _), (ks_v, _) = (kernel_key(k, offset, n) for k in (key_param, key_m, key_v))
        inv_bc1, inv_bc2 = bias_reciprocals(bias_corr1, bias_corr2)
        gs_ptr = isinstance(grad_scale, torch.Tensor)
        if gs_ptr and (grad_scale.dtype != torch.float32 or grad_scale.numel() != 1 or grad_scale.device != param.device):
            raise ValueError(f"adamw_step: a tensor grad_scale must be one fp32 element on {param.device}, got "
                             f"{grad_scale.dtype} {tuple(grad_scale.shape)} on {grad_scale.device}")
        _adamw_kernel[(triton_cdiv(n, rows * M_BLOCK),)](
            _bits_view(param), _bits_view(grad), _bits_view(m), _bits_view(v), ms, amax, n, offset, ks_p, ks_m, ks_v,
            fp32(lr), fp32(beta1), fp32(one_minus_beta1), fp32(beta2), fp32(one_minus_beta2),
            inv_bc1, inv_bc2, fp32(eps), fp32(weight_decay), fp32(1.0 if gs_ptr else grad_scale),
            grad_scale if gs_ptr else amax,
            P_KIND=_KINDS[param.dtype], G_KIND=_KINDS[grad.dtype], M_KIND=_KINDS[m.dtype], V_KIND=_KINDS[v.dtype],
            HI_ABSORBED=hi_absorbed, ROWS=rows, GS_PTR=gs_ptr, num_warps=num_warps, enable_fp_fusion=False,
        )
    return amax.view(torch.float32)


# ---------------------------------------------------------------------------------------------- public
# Elements per twin call: the twin keeps ~100 bytes of fp32/fp64/int64 temporaries per element, which on the
# CPU is host memory (a 136M-element embedding would need 13 GiB at once). A multiple of M_BLOCK, so e4m3
# blocks and their scales line up; every element's result is the same as in one call (same counter).
TWIN_CHUNK = 1 << 20


def adamw_step(param, grad, m, v, m_scales, **scalars) -> torch.Tensor:
    """Kernel entry point (Triton on CUDA, else the twin, in TWIN_CHUNK pieces); see
    ``qtrain.numerics.adamw.adamw_update_``."""
    if use_triton(param):
        return adamw_step_triton(param, grad, m, v, m_scales, **scalars)
    n = param.numel()
    if n <= TWIN_CHUNK:
        return adamw_step_twin(param, grad, m, v, m_scales, **scalars)
    flat = [t.view(-1) for t in (param, grad, m, v)]
    amaxes = []
    for a in range(0, n, TWIN_CHUNK):
        b = min(n, a + TWIN_CHUNK)
        ms = None if m_scales is None else m_scales[a // M_BLOCK:(b + M_BLOCK - 1) // M_BLOCK]
        amaxes.append(adamw_step_twin(*(t[a:b] for t in flat), ms, **{**scalars, "offset": scalars["offset"] + a}))
    return torch.stack(amaxes).view(torch.int32).max().view(torch.float32)  # abs-max bits: an integer max
