"""SwiGLU forward and backward straight to FP8 in one pass, with power-of-two scales predicted per layer.

In an FP8 MLP the SwiGLU output h (M, F) and the up projection's output gradient du (M, 2F) exist only to be
quantized (q and its transpose q^T, for the two GEMMs that read each). With per-tensor current scaling the
scale needs max |x| before any element is scaled, so the two-pass path makes each in two (fp8.py,
activation.py + the quantize kernel): the SwiGLU kernel writes x in bf16 and reduces its abs-max, then the
quantize kernel reads x back and writes q and q^T. Per element of F that is 10 bytes moved forward (u 4, h 2,
h again 2, q and q^T 2) and 18 backward (u 4, dout 2, du 4, du again 4, q and q^T 4). Here one pass writes q and
q^T straight from the inputs: 6 and 10 bytes.

What makes one pass possible is a scale known in advance. The scale is a power of two, 2^e, with e chosen from
the tensor's own exponent

    e_own = floor(log2(FMAX / max(amax, AMAX_FLOOR)))      (the largest e with amax * 2^e <= FMAX, up to the
                                                             rounding of the one division)

and the exponent this tensor had at the same layer in the previous call (`hint`, an int32 the caller keeps per
layer): the hint is kept when it fits and wastes at most KEEP_BINADES binade, e_own - KEEP_BINADES <= hint <= e_own,
else e = e_own (`scale_exponent`). The kernel writes with the hinted exponent and reduces the true amax; a second
launch then checks the rule: where the hint is not kept, that launch recomputes the tile from the inputs and writes
q and q^T again with e_own; where it is kept, every program exits without touching memory. The hint is then set
to e. The window is what keeps the second pass rare: with e = e_own exactly, a gradient whose abs-max hovers
around a power of two missed in 16-21% of the backward calls (Qwen2.5-1.5B training on the H200), each a second
pass; with it, only an abs-max that leaves the two binades costs one.

The result is x quantized at 2^e for the e the rule picks, so it depends on the inputs and the hint, and nothing
else: a stale, wrong or unset hint costs one more pass and gives the e_own result. The rule is idempotent (after a
call the hint is e; the same inputs again keep it), so a rerun of the same forward (recompute, a CUDA-graph
replay, a compiled graph that rematerializes the op) gives the same bits. Across steps the hints are run state:
one (2,) tensor per layer (`hints.ScaleHints`, which the Transformer holds) that checkpoints save, so a resumed run
continues bit for bit.
The hint is written behind torch.compile's back (the ops declare no mutation; declaring it would make the compiler
copy the hint around the op): no other op reads or writes it, and by idempotence a reordered or repeated call
changes nothing.

A power-of-two scale leaves the largest element between FMAX/2 and FMAX at e_own (the exact scale puts it at FMAX),
between FMAX/4 and FMAX with a kept hint: the tensor's dynamic range loses at most two binades at the bottom (of
e4m3's 17; delayed scaling, which takes the largest abs-max of a long history, routinely gives up more), and
scaling itself is exact (no rounding of x * scale before the cast). Rounding of the SwiGLU values is the existing
kernels': h and du are rounded to u's dtype first, as the two-pass path stores them, so the twins below are the
two-pass twins with the scale rule swapped (`pow2_scale`).

Measured on the H200 (Qwen2.5-1.5B at 64 x 1024 tokens): forward 1.06 ms against the two-pass 1.50, backward 1.68
against 2.70, with the hint right; a missed hint costs a second pass (1.92 / 3.16 ms).
The kernels are compute-bound more than memory-bound (exp and division per element: a second pass that only
masked its loads and stores still took ~1 ms, so its programs branch off on the loaded exponent).
Validated on the GPU for bf16 inputs, read natively: the integer-bit loads of `load_f32` made Triton 3.6 write
~25% of q^T wrong there (any transposition).

Layout (STYLE.md "Kernels and their twins"): scale rule, twins (the specification), Triton kernels, launchers,
custom ops (a torch.compile'd block calls them as opaque steps).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from qtrain.kernels.dispatch import INTERPRET, jit, tl, triton, use_triton
from qtrain.kernels.fp8_quant import AMAX_FLOOR, FP8_MAX
from qtrain.kernels.stochastic_rounding import KINDS, load_f32, round_f32, store_f32
from qtrain.kernels.swiglu.activation import swiglu_backward_twin
from qtrain.kernels.swiglu.fp8 import check_swiglu_fp8_args

__all__ = ["HINT_UNSET", "KEEP_BINADES", "count_hint_misses", "new_scale_hint", "pow2_scale", "scale_exponent",
           "swiglu_backward_fp8_onepass",
           "swiglu_backward_fp8_onepass_twin", "swiglu_fp8_onepass", "swiglu_fp8_onepass_twin"]

HINT_UNSET = -1000  # no exponent is ever this: the first call of a layer takes the second pass
KEEP_BINADES = 1  # a hint up to this many binades below the tensor's own exponent is kept (`scale_exponent`)
# Tiles (the launchers take others as parameters; every tile gives the same bits): a program covers BLOCK_M rows x
# BLOCK_F columns of F; BLOCK_M bytes per row of q^T per store, as the quantize kernel's 64. H200, Qwen2.5-1.5B
# shapes: backward 32 x 128 / 8 warps 1.75 ms, / 4 warps 1.85, 64 x 64 / 8 warps 2.03.
FWD_BLOCK_M, FWD_BLOCK_F, FWD_WARPS = 64, 128, 8
BWD_BLOCK_M, BWD_BLOCK_F, BWD_WARPS = 32, 128, 8

Result = tuple[Tensor, Tensor, Tensor]  # (q (M, N), q^T (N, M), inv_scale 0-dim fp32)

# Diagnostics (`count_hint_misses`): None in training (no work); else an int64 (2, 2) device tensor the Triton
# launchers add to, [forward, backward] x [calls, missed hints], without a host sync. A missed hint costs the second
# pass (1.5 ms more for the backward at 1.5B shapes): the profile suite reports how often that happens in a step.
HINT_MISSES: Tensor | None = None


def count_hint_misses(device: torch.device | str | None) -> Tensor | None:
    """Start counting the Triton launchers' calls and missed hints on `device` into a fresh (2, 2) tensor (rows
    forward, backward; columns calls, misses) and return it; None stops counting."""
    global HINT_MISSES
    HINT_MISSES = None if device is None else torch.zeros(2, 2, dtype=torch.int64, device=device)
    return HINT_MISSES


def _check(u: Tensor, dtype: torch.dtype, dout: Tensor | None = None) -> None:
    check_swiglu_fp8_args(u, dtype, "swiglu one-pass FP8")
    if dout is not None and (dout.shape != (u.shape[0], u.shape[1] // 2) or dout.dtype != u.dtype):
        raise ValueError(f"swiglu one-pass FP8: dout must be (M, F) in u's dtype, got {tuple(dout.shape)} "
                         f"{dout.dtype} for u {tuple(u.shape)} {u.dtype}")


def new_scale_hint(device: torch.device | str, slots: int = 2) -> Tensor:
    """Fresh hints: `slots` int32 exponents (a layer's h and du), unset (the first call takes both passes)."""
    return torch.full((slots,), HINT_UNSET, dtype=torch.int32, device=device)


# ------------------------------------------------------------------------------------------ scale rule
def pow2_scale(amax: Tensor, fmax: float) -> tuple[Tensor, Tensor, Tensor]:
    """(scale, inv_scale, e) for an fp32 amax: scale = 2^e, e = floor(log2(fmax / max(amax, AMAX_FLOOR))).
    torch's division is correctly rounded, as the kernels' div_rn; frexp reads the binade exactly."""
    r = torch.full((), fmax, dtype=torch.float32, device=amax.device) / amax.float().reshape(()).clamp_min(AMAX_FLOOR)
    e = torch.frexp(r).exponent.to(torch.int32) - 1  # r = m * 2^k with m in [0.5, 1): floor(log2 r) = k - 1
    one = torch.ones((), dtype=torch.float32, device=amax.device)
    return torch.ldexp(one, e), torch.ldexp(one, -e), e


def scale_exponent(e_own: Tensor, hint: Tensor) -> Tensor:
    """The exponent a call uses (int32, hint's shape): the hint where it fits and wastes at most KEEP_BINADES
    binade (e_own - KEEP_BINADES <= hint <= e_own), else the tensor's own exponent e_own (`pow2_scale`'s e)."""
    e_own = e_own.to(torch.int32).reshape(hint.shape)
    return torch.where((hint <= e_own) & (hint >= e_own - KEEP_BINADES), hint, e_own)


def _quantize_pow2(x: Tensor, dtype: torch.dtype, hint: Tensor | None = None) -> Result:
    """q, q^T, inv_scale of x (already in its stored dtype) with 2^e: e = `scale_exponent` of its abs-max and
    `hint` (a one-element int32 tensor, set to e), or without a hint the abs-max's own exponent."""
    fmax = FP8_MAX[dtype]
    amax = torch.linalg.vector_norm(x, float("inf")) if x.numel() else x.new_zeros(())
    scale, inv_scale, e = pow2_scale(amax, fmax)
    if hint is not None:
        e = scale_exponent(e, hint)
        hint.copy_(e)
        one = torch.ones((), dtype=torch.float32, device=x.device)
        scale, inv_scale = torch.ldexp(one, e.reshape(())), torch.ldexp(one, -e.reshape(()))
    q = (x.float() * scale).clamp_(-fmax, fmax).to(dtype).contiguous()
    # a copy always (with one row, q.t() is already contiguous: a custom op may not return aliased outputs)
    return q, q.t().clone(memory_format=torch.contiguous_format), inv_scale


# ---------------------------------------------------------------------------------------------- twins
def swiglu_fp8_onepass_twin(u: Tensor, dtype: torch.dtype = torch.float8_e4m3fn, hint: Tensor | None = None
                            ) -> Result:
    """The specification of the forward: h = up * silu(gate) in u's dtype (`activation.swiglu`'s rounding), quantized
    with 2^e, e = `scale_exponent` of max |h| and `hint` (one int32, set to e; none: max |h|'s own exponent):
    (h_q (M, F), h_q^T (F, M), inv_scale)."""
    _check(u, dtype)
    up, gate = u.chunk(2, dim=-1)
    return _quantize_pow2(F.silu(gate) * up, dtype, hint)


def swiglu_backward_fp8_onepass_twin(dout: Tensor, u: Tensor, dtype: torch.dtype = torch.float8_e4m3fn,
                                     hint: Tensor | None = None) -> Result:
    """The specification of the backward: du = `swiglu_backward_twin(dout, u)` (in u's dtype), quantized with 2^e
    as the forward's (max |du| and `hint`): (du_q (M, 2F), du_q^T (2F, M), inv_scale)."""
    _check(u, dtype, dout)
    return _quantize_pow2(swiglu_backward_twin(dout, u), dtype, hint)


# -------------------------------------------------------------------------------------------- triton
@jit
def _pow2_exponent(amax_ptr, FMAX: tl.constexpr, AMAX_FLOOR: tl.constexpr):
    """`pow2_scale`'s e from the one fp32 amax: the exponent field of the correctly rounded FMAX / amax."""
    amax = tl.maximum(tl.load(amax_ptr).to(tl.float32), AMAX_FLOOR)
    r = tl.math.div_rn(tl.full((), FMAX, tl.float32), amax)
    return ((r.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@jit
def _exp2_f32(e):
    """2^e as fp32, exactly (e within the normal range, as every exponent here is)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@jit
def _rows_cols(BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr, INT32: tl.constexpr):
    """The program's row and column indices, int32 where every offset fits (INT32), else int64."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rf = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    if not INT32:
        rm, rf = rm.to(tl.int64), rf.to(tl.int64)
    return rm, rf


@jit
def _store_q_and_qt(q_ptr, qt_ptr, x, e, rm, rn, M, N, n_end, FMAX: tl.constexpr, EVEN: tl.constexpr):
    """q[m, n] = cast_rn(clamp(x[m, n] * 2^e, +-FMAX)) and q^T[n, m] for the tile (rm, rn) of an (M, N) q, at
    m < M and n < n_end (the tile's column range ends there; EVEN: the tile is inside). q^T's tile is the fp32 tile
    transposed before the cast (transposing the e4m3 tile or its bytes instead measured the same in time and bits on
    the H200). The clamp matters only to a pass 1 whose hint is above the tensor's own exponent, which pass 2 then
    redoes with e <= e_own (max |x| * 2^e <= FMAX): the codes left in memory never need it."""
    y = tl.minimum(tl.maximum(x * _exp2_f32(e), -FMAX), FMAX)
    q = y.to(q_ptr.dtype.element_ty)
    store_f32(q_ptr + rm[:, None] * N + rn[None, :], q, (rm[:, None] < M) & (rn[None, :] < n_end), 0, EVEN)
    qt_off = rn[:, None] * M + rm[None, :]
    qt_mask = (rn[:, None] < n_end) & (rm[None, :] < M)
    store_f32(qt_ptr + qt_off, tl.trans(y).to(qt_ptr.dtype.element_ty), qt_mask, 0, EVEN)


@jit
def _pass_setup(hint_ptr, amax_ptr, inv_scale_ptr, FMAX: tl.constexpr, AMAX_FLOOR: tl.constexpr,
                KEEP: tl.constexpr, REDO: tl.constexpr):
    """(e, go): pass 1 writes with the hinted exponent, every program; pass 2 with the tensor's own exponent, only
    where `scale_exponent` does not keep the hint (`go`, a loaded value: the caller branches on it, so a program
    whose hint held reads and computes nothing). The first program writes inv_scale = 2^-e (pass 2's is final)."""
    e = tl.load(hint_ptr)
    go = e == e
    if REDO:
        e_own = _pow2_exponent(amax_ptr, FMAX, AMAX_FLOOR)
        go = (e > e_own) | (e < e_own - KEEP)
        e = tl.where(go, e_own, e)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(inv_scale_ptr, _exp2_f32(-e))
    return e, go


@jit
def _swiglu_fwd_fp8_kernel(u_ptr, q_ptr, qt_ptr, hint_ptr, amax_ptr, partial_ptr, inv_scale_ptr, M, F,
                           KIND: tl.constexpr, LOAD_KIND: tl.constexpr, FMAX: tl.constexpr,
                           AMAX_FLOOR: tl.constexpr, KEEP: tl.constexpr, REDO: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_F: tl.constexpr, FAST_ROUND: tl.constexpr, EVEN: tl.constexpr,
                           INT32: tl.constexpr):
    """h = round(round(silu(gate)) * up) for the tile (as `swiglu_fp8`'s pass 1), written as e4m3/e5m2 q and q^T
    with scale 2^e; pass 1 also stores the tile's max |h| in partial_ptr[program]. LOAD_KIND: how u is read
    (`load_f32`; 0 with a bf16 u loads it natively). EVEN, INT32: `_index_mode`'s."""
    e, go = _pass_setup(hint_ptr, amax_ptr, inv_scale_ptr, FMAX, AMAX_FLOOR, KEEP, REDO)
    if go:
        rm, rf = _rows_cols(BLOCK_M, BLOCK_F, INT32)
        mask = (rm[:, None] < M) & (rf[None, :] < F)
        off = rm[:, None] * (2 * F) + rf[None, :]
        up = load_f32(u_ptr + off, mask, LOAD_KIND, EVEN)
        gate = load_f32(u_ptr + off + F, mask, LOAD_KIND, EVEN)
        h = round_f32(round_f32(gate / (1.0 + tl.exp(-gate)), KIND, FAST_ROUND) * up, KIND, FAST_ROUND)  # masked: 0
        _store_q_and_qt(q_ptr, qt_ptr, h, e, rm, rf, M, F, F, FMAX, EVEN)
        if not REDO:  # rounding is monotone and odd: the max of the rounded values is what the twin reduces
            tl.store(partial_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1),
                     tl.max(tl.max(tl.abs(h), axis=1), axis=0))


@jit
def _swiglu_bwd_fp8_kernel(dout_ptr, u_ptr, q_ptr, qt_ptr, hint_ptr, amax_ptr, partial_ptr, inv_scale_ptr, M, F,
                           KIND: tl.constexpr, LOAD_KIND: tl.constexpr, FMAX: tl.constexpr,
                           AMAX_FLOOR: tl.constexpr, KEEP: tl.constexpr, REDO: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_F: tl.constexpr, FAST_ROUND: tl.constexpr, EVEN: tl.constexpr,
                           INT32: tl.constexpr):
    """du = [d_up, d_gate] for the tile (`swiglu._swiglu_bwd_kernel`'s arithmetic, rounded to u's dtype), written
    as q (M, 2F) and q^T (2F, M) with scale 2^e: d_up at columns rf, d_gate at F + rf. Passes as the forward's."""
    e, go = _pass_setup(hint_ptr, amax_ptr, inv_scale_ptr, FMAX, AMAX_FLOOR, KEEP, REDO)
    if go:
        rm, rf = _rows_cols(BLOCK_M, BLOCK_F, INT32)
        mask = (rm[:, None] < M) & (rf[None, :] < F)
        up_off = rm[:, None] * (2 * F) + rf[None, :]
        up = load_f32(u_ptr + up_off, mask, LOAD_KIND, EVEN)
        gate = load_f32(u_ptr + up_off + F, mask, LOAD_KIND, EVEN)
        d = load_f32(dout_ptr + rm[:, None] * F + rf[None, :], mask, LOAD_KIND, EVEN)
        s = 1.0 / (1.0 + tl.exp(-gate))
        d_up = round_f32(d * gate * s, KIND, FAST_ROUND)
        d_gate = round_f32(d * up * s * (1.0 + gate * (1.0 - s)), KIND, FAST_ROUND)
        _store_q_and_qt(q_ptr, qt_ptr, d_up, e, rm, rf, M, 2 * F, F, FMAX, EVEN)
        _store_q_and_qt(q_ptr, qt_ptr, d_gate, e, rm, rf + F, M, 2 * F, 2 * F, FMAX, EVEN)
        if not REDO:
            tl.store(partial_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1),
                     tl.max(tl.max(tl.maximum(tl.abs(d_up), tl.abs(d_gate)), axis=1), axis=0))


def _bits(t: Tensor) -> Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _index_mode(M: int, F: int, bm: int, bf: int) -> tuple[bool, bool]:
    """(EVEN, INT32) of a launch. The kernels are bound by instructions as much as by memory (exp, a division, two
    roundings, two casts and a transposition per element), so where the tiles divide the shape they run without
    masks (both kernels' columns are F wide, the backward's second half at F + rf), and where every offset fits in
    int32 (u (M, 2F) is the largest operand) with 32-bit index arithmetic. Neither changes a bit."""
    return M % bm == 0 and F % bf == 0, M * 2 * F < 2 ** 31


def _launch_two_passes(kernel, inputs: tuple[Tensor, ...], M: int, N: int, F: int, kind: int, dtype: torch.dtype,
                       hint: Tensor, block: tuple[int, int, int], direction: int) -> Result:
    """Pass 1 with the hinted exponent, the abs-max, pass 2 where `scale_exponent` does not keep the hint, the hint
    set to the exponent used (and, when counting, the call and whether it missed into HINT_MISSES[direction]:
    0 forward, 1 backward)."""
    q = torch.empty((M, N), dtype=dtype, device=hint.device)
    qt = torch.empty((N, M), dtype=dtype, device=hint.device)
    inv_scale = torch.empty((), dtype=torch.float32, device=hint.device)
    if not M * N:  # the twin's: amax 0, the hint's rule
        e = scale_exponent(pow2_scale(torch.zeros((), device=hint.device), FP8_MAX[dtype])[2], hint)
        hint.copy_(e)
        inv_scale.copy_(torch.ldexp(torch.ones((), device=hint.device), -e.reshape(())))
        return q, qt, inv_scale
    bm, bf, warps = block
    grid = (triton.cdiv(M, bm), triton.cdiv(F, bf))
    partial = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=hint.device)
    # On the GPU bf16 is read natively and rounded by the hardware conversion (the same values as the integer-bit
    # `load_f32` / `round_f32`): with the int16-bit loads Triton 3.6 wrote ~25% of q^T wrong on the H200, whatever
    # the transposition. The interpreter, whose bf16 conversions are not the GPU's, runs the integer-bit ones.
    native = not INTERPRET
    even, int32 = _index_mode(M, F, bm, bf)
    const = dict(KIND=kind, LOAD_KIND=0 if native else kind, FMAX=FP8_MAX[dtype], AMAX_FLOOR=AMAX_FLOOR,
                 KEEP=KEEP_BINADES, BLOCK_M=bm, BLOCK_F=bf, FAST_ROUND=native, EVEN=even, INT32=int32,
                 num_warps=warps)
    ins = inputs if native else tuple(_bits(t) for t in inputs)
    kernel[grid](*ins, q, qt, hint, partial, partial, inv_scale, M, F, REDO=False, **const)
    amax = partial.amax()
    kernel[grid](*ins, q, qt, hint, amax, partial, inv_scale, M, F, REDO=True, **const)
    e = scale_exponent(pow2_scale(amax, FP8_MAX[dtype])[2], hint)
    if HINT_MISSES is not None and HINT_MISSES.device == hint.device:
        HINT_MISSES[direction, 0] += 1
        HINT_MISSES[direction, 1] += (hint != e).sum()
    hint.copy_(e)
    return q, qt, inv_scale


def swiglu_fp8_onepass_triton(u: Tensor, dtype: torch.dtype, hint: Tensor, *, block_m: int = FWD_BLOCK_M,
                              block_f: int = FWD_BLOCK_F, num_warps: int = FWD_WARPS) -> Result:
    """Host launcher of the forward; same contract as the twin, whatever `hint` holds (which it updates). The tile
    (`block_m` rows x `block_f` columns, `num_warps`) changes no bit."""
    _check(u, dtype)
    u = u.contiguous()
    M, F = u.shape[0], u.shape[1] // 2
    return _launch_two_passes(_swiglu_fwd_fp8_kernel, (u,), M, F, F, KINDS[u.dtype], dtype, hint,
                              (block_m, block_f, num_warps), 0)


def swiglu_backward_fp8_onepass_triton(dout: Tensor, u: Tensor, dtype: torch.dtype, hint: Tensor, *,
                                       block_m: int = BWD_BLOCK_M, block_f: int = BWD_BLOCK_F,
                                       num_warps: int = BWD_WARPS) -> Result:
    """Host launcher of the backward; same contract as the twin, whatever `hint` holds (which it updates). The tile
    changes no bit."""
    _check(u, dtype, dout)
    u, dout = u.contiguous(), dout.contiguous()
    M, F = dout.shape
    return _launch_two_passes(_swiglu_bwd_fp8_kernel, (dout, u), M, 2 * F, F, KINDS[u.dtype], dtype,
                              hint, (block_m, block_f, num_warps), 1)


# ---------------------------------------------------------------------------------------------- public
# The hint is an argument, not a declared mutation: the rule is idempotent and nothing else touches it (module
# docstring).
@torch.library.custom_op("qtrain::swiglu_fp8_onepass", mutates_args=())
def swiglu_fp8_onepass(u: Tensor, dtype: torch.dtype, hint: Tensor, slot: int) -> tuple[Tensor, Tensor, Tensor]:
    """(h_q, h_q^T, inv_scale) for h = swiglu(u), power-of-two scale by `scale_exponent` from hint[slot] (which it
    updates); Triton (one pass where the hint is kept) or the twin per dispatch. The kernels are validated on the
    GPU for bf16 u (what FP8 training runs); other dtypes take the twin there (an fp32 u gave wrong q^T codes at
    M = 1 on the H200)."""
    if use_triton(u) and (u.dtype == torch.bfloat16 or INTERPRET):
        return swiglu_fp8_onepass_triton(u, dtype, hint[slot:slot + 1])
    return swiglu_fp8_onepass_twin(u, dtype, hint[slot:slot + 1])


@swiglu_fp8_onepass.register_fake
def _(u: Tensor, dtype: torch.dtype, hint: Tensor, slot: int) -> tuple[Tensor, Tensor, Tensor]:
    _check(u, dtype)
    M, F = u.shape[0], u.shape[1] // 2
    return u.new_empty((M, F), dtype=dtype), u.new_empty((F, M), dtype=dtype), u.new_empty((), dtype=torch.float32)


@torch.library.custom_op("qtrain::swiglu_backward_fp8_onepass", mutates_args=())
def swiglu_backward_fp8_onepass(dout: Tensor, u: Tensor, dtype: torch.dtype, hint: Tensor, slot: int
                                ) -> tuple[Tensor, Tensor, Tensor]:
    """(du_q, du_q^T, inv_scale) for du = d swiglu(u) / du given dout, power-of-two scale from hint[slot] as the
    forward's; Triton or the twin."""
    if use_triton(u) and (u.dtype == torch.bfloat16 or INTERPRET):
        return swiglu_backward_fp8_onepass_triton(dout, u, dtype, hint[slot:slot + 1])
    return swiglu_backward_fp8_onepass_twin(dout, u, dtype, hint[slot:slot + 1])


@swiglu_backward_fp8_onepass.register_fake
def _(dout: Tensor, u: Tensor, dtype: torch.dtype, hint: Tensor, slot: int) -> tuple[Tensor, Tensor, Tensor]:
    _check(u, dtype, dout)
    M, N = u.shape
    return u.new_empty((M, N), dtype=dtype), u.new_empty((N, M), dtype=dtype), u.new_empty((), dtype=torch.float32)
